// `ddip run`'s command line, checked: what the launch is planned from (run_plan.hpp), kept apart
// from the event loop so it can be tested without one.
#pragma once

#include <CLI/CLI.hpp>

#include "ddip/plan.hpp"
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ddip::run {

// One entry of --hosts (see ddip/plan.hpp: the launch plan is the runtime's, shared with Python).
using HostSpec = plan::Host;
using plan::LaunchEnv;
using plan::launcher_argv;
using plan::rank_environment;
using plan::uniform_cpus;

// What a `ddip run` started on a remote host by another `ddip run` is told (hidden flags): where
// its ranks sit in the whole launch. Its stdin is then the launching side's control channel.
struct NodeOptions {
  int rank_offset = 0;  // RANK of its first rank
  int world_size = 0;   // ranks on every host together
  int node_rank = 0;    // GROUP_RANK: its host's place in --hosts
  int nnodes = 1;       // GROUP_WORLD_SIZE
  std::string name;     // its host's name, for messages
  std::string cwd;      // the launching side's directory, if it exists here too
  int files = 0;        // files shipped on the channel before anything else (--ship there)
  std::string run_id;   // TORCHELASTIC_RUN_ID, the same on every host
  // --node-restart RESTART,MAX (helper B): the attempt's TORCHELASTIC_RESTART_COUNT and
  // TORCHELASTIC_MAX_RESTARTS (the ddip run that started it restarts every host).
  int restart = 0, max_restarts = 0;
};

// torchrun's -r/--redirects and -t/--tee (torch's Std): which of a rank's streams go to its log
// files, for every local rank ("3") or per local rank ("0:1,1:2"). 0 none, 1 stdout, 2 stderr,
// 3 both.
struct StdStreams {
  int all = 0;
  std::map<int, int> by_local_rank;  // given per rank: ranks not named get 0
  bool per_rank = false;
  int of(int local_rank) const {
    if (!per_rank) return all;
    auto it = by_local_rank.find(local_rank);
    return it == by_local_rank.end() ? 0 : it->second;
  }
};

struct RunOptions {
  int nproc = 1;  // ranks on this node: -n/--nproc-per-node N|cpu|gpu|auto, resolved
  std::vector<std::string> gpus;  // --gpus entries as given; empty when the flag is absent
  // --show: the (global) ranks whose output reaches the terminal: all, none or a list.
  std::string show = "all";
  // --local-ranks-filter (torchrun's): local ranks shown on the terminal; empty: every one.
  std::vector<int> local_ranks_filter;
  StdStreams redirects, tee;  // -r/--redirects, -t/--tee (torchrun's meaning)
  // --log-dir: torchrun's layout, DIR/<run id>_<suffix>/attempt_<n>/<local rank>/
  // {stdout,stderr}.log and error.json. Without -r/-t, every stream is kept (as -t 3).
  std::string log_dir;
  // Not an option: made at launch (run_plan's make_log_job_dir), --log-dir's DIR/<run id>_<random>
  // or torchrun's temporary one; "": no log files.
  std::string log_job_dir;

  // torchrun's launch (torch/distributed/run.py), each also read from its PET_* variable (the
  // command line wins), parsed as torch does. nnodes_max == 1 is one node, whatever the
  // rendezvous; more is a launch across nodes (one ddip run per node).
  int nnodes_min = 1, nnodes_max = 1;
  int node_rank = -1;  // -1: not given (torch's default is 0)
  // After parse(): --standalone, or a static rendezvous on one node without --master-port or
  // --rdzv-endpoint, is torch's "c10d at localhost:0" with a random run id: rdzv_id is then "".
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;  // as given ("" none); rdzv_host()/rdzv_port() read it
  std::string rdzv_id = "none";  // "": a random id (UUID 4) picked at launch
  std::map<std::string, std::string> rdzv_conf;
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval_s = 0.1;  // accepted; ddip run's event loop needs no polling
  std::string start_method = "spawn";  // accepted; ranks are always fresh processes (exec)
  std::string role = "default";
  std::string local_addr;
  // Forwarded to the ranks (TORCHELASTIC_SIGNALS_TO_HANDLE); torch's default.
  std::vector<std::string> signals_to_handle = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"};
  bool master_port_given = false;  // --master-port / PET_MASTER_PORT (torch's default: 29500)
  // How COMMAND's first word is run (torchrun's -m, --no-python, --run-path, and ddip's rule:
  // see run.md); `command` below is already the argv every rank runs.
  bool module = false, no_python = false, run_path = false;
  // COMMAND as given (torchrun's "--" taken out), before the interpreter: what another host's
  // ddip run is given, to run with its own interpreter.
  std::vector<std::string> given_command;
  // --local-rank-arg (torch.distributed.launch without --use-env): each rank's argv gets
  // "--local-rank=<local rank>" inserted at this index of `command`; -1: not.
  int local_rank_arg_at = -1;
  double timeout_s = 0;  // 0: no timeout
  bool die_with_parent = false;
  bool raw = false;  // --raw: every rank's lines as they come, repeats not collapsed
  bool check = false;  // --check: check the command line and plan the launch; start nothing
  std::vector<std::string> env;  // --env, as NAME=VALUE: for every rank on every host
  std::vector<HostSpec> hosts;  // --hosts; empty: this machine only
  std::string launcher = "ssh";
  std::string remote_ddip;  // --ddip: the ddip program on the hosts; empty: this one's path
  std::string master_addr;  // empty: chosen (127.0.0.1, or the address rank 0's host has)
  int master_port = 0;      // 0: chosen (see master_port_given)
  double link_timeout_s = 30;  // --link-timeout: how long a host may be silent, with --hosts
  // --key-file (added for run_join.hpp, issue 32 item 2): the shared key that authenticates the
  // links of a job formed from one ddip run per node; "" reads DDIP_RUN_KEY instead.
  std::string key_file;
  std::vector<std::string> ship;  // --ship: files sent to every other host with the launch
  // Someone can answer a rank's debugger prompt (ddip run's stdin is a terminal or a pipe; on
  // another host, --node-prompts): each rank's stdin is then a pipe of its own that gets the
  // lines typed at its prompts, instead of /dev/null.
  bool prompts = false;
  // --prompt-records (hidden, for %%diprun): a prompt is shown as a record line on stdout.
  bool prompt_records = false;
  std::optional<NodeOptions> node;
  std::vector<std::string> command;

  // One rank per listed GPU, else -n; with --hosts, the sum over the hosts.
  int world_size() const {
    if (!hosts.empty()) {
      int n = 0;
      for (const auto& h : hosts) n += h.ranks;
      return n;
    }
    return gpus.empty() ? nproc : static_cast<int>(gpus.size());
  }
};

// torch's parse_rendezvous_endpoint: HOST[:PORT] or [IPv6][:PORT]; "" is localhost. Throws
// std::invalid_argument naming what is wrong.
struct Endpoint {
  std::string host;
  int port = 0;
};
Endpoint parse_endpoint(const std::string& endpoint, int default_port = 29400);

// The interpreter torchrun's "python" is here (run.md): $PYTHON_EXEC (as torch reads it), else
// `fallback` (python -m ddip's own sys.executable), else the python3 (or python) beside this
// ddip program, in the environment it is installed in, else python3 on PATH.
std::string python_interpreter(const std::string& fallback = "");

// The `ddip` program's command line: `ddip run`.
class CommandLine {
 public:
  CommandLine();
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  // `args` is argv without the program name. Throws CLI::Error: CallForHelp for --help,
  // a ParseError subclass for anything wrong.
  RunOptions parse(const std::vector<std::string>& args);
  // Prints what `e` calls for (help, or the error and a hint); returns the exit code: 0 for
  // help, 2 for a usage error (as argparse and most Unix tools do; CLI11's own codes are 1xx).
  // Under --check a program asked, not a person: the error alone, without the hint.
  int exit(const CLI::Error& e);

 private:
  // One option as the command line (or its PET_* variable) gave it: its value, where it came
  // (a position on the command line; 0 for PET_*, so those problems are named first), as spelled.
  struct Given {
    std::string value;
    size_t pos = 0;
    std::string spelled;
  };
  // A problem with the command line, where it was: every one is named, in order.
  struct Problem {
    size_t pos;
    std::string text;
  };
  // Declares an option: `names` as CLI11 takes them (every spelling), `pet` its PET_* variable
  // ("" none), `flag` when it takes no value. For --help, and what scan() looks names up in.
  CLI::Option* option(const std::string& names, const std::string& help, const std::string& pet,
                      bool flag = false);
  void add_rank_options();
  void add_output_options();
  void add_torchrun_options();
  void add_host_options();
  void add_program_options();

  // parse()'s steps, in order. scan(): args after "run" split into options and COMMAND.
  void scan(const std::vector<std::string>& args);
  void read_pet();     // PET_* for what the command line did not give
  void read_ranks();   // -n/--nproc-per-node, --gpus
  void read_output();  // --show, --local-ranks-filter, -r, -t, --log-dir, --timeout
  void read_torchrun();  // nnodes, node rank, rendezvous, restarts, signals, master
  void read_command();   // -m, --no-python, --run-path, the interpreter, --check's lookups
  void read_env();       // --env: NAME alone takes its value here
  void read_hosts();     // --hosts, --gpus across hosts, and --launcher for each other host
  void read_node();      // --node: this host's place in a launch across hosts
  void not_yet();        // what ddip run does not do yet, named

  const Given* given(const std::string& name) const;  // by its first long name
  bool has(const std::string& name) const { return given(name) != nullptr; }
  bool flag(const std::string& name) const;  // a flag given (PET_*: a non-zero number)
  void problem(const std::string& name, const std::string& text);  // about option `name`
  void problem_at(size_t pos, std::string text) { problems_.push_back({pos, std::move(text)}); }

  CLI::App app_;
  CLI::App* run_ = nullptr;
  RunOptions opts_;
  std::map<std::string, std::string> help_values_;  // what CLI11 binds the options to (unused)
  std::map<std::string, bool> help_flags_;
  std::map<std::string, std::string> pet_;  // option (first long name) -> its PET_* variable
  std::map<std::string, std::string> key_of_;  // every spelling ("-n", "--nproc_per_node") -> key
  std::map<std::string, bool> is_flag_;        // key -> takes no value
  std::map<std::string, Given> given_;      // option -> the value that counts (the last)
  std::map<std::string, std::vector<Given>> repeated_;  // --env, --ship: every one
  std::vector<std::string> command_;  // COMMAND as given
  bool dashdash_ = false;             // "--" ended the options (torchrun drops one "--")
  size_t command_pos_ = 0;
  std::vector<Problem> problems_;
  bool check_ = false;
  std::vector<std::string> command_doc_;  // COMMAND is declared for --help only
  NodeOptions node_;
};

// The signals ddip run takes over and forwards to every rank (then stops them, as after a
// SIGTERM): SIGINT, SIGTERM and SIGHUP always, and --signals-to-handle's (torch's default adds
// SIGQUIT).
std::vector<int> forwarded_signals(const RunOptions& opts);

// Which ranks reach the terminal (--show): "all", "none", or a comma list of ranks ("0", "0,2").
// Throws CLI::ValidationError naming the bad entry.
std::vector<bool> shown_ranks(const std::string& show, int world_size);

}  // namespace ddip::run
