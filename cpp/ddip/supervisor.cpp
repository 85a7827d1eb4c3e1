#include "ddip/supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <system_error>
#include <utility>

namespace ddip {
namespace detail {

int pidfd_send_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

int waitid_pidfd(int pidfd, siginfo_t* info, int options) {
  constexpr idtype_t kPidfd = static_cast<idtype_t>(3);  // P_PIDFD in <linux/wait.h>
  return ::waitid(kPidfd, static_cast<id_t>(pidfd), info, options);
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Runs in the clone(CLONE_VM | CLONE_VFORK) child: only async-signal-safe calls, no allocation, no
// writes but `err`.
[[noreturn]] void exec_child(pid_t parent, const char* file, char* const* argv, char* const* envp,
                             const char* cwd, int in_fd, int out_fd, int err_fd, int report_fd) {
  int err = 0;
  const char* step = nullptr;
  if (::setpgid(0, 0) < 0) {
    err = errno, step = "setpgid";
  } else if (::prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) {
    err = errno, step = "prctl";
  } else if (::getppid() != parent) {
    ::_exit(1);  // the parent already died: don't start an orphan
  } else if (in_fd >= 0 && ::dup2(in_fd, 0) < 0) {
    err = errno, step = "dup2";
  } else if (out_fd >= 0 && ::dup2(out_fd, 1) < 0) {
    err = errno, step = "dup2";
  } else if (err_fd >= 0 && ::dup2(err_fd, 2) < 0) {
    err = errno, step = "dup2";
  } else if (cwd && ::chdir(cwd) < 0) {
    err = errno, step = "chdir";
  }
  if (!step) {
    // Handlers are the parent's (they would run on its memory): default them all, as
    // posix_spawn does, before unblocking what the parent blocked around clone.
    for (int s = 1; s < NSIG; ++s) {
      struct sigaction sa{};
      if (::sigaction(s, nullptr, &sa) == 0 && sa.sa_handler != SIG_IGN && sa.sa_handler != SIG_DFL)
        ::signal(s, SIG_DFL);
    }
    ::signal(SIGPIPE, SIG_DFL);  // Python ignores it; a worker should not inherit that
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execvpe(file, argv, envp);
    err = errno, step = "exec";
  }
  // Report "step\0errno" to the parent over the close-on-exec pipe.
  char buf[32];
  size_t n = std::strlen(step);
  std::memcpy(buf, step, n + 1);
  std::memcpy(buf + n + 1, &err, sizeof err);
  ssize_t ignored = ::write(report_fd, buf, n + 1 + sizeof err);
  (void)ignored;
  ::_exit(err == ENOENT ? 127 : 126);
}

struct ExecArgs {
  pid_t parent;
  const char* file;
  char* const* argv;
  char* const* envp;
  const char* cwd;
  int in_fd, out_fd, err_fd, report_fd;
};

int clone_entry(void* p) {
  auto* a = static_cast<ExecArgs*>(p);
  exec_child(a->parent, a->file, a->argv, a->envp, a->cwd, a->in_fd, a->out_fd, a->err_fd,
             a->report_fd);
}

// PIDFD_GET_INFO (Linux 6.13; the exit status since 6.15), declared here for older headers.
struct PidfdInfo {
  uint64_t mask;
  uint64_t cgroupid;
  uint32_t pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
  int32_t exit_code;  // a wait status, as waitpid() returns it
};
static_assert(sizeof(PidfdInfo) == 64);
constexpr unsigned long kPidfdGetInfo = _IOWR(0xFF, 11, PidfdInfo);
constexpr uint64_t kPidfdInfoExit = 1u << 3;

// The status of a child someone else reaped: the kernel keeps it for holders of a pidfd.
ExitStatus status_from_pidfd(int pidfd) {
  PidfdInfo info{};
  info.mask = kPidfdInfoExit;
  if (::ioctl(pidfd, kPidfdGetInfo, &info) < 0 || !(info.mask & kPidfdInfoExit))
    return ExitStatus{0, 0, true};  // an older kernel: unknown it is
  if (WIFSIGNALED(info.exit_code)) return ExitStatus{0, WTERMSIG(info.exit_code), false};
  return ExitStatus{WEXITSTATUS(info.exit_code), 0, false};
}

ExitStatus decode(const siginfo_t& info) {
  ExitStatus s;
  if (info.si_code == CLD_EXITED)
    s.code = info.si_status;
  else
    s.signal = info.si_status;
  return s;
}


// A child's stdin: its end (none: ours, inherited), and ours to write to for stdin_pipe.
struct ChildStdin {
  Fd child, ours;
};

ChildStdin child_stdin(const SpawnSpec& spec) {
  ChildStdin in;
  if (spec.stdin_pipe) {
    Pipe p = make_pipe();
    in.child = std::move(p.read);
    in.ours = std::move(p.write);
  } else if (!spec.stdin_data.empty()) {
    // Written before the child exists: it fits the pipe's buffer, so nothing can block.
    if (spec.stdin_data.size() > 60000)
      throw std::invalid_argument("SpawnSpec.stdin_data is larger than a pipe holds");
    Pipe p = make_pipe();
    size_t done = 0;
    while (done < spec.stdin_data.size()) {
      ssize_t n =
          ::write(p.write.get(), spec.stdin_data.data() + done, spec.stdin_data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      check(n, "write", "filling a child's stdin");
      done += static_cast<size_t>(n);
    }
    in.child = std::move(p.read);
  } else if (spec.null_stdin) {
    in.child = Fd(check(::open("/dev/null", O_RDONLY | O_CLOEXEC), "open(/dev/null)",
                        "giving a worker an empty stdin"));
  }
  return in;
}

// Starts the child that runs clone_entry(args); its pid, and its pidfd in `pidfd`.
pid_t clone_child(ExecArgs& args, int& pidfd) {
  // CLONE_VM | CLONE_VFORK, as posix_spawn does: no page-table copy of a multi-GiB notebook
  // process, and the parent resumes once the child has exec'd (or failed to).
  std::vector<char> stack(256 * 1024);
  // No signal handler may run in the child while it shares our memory.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &old);
  // CLONE_PIDFD: the pidfd comes with the child, so no moment exists where only a reusable pid
  // names it. The exit signal stays SIGCHLD: execve resets any other to SIGCHLD anyway.
  pid_t pid = ::clone(clone_entry, stack.data() + stack.size(),
                      CLONE_VM | CLONE_VFORK | CLONE_PIDFD | SIGCHLD, &args, &pidfd);
  int clone_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  errno = clone_errno;
  if (pid < 0) throw_errno("clone", "starting a worker process");
  return pid;
}

// What the child reported on `report` before exec failed, if it did: then it is reaped and the
// failure thrown, as std::system_error with the child's errno.
void check_exec(const Fd& report, const Fd& pidfd, const std::string& program) {
  char buf[32] = {};
  ssize_t n;
  do {
    n = ::read(report.get(), buf, sizeof buf);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return;
  size_t len = ::strnlen(buf, sizeof buf);
  int child_errno = 0;
  std::memcpy(&child_errno, buf + len + 1, sizeof child_errno);
  siginfo_t info{};
  waitid_pidfd(pidfd.get(), &info, WEXITED);
  throw std::system_error(child_errno, std::generic_category(),
                          std::string(buf) + " failed while starting '" + program + "'");
}

}  // namespace detail

std::string signal_name(int sig) {
  // sigabbrev_np() would do, but it is glibc 2.32's and the wheels run on 2.31.
  static constexpr std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},       {SIGINT, "SIGINT"},       {SIGQUIT, "SIGQUIT"},
      {SIGILL, "SIGILL"},       {SIGTRAP, "SIGTRAP"},     {SIGABRT, "SIGABRT"},
      {SIGBUS, "SIGBUS"},       {SIGFPE, "SIGFPE"},       {SIGKILL, "SIGKILL"},
      {SIGUSR1, "SIGUSR1"},     {SIGSEGV, "SIGSEGV"},     {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"},     {SIGALRM, "SIGALRM"},     {SIGTERM, "SIGTERM"},
      {SIGSTKFLT, "SIGSTKFLT"}, {SIGCHLD, "SIGCHLD"},     {SIGCONT, "SIGCONT"},
      {SIGSTOP, "SIGSTOP"},     {SIGTSTP, "SIGTSTP"},     {SIGTTIN, "SIGTTIN"},
      {SIGTTOU, "SIGTTOU"},     {SIGURG, "SIGURG"},       {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"},     {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"},
      {SIGWINCH, "SIGWINCH"},   {SIGIO, "SIGIO"},         {SIGPWR, "SIGPWR"},
      {SIGSYS, "SIGSYS"}};
  for (const auto& [number, name] : kNames)
    if (number == sig) return name;
  return "signal " + std::to_string(sig);
}

std::string ExitStatus::describe() const {
  if (unknown) return "exit status unknown (reaped by someone else in the notebook process)";
  if (signal) return "killed by " + signal_name(signal);
  return "exit code " + std::to_string(code);
}

Supervisor::~Supervisor() {
  auto deadline = std::chrono::steady_clock::now() + kill_wait_;
  for (size_t i = 0; i < children_.size(); ++i) {
    try {
      if (!running(i)) continue;
      signal(i, SIGKILL);
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      wait(i, std::max(left, std::chrono::milliseconds(0)));
    } catch (const std::exception&) {
      // A destructor can only leave it: the child is SIGKILLed or gone already.
    }
  }
}

size_t Supervisor::spawn(const SpawnSpec& spec) {
  if (spec.argv.empty()) throw std::invalid_argument("SpawnSpec.argv is empty");
  // Everything the child needs is prepared before vfork: it may not allocate.
  auto argv = detail::c_strings(spec.argv);
  auto envp = detail::c_strings(spec.env);
  Pipe report = make_pipe();
  auto [null_in, stdin_write] = detail::child_stdin(spec);
  Pipe out, err;
  if (spec.capture_output) {
    out = make_pipe(true);
    err = make_pipe(true);
  }
  detail::ExecArgs args{::getpid(),
                        argv[0],
                        argv.data(),
                        envp.data(),
                        spec.cwd.empty() ? nullptr : spec.cwd.c_str(),
                        null_in.get(),
                        out.write.get(),
                        err.write.get(),
                        report.write.get()};
  Child c;
  int pidfd = -1;
  c.pid_ = detail::clone_child(args, pidfd);
  c.pidfd_ = Fd(pidfd);
  // CLONE_VFORK: the child has exec'd (or failed) by now, in its own process group.
  report.write.reset();
  detail::check_exec(report.read, c.pidfd_, spec.argv[0]);
  if (spec.capture_output) {
    c.out_ = std::move(out.read);
    c.err_ = std::move(err.read);
  }
  c.in_ = std::move(stdin_write);
  children_.push_back(std::move(c));
  return children_.size() - 1;
}

size_t Supervisor::adopt(pid_t pid, Fd pidfd, Fd out, Fd err) {
  Child c;
  c.pid_ = pid;
  c.pidfd_ = std::move(pidfd);
  c.out_ = std::move(out);
  c.err_ = std::move(err);
  children_.push_back(std::move(c));
  return children_.size() - 1;
}

std::optional<ExitStatus> Supervisor::poll(size_t i) {
  Child& c = children_.at(i);
  if (c.status_) return c.status_;
  siginfo_t info{};
  // WNOWAIT first: while the leader is an unreaped zombie its pid can't be reused, so killing its
  // group reaches only what it left behind (DataLoader workers, say), never a stranger.
  int rc = detail::waitid_pidfd(c.pidfd_.get(), &info, WEXITED | WNOHANG | WNOWAIT);
  if (rc < 0) {
    if (errno == EINTR) return std::nullopt;
    if (errno != ECHILD) throw_errno("waitid", "checking on a worker process");
    // Someone in the host reaped it (os.wait(), SIGCHLD ignored). Its pid may already be reused,
    // so its group is not signalled: a stranger could lead a group of that number by now.
    c.status_ = detail::status_from_pidfd(c.pidfd_.get());
    return c.status_;
  }
  if (info.si_pid == 0) return std::nullopt;
  ::kill(-c.pid_, SIGKILL);
  siginfo_t reaped{};
  do {
    rc = detail::waitid_pidfd(c.pidfd_.get(), &reaped, WEXITED);
  } while (rc < 0 && errno == EINTR);
  // ECHILD: reaped by someone else in between; the status already read is still the real one.
  if (rc < 0 && errno != ECHILD) throw_errno("waitid", "reaping a worker process");
  c.status_ = detail::decode(info);
  return c.status_;
}

std::optional<ExitStatus> Supervisor::wait(size_t i, std::chrono::milliseconds timeout) {
  Child& c = children_.at(i);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!c.status_) {
    if (poll(i)) break;
    int ms = -1;
    if (timeout.count() >= 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      ms = static_cast<int>(left.count());
    }
    pollfd p{c.pidfd_.get(), POLLIN, 0};
    int rc = ::poll(&p, 1, ms);
    if (rc < 0 && errno != EINTR) throw_errno("poll", "waiting for a worker process to exit");
    // Exited yet not reapable: a zombie that a tracer (gdb, strace, py-spy) has not let go of.
    // Its pidfd stays readable, so look again in a while instead of spinning.
    if (rc > 0 && !poll(i)) ::poll(nullptr, 0, std::min(ms < 0 ? 10 : ms, 10));
  }
  return c.status_;
}

bool Supervisor::running(size_t i) { return !poll(i).has_value(); }

void Supervisor::signal(size_t i, int sig, bool whole_group) {
  Child& c = children_.at(i);
  if (!running(i)) return;
  // Not yet reaped, so the pid (and its group id) can't have been reused.
  if (whole_group && ::kill(-c.pid_, sig) == 0) return;
  if (detail::pidfd_send_signal(c.pidfd_.get(), sig) < 0 && errno != ESRCH)
    throw_errno("pidfd_send_signal", "signalling a worker process");
}

void Supervisor::signal_all(int sig, bool whole_group) {
  for (size_t i = 0; i < children_.size(); ++i) signal(i, sig, whole_group);
}

std::vector<size_t> Supervisor::stop_all(std::chrono::milliseconds grace) noexcept {
  // Each step per child, so that one child's error (a bug, or an fd limit) stops no other.
  auto each = [this](auto&& step) {
    for (size_t i = 0; i < children_.size(); ++i) try {
        step(i);
      } catch (const std::exception&) {
      }
  };
  auto left = [](std::chrono::steady_clock::time_point deadline) {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(0));
  };
  each([&](size_t i) { signal(i, SIGTERM); });
  auto deadline = std::chrono::steady_clock::now() + grace;
  each([&](size_t i) { wait(i, left(deadline)); });
  each([&](size_t i) { signal(i, SIGKILL); });
  deadline = std::chrono::steady_clock::now() + kill_wait_;
  each([&](size_t i) { wait(i, left(deadline)); });
  std::vector<size_t> stuck;
  for (size_t i = 0; i < children_.size(); ++i) {
    bool reaped = false;
    try {
      reaped = poll(i).has_value();
    } catch (const std::exception&) {
    }
    if (!reaped) stuck.push_back(i);
  }
  return stuck;
}

}  // namespace ddip
