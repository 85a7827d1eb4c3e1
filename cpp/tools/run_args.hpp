// `ddip run`'s command line and each rank's environment: everything the launcher decides before
// it starts a process, kept apart from the event loop so it can be tested without one.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ddip::run {

// One entry of --hosts: a host's name, and its ranks' count or GPUs.
struct HostSpec {
  std::string name;
  int ranks = 0;
  std::vector<std::string> gpus;  // "node1[0,1]": one rank per GPU; empty: CPU ranks
  bool local = false;             // this machine: its ranks start here, without a launcher
};

// What a `ddip run` started on a remote host by another `ddip run` is told (hidden flags): where
// its ranks sit in the whole launch. Its stdin is then the launching side's control channel.
struct NodeOptions {
  int rank_offset = 0;  // RANK of its first rank
  int world_size = 0;   // ranks on every host together
  int node_rank = 0;    // GROUP_RANK: its host's place in --hosts
  int nnodes = 1;       // GROUP_WORLD_SIZE
  std::string name;     // its host's name, for messages
  std::string cwd;      // the launching side's directory, if it exists here too
};

struct RunOptions {
  int nproc = 1;
  std::vector<std::string> gpus;  // --gpus entries as given; empty when the flag is absent
  std::string tee = "all";
  std::string log_dir;
  double timeout_s = 0;  // 0: no timeout
  bool die_with_parent = false;
  std::vector<std::string> env;  // --env, as NAME=VALUE: for every rank on every host
  std::vector<HostSpec> hosts;  // --hosts; empty: this machine only
  std::string launcher = "ssh";
  std::string remote_ddip;  // --ddip: the ddip program on the hosts; empty: this one's path
  std::string master_addr;  // empty: chosen (127.0.0.1, or the address rank 0's host has)
  int master_port = 0;      // 0: chosen
  double link_timeout_s = 30;  // --link-timeout: how long a host may be silent, with --hosts
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
  int exit(const CLI::Error& e) { return app_.exit(e) == 0 ? 0 : 2; }

 private:
  CLI::App app_;
  CLI::App* run_ = nullptr;
  RunOptions opts_;
  std::string gpus_, hosts_, node_spec_;
  std::vector<std::string> env_;
  NodeOptions node_;
  std::vector<std::string> command_doc_;  // COMMAND is declared for --help only; see parse()
};

// Which ranks reach the terminal: "all", "none", or a comma list of ranks ("0", "0,2").
// Throws CLI::ValidationError naming the bad entry.
std::vector<bool> tee_ranks(const std::string& tee, int world_size);

// The GPUs, in rank order, that every rank's CUDA_VISIBLE_DEVICES lists for --gpus `requested`.
// Numbers are positions in the launcher's own `visible` list when CUDA_VISIBLE_DEVICES is set (else
// physical indices, checked against `device_count` when that is known); UUIDs ("GPU-...",
// "MIG-...") pass through; "all" is every visible GPU. Throws std::invalid_argument saying what is
// wrong and what is visible.
std::vector<std::string> resolve_gpus(const std::vector<std::string>& requested,
                                      const std::optional<std::string>& visible,
                                      std::optional<int> device_count);

// Whether `name` is this machine: localhost, 127.0.0.1, ::1 or its host name.
bool is_this_host(const std::string& name);

// "node1:4,node2:4" or "node1[0,1] node2[2,3]" (commas or spaces between hosts) -> hosts, in
// rank order. `is_local` says whether a name is this machine. Throws std::invalid_argument saying
// what is wrong and how to write it.
std::vector<HostSpec> parse_hosts(const std::string& text,
                                  bool (*is_local)(const std::string& name));

// --hosts and --gpus together as one host list for parse_hosts(): the same GPUs on every host
// (--hosts node1,node2 --gpus 0,1), or each host's own (--gpus 'node1:0,1 node2:2,3', with or
// without --hosts naming the same hosts). Throws std::invalid_argument.
std::string hosts_with_gpus(const std::optional<std::string>& hosts, const std::string& gpus);

// What is shared by every rank of one launch on one host.
struct LaunchEnv {
  int world_size = 1;        // every host's ranks together
  int local_world_size = 0;  // this host's; 0: world_size (one host)
  int rank_offset = 0;       // RANK of this host's first rank
  int group_rank = 0, group_world_size = 1;  // this host's place among the hosts
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::optional<std::string> cuda_visible_devices;  // set by --gpus
  // No GPU for these ranks (no --gpus, none visible): accelerate is told so (ACCELERATE_USE_CPU),
  // or it would run each CPU rank as a world of its own.
  bool cpu_ranks = false;
  int local_size() const { return local_world_size ? local_world_size : world_size; }
};

// torchrun's environment for this host's `local_rank`, on top of `base` ("KEY=value" entries):
// RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ... MASTER_ADDR,
// MASTER_PORT, without any TORCHELASTIC_* variable (there is no elastic agent to talk to).
// OMP_NUM_THREADS=1 when this host runs more than one rank, PYTHONUNBUFFERED=1, and
// ACCELERATE_USE_CPU=true for CPU ranks, each unless `base` sets it.
std::vector<std::string> rank_environment(const std::vector<std::string>& base,
                                          const LaunchEnv& launch, int local_rank);

// SLURM_JOB_CPUS_PER_NODE ("8(x2),8") -> the CPUs every node has, or "" when they differ or it
// can't be read: srun's --cpus-per-task for one task per node.
std::string uniform_cpus(const std::string& cpus_per_node);

// A string the POSIX shell reads back as exactly `word`.
std::string shell_quote(const std::string& word);
// Splits a --launcher value into words as the shell would (quotes, backslashes; no expansion).
// Throws std::invalid_argument for an unclosed quote.
std::vector<std::string> split_words(const std::string& text);

// The command, run on this machine, that starts `remote` (a `ddip run` command line) on `host`:
// launcher "ssh [ssh options]" (default), "slurm [srun options]", or a template with {host} and
// {command}, run by /bin/sh. `slurm_cpus`: CPUs of every node (uniform_cpus), or "". ssh gives
// up on a silent server after about `link_timeout_s`; ssh options in `launcher` come first,
// so they win over these defaults (ssh takes an option's first value). Throws
// std::invalid_argument for a launcher it can't use.
std::vector<std::string> launcher_argv(const std::string& launcher, const std::string& host,
                                       const std::vector<std::string>& remote,
                                       const std::string& slurm_cpus = "",
                                       double link_timeout_s = 30);

}  // namespace ddip::run
