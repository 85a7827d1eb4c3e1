// What `ddip run` says at its end: the root cause, every other rank's end, and the exit code;
// and what a host's ddip run tells the one that started it instead (protocol::NodeDone). Pure
// functions of what the launcher saw, so every wording is tested without starting a process.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddip/supervisor.hpp"
#include "run_protocol.hpp"

namespace ddip::run {

// CLOCK_REALTIME in nanoseconds: comparable across hosts (kept in sync by NTP).
int64_t realtime_ns();

// The first failure, wherever it happened: the root cause ddip run reports and exits with.
struct RootCause {
  size_t unit = 0;
  int rank = -1;     // -1: a host's ddip run (or its launcher), before any of its ranks failed
  std::string who;   // "rank 3", "rank 3 (on node2)", "host node2"
  std::string what;  // "exit code 1", "killed by SIGSEGV"
  int code = 1;      // ddip run's exit code
  int exit_code = 0, signal = 0;  // a rank's: how it ended, for the report to another host
  std::vector<std::string> tail;  // last lines of its stderr
  std::string error;  // its TORCHELASTIC_ERROR_FILE's JSON (torch's @record wrote it), or ""
  int64_t when_ns = 0;            // CLOCK_REALTIME where it was seen: comparable across hosts
  bool reported = false;          // by another host's ddip run
};

// How a rank stood towards the signal ddip run sent to stop it, read just before it was sent
// (stance()): what tells a rank that ddip run stopped from one that was ending by itself.
struct AtStop {
  int signal = 0;        // SIGTERM (a stop), or SIGKILL (a kill without a stop before it)
  bool exiting = false;  // it was already exiting (its own exit, not yet reaped): unstoppable
  bool handles = false;  // it catches or blocks `signal`: its own code decides how it ends
};

// `pid`'s stance towards `sig` now, from /proc/<pid>/stat (the kernel's PF_EXITING flag, or a
// zombie) and /proc/<pid>/status (SigCgt, SigBlk). A process /proc no longer shows counts as
// exiting.
AtStop stance(pid_t pid, int sig);

// How one supervised process ended: a rank, or a host's launcher with its ranks.
struct UnitEnd {
  bool host = false;
  std::string name;  // host units: the host
  int first_rank = 0, nranks = 1;
  std::optional<ExitStatus> status;  // nullopt: still running
  bool stopped = false;              // was running when ddip run stopped everyone
  AtStop at_stop;                    // when `stopped`: how it stood then
  // Host units: their ranks' ends as that host's ddip run reported them at its end.
  std::vector<protocol::RankEnd> ranks;
};

// A rank that aborted (SIGABRT, or exit code 134 through a shell) with the C++ runtime's
// "terminate called without an active exception" as the last line of its stderr: how a torch
// rank dies when one of torch's threads (gloo's worker, say) outlives Python's shutdown.
bool terminate_abort(const RootCause& cause);

// Whether ddip run's stop is what ended the rank: it was signalled, was not already exiting, and
// ended as that signal ends a process (killed by it, or by the SIGKILL after the grace), or by
// its own code where that code handled the signal. A rank that was exiting by itself, or that
// ended with an exit code although the signal would have killed it, failed on its own.
bool ended_by_stop(const UnitEnd& unit);

// "still running", "exit code 0", "killed by SIGTERM (stopped by ddip run)".
std::string rank_end(const std::optional<ExitStatus>& status, bool stopped);
std::string rank_end(const UnitEnd& unit);

// Every rank's end but the root cause's, one indented line each.
std::string other_ranks(const std::vector<UnitEnd>& units, const std::optional<RootCause>& root);

// Why the launch ended, as the failure policy decided it.
struct Outcome {
  std::optional<RootCause> root;
  bool timed_out = false;
  double timeout_s = 0;
  int first_signal = 0;        // forwarded to every rank
  bool grace_ran_out = false;  // ranks still running after the signal's grace got SIGKILL
  std::chrono::milliseconds grace{5000};
  std::string lost;  // a host's ddip run: why its link to the starting side counts as gone
  // The launcher's exit code: the root cause's, 124 on timeout, 128 + a forwarded signal, 1
  // for a lost link, else 0.
  int exit_code() const;
};

// The summary ddip run prints to stderr ("" when every rank exited 0 on its own).
std::string summary(const Outcome& outcome, const std::vector<UnitEnd>& units);

// A host's ddip run's account of its ranks, for the ddip run that started it.
protocol::NodeDone node_done(const std::vector<UnitEnd>& units);

}  // namespace ddip::run
