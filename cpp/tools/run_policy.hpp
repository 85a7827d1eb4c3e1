// `ddip run`'s failure policy: which failure is the root cause, when to stop every rank, and how
// (SIGTERM, the grace period, SIGKILL; or a forwarded signal's grace, then SIGKILL), a timeout, a
// second Ctrl-C, a lost link to the ddip run that started this one. It decides; a Crew acts on
// the processes. Time comes in as arguments, so the policy is tested without waiting.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "run_loop.hpp"
#include "run_report.hpp"

namespace ddip::run {

// What the policy has done to the processes.
class Crew {
 public:
  virtual ~Crew() = default;
  // SIGTERM to every rank here still running (each then counts as stopped by ddip run), Stop to
  // every host's ddip run.
  virtual void terminate() = 0;
  // SIGKILL to the same, Kill to every host's ddip run.
  virtual void kill() = 0;
  // `sig` to every rank here still running, Signal to every host's ddip run.
  virtual void forward(int sig) = 0;
  // On another host: tell the ddip run that started this one of the first failure, at once.
  virtual void report_upstream(const RootCause& cause) = 0;
  // Ask every rank where it is (its collectives and stack, run_collectives.hpp) and show it;
  // then, when every rank answered or the wait is over, call collected() (at once when there is
  // nobody to ask).
  virtual void collect() = 0;
};

class FailurePolicy {
 public:
  struct Options {
    std::chrono::milliseconds grace{5000};  // SIGTERM (or a forwarded signal) to SIGKILL
    double timeout_s = 0;                   // --timeout; 0: none
    bool node = false;                      // this is another host's ddip run (--node)
    // The timeout and the first Ctrl-C first ask the ranks where they are (Crew::collect), and
    // stop or forward once collected(): not on another host, whose ranks are asked from the
    // ddip run that started it.
    bool collect = false;
  };
  FailurePolicy(Crew& crew, Options options, Clock::time_point started);

  // A rank failed (here, or reported by a host), or a host's launcher did: the first is the
  // root cause (across hosts: the earliest by the hosts' clocks), and everyone is stopped; after
  // a terminate_abort (a rank dying in torch's exit) only once the grace has passed, so the
  // others can end on their own and their ends tell whether its work was done.
  void failed(RootCause cause, Clock::time_point now);
  // A host's launcher ended non-zero without a report from its ranks: a failure, unless it
  // exited so after a forwarded signal (as the ranks it stopped did).
  void launcher_failed(RootCause cause, Clock::time_point now);

  enum class Signalled { kForwarded, kKilling, kKillingAgain };
  // This process got `sig`: the first is forwarded to every rank with the grace period to act on
  // it; another kills every rank.
  Signalled signalled(int sig, Clock::time_point now);
  // On another host: the starting side forwarded `sig`.
  void told_signal(int sig, Clock::time_point now);
  // Stop (Stop from the starting side): SIGTERM, grace, SIGKILL; once.
  void stop(Clock::time_point now);
  // Kill from the starting side: stop now, and SIGKILL at once.
  void told_kill(Clock::time_point now);
  // On another host: the link to the starting side is gone (`why`); stop, and exit 1 unless a
  // rank failed or a signal came first. closed(): its end of file, which counts only when ddip
  // run was not stopping already (then it was the starting side finishing).
  void link_lost(std::string why, Clock::time_point now);
  void link_closed(std::string why, Clock::time_point now);

  // The ranks' states asked for by Crew::collect are shown (or the wait is over): what waited
  // for them, the stop after the timeout or the forwarded Ctrl-C, is done now.
  void collected(Clock::time_point now);
  bool collecting() const { return after_collect_.has_value(); }

  // While a rank's debugger prompt waits for an answer (`on`), the timeout stands still: time at
  // a prompt is the person's, not the job's.
  void paused(bool on, Clock::time_point now);

  // When tick() next has something to do (the timeout, the SIGKILL after the grace).
  std::optional<Clock::time_point> next_deadline(bool all_exited) const;
  void tick(Clock::time_point now, bool all_exited);

  bool stopping() const { return stopping_; }
  const std::optional<RootCause>& root() const { return outcome_.root; }
  // Everything the report needs; its exit_code() is the launcher's.
  const Outcome& outcome() const { return outcome_; }

 private:
  void kill_by(Clock::time_point t);
  void kill_all();
  void forward(int sig, Clock::time_point now);
  // Asks the ranks first, once per run, when Options::collect: `then` (0: stop; else the signal
  // to forward) waits for collected(). False when nothing is asked: the caller acts now.
  bool collect_first(int then);

  Crew& crew_;
  Options opts_;
  Outcome outcome_;
  std::optional<Clock::time_point> timeout_at_;
  std::optional<Clock::time_point> paused_since_;  // a prompt waits: the timeout stands still
  // When the ranks still running are stopped after a terminate_abort, if they have not ended.
  std::optional<Clock::time_point> stop_at_;
  // When every rank still running gets SIGKILL: the grace after a stop or a forwarded signal.
  std::optional<Clock::time_point> kill_at_;
  std::optional<int> after_collect_;  // what waits for collected(): 0 stop, else a signal
  bool stopping_ = false, killed_ = false, collected_once_ = false;
  int interrupts_ = 0;
};

}  // namespace ddip::run
