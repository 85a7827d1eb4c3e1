#include "run_args.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <stdexcept>

namespace ddip::run {
using plan::parse_index;
using plan::split_list;

namespace {
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Where `program` is found as exec() would find it: a path as it is, a name in PATH; "" if not.
std::string find_program(const std::string& program) {
  if (program.find('/') != std::string::npos) return regular_file(program) ? program : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = std::min(dirs.find(':', start), dirs.size());
    std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    std::string candidate = dir + "/" + program;
    if (regular_file(candidate) && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

bool executable(const std::string& path) {
  return regular_file(path) && ::access(path.c_str(), X_OK) == 0;
}

// An integer as Python's int() reads a command line's (no sign, no spaces here: torch's values
// are counts and ports).
std::optional<long> whole_number(const std::string& s) {
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), ::isdigit)) return std::nullopt;
  return std::stol(s);
}

// torch's Std.from_str: "0".."3" for every local rank, or "0:1,1:2" per local rank.
std::optional<StdStreams> parse_streams(const std::string& v) {
  StdStreams s;
  if (v.size() == 1 && v[0] >= '0' && v[0] <= '3') {
    s.all = v[0] - '0';
    return s;
  }
  s.per_rank = true;
  for (const auto& item : split_list(v)) {
    auto colon = item.find(':');
    if (colon == std::string::npos) return std::nullopt;
    auto rank = parse_index(item.substr(0, colon));
    std::string stream = item.substr(colon + 1);
    if (!rank || stream.size() != 1 || stream[0] < '0' || stream[0] > '3') return std::nullopt;
    s.by_local_rank[*rank] = stream[0] - '0';
  }
  return s;
}

// Signal names torch's --signals-to-handle takes (getattr(signal, name)) that stop a job when
// forwarded, as torch's agent acts on each: not SIGPIPE (ddip run ignores it), nor SIGURG (its
// own question to the ranks), nor job control's.
const std::map<std::string, int>& signal_numbers() {
  static const std::map<std::string, int> names = {
      {"SIGHUP", SIGHUP},   {"SIGINT", SIGINT},   {"SIGQUIT", SIGQUIT}, {"SIGTERM", SIGTERM},
      {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGALRM", SIGALRM}, {"SIGABRT", SIGABRT},
      {"SIGXCPU", SIGXCPU}};
  return names;
}

// --run-path: torch runs the script with runpy.run_path in its worker; here a Python started for
// it does, with the script's own argv.
constexpr const char* kRunPath =
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')";
}  // namespace

Endpoint parse_endpoint(const std::string& given, int default_port) {
  std::string e = given;
  while (!e.empty() && std::isspace(static_cast<unsigned char>(e.front()))) e.erase(0, 1);
  while (!e.empty() && std::isspace(static_cast<unsigned char>(e.back()))) e.pop_back();
  if (e.empty()) return {"localhost", default_port};
  Endpoint out{e, default_port};
  if (!(e.front() == '[' && e.back() == ']')) {
    auto colon = e.rfind(':');
    if (colon != std::string::npos) {
      out.host = e.substr(0, colon);
      auto port = whole_number(e.substr(colon + 1));
      if (!port || *port >= 65536)
        throw std::invalid_argument("the port of '" + given +
                                    "' must be a number from 0 to 65535");
      out.port = static_cast<int>(*port);
    }
  }
  if (out.host.size() > 1 && out.host.front() == '[' && out.host.back() == ']')
    out.host = out.host.substr(1, out.host.size() - 2);
  bool ok = !out.host.empty() && std::all_of(out.host.begin(), out.host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' ||
           c == '-';
  });
  if (!ok) throw std::invalid_argument("'" + given + "' is not HOST[:PORT]");
  return out;
}

std::string python_interpreter(const std::string& fallback) {
  if (const char* exec = std::getenv("PYTHON_EXEC"); exec && *exec) return exec;
  if (!fallback.empty()) return fallback;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (const char* name : {"python3", "python"}) {
      auto candidate = (self.parent_path() / name).string();
      if (executable(candidate)) return candidate;
    }
  return "python3";
}

CommandLine::CommandLine()
    : app_("ddip: distributed data-parallel PyTorch on a C++ runtime", "ddip") {
  app_.require_subcommand(1);
  run_ = app_.add_subcommand(
      "run",
      "Start COMMAND once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
      "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and show every rank's output line by line, "
      "labelled [rank]. The first rank to fail stops the others; ddip run then exits with its "
      "code. Takes torchrun's command line: a script is run with Python, every option also as "
      "--under_score and from its PET_* variable");
  // --help lists them in this order.
  add_rank_options();
  add_output_options();
  add_torchrun_options();
  add_host_options();
  add_program_options();
}

CLI::Option* CommandLine::option(const std::string& names, const std::string& help,
                                 const std::string& pet, bool is_flag) {
  std::string key;
  for (const auto& n : split_list(names)) {
    std::string spelled = n.size() == 1 ? "-" + n : n;
    if (key.empty() || (key.rfind("--", 0) != 0 && spelled.rfind("--", 0) == 0)) key = spelled;
  }
  // The key is the first long name; every spelling leads to it.
  for (const auto& n : split_list(names)) key_of_[n] = key;
  is_flag_[key] = is_flag;
  if (!pet.empty()) pet_[key] = pet;
  if (is_flag) return run_->add_flag(names, help_flags_[key], help);
  return run_->add_option(names, help_values_[key], help);
}

void CommandLine::add_rank_options() {
  option("-n,--nproc-per-node,--nproc_per_node",
         "Ranks on this node: a number (default 1; up to 1024), cpu (one per CPU), gpu (one per "
         "visible GPU; an error without one) or auto (gpu if there is one, else cpu)",
         "PET_NPROC_PER_NODE")
      ->type_name("N|cpu|gpu|auto");
  option("--gpus",
         "One rank per listed GPU, in this order: rank i uses device index i. Entries are "
         "indices (positions in CUDA_VISIBLE_DEVICES when that is set), GPU-/MIG- UUIDs, or "
         "'all'. Across hosts: 'node1:0,1 node2:2,3', or with --hosts node1,node2 the GPUs every "
         "host uses",
         "")
      ->type_name("LIST");
  option("--timeout",
         "Stop every rank after this many seconds and exit with 124, first printing where each "
         "rank is: which collective it has not joined, and its stack (time while a rank's "
         "debugger prompt waits for an answer does not count)",
         "")
      ->type_name("SECONDS");
  option("-e,--env",
         "Set NAME for every rank, on every host: NAME=VALUE, or NAME alone for its value here. "
         "Repeat for more. Ranks on other hosts otherwise start with their host's own "
         "environment; values travel on a command line there, so pass no secrets this way",
         "")
      ->type_name("NAME[=VALUE]");
}

void CommandLine::add_output_options() {
  option("--show",
         "Ranks whose output reaches the terminal: all (default), none, or a comma list of "
         "ranks such as 0 (ddip run's own; it was --tee before torchrun's -t/--tee)",
         "")
      ->type_name("all|none|RANKS");
  option("--raw",
         "Show every rank's lines as they come; by default a line that several ranks print "
         "alike is shown once, labelled with their ranks: [0-7] text",
         "", true);
  option("--local-ranks-filter,--local_ranks_filter",
         "torchrun's: only these local ranks (a comma list) reach the terminal; log files keep "
         "every rank's",
         "PET_LOCAL_RANKS_FILTER")
      ->type_name("RANKS");
  option("-r,--redirects",
         "torchrun's: streams written to the log files only, not the terminal: 0 none, 1 "
         "stdout, 2 stderr, 3 both, for every local rank, or per local rank as 0:1,1:2",
         "PET_REDIRECTS")
      ->type_name("STREAMS");
  option("-t,--tee",
         "torchrun's: streams written to the log files and the terminal (the values of -r)",
         "PET_TEE")
      ->type_name("STREAMS");
  option("--log-dir,--log_dir",
         "Log files in torchrun's layout: DIR/<run id>_<random>/attempt_<n>/<local rank>/"
         "{stdout,stderr}.log and error.json. Without -r or -t every stream is kept (-t 3); "
         "with -r or -t but no --log-dir, a new directory under $TMPDIR (named on stderr)",
         "PET_LOG_DIR")
      ->type_name("DIR");
}

void CommandLine::add_torchrun_options() {
  const std::string ours = "torchrun's; see run.md for what it changes here";
  option("--nnodes", "Nodes: N or MIN:MAX (torchrun's; one ddip run per node). Default 1",
         "PET_NNODES")
      ->type_name("N|MIN:MAX");
  option("--node-rank,--node_rank", "This node's rank, with the static rendezvous",
         "PET_NODE_RANK")
      ->type_name("K");
  option("--rdzv-backend,--rdzv_backend", "static (default) or c10d", "PET_RDZV_BACKEND")
      ->type_name("BACKEND");
  option("--rdzv-endpoint,--rdzv_endpoint", "HOST[:PORT] (port 29400 by default)",
         "PET_RDZV_ENDPOINT")
      ->type_name("HOST[:PORT]");
  option("--rdzv-id,--rdzv_id", "The job's id: TORCHELASTIC_RUN_ID", "PET_RDZV_ID")
      ->type_name("ID");
  option("--rdzv-conf,--rdzv_conf", "KEY=VALUE,... for the rendezvous", "PET_RDZV_CONF")
      ->type_name("CONF");
  // Added by helper B for run_join.hpp (issue 32 item 2): the nodes' shared key.
  option("--key-file,--key_file",
         "One ddip run per node: a file holding a key every node shares (else DDIP_RUN_KEY); the "
         "nodes' links authenticate with it, and a node without it can't join",
         "")
      ->type_name("FILE");
  option("--standalone", "One node, its rendezvous on a free port, a random run id",
         "PET_STANDALONE", true);
  option("--max-restarts,--max_restarts", "Restarts of the whole job after a failure",
         "PET_MAX_RESTARTS")
      ->type_name("K");
  option("--monitor-interval,--monitor_interval", ours + " (nothing: no polling)",
         "PET_MONITOR_INTERVAL")
      ->type_name("SECONDS");
  option("--start-method,--start_method", ours + " (nothing: ranks are always new processes)",
         "PET_START_METHOD")
      ->type_name("spawn|fork|forkserver");
  option("--event-log-handler,--event_log_handler", ours + " (nothing: no event log)",
         "PET_EVENT_LOG_HANDLER")
      ->type_name("NAME");
  option("--role", "ROLE_NAME of every rank (default: default)", "PET_ROLE")->type_name("ROLE");
  option("--local-addr,--local_addr", "This node's address towards the others", "PET_LOCAL_ADDR")
      ->type_name("ADDR");
  option("--signals-to-handle,--signals_to_handle",
         "Signals forwarded to every rank (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)",
         "PET_SIGNALS_TO_HANDLE")
      ->type_name("SIGNALS");
  option("--master-addr,--master_addr",
         "MASTER_ADDR for every rank (default: 127.0.0.1 on one host; with --hosts, rank 0's "
         "host: its name, or this machine's address towards the first other host)",
         "PET_MASTER_ADDR")
      ->type_name("ADDR");
  option("--master-port,--master_port",
         "MASTER_PORT for every rank (default: a free port here; a random one in 29500-30499 "
         "when rank 0 runs on another host)",
         "PET_MASTER_PORT")
      ->type_name("PORT");
  option("-m,--module", "Run COMMAND's first word as a Python module (python -m)", "PET_MODULE",
         true);
  option("--no-python,--no_python", "Run COMMAND as a program, without Python",
         "PET_NO_PYTHON", true);
  option("--run-path,--run_path", "Run the script with runpy.run_path (torchrun's)",
         "PET_RUN_PATH", true);
  option("--use-env,--use_env",
         "torch.distributed.launch's: ranks read LOCAL_RANK from the environment (always so)", "",
         true);
  option("--local-rank-arg",
         "Pass --local-rank=<local rank> to the script, as torch.distributed.launch does "
         "without --use-env",
         "", true);
  // torchrun's, not ddip run's: named as such rather than taken for the command.
  for (const char* names :
       {"--logs-specs,--logs_specs", "--numa-binding,--numa_binding",
        "--duplicate-stdout-filters,--duplicate_stdout_filters",
        "--duplicate-stderr-filters,--duplicate_stderr_filters",
        "--shutdown-timeout,--shutdown_timeout"})
    option(names, "", "")->group("");
  option("--virtual-local-rank,--virtual_local_rank", "", "", true)->group("");
}

void CommandLine::add_host_options() {
  option("--hosts",
         "Ranks on several hosts, numbered host by host: node1:4,node2:4 (CPU ranks), "
         "'node1[0,1] node2[2,3]' (one rank per listed GPU), or node1,node2 with --gpus. This "
         "machine may be one of them (localhost or its name); every other host is reached with "
         "--launcher and runs the same ddip program (--ddip)",
         "")
      ->type_name("LIST");
  option("--launcher",
         "How --hosts are reached: ssh (default; 'ssh -p 2222' adds ssh options), slurm (srun, "
         "inside an allocation; 'slurm --mpi=none' adds srun options), or a launcher command with "
         "{host} and {command}, run by /bin/sh (e.g. 'docker exec -i {host} {command}')",
         "")
      ->type_name("LAUNCHER");
  option("--ddip",
         "The ddip program on the other hosts (default: this one's path, as for a shared or "
         "identical environment)",
         "")
      ->type_name("PATH");
  option("--ship",
         "With --hosts: send FILE to every other host with the launch, into a private "
         "directory there (removed when its ranks are gone); COMMAND's arguments equal to FILE "
         "name that copy there. For a script that exists only here. Repeat for more",
         "")
      ->type_name("FILE");
  option("--link-timeout",
         "With --hosts: how long another host's ddip run goes on without hearing from this one "
         "(or without being able to send its output) before it stops its ranks; ssh gives up "
         "on a silent host after about as long. Default 30",
         "")
      ->type_name("SECONDS");
}

void CommandLine::add_program_options() {
  // Set by a ddip run on the ddip run it starts on each other host; not for people.
  option("--node", "RANK_OFFSET,WORLD_SIZE,NODE_RANK,NNODES", "")->group("");
  option("--node-name", "", "")->group("");
  option("--node-cwd", "", "")->group("");
  option("--node-run-id", "", "")->group("");
  option("--node-files", "", "")->group("");
  option("--node-restart", "", "")->group("");  // helper B: RESTART,MAX (NodeOptions)
  option("--node-prompts", "", "", true)->group("");
  // %%diprun's: a rank's debugger prompt as a record line on stdout, which it answers.
  option("--prompt-records", "", "", true)->group("");
  // python -m ddip's: its own interpreter is torchrun's "python".
  option("--interpreter", "", "")->group("");
  option("--die-with-parent",
         "Exit, and so stop every rank, when the process that started ddip run dies (for "
         "programs that drive it, such as %%diprun)",
         "", true);
  option("--check",
         "Check the command line and plan the launch, then exit without starting anything: 0, "
         "or 2 and the errors alone (for programs that drive ddip run, such as %%diprun, to "
         "tell its usage errors from a rank's exit code)",
         "", true);
  // Never given to CLI11 (scan() splits the command off); declared so that --help shows the
  // usage line and what COMMAND is.
  run_->add_option("COMMAND", command_doc_,
                   "What every rank runs, with its arguments: a script (train.py, run with "
                   "Python as torchrun runs it), or a program found on PATH (python train.py). "
                   "Put it after -- when it could be taken for a flag of ddip run");
  run_->footer(
      "A rank's breakpoint() prompts on ddip run's terminal, labelled with its rank ([1] "
      "ipdb> ), one rank at a time, and the line typed next goes to that rank only, on any "
      "host: each rank's stdin is then a pipe of its own, written only at its prompts; when "
      "ddip run's stdin is neither a terminal nor a pipe, it is /dev/null and breakpoint() "
      "says so and goes on. Ranks also get OMP_NUM_THREADS (their host's cores divided among "
      "its ranks), PYTHONUNBUFFERED=1 and PYTHONBREAKPOINT=ddip.rank.run_debug.set_trace (the "
      "prompt above), unless already set, and torchrun's TORCHELASTIC_* variables: "
      "TORCHELASTIC_RUN_ID (--rdzv-id, or a random one), TORCHELASTIC_RESTART_COUNT, "
      "TORCHELASTIC_MAX_RESTARTS, and a TORCHELASTIC_ERROR_FILE per rank: a rank that fails "
      "inside a function decorated with torch's @record writes its traceback there, and ddip "
      "run's report shows it. Ctrl-C (SIGINT), SIGTERM and SIGHUP (a closed terminal) are "
      "forwarded to every rank's process group, on every host, and so are the signals "
      "--signals-to-handle lists (SIGQUIT by default); a second one kills the ranks. "
      "At --timeout and the first Ctrl-C, every Python rank first says where it is (torch's "
      "flight recorder and its stack) through a startup hook ddip run puts first on its "
      "PYTHONPATH, which also makes pdb.set_trace() prompt as breakpoint() does; "
      "DDIP_RUN_HOOK=0 turns it off. With --hosts, ranks on other hosts get that host's own "
      "environment (as under torchrun) plus the variables above, and run in this directory "
      "when it exists there. See run.md for every option's meaning.");
}

int CommandLine::exit(const CLI::Error& e) {
  if (e.get_exit_code() != 0 && check_) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return app_.exit(e) == 0 ? 0 : 2;
}

const CommandLine::Given* CommandLine::given(const std::string& name) const {
  auto it = given_.find(name);
  return it == given_.end() ? nullptr : &it->second;
}

bool CommandLine::flag(const std::string& name) const {
  const Given* g = given(name);
  if (!g) return false;
  if (g->pos > 0) return true;  // on the command line
  auto n = whole_number(g->value);
  return n && *n != 0;
}

void CommandLine::problem(const std::string& name, const std::string& text) {
  const Given* g = given(name);
  std::string who = g ? (g->pos > 0 ? g->spelled : g->spelled + "=" + g->value) : name;
  problem_at(g ? g->pos : 0, who + ": " + text);
}

RunOptions CommandLine::parse(const std::vector<std::string>& args) {
  opts_ = RunOptions{};
  given_.clear();
  repeated_.clear();
  command_.clear();
  problems_.clear();
  dashdash_ = false;
  check_ = false;
  node_ = NodeOptions{};
  if (args.empty() || args[0] != "run") {
    // No subcommand, another one, or ddip's own --help: CLI11 says what is wrong.
    app_.parse(std::vector<std::string>(args.rbegin(), args.rend()));
    throw CLI::RequiredError("run");
  }
  scan(args);
  read_pet();
  read_ranks();
  read_output();
  read_torchrun();
  read_env();
  if (!opts_.hosts.empty() || has("--hosts") ||
      (has("--gpus") && given("--gpus")->value.find(':') != std::string::npos))
    read_hosts();
  else
    for (const char* flag : {"--launcher", "--ddip", "--ship"}) {
      if (has(flag)) problem(flag, "requires --hosts");
      for (const auto& g : repeated_[flag]) {
        problem_at(g.pos, g.spelled + ": requires --hosts");
        break;
      }
    }
  if (has("--node")) read_node();
  read_command();
  not_yet();
  if (!problems_.empty()) {
    std::stable_sort(problems_.begin(), problems_.end(),
                     [](const Problem& a, const Problem& b) { return a.pos < b.pos; });
    std::string text;
    for (const auto& p : problems_) text += (text.empty() ? "" : "\n") + p.text;
    throw CLI::ValidationError(text);
  }
  return opts_;
}

void CommandLine::scan(const std::vector<std::string>& args) {
  // The command's own flags must never be taken for ours: it starts at the first word that is
  // neither one of our options nor an option's value, or after "--". Each option is looked up by
  // every spelling, and by a unique prefix of a long name, as torchrun's argparse does.
  bool help = false;
  size_t i = 1;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      dashdash_ = true;
      ++i;
      break;
    }
    if (a.size() < 2 || a[0] != '-') break;
    if (a == "-h" || a == "--help") {
      help = true;
      continue;
    }
    const bool is_long = a.rfind("--", 0) == 0;
    const size_t eq = a.find('=');
    std::string name = is_long ? a.substr(0, eq) : a.substr(0, 2);
    std::optional<std::string> value;
    if (is_long && eq != std::string::npos) value = a.substr(eq + 1);
    if (!is_long && a.size() > 2) value = a.substr(a[2] == '=' ? 3 : 2);
    auto found = key_of_.find(name);
    std::string key = found == key_of_.end() ? "" : found->second;
    if (key.empty() && is_long) {
      std::set<std::string> keys;
      for (const auto& [spelled, k] : key_of_)
        if (spelled.rfind(name, 0) == 0 && spelled.rfind("--", 0) == 0 &&
            !run_->get_option(k)->get_group().empty())
          keys.insert(k);
      if (keys.size() == 1) key = *keys.begin();
      if (keys.size() > 1) {
        std::string which;
        for (const auto& k : keys) which += (which.empty() ? "" : ", ") + k;
        problem_at(i, name + ": ambiguous, could be " + which);
        if (!value && i + 2 < args.size() && args[i + 1][0] != '-') ++i;
        continue;
      }
    }
    if (key.empty()) {
      problem_at(i, name + ": no such option of ddip run (ddip run --help lists them; put "
                           "the command after -- if this is its own)");
      // "--nnodes 4 python x.py": the value is the flag's, not the command, if a command follows.
      if (!value && i + 2 < args.size() && args[i + 1][0] != '-') ++i;
      continue;
    }
    const size_t pos = i;
    if (is_flag_[key]) {
      if (value) {
        problem_at(pos, name + ": takes no value, got " + *value);
        continue;
      }
      value = "";
    } else if (!value) {
      // argparse's rule: the next word is the value unless it is an option itself.
      bool next_is_value = i + 1 < args.size() &&
                           (args[i + 1].empty() || args[i + 1][0] != '-' ||
                            (args[i + 1].size() > 1 && std::isdigit(static_cast<unsigned char>(
                                                           args[i + 1][1]))));
      if (!next_is_value) {
        problem_at(pos, name + ": needs a value");
        continue;
      }
      value = args[++i];
    }
    Given g{*value, pos, name};
    if (key == "--env" || key == "--ship")
      repeated_[key].push_back(g);
    else
      given_[key] = g;
  }
  if (help) app_.parse(std::vector<std::string>{"--help", "run"});
  check_ = has("--check");
  command_pos_ = i;
  command_.assign(args.begin() + static_cast<std::ptrdiff_t>(std::min(i, args.size())),
                  args.end());
}

void CommandLine::read_pet() {
  for (const auto& [key, pet] : pet_) {
    if (given_.count(key)) continue;  // the command line wins, as in torch's env action
    if (const char* v = std::getenv(pet.c_str())) given_[key] = Given{v, 0, pet};
  }
}

void CommandLine::read_ranks() {
  if (const Given* n = given("--nproc-per-node")) {
    const std::string& v = n->value;
    std::optional<long> count = whole_number(v);
    auto gpus = [] {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      return static_cast<long>(
          plan::visible_gpus(visible ? std::optional<std::string>(visible) : std::nullopt,
                             plan::nvidia_device_count())
              .size());
    };
    if (v == "cpu") count = plan::cpu_count();
    if (v == "gpu" || v == "auto") {
      count = gpus();
      if (*count == 0 && v == "auto") count = plan::cpu_count();
      if (*count == 0)
        problem("--nproc-per-node", "there is no GPU here (torchrun: Cuda is not available); "
                                    "give a number of ranks, cpu or auto");
    }
    if (!count)
      problem("--nproc-per-node", "give a number of ranks (1 to 1024), cpu, gpu or auto; got '" +
                                      v + "'");
    else if (*count > 1024 || (*count < 1 && v != "gpu"))
      problem("--nproc-per-node", "Value " + v + " not in range 1 to 1024");
    else if (*count >= 1)
      opts_.nproc = static_cast<int>(*count);
  }
  // -n from PET_NPROC_PER_NODE yields to --gpus or --hosts on the command line.
  const Given* n = given("--nproc-per-node");
  bool n_here = n && n->pos > 0;
  for (const char* other : {"--gpus", "--hosts"})
    if (n_here && has(other)) {
      const Given* o = given(other);
      const Given* first = n->pos < o->pos ? n : o;
      const Given* second = first == n ? o : n;
      problem_at(second->pos, first->spelled + " excludes " + second->spelled +
                                  " (give the ranks one way)");
    }
  if (const Given* g = given("--gpus");
      g && g->value.find(':') == std::string::npos && !has("--hosts")) {
    opts_.gpus = split_list(g->value);
    if (std::any_of(opts_.gpus.begin(), opts_.gpus.end(),
                    [](const std::string& e) { return e.empty(); }))
      problem("--gpus", "an entry is empty; give GPUs like 0,3 or all");
  }
}

void CommandLine::read_output() {
  if (const Given* s = given("--show")) {
    opts_.show = s->value;
    if (s->value != "all" && s->value != "none")
      for (const auto& item : split_list(s->value))
        if (!parse_index(item)) {
          problem("--show", "'" + item + "' is not a rank; give all, none, or ranks like 0 or 0,2");
          break;
        }
  }
  if (const Given* f = given("--local-ranks-filter"); f && !f->value.empty()) {
    for (const auto& item : split_list(f->value)) {
      auto r = parse_index(item);
      if (!r) {
        problem("--local-ranks-filter",
                "give a comma-separated list of local ranks, e.g. 0,1,2 (torchrun's meaning)");
        opts_.local_ranks_filter.clear();
        break;
      }
      opts_.local_ranks_filter.push_back(*r);
    }
  }
  for (auto [key, into] : {std::pair{"--redirects", &opts_.redirects}, {"--tee", &opts_.tee}})
    if (const Given* g = given(key)) {
      if (auto s = parse_streams(g->value))
        *into = *s;
      else
        problem(key, "give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank as "
                     "0:1,1:2; got '" + g->value + "'");
    }
  if (const Given* d = given("--log-dir")) {
    opts_.log_dir = d->value;
    if (d->value.empty()) problem("--log-dir", "give a directory");
  }
  // With --hosts, and on each other host's ddip run (--node), which has none.
  if (const Given* t = given("--link-timeout")) {
    char* end = nullptr;
    double s = std::strtod(t->value.c_str(), &end);
    if (t->value.empty() || *end != '\0' || !(s >= 1 && s <= 86400))
      problem("--link-timeout", "give 1 to 86400 seconds, got " + t->value);
    else
      opts_.link_timeout_s = s;
  }
  if (const Given* t = given("--timeout")) {
    // strtod, not CLI11's number check, for one message: "give a positive number".
    char* end = nullptr;
    double s = std::strtod(t->value.c_str(), &end);
    if (t->value.empty() || *end != '\0' || !(s > 0) || s > 1e9)
      problem("--timeout", "give a positive number of seconds, got " + t->value);
    else
      opts_.timeout_s = s;
  }
  opts_.die_with_parent = has("--die-with-parent");
  opts_.raw = has("--raw");
  opts_.check = check_;
  opts_.prompts = has("--node-prompts");
  opts_.prompt_records = has("--prompt-records");
}

void CommandLine::read_torchrun() {
  if (const Given* g = given("--nnodes")) {
    auto colon = g->value.find(':');
    auto lo = whole_number(g->value.substr(0, colon));
    auto hi = colon == std::string::npos ? lo : whole_number(g->value.substr(colon + 1));
    if (!lo || !hi || *lo < 1 || *lo > *hi || *hi > 100000)
      problem("--nnodes", "give N or MIN:MAX with 0 < MIN <= MAX, got '" + g->value + "'");
    else {
      opts_.nnodes_min = static_cast<int>(*lo);
      opts_.nnodes_max = static_cast<int>(*hi);
    }
  }
  if (const Given* g = given("--node-rank")) {
    auto k = whole_number(g->value);
    if (!k)
      problem("--node-rank", "give a node rank (0, 1, ...), got '" + g->value + "'");
    else
      opts_.node_rank = static_cast<int>(*k);
  }
  if (const Given* g = given("--rdzv-backend")) {
    opts_.rdzv_backend = g->value;
    if (g->value != "static" && g->value != "c10d")
      problem("--rdzv-backend", "ddip run's rendezvous is static or c10d, got '" + g->value + "'");
  }
  if (const Given* g = given("--rdzv-endpoint")) {
    opts_.rdzv_endpoint = g->value;
    try {
      if (!g->value.empty()) parse_endpoint(g->value);
    } catch (const std::invalid_argument& e) {
      problem("--rdzv-endpoint", e.what());
    }
  }
  if (const Given* g = given("--rdzv-id")) opts_.rdzv_id = g->value;
  if (const Given* g = given("--key-file")) opts_.key_file = g->value;  // helper B, run_join
  if (const Given* g = given("--rdzv-conf")) {
    for (const auto& kv : split_list(g->value)) {
      if (g->value.find_first_not_of(" \t") == std::string::npos) break;
      auto eq = kv.find('=');
      std::string k = kv.substr(0, eq), v = eq == std::string::npos ? "" : kv.substr(eq + 1);
      if (k.empty() || v.empty()) {
        problem("--rdzv-conf", "give KEY1=VALUE1,KEY2=VALUE2,... (torch's format), got '" +
                                   g->value + "'");
        break;
      }
      opts_.rdzv_conf[k] = v;
    }
  }
  opts_.standalone = flag("--standalone");
  if (const Given* g = given("--max-restarts")) {
    auto k = whole_number(g->value);
    if (!k)
      problem("--max-restarts", "give a number of restarts (0 or more), got '" + g->value + "'");
    else
      opts_.max_restarts = static_cast<int>(*k);
  }
  if (const Given* g = given("--monitor-interval")) {
    char* end = nullptr;
    double s = std::strtod(g->value.c_str(), &end);
    if (g->value.empty() || *end != '\0')
      problem("--monitor-interval", "give a number of seconds, got '" + g->value + "'");
    else
      opts_.monitor_interval_s = s;
  }
  if (const Given* g = given("--start-method")) {
    opts_.start_method = g->value;
    if (g->value != "spawn" && g->value != "fork" && g->value != "forkserver")
      problem("--start-method", "give spawn, fork or forkserver, got '" + g->value + "'");
  }
  if (const Given* g = given("--role")) opts_.role = g->value;
  if (const Given* g = given("--local-addr")) opts_.local_addr = g->value;
  if (const Given* g = given("--signals-to-handle")) {
    opts_.signals_to_handle.clear();
    for (const auto& name : split_list(g->value)) {
      if (!signal_numbers().count(name)) {
        problem("--signals-to-handle",
                "'" + name + "' is not a signal that stops a job, such as SIGUSR1 or SIGQUIT");
        break;
      }
      opts_.signals_to_handle.push_back(name);
    }
  }
  if (const Given* g = given("--master-addr")) opts_.master_addr = g->value;
  if (const Given* g = given("--master-port")) {
    auto p = whole_number(g->value);
    if (!p || *p < 1 || *p > 65535)
      problem("--master-port", "give a port from 1 to 65535, got '" + g->value + "'");
    else {
      opts_.master_port = static_cast<int>(*p);
      opts_.master_port_given = true;
    }
  }
  // torch's run(): --standalone, or a static rendezvous on one node with no port or endpoint,
  // is a c10d rendezvous on a free local port under a random run id.
  if (opts_.standalone ||
      (opts_.rdzv_backend == "static" && opts_.rdzv_endpoint.empty() &&
       !opts_.master_port_given && opts_.nnodes_max == 1)) {
    opts_.rdzv_backend = "c10d";
    opts_.rdzv_endpoint = "localhost:0";
    opts_.rdzv_id = "";
  }
  if (opts_.rdzv_backend == "static" && opts_.node_rank >= opts_.nnodes_max)
    problem("--node-rank", "node ranks are 0 to " + std::to_string(opts_.nnodes_max - 1) +
                               " with --nnodes " + std::to_string(opts_.nnodes_max));
  for (const char* names : {"--logs-specs", "--numa-binding", "--duplicate-stdout-filters",
                            "--duplicate-stderr-filters", "--shutdown-timeout",
                            "--virtual-local-rank"})
    if (has(names)) problem(names, "torchrun's option is not one of ddip run's");
}

void CommandLine::read_command() {
  opts_.module = flag("--module");
  opts_.no_python = flag("--no-python");
  opts_.run_path = flag("--run-path");
  // torchrun drops one "--": the one that ends its options, else one right after the script.
  std::vector<std::string> words = command_;
  if (!dashdash_ && words.size() >= 2 && words[1] == "--") words.erase(words.begin() + 1);
  opts_.given_command = words;
  if (words.empty()) {
    problem_at(command_pos_, "COMMAND is required");
    return;
  }
  const std::string& first = words.front();
  if (opts_.no_python && opts_.module && !opts_.run_path) {
    problem_at(command_pos_, "COMMAND: don't use both --no-python and --module (torchrun's rule)");
    return;
  }
  // ddip's rule beside torchrun's: a program found on PATH (python, bash, ./run.sh) that is not
  // a .py file is run as it is, as ddip run always has; anything else is a script for Python.
  bool program = opts_.no_python && !opts_.run_path;
  if (!opts_.module && !opts_.run_path && !opts_.no_python && !ends_with(first, ".py")) {
    std::string found = find_program(first);
    program = !found.empty() && ::access(found.c_str(), X_OK) == 0;
  }
  std::vector<std::string> argv;
  size_t script_at = 0;
  if (program) {
    argv = words;
  } else {
    const Given* interp = given("--interpreter");
    argv = {python_interpreter(interp ? interp->value : ""), "-u"};
    if (opts_.run_path)
      argv.insert(argv.end(), {"-c", kRunPath});
    else if (opts_.module)
      argv.push_back("-m");
    script_at = argv.size();
    argv.insert(argv.end(), words.begin(), words.end());
  }
  if (has("--local-rank-arg")) opts_.local_rank_arg_at = static_cast<int>(script_at + 1);
  opts_.command = argv;
  // Look the program or script up here, where the ranks run (not for ranks on other hosts, whose
  // files may be elsewhere or shipped), so that a typo fails before any rank starts.
  if (has("--hosts") || opts_.node || !opts_.hosts.empty()) return;
  if (program && opts_.no_python) {
    std::string found = find_program(first);
    if (found.empty())
      problem_at(command_pos_, "COMMAND: " + first +
                                   ": no such program (not a file, not on PATH); every rank "
                                   "would exit with 127 (not found)");
    else if (::access(found.c_str(), X_OK) != 0)
      problem_at(command_pos_, "COMMAND: " + first +
                                   " is not executable; every rank would exit with 126");
  } else if (!program && !opts_.module) {
    struct stat st {};
    if (::stat(first.c_str(), &st) != 0)
      problem_at(command_pos_,
                 "COMMAND: " + first +
                     (ends_with(first, ".py")
                          ? ": no such file here (Python would fail in every rank)"
                          : ": no such program on PATH and no such file (a program would exit "
                            "with 127, not found; a script is run with Python)"));
  }
}

void CommandLine::read_env() {
  for (const auto& g : repeated_["--env"]) {
    const std::string& e = g.value;
    auto eq = e.find('=');
    std::string name = e.substr(0, eq);
    bool ok = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
              std::all_of(name.begin(), name.end(), [](char c) {
                return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
              });
    if (!ok) {
      problem_at(g.pos, g.spelled + ": '" + e + "' is not NAME or NAME=VALUE");
    } else if (eq != std::string::npos) {
      opts_.env.push_back(e);
    } else if (const char* v = std::getenv(name.c_str())) {
      opts_.env.push_back(name + "=" + v);
    } else {
      problem_at(g.pos, g.spelled + ": " + name + " is not set here; give NAME=VALUE");
    }
  }
  for (const auto& g : repeated_["--ship"]) opts_.ship.push_back(g.value);
}

void CommandLine::read_hosts() {
  if (const Given* l = given("--launcher")) opts_.launcher = l->value;
  if (const Given* d = given("--ddip")) opts_.remote_ddip = d->value;
  const Given* hosts = given("--hosts");
  const Given* gpus = given("--gpus");
  try {
    std::string text = hosts ? hosts->value : "";
    if (gpus)
      text = plan::hosts_with_gpus(hosts ? std::optional<std::string>(text) : std::nullopt,
                                   gpus->value);
    opts_.hosts = plan::parse_hosts(text);
    std::vector<std::string> remote = {"true"};
    for (const auto& h : opts_.hosts)
      if (!h.local) launcher_argv(opts_.launcher, h.name, remote);
  } catch (const std::invalid_argument& e) {
    opts_.hosts.clear();
    problem(has("--launcher") ? "--launcher" : gpus ? "--gpus" : "--hosts", e.what());
  }
}

void CommandLine::read_node() {
  const std::string spec = given("--node")->value;
  auto parts = split_list(spec);
  std::vector<int> v;
  for (const auto& p : parts)
    if (auto i = parse_index(p)) v.push_back(*i);
  if (parts.size() != 4 || v.size() != 4 || v[1] < 1 || v[3] < 1 || v[2] >= v[3] ||
      v[0] + opts_.world_size() > v[1]) {
    problem("--node", "expected RANK_OFFSET,WORLD_SIZE,NODE_RANK,NNODES that fit this host's "
                      "ranks, got " + spec);
    return;
  }
  node_.rank_offset = v[0];
  node_.world_size = v[1];
  node_.node_rank = v[2];
  node_.nnodes = v[3];
  if (const Given* g = given("--node-name")) node_.name = g->value;
  if (const Given* g = given("--node-cwd")) node_.cwd = g->value;
  if (const Given* g = given("--node-run-id")) node_.run_id = g->value;
  if (const Given* g = given("--node-restart")) {
    auto parts = split_list(g->value);
    auto restart = parts.size() == 2 ? parse_index(parts[0]) : std::nullopt;
    auto max = parts.size() == 2 ? parse_index(parts[1]) : std::nullopt;
    if (!restart || !max || *restart > *max)
      problem("--node-restart", "expected RESTART,MAX with RESTART <= MAX, got " + g->value);
    else
      node_.restart = *restart, node_.max_restarts = *max;
  }
  if (const Given* g = given("--node-files")) {
    auto n = parse_index(g->value);
    if (!n || *n > 1024)
      problem("--node-files", "expected 0 to 1024, got " + g->value);
    else
      node_.files = *n;
  }
  opts_.node = node_;
}

void CommandLine::not_yet() {
  // Helper B (issue 32 items 2, 3): one ddip run per node (run_join.hpp) and --max-restarts
  // are here; what remains is the one pairing that can't be: --hosts starts every host's ddip
  // run itself, so they do not meet by rendezvous too.
  if (opts_.nnodes_max > 1 && has("--hosts"))
    problem("--nnodes", "give either --hosts (this ddip run starts every host's) or one ddip run "
                        "per node with --nnodes, not both");
}

std::vector<int> forwarded_signals(const RunOptions& opts) {
  std::vector<int> out = {SIGINT, SIGTERM, SIGHUP};
  for (const auto& name : opts.signals_to_handle) {
    auto it = signal_numbers().find(name);
    if (it != signal_numbers().end() && std::find(out.begin(), out.end(), it->second) == out.end())
      out.push_back(it->second);
  }
  return out;
}

std::vector<bool> shown_ranks(const std::string& show, int world_size) {
  std::vector<bool> shown(static_cast<size_t>(world_size), show == "all");
  if (show == "all" || show == "none") return shown;
  for (const auto& item : split_list(show)) {
    auto r = parse_index(item);
    if (!r)
      throw CLI::ValidationError(
          "--show", "'" + item + "' is not a rank; give all, none, or ranks like 0,2");
    if (*r >= world_size)
      throw CLI::ValidationError(
          "--show", "there is no rank " + item + ": ranks are 0-" + std::to_string(world_size - 1));
    shown[static_cast<size_t>(*r)] = true;
  }
  return shown;
}

}  // namespace ddip::run
