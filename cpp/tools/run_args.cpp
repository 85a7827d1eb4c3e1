#include "run_args.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>
#include <stdexcept>

namespace ddip::run {
using plan::parse_index;
using plan::split_list;

namespace {
// Whether `program` can be executed as it is named: a path, or a name looked up in PATH.
bool runnable(const std::string& program) {
  if (program.find('/') != std::string::npos) return ::access(program.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = std::min(dirs.find(':', start), dirs.size());
    std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    if (::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

// torchrun's habit, `torchrun --nproc-per-node 2 train.py`: ddip run starts a command (any
// program, as mpirun does), so a script that can't be run by itself is named with the fix rather
// than failing in every rank with "No such file or directory".
void check_program(const std::vector<std::string>& command) {
  const std::string& program = command.front();
  bool script = program.size() > 3 && program.compare(program.size() - 3, 3, ".py") == 0;
  if (script && !runnable(program))
    throw CLI::ValidationError(
        "COMMAND", program + " is a Python script, and ddip run starts a program on every rank: "
                             "name the interpreter, as in `ddip run -n 2 python " + program +
                             "` (torchrun adds python itself)");
}
}  // namespace

CommandLine::CommandLine()
    : app_("ddip: distributed data-parallel PyTorch on a C++ runtime", "ddip") {
  app_.require_subcommand(1);
  run_ = app_.add_subcommand(
      "run",
      "Start COMMAND once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
      "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and show every rank's output line by line, "
      "labelled [rank]. The first rank to fail stops the others; ddip run then exits with its "
      "code.");
  // --help lists them in this order.
  CLI::Option* nproc = add_rank_options();
  add_host_options(nproc);
  add_program_options();
}

CLI::Option* CommandLine::add_rank_options() {
  auto* n = run_->add_option("-n,--nproc-per-node", opts_.nproc,
                             "Number of ranks (CPU processes), default 1")
                ->type_name("N")
                ->check(CLI::Range(1, 1024));
  run_->add_option("--gpus", gpus_,
                   "One rank per listed GPU, in this order: rank i uses device index i. "
                   "Entries are indices (positions in CUDA_VISIBLE_DEVICES when that is set), "
                   "GPU-/MIG- UUIDs, or 'all'. Across hosts: 'node1:0,1 node2:2,3', or with "
                   "--hosts node1,node2 the GPUs every host uses")
      ->type_name("LIST")
      ->excludes(n);
  run_->add_option("--tee", opts_.show,
                   "Ranks whose output reaches the terminal: all (default), none, or a comma "
                   "list of ranks such as 0")
      ->check(
          [](const std::string& v) -> std::string {
            if (v == "all" || v == "none") return {};
            for (const auto& item : split_list(v))
              if (!parse_index(item))
                return "'" + item + "' is not a rank; give all, none, or ranks like 0 or 0,2";
            return {};
          },
          "")
      ->type_name("all|none|RANKS");
  run_->add_option("--log-dir", opts_.log_dir,
                   "Also write each rank's full output to DIR/rank<i>.stdout and "
                   "DIR/rank<i>.stderr (DIR is created)")
      ->type_name("DIR");
  run_->add_option("--timeout", opts_.timeout_s,
                   "Stop every rank after this many seconds and exit with 124, first printing "
                   "where each rank is: which collective it has not joined, and its stack "
                   "(time while a rank's debugger prompt waits for an answer does not count)")
      ->type_name("SECONDS")
      ->check(
          [](const std::string& v) -> std::string {
            // CLI11's PositiveNumber would say "not in range 0.000000 to 1797693...".
            double s = 0;
            if (CLI::detail::lexical_cast(v, s) && s > 0) return {};
            return "give a positive number of seconds, got " + v;
          },
          "");
  run_->add_option("-e,--env", env_,
                   "Set NAME for every rank, on every host: NAME=VALUE, or NAME alone for its "
                   "value here. Repeat for more. Ranks on other hosts otherwise start with "
                   "their host's own environment; values travel on a command line there, so "
                   "pass no secrets this way")
      ->type_name("NAME[=VALUE]")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  return n;
}

void CommandLine::add_host_options(CLI::Option* n) {
  run_->add_option("--hosts", hosts_,
                   "Ranks on several hosts, numbered host by host: node1:4,node2:4 (CPU ranks), "
                   "'node1[0,1] node2[2,3]' (one rank per listed GPU), or node1,node2 with "
                   "--gpus. This machine may be one of them (localhost or its name); every other "
                   "host is reached with --launcher and runs the same ddip program (--ddip)")
      ->type_name("LIST")
      ->excludes(n);
  run_->add_option("--launcher", opts_.launcher,
                   "How --hosts are reached: ssh (default; 'ssh -p 2222' adds ssh options), "
                   "slurm (srun, inside an allocation; 'slurm --mpi=none' adds srun options), or "
                   "a template with {host} and {command}, run by /bin/sh")
      ->type_name("LAUNCHER");
  run_->add_option("--ddip", opts_.remote_ddip,
                   "The ddip program on the other hosts (default: this one's path, as for a "
                   "shared or identical environment)")
      ->type_name("PATH");
  run_->add_option("--ship", opts_.ship,
                   "With --hosts: send FILE to every other host with the launch, into a private "
                   "directory there (removed when its ranks are gone); COMMAND's arguments equal "
                   "to FILE name that copy there. For a script that exists only here. Repeat for "
                   "more")
      ->type_name("FILE")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  run_->add_option("--link-timeout", opts_.link_timeout_s,
                   "With --hosts: how long another host's ddip run goes on without hearing from "
                   "this one (or without being able to send its output) before it stops its ranks; "
                   "ssh gives up on a silent host after about as long. Default 30")
      ->type_name("SECONDS")
      ->check(CLI::Range(1.0, 86400.0));
  // Added for run_join.hpp (issue 32 item 2): one ddip run per node.
  run_->add_option("--key-file", opts_.key_file,
                   "With one ddip run per node (--nnodes): a file holding a key every node "
                   "shares (else the DDIP_RUN_KEY variable); the nodes' links then authenticate "
                   "with it, and a node without it can't join")
      ->type_name("FILE");
  run_->add_option("--master-addr", opts_.master_addr,
                   "MASTER_ADDR for every rank (default: 127.0.0.1 on one host; with --hosts, "
                   "rank 0's host: its name, or this machine's address towards the first other "
                   "host)")
      ->type_name("ADDR");
  run_->add_option("--master-port", opts_.master_port,
                   "MASTER_PORT for every rank (default: a free port here; a random one in "
                   "29500-30499 when rank 0 runs on another host)")
      ->type_name("PORT")
      ->check(CLI::Range(1, 65535));
}

void CommandLine::add_program_options() {
  // Set by a ddip run on the ddip run it starts on each other host; not for people.
  run_->add_option("--node", node_spec_, "RANK_OFFSET,WORLD_SIZE,NODE_RANK,NNODES")->group("");
  run_->add_option("--node-name", node_.name)->group("");
  run_->add_option("--node-cwd", node_.cwd)->group("");
  run_->add_option("--node-run-id", node_.run_id)->group("");
  run_->add_option("--node-files", node_.files)->group("")->check(CLI::Range(0, 1024));
  run_->add_flag("--node-prompts", opts_.prompts)->group("");
  // %%diprun's: a rank's debugger prompt as a record line on stdout, which it answers.
  run_->add_flag("--prompt-records", opts_.prompt_records)->group("");
  run_->add_flag("--die-with-parent", opts_.die_with_parent,
                 "Exit, and so stop every rank, when the process that started ddip run dies "
                 "(for programs that drive it, such as %%diprun)");
  run_->add_flag("--check", opts_.check,
                 "Check the command line and plan the launch, then exit without starting "
                 "anything: 0, or 2 and the error alone (for programs that drive ddip run, such "
                 "as %%diprun, to tell its usage errors from a rank's exit code)");
  // Never given to CLI11 (parse() splits the command off first); declared so that --help shows
  // the usage line and what COMMAND is.
  run_->add_option("COMMAND", command_doc_,
                   "What every rank runs, with its arguments, e.g. python train.py --lr 0.1. "
                   "Put it after -- when it could be taken for a flag of ddip run");
  run_->footer(
      "A rank's breakpoint() prompts on ddip run's terminal, labelled with its rank ([1] "
      "ipdb> ), one rank at a time, and the line typed next goes to that rank only, on any "
      "host: each rank's stdin is then a pipe of its own, written only at its prompts; when "
      "ddip run's stdin is neither a terminal nor a pipe, it is /dev/null and breakpoint() "
      "says so and goes on. Ranks also get OMP_NUM_THREADS (their host's cores divided among "
      "its ranks), PYTHONUNBUFFERED=1 and PYTHONBREAKPOINT=ddip.rank.run_debug.set_trace (the "
      "prompt above), unless already set, and torchrun's "
      "TORCHELASTIC_* variables: one TORCHELASTIC_RUN_ID for the launch, "
      "TORCHELASTIC_RESTART_COUNT=0 and TORCHELASTIC_MAX_RESTARTS=0 (ddip run never restarts "
      "ranks), and a TORCHELASTIC_ERROR_FILE per rank: a rank that fails inside a function "
      "decorated with torch's @record writes its traceback there, and ddip run's report shows "
      "it. Ctrl-C (SIGINT), SIGTERM and SIGHUP (a closed terminal) are forwarded to every "
      "rank's process group, on every host; a second one kills the ranks. At --timeout and the "
      "first Ctrl-C, every Python rank first says where it is (torch's flight recorder and its "
      "stack) through a startup hook ddip run puts first on its PYTHONPATH, which also makes "
      "pdb.set_trace() prompt as breakpoint() does; DDIP_RUN_HOOK=0 turns it off. With "
      "--hosts, ranks "
      "on other hosts get that host's own environment (as under torchrun) plus the variables "
      "above, and run in this directory when it exists there.");
}

int CommandLine::exit(const CLI::Error& e) {
  // A failed parse has still counted the flags before the bad one; %%diprun puts --check first.
  if (e.get_exit_code() != 0 && run_->count("--check") > 0) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return app_.exit(e) == 0 ? 0 : 2;
}

RunOptions CommandLine::parse(const std::vector<std::string>& args) {
  opts_ = RunOptions{};
  gpus_.clear();
  hosts_.clear();
  env_.clear();
  node_spec_.clear();
  node_ = NodeOptions{};
  std::vector<std::string> command;
  app_.parse(split_command(args, command));
  if (command.empty()) throw CLI::RequiredError("COMMAND");
  check_program(command);
  opts_.command = std::move(command);
  // --gpus says each host's GPUs when there are hosts: with --hosts node1,node2, or naming them.
  bool across = run_->count("--hosts") ||
                (run_->count("--gpus") && gpus_.find(':') != std::string::npos);
  if (run_->count("--gpus") && !across) {
    opts_.gpus = split_list(gpus_);
    for (const auto& g : opts_.gpus)
      if (g.empty())
        throw CLI::ValidationError("--gpus", "an entry is empty; give GPUs like 0,3 or all");
  }
  if (!across) {
    for (const char* flag : {"--launcher", "--ddip", "--ship"})
      if (run_->count(flag))
        throw CLI::ValidationError(flag, std::string(flag) + " requires --hosts");
  }
  read_env();
  if (across) read_hosts();
  if (run_->count("--node")) read_node();
  return opts_;
}

std::vector<std::string> CommandLine::split_command(const std::vector<std::string>& args,
                                                    std::vector<std::string>& command) const {
  // The command's own flags must never reach CLI11: it starts at the first token that is neither
  // one of our flags nor a flag's value, or after "--".
  std::vector<std::string> ours;
  bool in_run = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!in_run) {
      ours.push_back(a);
      in_run = a == "run";
      continue;
    }
    if (a == "--") {
      command.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      break;
    }
    if (a.size() < 2 || a[0] != '-') {
      command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
      break;
    }
    ours.push_back(a);
    // "--flag value" and "-n 2" take the next token too; "--flag=value" and "-n2" don't.
    bool attached = a.rfind("--", 0) == 0 ? a.find('=') != std::string::npos : a.size() > 2;
    const CLI::Option* opt = run_->get_option_no_throw(a);
    if (!attached && opt && opt->get_items_expected_min() > 0 && i + 1 < args.size())
      ours.push_back(args[++i]);
  }
  std::reverse(ours.begin(), ours.end());  // CLI11 takes a vector last-first
  return ours;
}

void CommandLine::read_env() {
  for (const auto& e : env_) {
    auto eq = e.find('=');
    std::string name = e.substr(0, eq);
    bool ok = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
              std::all_of(name.begin(), name.end(), [](char c) {
                return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
              });
    if (!ok)
      throw CLI::ValidationError("--env", "'" + e + "' is not NAME or NAME=VALUE");
    if (eq != std::string::npos) {
      opts_.env.push_back(e);
    } else if (const char* v = std::getenv(name.c_str())) {
      opts_.env.push_back(name + "=" + v);
    } else {
      throw CLI::ValidationError("--env", name + " is not set here; give NAME=VALUE");
    }
  }
}

void CommandLine::read_hosts() {
  try {
    std::string text = hosts_;
    if (run_->count("--gpus"))
      text = plan::hosts_with_gpus(run_->count("--hosts") ? std::optional<std::string>(hosts_)
                                                    : std::nullopt,
                             gpus_);
    opts_.hosts = plan::parse_hosts(text);
    std::vector<std::string> remote = {"true"};
    for (const auto& h : opts_.hosts)
      if (!h.local) launcher_argv(opts_.launcher, h.name, remote);
  } catch (const std::invalid_argument& e) {
    const char* flag = run_->count("--launcher") ? "--launcher"
                       : run_->count("--gpus")   ? "--gpus"
                                                 : "--hosts";
    throw CLI::ValidationError(flag, e.what());
  }
}

void CommandLine::read_node() {
  auto parts = split_list(node_spec_);
  std::vector<int> v;
  for (const auto& p : parts)
    if (auto i = parse_index(p)) v.push_back(*i);
  if (parts.size() != 4 || v.size() != 4 || v[1] < 1 || v[3] < 1 || v[2] >= v[3] ||
      v[0] + opts_.world_size() > v[1])
    throw CLI::ValidationError("--node", "expected RANK_OFFSET,WORLD_SIZE,NODE_RANK,NNODES "
                                         "that fit this host's ranks, got " + node_spec_);
  node_.rank_offset = v[0];
  node_.world_size = v[1];
  node_.node_rank = v[2];
  node_.nnodes = v[3];
  opts_.node = node_;
}

std::vector<bool> shown_ranks(const std::string& tee, int world_size) {
  std::vector<bool> shown(static_cast<size_t>(world_size), tee == "all");
  if (tee == "all" || tee == "none") return shown;
  for (const auto& item : split_list(tee)) {
    auto r = parse_index(item);
    if (!r)
      throw CLI::ValidationError("--tee",
                                 "'" + item + "' is not a rank; give all, none, or ranks like 0,2");
    if (*r >= world_size)
      throw CLI::ValidationError(
          "--tee", "there is no rank " + item + ": ranks are 0-" + std::to_string(world_size - 1));
    shown[static_cast<size_t>(*r)] = true;
  }
  return shown;
}

}  // namespace ddip::run
