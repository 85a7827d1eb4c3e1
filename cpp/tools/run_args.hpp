// `ddip run`'s command line and each rank's environment: everything the launcher decides before
// it starts a process, kept apart from the event loop so it can be tested without one.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ddip::run {

struct RunOptions {
  int nproc = 1;
  std::vector<std::string> gpus;  // --gpus entries as given; empty when the flag is absent
  std::string tee = "all";
  std::string log_dir;
  double timeout_s = 0;  // 0: no timeout
  bool die_with_parent = false;
  std::vector<std::string> command;

  // One rank per listed GPU, else -n.
  int world_size() const { return gpus.empty() ? nproc : static_cast<int>(gpus.size()); }
};

// The `ddip` program's command line. Only `run` exists today; `--hosts` will join its flags.
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
  std::string gpus_;
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

// What is shared by every rank of one launch.
struct LaunchEnv {
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::optional<std::string> cuda_visible_devices;  // set by --gpus
};

// torchrun's environment for `rank`, on top of `base` ("KEY=value" entries): RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ... MASTER_ADDR, MASTER_PORT, without any
// TORCHELASTIC_* variable (there is no elastic agent to talk to). OMP_NUM_THREADS=1 when there is
// more than one rank and PYTHONUNBUFFERED=1, each unless `base` sets it.
std::vector<std::string> rank_environment(const std::vector<std::string>& base,
                                          const LaunchEnv& launch, int rank);

}  // namespace ddip::run
