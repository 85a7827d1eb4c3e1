// Spawning and supervising ranked worker processes, the tini / dumb-init way: each child in its
// own process group, PR_SET_PDEATHSIG set before exec, signals to the whole group, stop with
// SIGTERM, a grace period, then SIGKILL.
//
// Children are watched through pidfds, never waitpid(-1): the kernel process has other children
// (subprocess, ipykernel's) that are not ours to reap. The host may reap ours, though (os.wait(),
// SIGCHLD set to SIG_IGN): that is never an error; the status then comes from the pidfd (Linux
// 6.15+), or is reported as unknown.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "ddip/fd.hpp"

namespace ddip {

struct SpawnSpec {
  std::vector<std::string> argv;  // argv[0] is looked up in PATH when it has no '/'
  std::vector<std::string> env;   // complete environment, "KEY=value"
  std::string cwd;                // empty: inherit
  bool capture_output = true;     // fd 1 and 2 become pipes the caller reads
  bool null_stdin = true;         // fd 0 is /dev/null: input() in a rank must not wait on ours
  // When set, fd 0 is a pipe holding this (at most 60000 bytes), then end of file: how a
  // launcher hands a secret to what it starts without a command line or environment showing it.
  std::string stdin_data = {};
  // When set, fd 0 is a pipe whose write end the caller keeps (Child::stdin_pipe()): a channel
  // to tell a long-running child things later, and end of file when the caller closes it.
  bool stdin_pipe = false;
};

struct ExitStatus {
  int code = 0;          // exit code, when the child exited
  int signal = 0;        // the signal that killed it, or 0
  bool unknown = false;  // someone else in this process reaped it: code and signal mean nothing
  // The shell's convention: 128 + signal for a signalled child.
  int shell_code() const { return signal ? 128 + signal : code; }
  // "exit code 3", "killed by SIGKILL", "exit status unknown (...)"
  std::string describe() const;
};

class Child {
 public:
  pid_t pid() const { return pid_; }
  int pidfd() const { return pidfd_.get(); }  // readable once the child has exited
  Fd& stdout_pipe() { return out_; }
  Fd& stderr_pipe() { return err_; }
  Fd& stdin_pipe() { return in_; }  // SpawnSpec::stdin_pipe's write end
  const std::optional<ExitStatus>& status() const { return status_; }

 private:
  friend class Supervisor;
  pid_t pid_ = -1;
  Fd pidfd_;
  Fd out_, err_, in_;
  std::optional<ExitStatus> status_;
};

class Supervisor {
 public:
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;
  // How long a SIGKILLed child gets to be reaped: one in uninterruptible sleep (a hung NFS read,
  // a wedged GPU driver) may never go, and the notebook must not hang with it.
  static constexpr std::chrono::milliseconds kKillWait{5000};

  explicit Supervisor(std::chrono::milliseconds kill_wait = kKillWait) : kill_wait_(kill_wait) {}

  // Kills (SIGKILL) and reaps whatever is still running, waiting at most kill_wait in all; a
  // child that would not die by then is left behind (it dies with this process's children).
  ~Supervisor();

  // Starts a child; returns its index. Throws std::system_error when exec fails (the child's
  // errno, e.g. "No such file or directory"), after reaping it.
  size_t spawn(const SpawnSpec& spec);
  // Supervises a child started elsewhere (forked by a RankTemplate, as a child of this process)
  // exactly like a spawned one; returns its index. `out`/`err`: read ends of its output pipes.
  size_t adopt(pid_t pid, Fd pidfd, Fd out, Fd err);
  size_t size() const { return children_.size(); }
  Child& child(size_t i) { return children_.at(i); }

  // Non-blocking: the exit status once the child has exited (reaps it), else nullopt. Never
  // throws for a child someone else reaped (ECHILD): that status is `unknown`.
  std::optional<ExitStatus> poll(size_t i);
  // Blocks up to `timeout` for the child to exit.
  std::optional<ExitStatus> wait(size_t i, std::chrono::milliseconds timeout);
  bool running(size_t i);

  // Sends `sig` to the child's process group (so its own children get it too), or to the child
  // alone. A child that has already exited is skipped.
  void signal(size_t i, int sig, bool whole_group = true);
  void signal_all(int sig, bool whole_group = true);

  // SIGTERM to every running child's group, wait up to `grace`, then SIGKILL and wait up to
  // kill_wait. Returns the indices of children still not reaped. Never throws: it runs on error
  // paths.
  std::vector<size_t> stop_all(std::chrono::milliseconds grace) noexcept;

 private:
  std::chrono::milliseconds kill_wait_;
  std::vector<Child> children_;
};

std::string signal_name(int sig);

namespace detail {
// waitid() on a pidfd (P_PIDFD, Linux 5.4). glibc declares P_PIDFD from 2.36 on and the wheels
// build against 2.31, so the id type is given by its number here, once.
int waitid_pidfd(int pidfd, siginfo_t* info, int options);
}  // namespace detail

}  // namespace ddip
