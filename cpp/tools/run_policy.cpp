#include "run_policy.hpp"

#include <csignal>

namespace ddip::run {

FailurePolicy::FailurePolicy(Crew& crew, Options options, Clock::time_point started)
    : crew_(crew), opts_(options) {
  outcome_.timeout_s = opts_.timeout_s;
  outcome_.grace = opts_.grace;
  if (opts_.timeout_s > 0)
    timeout_at_ = started + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(opts_.timeout_s));
}

// The earliest deadline wins: a failure or stop after a forwarded signal does not extend the
// grace that signal started.
void FailurePolicy::kill_by(Clock::time_point t) {
  if (!kill_at_ || t < *kill_at_) kill_at_ = t;
}

void FailurePolicy::failed(RootCause cause, Clock::time_point now) {
  if (cause.when_ns == 0) cause.when_ns = realtime_ns();
  auto& root = outcome_.root;
  // A host's report crosses the network, so it can arrive after a failure here that it caused
  // (a peer's collective failing once that host's rank died): across hosts the earliest failure
  // by the hosts' clocks is the root cause.
  if (root && cause.reported && cause.when_ns < root->when_ns) {
    root = std::move(cause);
    return;
  }
  if (root || stopping_) return;  // a later failure, or one of the ranks being stopped
  // Told now, not at the end: the first failure anywhere is the root cause, and the other
  // hosts' ranks fail soon after (their peer is gone). The rule the notebook's side follows too
  // (python/ddip/errors.py, root_cause_first): here every failure is an exit, so "a death
  // first, then by when it was heard of" is the first reported; ranks ddip stopped never are.
  if (opts_.node) crew_.report_upstream(cause);
  root = std::move(cause);
  if (outcome_.first_signal) {
    // The others got the same signal and are acting on it (a KeyboardInterrupt handler saving a
    // checkpoint, say): they get the grace period before SIGKILL, not a SIGTERM on top.
    stopping_ = true;
    kill_by(now + opts_.grace);
    return;
  }
  if (terminate_abort(*root)) {
    stop_at_ = now + opts_.grace;
    return;
  }
  stop(now);
}

void FailurePolicy::launcher_failed(RootCause cause, Clock::time_point now) {
  // After a forwarded signal a host's ddip run exits 128+signal like the ranks it stopped.
  if (outcome_.root || outcome_.first_signal) return;
  failed(std::move(cause), now);
}

void FailurePolicy::stop(Clock::time_point now) {
  if (stopping_) return;
  stopping_ = true;
  kill_by(now + opts_.grace);
  crew_.terminate();
}

void FailurePolicy::kill_all() {
  killed_ = true;
  crew_.kill();
}

void FailurePolicy::forward(int sig, Clock::time_point now) {
  // The ranks get the grace period to act on it, then SIGKILL, as after a stop: one that ignores
  // the signal must not run on. Each host's ddip run keeps its own deadline the same way.
  kill_by(now + opts_.grace);
  crew_.forward(sig);
}

bool FailurePolicy::collect_first(int then) {
  if (!opts_.collect || collected_once_ || stopping_) return false;
  collected_once_ = true;
  after_collect_ = then;
  crew_.collect();  // may call collected() at once
  return true;
}

void FailurePolicy::collected(Clock::time_point now) {
  if (!after_collect_) return;
  int then = *after_collect_;
  after_collect_.reset();
  if (then == 0)
    stop(now);
  else if (!killed_)  // a second Ctrl-C while the ranks were asked has killed them
    forward(then, now);
}

FailurePolicy::Signalled FailurePolicy::signalled(int sig, Clock::time_point now) {
  if (++interrupts_ == 1) {
    outcome_.first_signal = sig;
    // Ctrl-C: where every rank is, first; a scheduler's SIGTERM or a hang-up is acted on now.
    if (sig != SIGINT || !collect_first(sig)) forward(sig, now);
    return Signalled::kForwarded;
  }
  bool again = killed_;
  kill_all();
  return again ? Signalled::kKillingAgain : Signalled::kKilling;
}

void FailurePolicy::told_signal(int sig, Clock::time_point now) {
  if (!outcome_.first_signal) outcome_.first_signal = sig;
  forward(sig, now);
}

void FailurePolicy::told_kill(Clock::time_point now) {
  stop(now);
  kill_all();
}

void FailurePolicy::link_lost(std::string why, Clock::time_point now) {
  if (outcome_.lost.empty()) outcome_.lost = std::move(why);
  stop(now);
}

void FailurePolicy::link_closed(std::string why, Clock::time_point now) {
  if (outcome_.lost.empty() && !stopping_) outcome_.lost = std::move(why);
  stop(now);
}

void FailurePolicy::paused(bool on, Clock::time_point now) {
  if (on && !paused_since_) {
    paused_since_ = now;
  } else if (!on && paused_since_) {
    if (timeout_at_) *timeout_at_ += now - *paused_since_;
    paused_since_.reset();
  }
}

std::optional<Clock::time_point> FailurePolicy::next_deadline(bool all_exited) const {
  std::optional<Clock::time_point> next;
  if (timeout_at_ && !stopping_ && !paused_since_ && !after_collect_) next = timeout_at_;
  if (stop_at_ && !stopping_ && !all_exited && (!next || *stop_at_ < *next)) next = stop_at_;
  if (kill_at_ && !killed_ && !all_exited && (!next || *kill_at_ < *next)) next = kill_at_;
  return next;
}

void FailurePolicy::tick(Clock::time_point now, bool all_exited) {
  if (timeout_at_ && !stopping_ && !paused_since_ && !after_collect_ && now >= *timeout_at_) {
    outcome_.timed_out = true;
    timeout_at_.reset();
    if (!collect_first(0)) stop(now);
  }
  if (stop_at_ && !stopping_ && !all_exited && now >= *stop_at_) stop(now);
  if (kill_at_ && !killed_ && !all_exited && now >= *kill_at_) {
    // Past the grace after a forwarded signal: ranks killed now are stopped by ddip run, not
    // failures of their own.
    if (!stopping_) outcome_.grace_ran_out = true;
    stopping_ = true;
    kill_all();
  }
}

}  // namespace ddip::run
