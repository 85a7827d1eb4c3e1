// Standing agents: the launcher (ssh, srun, a launcher command) and the HostAgent it runs on
// another host, kept for as long as the kernel lives instead of one per group, so that a host's
// rank template (its warm ranks) outlives each group, like the kernel's own.
//
// The AgentKeeper spawns launchers from a thread of its own that lives as long as the object,
// because PR_SET_PDEATHSIG binds a child to the *thread* that created it: a group's IO thread
// ends with the group, the keeper's with the kernel. That thread owns every launcher's fds: the
// write end of its stdin (where each group's ticket goes, one line per group, and whose end of
// file tells the agent to stop everything and exit), and its stdout/stderr, always drained (a
// tail kept to explain a failed start).
//
// A group leases one agent per host (HostLinks): an idle one started by the same command line,
// or a new one. When the group ends, the lease goes back: the agent waits for its next ticket,
// unless the lease was retired (the group did not end cleanly on that host), and then its stdin
// is closed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddip/supervisor.hpp"

namespace ddip {

namespace detail {
struct KeeperCore;
struct StandingAgent;
}  // namespace detail

class AgentLease;

class AgentKeeper {
 public:
  // `stop_grace`: how long a launcher whose stdin was closed gets to exit before SIGKILL.
  // `keepalive`: how often each agent gets an empty line, so that one cut off from the kernel
  // between groups notices (AgentOptions::idle_timeout, 30 s, is several of them).
  explicit AgentKeeper(std::chrono::milliseconds stop_grace = std::chrono::seconds(5),
                       std::chrono::milliseconds keepalive = std::chrono::seconds(5));
  AgentKeeper(const AgentKeeper&) = delete;
  AgentKeeper& operator=(const AgentKeeper&) = delete;
  // Lets every agent go (stdin closed), waits up to the grace, then kills the launchers left.
  ~AgentKeeper();

  // An idle, running agent started by exactly `launcher` (argv, env, cwd), or a new one; an idle
  // one with the same argv but another environment is let go. `on_exit` runs on the keeper's
  // thread once the launcher has exited and its output is read; it must not block. Throws what
  // spawning throws (nothing is left running then).
  std::unique_ptr<AgentLease> lease(const SpawnSpec& launcher, std::function<void()> on_exit);
  // Lets every idle agent go now and each leased one when its group ends; waits up to `timeout`
  // for the idle ones' launchers to exit (SIGKILL after the grace). How many were idle.
  size_t release(std::chrono::milliseconds timeout);
  // The launchers running now, idle or leased.
  std::vector<pid_t> launchers() const;

 private:
  std::shared_ptr<detail::KeeperCore> core_;
  std::thread thread_;
  pid_t owner_pid_ = -1;
};

// One group's use of one standing agent. Everything but the destructor is thread-safe.
class AgentLease {
 public:
  AgentLease(std::shared_ptr<detail::KeeperCore> core, std::shared_ptr<detail::StandingAgent> a,
             bool reused);
  AgentLease(const AgentLease&) = delete;
  AgentLease& operator=(const AgentLease&) = delete;
  // Back to the keeper: idle for the next group, or let go when retired.
  ~AgentLease();

  pid_t pid() const;
  // The agent served an earlier group (its launcher was not started for this one).
  bool reused() const { return reused_; }
  // Written to the agent's stdin (a ticket line).
  void send(std::string line);
  // This agent is not to serve another group: its stdin is closed now, so it stops what it runs
  // and exits (its launcher is killed if it has not within the keeper's grace).
  void retire();
  bool retired() const;
  // Set once the launcher has exited and its output was read.
  std::optional<ExitStatus> exit_status() const;
  // The last lines the launcher printed (stdout and stderr as one) since this lease began.
  std::string tail() const;

 private:
  std::shared_ptr<detail::KeeperCore> core_;
  std::shared_ptr<detail::StandingAgent> agent_;
  bool reused_;
};

}  // namespace ddip
