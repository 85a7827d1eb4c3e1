#include "run_report.hpp"

#include <time.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string_view>

#include "run_elastic.hpp"

namespace ddip::run {

int64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

bool terminate_abort(const RootCause& c) {
  if (c.rank < 0 || !(c.signal == SIGABRT || (c.signal == 0 && c.exit_code == 128 + SIGABRT)))
    return false;
  for (auto l = c.tail.rbegin(); l != c.tail.rend(); ++l) {
    std::string_view line = *l;
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.remove_suffix(1);
    if (!line.empty()) return line == "terminate called without an active exception";
  }
  return false;
}

AtStop stance(pid_t pid, int sig) {
  AtStop at;
  at.signal = sig;
  const std::string proc = "/proc/" + std::to_string(pid);
  std::ifstream stat_file(proc + "/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid pgrp session tty_nr tpgid flags ...": comm may hold anything but
  // its last ')'.
  auto close = stat.rfind(')');
  std::istringstream fields(close == std::string::npos ? std::string() : stat.substr(close + 1));
  std::string state;
  unsigned long flags = 0;
  long skip = 0;
  fields >> state >> skip >> skip >> skip >> skip >> skip >> flags;
  constexpr unsigned long kPfExiting = 0x4;  // include/linux/sched.h
  if (!fields || state == "Z" || state == "X" || (flags & kPfExiting)) {
    at.exiting = true;
    return at;
  }
  std::ifstream status(proc + "/status");
  const unsigned long long bit = 1ULL << (sig - 1);
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigCgt:", 0) != 0 && line.rfind("SigBlk:", 0) != 0) continue;
    if (std::strtoull(line.c_str() + 7, nullptr, 16) & bit) at.handles = true;
  }
  return at;
}

bool ended_by_stop(const UnitEnd& un) {
  if (!un.stopped || !un.status) return false;
  if (un.status->unknown) return true;  // reaped by someone else: nothing tells
  if (un.at_stop.exiting) return false;
  if (un.status->signal)
    return un.status->signal == un.at_stop.signal || un.status->signal == SIGKILL;
  return un.at_stop.handles;
}

namespace {

// The evidence that a terminate_abort rank had done its work: every other rank ran to its end
// and exited 0 on its own (a rank that aborted mid-run leaves its peers failing or hung).
bool died_in_exit(const Outcome& o, const std::vector<UnitEnd>& units) {
  if (!o.root || !terminate_abort(*o.root) || o.first_signal || o.timed_out) return false;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitEnd& un = units[u];
    if (un.host) {
      if (un.ranks.empty()) return false;
      for (const auto& r : un.ranks)
        if (!(o.root->unit == u && o.root->rank == r.rank) && r.what != "exit code 0") return false;
    } else if (o.root->unit != u &&
               (!un.status || ended_by_stop(un) || un.status->signal || un.status->code != 0)) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string rank_end(const std::optional<ExitStatus>& status, bool stopped) {
  if (!status) return "still running";
  return status->describe() + (stopped ? " (stopped by ddip run)" : "");
}

std::string rank_end(const UnitEnd& un) { return rank_end(un.status, ended_by_stop(un)); }

std::string other_ranks(const std::vector<UnitEnd>& units, const std::optional<RootCause>& root) {
  auto range = [](const UnitEnd& un) {
    return un.nranks == 1 ? "rank " + std::to_string(un.first_rank)
                          : "ranks " + std::to_string(un.first_rank) + "-" +
                                std::to_string(un.first_rank + un.nranks - 1);
  };
  std::string out;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitEnd& un = units[u];
    if (un.host) {
      if (root && root->unit == u && root->rank < 0) continue;
      for (const auto& r : un.ranks)
        if (!root || root->unit != u || root->rank != r.rank)
          out += "  rank " + std::to_string(r.rank) + " (on " + un.name + "): " + r.what + "\n";
      if (un.ranks.empty())
        out += "  " + range(un) + " (on " + un.name + "): " +
               (un.status ? "unknown; its launcher ended with " + un.status->describe()
                          : std::string("still running")) +
               "\n";
      continue;
    }
    if (root && root->unit == u) continue;
    out += "  rank " + std::to_string(un.first_rank) + ": " + rank_end(un) + "\n";
  }
  return out;
}

int Outcome::exit_code() const {
  if (root) return root->code;
  if (timed_out) return 124;
  if (first_signal) return 128 + first_signal;
  return lost.empty() ? 0 : 1;
}

std::string summary(const Outcome& o, const std::vector<UnitEnd>& units) {
  std::string report;
  if (o.root) {
    report = "ddip run: " + o.root->who + " failed first: " + o.root->what;
    if (o.first_signal) report += " (after ddip run forwarded " + signal_name(o.first_signal) + ")";
    report += "\n";
    // As torchrun's "Root Cause": what its error file says, in place of its stderr's last lines
    // (the same traceback, when the exception also reached Python's top level).
    auto error = read_rank_error(o.root->error);
    if (error) {
      report += "its error file (TORCHELASTIC_ERROR_FILE, written by torch's @record) says: " +
                error->message.substr(0, error->message.find('\n')) + "\n";
      for (const auto& l : error->traceback) report += "  | " + l + "\n";
    } else if (!o.root->tail.empty()) {
      report += "last lines of its stderr:\n";
      for (const auto& l : o.root->tail) report += "  | " + l + "\n";
    }
    std::string others = other_ranks(units, o.root);
    if (!others.empty()) report += "other ranks:\n" + others;
    if (died_in_exit(o, units))
      report += "ddip run: " + o.root->who +
                " died in torch's exit after its work was done: every other rank exited 0, and it "
                "aborted as Python shut down while one of torch's threads (gloo's, say) still "
                "held its tensors. End the script with torch.distributed.destroy_process_group() "
                "after its last collective (accelerate: accelerator.end_training()); see "
                "docs/run.md.\n";
  } else if (o.timed_out) {
    std::ostringstream secs;
    secs << o.timeout_s;
    report =
        "ddip run: timed out after " + secs.str() + " s; ranks:\n" + other_ranks(units, o.root);
  } else if (o.first_signal) {
    report = "ddip run: forwarded " + signal_name(o.first_signal) + " to every rank" +
             (o.grace_ran_out ? ", then SIGKILL to those still running after " +
                                    std::to_string(o.grace.count() / 1000) + " s"
                              : std::string()) +
             "; ranks:\n" + other_ranks(units, o.root);
  }
  if (!report.empty()) report += "ddip run: exit code " + std::to_string(o.exit_code()) + "\n";
  return report;
}

protocol::NodeDone node_done(const std::vector<UnitEnd>& units) {
  protocol::NodeDone done;
  for (const auto& un : units)
    done.ranks.push_back({un.first_rank, rank_end(un)});
  return done;
}

}  // namespace ddip::run
