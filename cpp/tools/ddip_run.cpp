// `ddip run`: a torchrun-compatible launcher. One thread, one epoll set over every rank's
// stdout/stderr pipes and pidfd, a signalfd, and deadlines; no Python anywhere, so a launch costs
// what starting the ranks costs.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "ddip/fd.hpp"
#include "ddip/output.hpp"
#include "ddip/supervisor.hpp"
#include "run_args.hpp"

extern char** environ;

namespace ddip::run {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// SIGTERM to SIGKILL when stopping ranks, as torch elastic and tini do; long enough for a rank
// to leave a collective and flush its logs.
constexpr milliseconds kGrace{5000};
// After the last rank has exited, how long its pipes may stay open: a descendant that left the
// rank's process group can hold them forever.
constexpr milliseconds kDrain{1000};
constexpr size_t kReadChunk = 64 * 1024;

// Writes everything, waiting when `fd` is non-blocking and full. False when the reader is gone
// (EPIPE) or the file can't take more (ENOSPC, EIO): the caller stops writing there.
bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

// "[rank] " at the start of every line. A line ends at '\n', or at '\r' when text follows (a
// progress bar redrawn in place keeps its label; "\r\n" gets one label). `after_cr` carries
// whether the stream's previous text ended with '\r' across calls.
std::string label(std::string_view text, const std::string& tag, bool& after_cr) {
  std::string out;
  out.reserve(text.size() + tag.size() * 4);
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find_first_of("\r\n", start);
    if (end == std::string_view::npos) end = text.size();
    if (end > start || (end < text.size() && text[end] == '\n' && !after_cr)) out += tag;
    out.append(text.substr(start, end - start));
    if (end < text.size()) out += text[end];
    after_cr = end < text.size() && text[end] == '\r';
    start = end + 1;
  }
  if (!out.empty() && out.back() != '\n' && out.back() != '\r') {
    out += '\n';
    after_cr = false;
  }
  return out;
}

int free_port() {
  Fd s(check(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), "socket", "finding a free port"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  check(::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), "bind",
        "finding a free port");
  socklen_t len = sizeof addr;
  check(::getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len), "getsockname",
        "finding a free port");
  return ntohs(addr.sin_port);
}

std::optional<int> nvidia_device_count() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec);
  if (ec) return std::nullopt;
  int n = 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) ++n;
  return n;
}

// A rank's command could not be started (not found, not executable): the shell's 127 / 126.
struct CannotStart : std::system_error {
  using std::system_error::system_error;
  int exit_code() const { return code().value() == ENOENT ? 127 : 126; }
};

class Launcher {
 public:
  Launcher(RunOptions opts, std::vector<bool> shown, LaunchEnv launch)
      : opts_(std::move(opts)), launch_(std::move(launch)) {
    ranks_.resize(static_cast<size_t>(launch_.world_size));
    for (size_t i = 0; i < ranks_.size(); ++i) {
      ranks_[i].tag = "[" + std::to_string(i) + "] ";
      ranks_[i].shown = shown[i];
    }
  }

  // Runs the ranks to the end; returns the launcher's exit code.
  int run();

 private:
  // epoll data: rank << 2 | what; the signalfd has its own value.
  enum What : uint64_t { kStdout = 1, kStderr = 2, kExit = 3 };
  static constexpr uint64_t kSignals = ~uint64_t{0};

  struct Rank {
    std::string tag;
    bool shown = true;
    RankOutput output;
    Fd log[3];  // [1] stdout, [2] stderr
    std::optional<ExitStatus> status;
    bool stopped = false;  // was running when ddip run stopped everyone
    bool after_cr[3] = {false, false, false};
  };

  RunOptions opts_;
  LaunchEnv launch_;
  Supervisor sup_;
  std::vector<Rank> ranks_;
  Fd epoll_, signals_;
  bool terminal_ok_[3] = {true, true, true};

  std::optional<size_t> root_;  // the first rank to fail
  bool stopping_ = false, killed_ = false, timed_out_ = false;
  int interrupts_ = 0, first_signal_ = 0;
  Clock::time_point started_, kill_at_, drain_until_;
  std::optional<Clock::time_point> timeout_at_;

  void watch(int fd, uint64_t data) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = data;
    check(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev), "epoll_ctl", "watching a rank");
  }
  Fd& pipe(size_t r, RankOutput::Stream s) {
    Child& c = sup_.child(r);
    return s == RankOutput::kStdout ? c.stdout_pipe() : c.stderr_pipe();
  }
  bool pipes_open() {
    for (size_t r = 0; r < sup_.size(); ++r)
      if (pipe(r, RankOutput::kStdout) || pipe(r, RankOutput::kStderr)) return true;
    return false;
  }
  bool all_exited() const {
    for (const auto& rk : ranks_)
      if (!rk.status) return false;
    return true;
  }

  void open_logs();
  void start_ranks();
  void read_pipe(size_t r, RankOutput::Stream s);
  void drain(size_t r);
  void emit(size_t r, RankOutput::Stream s, std::string_view text);
  void on_exit(size_t r);
  void on_signal();
  void stop();
  int finish();
  std::string states(std::optional<size_t> except) const;
};

void Launcher::open_logs() {
  if (opts_.log_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(opts_.log_dir, ec);
  if (ec) throw std::system_error(ec, "creating --log-dir " + opts_.log_dir);
  for (size_t r = 0; r < ranks_.size(); ++r) {
    for (int s : {1, 2}) {
      std::string path =
          opts_.log_dir + "/rank" + std::to_string(r) + (s == 1 ? ".stdout" : ".stderr");
      ranks_[r].log[s] =
          Fd(check(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), "open",
                   "creating " + path));
    }
  }
}

void Launcher::start_ranks() {
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) base.emplace_back(*e);
  for (size_t r = 0; r < ranks_.size(); ++r) {
    SpawnSpec spec;
    spec.argv = opts_.command;
    spec.env = rank_environment(base, launch_, static_cast<int>(r));
    try {
      sup_.spawn(spec);
    } catch (const std::system_error& e) {
      throw CannotStart(e.code(),
                        "cannot start rank " + std::to_string(r) + ": " +
                            std::string(e.what()).substr(0, std::string(e.what()).rfind(':')));
    }
    Child& c = sup_.child(r);
    watch(c.stdout_pipe().get(), r << 2 | kStdout);
    watch(c.stderr_pipe().get(), r << 2 | kStderr);
    watch(c.pidfd(), r << 2 | kExit);
  }
}

void Launcher::emit(size_t r, RankOutput::Stream s, std::string_view text) {
  if (text.empty() || !ranks_[r].shown || !terminal_ok_[s]) return;
  if (!write_all(s, label(text, ranks_[r].tag, ranks_[r].after_cr[s]))) terminal_ok_[s] = false;
}

void Launcher::read_pipe(size_t r, RankOutput::Stream s) {
  Fd& fd = pipe(r, s);
  if (!fd) return;
  char buf[kReadChunk];
  ssize_t n = ::read(fd.get(), buf, sizeof buf);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return;
    n = 0;  // EIO and the like: nothing more will come from it
  }
  Rank& rk = ranks_[r];
  if (n == 0) {
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd.get(), nullptr);
    fd.reset();
    emit(r, s, rk.output.flush(s));
    return;
  }
  std::string_view data(buf, static_cast<size_t>(n));
  if (rk.log[s] && !write_all(rk.log[s].get(), data)) {
    std::cerr << "ddip run: writing rank " << r << "'s log failed (" << std::strerror(errno)
              << "); its output goes on to the terminal only\n";
    rk.log[s].reset();
  }
  for (auto& piece : rk.output.feed(s, data)) emit(r, s, piece.text);
}

// Everything the exited rank wrote is in its pipes already; take it before reporting.
void Launcher::drain(size_t r) {
  for (auto s : {RankOutput::kStdout, RankOutput::kStderr}) {
    for (int i = 0; i < 4096 && pipe(r, s); ++i) {
      pollfd p{pipe(r, s).get(), POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      read_pipe(r, s);
    }
  }
}

void Launcher::on_exit(size_t r) {
  auto st = sup_.poll(r);
  if (!st) return;
  Rank& rk = ranks_[r];
  rk.status = st;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, sup_.child(r).pidfd(), nullptr);
  drain(r);
  if (st->shell_code() != 0 && !stopping_) {
    root_ = r;
    stop();
  }
  if (all_exited()) drain_until_ = Clock::now() + kDrain;
}

void Launcher::stop() {
  stopping_ = true;
  kill_at_ = Clock::now() + kGrace;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    // One that has exited, even if its pidfd has not been read yet, ended on its own.
    if (ranks_[r].status || !sup_.running(r)) continue;
    ranks_[r].stopped = true;
    sup_.signal(r, SIGTERM);
  }
}

void Launcher::on_signal() {
  signalfd_siginfo si{};
  while (::read(signals_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    int sig = static_cast<int>(si.ssi_signo);
    if (++interrupts_ == 1) {
      first_signal_ = sig;
      sup_.signal_all(sig);
    } else {
      if (!killed_) std::cerr << "ddip run: " << signal_name(sig) << " again: killing every rank\n";
      killed_ = true;
      for (size_t r = 0; r < ranks_.size(); ++r) {
        if (ranks_[r].status || !sup_.running(r)) continue;
        ranks_[r].stopped = true;
        sup_.signal(r, SIGKILL);
      }
    }
  }
}

std::string Launcher::states(std::optional<size_t> except) const {
  std::string out;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (except && r == *except) continue;
    const Rank& rk = ranks_[r];
    out += "  rank " + std::to_string(r) + ": ";
    if (!rk.status)
      out += "still running";
    else
      out += rk.status->describe() + (rk.stopped ? " (stopped by ddip run)" : "");
    out += '\n';
  }
  return out;
}

int Launcher::finish() {
  std::string report;
  int code = 0;
  if (root_) {
    const Rank& rk = ranks_[*root_];
    code = rk.status->shell_code();
    report = "ddip run: rank " + std::to_string(*root_) + " failed first: " + rk.status->describe();
    if (first_signal_) report += " (after ddip run forwarded " + signal_name(first_signal_) + ")";
    report += "\n";
    std::string tail = rk.output.stderr_tail();
    if (!tail.empty()) {
      report += "last lines of rank " + std::to_string(*root_) + "'s stderr:\n";
      size_t start = 0;
      while (start <= tail.size()) {
        size_t end = tail.find('\n', start);
        if (end == std::string::npos) end = tail.size();
        report += "  | " + tail.substr(start, end - start) + "\n";
        start = end + 1;
      }
    }
    if (ranks_.size() > 1) report += "other ranks:\n" + states(root_);
  } else if (timed_out_) {
    code = 124;
    std::ostringstream secs;
    secs << opts_.timeout_s;
    report = "ddip run: timed out after " + secs.str() + " s; ranks:\n" + states(std::nullopt);
  } else if (first_signal_) {
    code = 128 + first_signal_;
    report = "ddip run: forwarded " + signal_name(first_signal_) + " to every rank; ranks:\n" +
             states(std::nullopt);
  }
  if (!report.empty()) {
    report += "ddip run: exit code " + std::to_string(code) + "\n";
    write_all(2, report);
  }
  return code;
}

int Launcher::run() {
  started_ = Clock::now();
  if (opts_.timeout_s > 0)
    timeout_at_ = started_ + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(opts_.timeout_s));
  // Signals arrive as data in the loop; the ranks get an empty mask back before exec.
  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&mask, s);
  check(::sigprocmask(SIG_BLOCK, &mask, nullptr), "sigprocmask", "taking over SIGINT and SIGTERM");
  signals_ = Fd(check(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK), "signalfd",
                      "taking over SIGINT and SIGTERM"));
  // A closed terminal or pipe must not kill the launcher (and with it, every rank).
  ::signal(SIGPIPE, SIG_IGN);
  epoll_ = Fd(check(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1", "starting the launcher"));
  watch(signals_.get(), kSignals);
  open_logs();
  start_ranks();

  epoll_event events[64];
  while (true) {
    if (all_exited() && (!pipes_open() || Clock::now() >= drain_until_)) break;
    auto now = Clock::now();
    std::optional<Clock::time_point> next;
    auto consider = [&](Clock::time_point t) {
      if (!next || t < *next) next = t;
    };
    if (timeout_at_ && !stopping_) consider(*timeout_at_);
    if (stopping_ && !killed_) consider(kill_at_);
    if (all_exited()) consider(drain_until_);
    int wait_ms = -1;
    if (next) {
      auto left = std::chrono::ceil<milliseconds>(*next - now).count();
      wait_ms = static_cast<int>(std::max<decltype(left)>(left, 0));
    }
    int n = ::epoll_wait(epoll_.get(), events, 64, wait_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("epoll_wait", "watching the ranks");
    }
    for (int i = 0; i < n; ++i) {
      uint64_t d = events[i].data.u64;
      if (d == kSignals) {
        on_signal();
        continue;
      }
      size_t r = d >> 2;
      switch (d & 3) {
        case kStdout:
          read_pipe(r, RankOutput::kStdout);
          break;
        case kStderr:
          read_pipe(r, RankOutput::kStderr);
          break;
        case kExit:
          on_exit(r);
          break;
      }
    }
    now = Clock::now();
    if (timeout_at_ && !stopping_ && now >= *timeout_at_) {
      timed_out_ = true;
      stop();
    }
    if (stopping_ && !killed_ && now >= kill_at_) {
      killed_ = true;
      for (size_t r = 0; r < ranks_.size(); ++r)
        if (!ranks_[r].status) sup_.signal(r, SIGKILL);
    }
  }
  for (size_t r = 0; r < ranks_.size(); ++r)
    for (auto s : {RankOutput::kStdout, RankOutput::kStderr})
      if (pipe(r, s)) emit(r, s, ranks_[r].output.flush(s));
  return finish();
}

}  // namespace
}  // namespace ddip::run

int main(int argc, char** argv) {
  using namespace ddip::run;
  CommandLine cl;
  RunOptions opts;
  try {
    opts = cl.parse(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const CLI::Error& e) {
    return cl.exit(e);
  }
  LaunchEnv launch;
  std::vector<bool> shown;
  try {
    if (!opts.gpus.empty()) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      auto gpus =
          resolve_gpus(opts.gpus, visible ? std::optional<std::string>(visible) : std::nullopt,
                       nvidia_device_count());
      std::string list;
      for (const auto& g : gpus) list += (list.empty() ? "" : ",") + g;
      launch.cuda_visible_devices = list;
      launch.world_size = static_cast<int>(gpus.size());
    } else {
      launch.world_size = opts.nproc;
    }
    shown = tee_ranks(opts.tee, launch.world_size);
  } catch (const std::invalid_argument& e) {
    return cl.exit(CLI::ValidationError("--gpus", e.what()));
  } catch (const CLI::Error& e) {
    return cl.exit(e);
  }
  try {
    if (opts.die_with_parent) {
      // SIGKILL: the ranks then die of their own PR_SET_PDEATHSIG.
      pid_t parent = ::getppid();
      ddip::check(::prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl", "tying ddip run to its parent");
      if (::getppid() != parent) return 1;  // the parent died before prctl took effect
    }
    // Ranks must not compete for the terminal's input; they inherit this.
    ddip::Fd null(
        ddip::check(::open("/dev/null", O_RDONLY | O_CLOEXEC), "open", "opening /dev/null"));
    ddip::check(::dup2(null.get(), 0), "dup2", "giving the ranks /dev/null as stdin");
    launch.master_port = free_port();
    Launcher launcher(std::move(opts), std::move(shown), std::move(launch));
    return launcher.run();
  } catch (const CannotStart& e) {
    std::cerr << "ddip run: " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "ddip run: " << e.what() << "\n";
    return 1;
  }
}
