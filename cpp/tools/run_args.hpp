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
  bool local_rank_arg = false;  // --local-rank-arg: torch.distributed.launch's --local-rank=N
  double timeout_s = 0;  // 0: no timeout
  bool die_with_parent = false;
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
  CLI::App app_;
  CLI::App* run_ = nullptr;
  RunOptions opts_;
  std::string gpus_, hosts_, node_spec_;
  std::vector<std::string> env_;
  NodeOptions node_;
  std::vector<std::string> command_doc_;  // COMMAND is declared for --help only; see parse()
  // The flags, by what they are about: the ranks (returns -n, which --hosts excludes), the hosts,
  // and ddip run itself (with the hidden ones one ddip run gives another, and COMMAND).
  CLI::Option* add_rank_options();
  void add_host_options(CLI::Option* n);
  void add_program_options();
  // parse()'s steps. `args` without COMMAND, in CLI11's order; COMMAND into `command`.
  std::vector<std::string> split_command(const std::vector<std::string>& args,
                                         std::vector<std::string>& command) const;
  void read_env();    // --env: NAME alone takes its value here
  void read_hosts();  // --hosts, --gpus across hosts, and --launcher for each other host
  void read_node();   // --node: this host's place in a launch across hosts
};

// Which ranks reach the terminal (--show): "all", "none", or a comma list of ranks ("0", "0,2").
// Throws CLI::ValidationError naming the bad entry.
std::vector<bool> shown_ranks(const std::string& show, int world_size);

}  // namespace ddip::run
