// `ddip run`'s launch as data, decided before anything starts: each process it supervises (a
// rank here, or another host's ddip run through that host's launcher), with its command line and
// environment, made from the command line and what this machine says. Kept apart from running it
// (ddip_run.cpp's Launcher), as torch elastic keeps its WorkerSpec, so it is tested as data.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "ddip/supervisor.hpp"
#include "run_args.hpp"
#include "run_elastic.hpp"
#include "run_output.hpp"

namespace ddip::run {

// What every rank's PYTHONBREAKPOINT names unless the user set it: breakpoint() writes a Prompt
// record and reads its answer from the rank's stdin (python/ddip/rank/run_debug.py).
inline constexpr const char* kBreakpointHook = "ddip.rank.run_debug.set_trace";

// What the launcher supervises: a rank of its own, or the launcher of another host's ddip run.
struct UnitPlan {
  bool host = false;
  std::string name;  // host units: the host
  int first_rank = 0, nranks = 1;
  bool shown = true;       // rank units: reaches the terminal (--show, --local-ranks-filter)
  RankStreams streams;     // rank units: -r/-t, and its log directory
  std::string error_file;  // rank units: its TORCHELASTIC_ERROR_FILE ("" when none)
  SpawnSpec spec;
  std::string ship;  // host units: the shipped files, sent on its channel first
};

// What the plan takes from this machine and this process: this_machine() reads them, tests give
// their own.
struct Machine {
  std::vector<std::string> env;  // this process's environment, "KEY=value"
  int cores = 0;                 // CPUs for the thread rule (plan::cpu_count)
  // The GPUs this machine has (plan::nvidia_device_count): asked only when ranks start here.
  std::function<int()> gpu_count;
  std::string cwd;   // where ranks on other hosts run, when it exists there ("": unknown)
  std::string self;  // this program: the ddip run started on other hosts, unless --ddip
  // MASTER_PORT when none is given (plan::master_port).
  std::function<int(bool rank0_here, const std::string& address)> master_port;
};
Machine this_machine();

// torchrun's elastic variables for every rank of the launch: one run id on every host, and each
// rank's error file here (none under --check, which starts nothing); and the directory of ddip's
// startup hook, which every Python rank here gets first on its PYTHONPATH.
struct Elastic {
  std::string run_id;
  const ErrorFiles* errors = nullptr;
  // ddip's startup hook for the ranks (run_collectives.hpp), beside the error files; "": none.
  std::string hook_dir;
  // TORCHELASTIC_RESTART_COUNT: this attempt's (--max-restarts; the job's host counts them
  // across nodes), and TORCHELASTIC_MAX_RESTARTS. --log-dir's attempt_<n> is the same n.
  int restart_count = 0, max_restarts = 0;
};

// --log-dir's directory for this launch (run_output's make_job_log_dir), or torchrun's temporary
// one when -r/-t keep files without --log-dir (said on stderr as `prog`'s); "" when no rank keeps
// logs. Throws std::system_error.
std::string make_log_job_dir(const RunOptions& opts, const std::string& run_id,
                             const std::string& prog);

// The launch's units, in rank order: one per rank started here, one per other host. `shipped`:
// the files sent to each other host first (run_ship.hpp's payload), "" for none. Throws
// std::invalid_argument for GPUs or a launcher that can't be had, CLI::ValidationError for a
// --tee naming no rank, std::runtime_error (a free port) for what the machine refused.
std::vector<UnitPlan> plan_units(const RunOptions& opts, const Machine& machine,
                                 const Elastic& elastic, const std::string& shipped);

}  // namespace ddip::run
