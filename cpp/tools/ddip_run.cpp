// `ddip run`: a torchrun-compatible launcher. One thread, one epoll set over every rank's
// stdout/stderr pipes and pidfd, a signalfd, and deadlines; no Python anywhere, so a launch costs
// what starting the ranks costs.
#include <arpa/inet.h>
#include <netdb.h>
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
#include <deque>
#include <filesystem>
#include <memory>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "ddip/fd.hpp"
#include "ddip/output.hpp"
#include "ddip/supervisor.hpp"
#include "run_args.hpp"
#include "run_protocol.hpp"

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

// Between two ddip runs (one on another host, started by the other), the starting side says it
// is there every link_timeout / 6 (at most every 5 s), and the other, hearing nothing for
// --link-timeout (or unable to send its output for that long), takes the link for gone and
// stops its ranks: a network that drops without a FIN or RST gives neither end of an ssh
// session an end of file.
milliseconds ping_every(milliseconds link_timeout) {
  return std::min(milliseconds(5000), std::max(milliseconds(100), link_timeout / 6));
}

// Writes everything, waiting when `fd` is non-blocking and full, for at most `limit` in all (0:
// no limit). False when the reader is gone (EPIPE), the file can't take more (ENOSPC, EIO) or the
// limit passed: the caller stops writing there.
bool write_all(int fd, std::string_view data, milliseconds limit = milliseconds::zero()) {
  const auto until = Clock::now() + limit;
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (errno == EAGAIN) {
      int wait_ms = -1;
      if (limit > milliseconds::zero()) {
        auto left = std::chrono::ceil<milliseconds>(until - Clock::now()).count();
        if (left <= 0) return false;
        wait_ms = static_cast<int>(left);
      }
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, wait_ms);
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

// A rank's command could not be started (not found, not executable): the shell's 127 / 126.
struct CannotStart : std::system_error {
  using std::system_error::system_error;
  int exit_code() const { return code().value() == ENOENT ? 127 : 126; }
};

// What the launcher supervises: a rank of its own, or the launcher of another host's ddip run.
struct UnitPlan {
  bool host = false;
  std::string name;  // host units: the host
  int first_rank = 0, nranks = 1;
  bool shown = true;  // rank units: reaches the terminal (--tee)
  SpawnSpec spec;
};

// The first failure, wherever it happened: the root cause ddip run reports and exits with.
struct RootCause {
  size_t unit = 0;
  int rank = -1;     // -1: a host's ddip run (or its launcher), before any of its ranks failed
  std::string who;   // "rank 3", "rank 3 (on node2)", "host node2"
  std::string what;  // "exit code 1", "killed by SIGSEGV"
  int code = 1;      // ddip run's exit code
  int exit_code = 0, signal = 0;  // a rank's: how it ended, for the report to another host
  std::vector<std::string> tail;  // last lines of its stderr
  int64_t when_ns = 0;  // CLOCK_REALTIME where it was seen: comparable across hosts
  bool reported = false;  // by another host's ddip run
};

int64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

class Launcher {
 public:
  // `node`: this ddip run was started on its host by another one (--node); its stdin is then
  // that one's control channel.
  Launcher(RunOptions opts, std::vector<UnitPlan> plans, std::optional<NodeOptions> node)
      : opts_(std::move(opts)), node_(std::move(node)) {
    link_timeout_ = std::chrono::duration_cast<milliseconds>(
        std::chrono::duration<double>(opts_.link_timeout_s));
    for (auto& p : plans) {
      Unit u;
      u.host = p.host;
      u.name = p.name;
      u.first_rank = p.first_rank;
      u.nranks = p.nranks;
      u.shown = p.shown;
      u.tag = "[" + std::to_string(p.first_rank) + "] ";
      u.spec = std::move(p.spec);
      units_.push_back(std::move(u));
    }
  }

  // Runs the ranks to the end; returns the launcher's exit code.
  int run();

 private:
  // epoll data: unit << 2 | what; the signalfd and the control channel have their own values.
  enum What : uint64_t { kStdout = 1, kStderr = 2, kExit = 3 };
  static constexpr uint64_t kSignals = ~uint64_t{0};
  static constexpr uint64_t kControl = ~uint64_t{0} - 1;

  struct Unit {
    bool host = false;
    std::string name, tag;
    int first_rank = 0, nranks = 1;
    bool shown = true;
    SpawnSpec spec;
    RankOutput output;
    Fd log[3];  // [1] stdout, [2] stderr
    std::optional<ExitStatus> status;
    bool stopped = false;  // was running when ddip run stopped everyone
    bool after_cr[3] = {false, false, false};
    // Host units: their ranks' states as that host's ddip run reported them at its end, and
    // the last lines of the launcher's own stderr (ssh's errors, say).
    std::vector<std::pair<int, std::string>> states;
    std::deque<std::string> tail;
  };

  RunOptions opts_;
  std::optional<NodeOptions> node_;
  Supervisor sup_;
  std::vector<Unit> units_;
  Fd epoll_, signals_, control_;
  protocol::ControlReader control_in_;
  bool terminal_ok_[3] = {true, true, true};

  std::optional<RootCause> root_;
  bool stopping_ = false, killed_ = false, timed_out_ = false;
  bool grace_ran_out_ = false;  // ranks still running at kill_at_ after a forwarded signal
  int interrupts_ = 0, first_signal_ = 0;
  // When every rank still running gets SIGKILL: the grace after a stop or a forwarded signal.
  std::optional<Clock::time_point> kill_at_;
  Clock::time_point started_, drain_until_, host_kill_at_, next_ping_, heard_at_;
  // The earliest deadline wins: a failure or stop after a forwarded signal does not extend the
  // grace that signal started.
  void kill_by(Clock::time_point t) {
    if (!kill_at_ || t < *kill_at_) kill_at_ = t;
  }
  std::optional<Clock::time_point> timeout_at_;
  bool host_kill_armed_ = false;
  std::string lost_;  // node mode: why the channel to the starting ddip run counts as gone
  milliseconds link_timeout_{30000};
  std::string link_timeout_s() const {
    std::ostringstream out;
    out << link_timeout_.count() / 1000.0;
    return out.str();
  }
  bool has_hosts() const {
    for (const auto& un : units_)
      if (un.host) return true;
    return false;
  }

  void watch(int fd, uint64_t data) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = data;
    check(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev), "epoll_ctl", "watching a rank");
  }
  Fd& pipe(size_t u, RankOutput::Stream s) {
    Child& c = sup_.child(u);
    return s == RankOutput::kStdout ? c.stdout_pipe() : c.stderr_pipe();
  }
  bool pipes_open() {
    for (size_t u = 0; u < sup_.size(); ++u)
      if (pipe(u, RankOutput::kStdout) || pipe(u, RankOutput::kStderr)) return true;
    return false;
  }
  bool all_exited() const {
    for (const auto& un : units_)
      if (!un.status) return false;
    return true;
  }

  void open_logs();
  void start_units();
  void read_pipe(size_t u, RankOutput::Stream s);
  void host_text(size_t u, RankOutput::Stream s, const std::string& text);
  void host_report(size_t u, std::string_view line);
  void on_report(size_t u, protocol::RankFailed m);
  void on_report(size_t u, protocol::NodeDone m);
  void drain(size_t u);
  void emit(size_t u, RankOutput::Stream s, std::string_view text);
  void on_exit(size_t u);
  void fail(RootCause cause);
  void on_signal();
  void on_control();
  void tell_hosts(const protocol::Control& message);
  void forward(int sig);
  void kill_all();
  void stop();
  int finish();
  std::string states() const;
  std::string me() const {
    return node_ ? "ddip run on " + node_->name : std::string("ddip run");
  }
};

void Launcher::open_logs() {
  if (opts_.log_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(opts_.log_dir, ec);
  if (ec) throw std::system_error(ec, "creating --log-dir " + opts_.log_dir);
  for (auto& un : units_) {
    if (un.host) continue;  // a host's ddip run keeps its ranks' logs there
    for (int s : {1, 2}) {
      std::string path = opts_.log_dir + "/rank" + std::to_string(un.first_rank) +
                         (s == 1 ? ".stdout" : ".stderr");
      un.log[s] = Fd(check(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                           "open", "creating " + path));
    }
  }
}

void Launcher::start_units() {
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& un = units_[u];
    try {
      sup_.spawn(un.spec);
    } catch (const std::system_error& e) {
      std::string what = std::string(e.what()).substr(0, std::string(e.what()).rfind(':'));
      throw CannotStart(e.code(), un.host ? "cannot start the launcher of host " + un.name + ": " + what
                                          : "cannot start rank " + std::to_string(un.first_rank) +
                                                ": " + what);
    }
    Child& c = sup_.child(u);
    watch(c.stdout_pipe().get(), u << 2 | kStdout);
    watch(c.stderr_pipe().get(), u << 2 | kStderr);
    watch(c.pidfd(), u << 2 | kExit);
  }
}

void Launcher::emit(size_t u, RankOutput::Stream s, std::string_view text) {
  Unit& un = units_[u];
  if (text.empty() || !terminal_ok_[s]) return;
  std::string labelled;
  if (!un.host) {  // a host's lines are labelled and filtered by --tee there already
    if (!un.shown) return;
    labelled = label(text, un.tag, un.after_cr[s]);
    text = labelled;
  }
  // On another host, this output goes back through the launcher: if it can't be sent for
  // link_timeout_, the link is gone (a network that dropped without a word), and so is the
  // ddip run that started this one.
  milliseconds limit = node_ ? link_timeout_ : milliseconds::zero();
  if (!write_all(s, text, limit)) {
    terminal_ok_[s] = false;
    if (node_ && lost_.empty()) {
      lost_ = "its output could not be sent back for " +
              link_timeout_s() + " s";
      if (!stopping_) stop();
    }
  }
}

// A host's output arrives in whole lines (RankOutput assembles them); its stderr also carries
// that host's reports (protocol records), which are read, not shown.
void Launcher::host_text(size_t u, RankOutput::Stream s, const std::string& text) {
  if (s == RankOutput::kStdout) {
    emit(u, s, text);
    return;
  }
  std::string shown;
  size_t start = 0;
  while (start < text.size()) {
    // A line ends at '\n', or at '\r' (a redrawn progress bar): a report can follow either.
    size_t end = text.find_first_of("\r\n", start);
    end = end == std::string::npos ? text.size() : end + 1;
    if (end < text.size() && text[end - 1] == '\r' && text[end] == '\n') ++end;
    std::string_view line(text.data() + start, end - start);
    if (protocol::is_record(line)) {
      host_report(u, line);
    } else {
      shown.append(line);
      std::string l(line);
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
      // ssh's and the host's own messages (not the ranks', which are labelled) explain a failed
      // launcher.
      if (!l.empty() && l[0] != '[') {
        units_[u].tail.push_back(l);
        if (units_[u].tail.size() > RankOutput::kTailLines) units_[u].tail.pop_front();
      }
    }
    start = end;
  }
  emit(u, s, shown);
}

void Launcher::host_report(size_t u, std::string_view line) {
  try {
    std::visit([&](auto m) { on_report(u, std::move(m)); }, protocol::decode_report(line));
  } catch (const protocol::ProtocolError& e) {
    // Shown now, and kept with the host's last words in case it is what failed.
    std::string why = "host " + units_[u].name + " sent a " + e.what();
    std::cerr << me() << ": " << why << "\n";
    units_[u].tail.push_back(why);
    if (units_[u].tail.size() > RankOutput::kTailLines) units_[u].tail.pop_front();
  }
}

void Launcher::on_report(size_t u, protocol::RankFailed m) {
  RootCause cause;
  cause.unit = u;
  cause.rank = m.rank;
  cause.who = "rank " + std::to_string(m.rank) + " (on " + units_[u].name + ")";
  cause.what = std::move(m.what);
  cause.exit_code = m.exit_code;
  cause.signal = m.signal;
  cause.code = ExitStatus{m.exit_code, m.signal, false}.shell_code();
  cause.tail = std::move(m.tail);
  cause.when_ns = m.when_ns;
  cause.reported = true;
  fail(std::move(cause));
}

void Launcher::on_report(size_t u, protocol::NodeDone m) {
  for (auto& r : m.ranks) units_[u].states.emplace_back(r.rank, std::move(r.what));
}

void Launcher::read_pipe(size_t u, RankOutput::Stream s) {
  Fd& fd = pipe(u, s);
  if (!fd) return;
  char buf[kReadChunk];
  ssize_t n = ::read(fd.get(), buf, sizeof buf);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return;
    n = 0;  // EIO and the like: nothing more will come from it
  }
  Unit& un = units_[u];
  if (n == 0) {
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd.get(), nullptr);
    fd.reset();
    std::string rest = un.output.flush(s);
    if (un.host)
      host_text(u, s, rest);
    else
      emit(u, s, rest);
    return;
  }
  std::string_view data(buf, static_cast<size_t>(n));
  if (un.log[s] && !write_all(un.log[s].get(), data)) {
    std::cerr << me() << ": writing rank " << un.first_rank << "'s log failed ("
              << std::strerror(errno) << "); its output goes on to the terminal only\n";
    un.log[s].reset();
  }
  for (auto& piece : un.output.feed(s, data)) {
    if (un.host)
      host_text(u, s, piece.text);
    else
      emit(u, s, piece.text);
  }
}

// Everything the exited unit wrote is in its pipes already; take it before reporting.
void Launcher::drain(size_t u) {
  for (auto s : {RankOutput::kStdout, RankOutput::kStderr}) {
    for (int i = 0; i < 4096 && pipe(u, s); ++i) {
      pollfd p{pipe(u, s).get(), POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      read_pipe(u, s);
    }
  }
}

void Launcher::fail(RootCause cause) {
  if (cause.when_ns == 0) cause.when_ns = realtime_ns();
  // A host's report crosses the network, so it can arrive after a failure here that it caused
  // (a peer's collective failing once that host's rank died): across hosts the earliest failure
  // by the hosts' clocks is the root cause.
  if (root_ && cause.reported && cause.when_ns < root_->when_ns) {
    root_ = std::move(cause);
    return;
  }
  if (root_ || stopping_) return;  // a later failure, or one of the ranks being stopped
  if (node_) {
    // Tell the ddip run that started this one now, not at the end: the first failure anywhere
    // is the root cause, and the other hosts' ranks fail soon after (their peer is gone).
    std::string report = protocol::encode(protocol::Report{protocol::RankFailed{
        cause.rank, cause.exit_code, cause.signal, cause.when_ns, cause.what, cause.tail}});
    if (terminal_ok_[2] && !write_all(2, report, link_timeout_)) terminal_ok_[2] = false;
  }
  root_ = std::move(cause);
  if (first_signal_) {
    // The others got the same signal and are acting on it (a KeyboardInterrupt handler saving a
    // checkpoint, say): they get the grace period before SIGKILL, not a SIGTERM on top.
    stopping_ = true;
    kill_by(Clock::now() + kGrace);
    return;
  }
  stop();
}

void Launcher::on_exit(size_t u) {
  auto st = sup_.poll(u);
  if (!st) return;
  Unit& un = units_[u];
  un.status = st;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, sup_.child(u).pidfd(), nullptr);
  drain(u);
  if (un.host) {
    // Its host's ddip run has ended: flush what it held back, then judge the launcher's exit.
    for (auto s : {RankOutput::kStdout, RankOutput::kStderr})
      host_text(u, s, un.output.flush(s));
    sup_.child(u).stdin_pipe().reset();
    // After a forwarded signal a host's ddip run exits 128+signal like the ranks it stopped;
    // otherwise a failing launcher without a report from its host is the root cause (ssh could
    // not connect, say, with ssh's message in its stderr).
    if (st->shell_code() != 0 && !root_ && !first_signal_) {
      RootCause cause;
      cause.unit = u;
      cause.who = "host " + un.name;
      cause.what = "its launcher (or ddip run there) ended with " + st->describe() +
                   " before any of its ranks reported a failure";
      cause.code = st->shell_code();
      cause.tail.assign(un.tail.begin(), un.tail.end());
      fail(std::move(cause));
    }
  } else if (st->shell_code() != 0) {
    RootCause cause;
    cause.unit = u;
    cause.rank = un.first_rank;
    cause.who = "rank " + std::to_string(un.first_rank);
    cause.what = st->describe();
    cause.code = st->shell_code();
    cause.exit_code = st->code;
    cause.signal = st->signal;
    cause.tail = lines_of(un.output.stderr_tail());
    fail(std::move(cause));
  }
  if (all_exited()) drain_until_ = Clock::now() + kDrain;
}

void Launcher::tell_hosts(const protocol::Control& message) {
  const std::string line = protocol::encode(message);
  for (size_t u = 0; u < units_.size(); ++u) {
    Fd& in = sup_.child(u).stdin_pipe();
    if (!units_[u].host || !in || units_[u].status) continue;
    if (!write_all(in.get(), line)) in.reset();
  }
}

void Launcher::stop() {
  stopping_ = true;
  kill_by(Clock::now() + kGrace);
  for (size_t u = 0; u < units_.size(); ++u) {
    // One that has exited, even if its pidfd has not been read yet, ended on its own.
    if (units_[u].status || !sup_.running(u) || units_[u].host) continue;
    units_[u].stopped = true;
    sup_.signal(u, SIGTERM);
  }
  // Each host's ddip run stops its own ranks the same way (SIGTERM, grace, SIGKILL).
  tell_hosts(protocol::Stop{});
}

void Launcher::kill_all() {
  killed_ = true;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].status || !sup_.running(u) || units_[u].host) continue;
    units_[u].stopped = true;
    sup_.signal(u, SIGKILL);
  }
  tell_hosts(protocol::Kill{});
  // A host that can't hear it (its network gone) must not keep ddip run waiting: its launcher
  // is killed a little later, and its ddip run then stops its ranks on losing this channel.
  if (!host_kill_armed_) {
    host_kill_armed_ = true;
    host_kill_at_ = Clock::now() + milliseconds(3000);
  }
}

void Launcher::forward(int sig) {
  // The ranks get the grace period to act on it, then SIGKILL, as after a stop: one that ignores
  // the signal must not run on. Each host's ddip run keeps its own deadline the same way.
  kill_by(Clock::now() + kGrace);
  for (size_t u = 0; u < units_.size(); ++u)
    if (!units_[u].host && !units_[u].status) sup_.signal(u, sig);
  tell_hosts(protocol::Signal{sig});
}

void Launcher::on_signal() {
  signalfd_siginfo si{};
  while (::read(signals_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    int sig = static_cast<int>(si.ssi_signo);
    if (node_ && sig == SIGHUP) continue;  // its ssh session ending: the control channel says
    if (++interrupts_ == 1) {
      first_signal_ = sig;
      forward(sig);
    } else {
      if (!killed_) std::cerr << me() << ": " << signal_name(sig) << " again: killing every rank\n";
      kill_all();
    }
  }
}

// Messages from the ddip run that started this one (protocol::Control); end of file (it exited,
// or its host or the network went away) means stop.
void Launcher::on_control() {
  char buf[256];
  ssize_t n = ::read(control_.get(), buf, sizeof buf);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  auto close_channel = [&] {
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, control_.get(), nullptr);
    control_.reset();
  };
  if (n <= 0) {
    close_channel();
    if (lost_.empty() && !stopping_)
      lost_ = "its launcher's stdin closed: the ddip run that started it is gone, or the launcher "
              "gives it no stdin (docker and kubectl exec need -i)";
    if (!stopping_) stop();
    return;
  }
  heard_at_ = Clock::now();
  control_in_.feed(std::string_view(buf, static_cast<size_t>(n)));
  try {
    while (auto m = control_in_.next()) {
      if (auto* s = std::get_if<protocol::Signal>(&*m)) {
        if (!first_signal_) first_signal_ = s->number;
        forward(s->number);
      } else if (std::holds_alternative<protocol::Stop>(*m)) {
        if (!stopping_) stop();
      } else if (std::holds_alternative<protocol::Kill>(*m)) {
        if (!stopping_) stop();
        kill_all();
      }  // Ping: hearing it was the point
    }
  } catch (const protocol::ProtocolError& e) {
    // Nothing more from this channel can be trusted: stop as if it had closed (the grace
    // period's SIGKILL needs no "kill" from it).
    close_channel();
    if (lost_.empty()) lost_ = "the ddip run that started it sent a " + std::string(e.what());
    if (!stopping_) stop();
  }
}

// Every rank's state but the root cause's, one line each.
std::string Launcher::states() const {
  auto range = [](const Unit& un) {
    return un.nranks == 1 ? "rank " + std::to_string(un.first_rank)
                          : "ranks " + std::to_string(un.first_rank) + "-" +
                                std::to_string(un.first_rank + un.nranks - 1);
  };
  std::string out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& un = units_[u];
    if (un.host) {
      if (root_ && root_->unit == u && root_->rank < 0) continue;
      for (const auto& [rank, what] : un.states)
        if (!root_ || root_->unit != u || root_->rank != rank)
          out += "  rank " + std::to_string(rank) + " (on " + un.name + "): " + what + "\n";
      if (un.states.empty())
        out += "  " + range(un) + " (on " + un.name + "): " +
               (un.status ? "unknown; its launcher ended with " + un.status->describe()
                          : std::string("still running")) +
               "\n";
      continue;
    }
    if (root_ && root_->unit == u) continue;
    out += "  rank " + std::to_string(un.first_rank) + ": ";
    if (!un.status)
      out += "still running";
    else
      out += un.status->describe() + (un.stopped ? " (stopped by ddip run)" : "");
    out += '\n';
  }
  return out;
}

int Launcher::finish() {
  if (node_) {
    if (!lost_.empty())
      std::cerr << me() << ": " << lost_ << "; stopped its ranks\n";
    // The ddip run that started this one writes the summary; it gets each rank's state.
    protocol::NodeDone done;
    for (const auto& un : units_) {
      std::string what = !un.status ? "still running"
                                    : un.status->describe() +
                                          (un.stopped ? " (stopped by ddip run)" : "");
      done.ranks.push_back({un.first_rank, std::move(what)});
    }
    if (terminal_ok_[2]) write_all(2, protocol::encode(protocol::Report{std::move(done)}), link_timeout_);
    if (root_) return root_->code;
    if (first_signal_) return 128 + first_signal_;
    return lost_.empty() ? 0 : 1;
  }
  std::string report;
  int code = 0;
  if (root_) {
    code = root_->code;
    report = "ddip run: " + root_->who + " failed first: " + root_->what;
    if (first_signal_) report += " (after ddip run forwarded " + signal_name(first_signal_) + ")";
    report += "\n";
    if (!root_->tail.empty()) {
      report += "last lines of its stderr:\n";
      for (const auto& l : root_->tail) report += "  | " + l + "\n";
    }
    std::string others = states();
    if (!others.empty()) report += "other ranks:\n" + others;
  } else if (timed_out_) {
    code = 124;
    std::ostringstream secs;
    secs << opts_.timeout_s;
    report = "ddip run: timed out after " + secs.str() + " s; ranks:\n" + states();
  } else if (first_signal_) {
    code = 128 + first_signal_;
    report = "ddip run: forwarded " + signal_name(first_signal_) + " to every rank" +
             (grace_ran_out_ ? ", then SIGKILL to those still running after " +
                                   std::to_string(kGrace.count() / 1000) + " s"
                             : std::string()) +
             "; ranks:\n" + states();
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
  if (node_) {
    // The control channel is this process's stdin; the ranks get /dev/null instead.
    control_ = Fd(check(::fcntl(0, F_DUPFD_CLOEXEC, 3), "fcntl", "keeping the control channel"));
    set_nonblocking(control_.get());
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kControl;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, control_.get(), &ev) != 0) {
      if (errno != EPERM) throw_errno("epoll_ctl", "watching the control channel");
      control_.reset();  // a file, /dev/null: no channel at all
      lost_ = "its launcher gives it no stdin to listen to (docker and kubectl exec need -i)";
    }
    heard_at_ = Clock::now();
    // Writes back through the launcher are bounded (see emit): they must not block for good.
    set_nonblocking(1);
    set_nonblocking(2);
  }
  Fd null(check(::open("/dev/null", O_RDONLY | O_CLOEXEC), "open", "opening /dev/null"));
  check(::dup2(null.get(), 0), "dup2", "giving the ranks /dev/null as stdin");
  open_logs();
  start_units();
  next_ping_ = Clock::now() + ping_every(link_timeout_);
  if (!lost_.empty()) stop();

  epoll_event events[64];
  while (true) {
    if (all_exited() && (!pipes_open() || Clock::now() >= drain_until_)) break;
    auto now = Clock::now();
    std::optional<Clock::time_point> next;
    auto consider = [&](Clock::time_point t) {
      if (!next || t < *next) next = t;
    };
    if (timeout_at_ && !stopping_) consider(*timeout_at_);
    if (kill_at_ && !killed_ && !all_exited()) consider(*kill_at_);
    if (killed_ && host_kill_at_ != Clock::time_point{}) consider(host_kill_at_);
    if (has_hosts() && !all_exited()) consider(next_ping_);
    if (node_ && control_ && lost_.empty()) consider(heard_at_ + link_timeout_);
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
      if (d == kControl) {
        on_control();
        continue;
      }
      size_t u = d >> 2;
      switch (d & 3) {
        case kStdout:
          read_pipe(u, RankOutput::kStdout);
          break;
        case kStderr:
          read_pipe(u, RankOutput::kStderr);
          break;
        case kExit:
          on_exit(u);
          break;
      }
    }
    now = Clock::now();
    if (timeout_at_ && !stopping_ && now >= *timeout_at_) {
      timed_out_ = true;
      stop();
    }
    if (kill_at_ && !killed_ && !all_exited() && now >= *kill_at_) {
      // Past the grace after a forwarded signal: ranks killed now are stopped by ddip run, not
      // failures of their own.
      if (!stopping_) grace_ran_out_ = true;
      stopping_ = true;
      kill_all();
    }
    if (has_hosts() && now >= next_ping_) {  // "still here", to each host's ddip run
      tell_hosts(protocol::Ping{});
      next_ping_ = now + ping_every(link_timeout_);
    }
    if (node_ && control_ && lost_.empty() && now >= heard_at_ + link_timeout_) {
      lost_ = "it heard nothing from the ddip run that started it for " +
              link_timeout_s() + " s";
      if (!stopping_) stop();
    }
    if (killed_ && host_kill_at_ != Clock::time_point{} && now >= host_kill_at_) {
      host_kill_at_ = {};
      for (size_t u = 0; u < units_.size(); ++u)
        if (units_[u].host && !units_[u].status) sup_.signal(u, SIGKILL);
    }
  }
  for (size_t u = 0; u < units_.size(); ++u)
    for (auto s : {RankOutput::kStdout, RankOutput::kStderr})
      if (pipe(u, s)) {
        std::string rest = units_[u].output.flush(s);
        if (units_[u].host)
          host_text(u, s, rest);
        else
          emit(u, s, rest);
      }
  return finish();
}

}  // namespace
}  // namespace ddip::run

namespace ddip::run {
namespace {

std::string self_path() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("ddip") : p.string();
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "" : ",") + x;
  return out;
}

// The ranks this machine starts itself: `n` of them (or one per GPU in `gpus`) from `launch`.
// --env values replace what the environment here says; torchrun's variables replace both.
std::vector<std::string> base_environment(const std::vector<std::string>& overrides) {
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string key = entry.substr(0, entry.find('=') + 1);
    if (std::none_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return o.rfind(key, 0) == 0; }))
      base.push_back(std::move(entry));
  }
  base.insert(base.end(), overrides.begin(), overrides.end());
  return base;
}

void add_ranks(std::vector<UnitPlan>& plans, const std::vector<std::string>& command,
               const LaunchEnv& launch, const std::vector<bool>& shown,
               const std::vector<std::string>& env) {
  std::vector<std::string> base = base_environment(env);
  for (int r = 0; r < launch.local_size(); ++r) {
    UnitPlan p;
    p.first_rank = launch.rank_offset + r;
    p.shown = shown[static_cast<size_t>(p.first_rank)];
    p.spec.argv = command;
    p.spec.env = rank_environment(base, launch, r);
    plans.push_back(std::move(p));
  }
}

std::optional<std::string> env_var(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::optional<std::string>(v) : std::nullopt;
}

// What --gpus entries are resolved against: this process's CUDA_VISIBLE_DEVICES, else the
// machine's GPUs.
plan::GpuView gpu_view() {
  plan::GpuView view;
  view.env = env_var("CUDA_VISIBLE_DEVICES");
  view.physical_count = plan::nvidia_device_count();
  view.who = "ddip run";
  view.cpu_hint = "; for CPU processes, give -n 2 (for example) instead of --gpus";
  return view;
}

// --gpus entries -> CUDA_VISIBLE_DEVICES for every rank, in rank order.
std::string resolved_gpus(const std::vector<std::string>& requested) {
  std::string out;
  for (const auto& g : plan::select_gpus(requested, gpu_view())) out += (out.empty() ? "" : ",") + g.entry;
  return out;
}

// Ranks given no --gpus see no GPU here: CUDA_VISIBLE_DEVICES hides them all, or there is none.
bool no_visible_gpu() {
  auto view = gpu_view();
  return plan::visible_gpus(view.env, view.physical_count).empty();
}

}  // namespace
}  // namespace ddip::run

int main(int argc, char** argv) {
  using namespace ddip::run;
  namespace plan = ddip::plan;
  CommandLine cl;
  RunOptions opts;
  try {
    opts = cl.parse(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const CLI::Error& e) {
    return cl.exit(e);
  }
  std::vector<UnitPlan> plans;
  std::vector<bool> shown;
  const std::string prog = opts.node ? "ddip run on " + opts.node->name : "ddip run";
  try {
    if (opts.node) {
      // On another host, for the ddip run that started it: in that one's directory when it
      // exists here too.
      if (!opts.node->cwd.empty() && ::chdir(opts.node->cwd.c_str()) != 0) {
        std::error_code ec;
        auto here = std::filesystem::current_path(ec);
        std::cerr << prog << ": " << opts.node->cwd << " does not exist here; running in "
                  << (ec ? std::string("its launcher's directory") : here.string()) << "\n";
      }
    }
    LaunchEnv launch;
    launch.cores = plan::cpu_count();
    if (!opts.gpus.empty()) {
      launch.cuda_visible_devices = resolved_gpus(opts.gpus);
      launch.world_size = static_cast<int>(plan::split_list(*launch.cuda_visible_devices).size());
    } else if (opts.hosts.empty()) {
      launch.world_size = opts.nproc;
      launch.cpu_ranks = no_visible_gpu();
    }
    int world = opts.node ? opts.node->world_size : opts.world_size();
    shown = tee_ranks(opts.tee, world);

    if (opts.hosts.empty()) {
      if (opts.node) {
        launch.local_world_size = launch.world_size;
        launch.world_size = opts.node->world_size;
        launch.rank_offset = opts.node->rank_offset;
        launch.group_rank = opts.node->node_rank;
        launch.group_world_size = opts.node->nnodes;
      }
      launch.master_addr = opts.master_addr.empty() ? "127.0.0.1" : opts.master_addr;
      launch.master_port = opts.master_port ? opts.master_port : plan::free_port();
      add_ranks(plans, opts.command, launch, shown, opts.env);
    } else {
      // Ranks host by host. Rank 0's host serves MASTER_ADDR:MASTER_PORT for torch.distributed.
      plan::Layout layout = plan::lay_out(opts.hosts, opts.master_addr, "", false);
      const std::string& addr = layout.master_addr;
      int port = opts.master_port ? opts.master_port : plan::master_port(opts.hosts[0].local);
      std::error_code ec;
      std::string cwd = std::filesystem::current_path(ec).string();
      std::string ddip = opts.remote_ddip.empty() ? self_path() : opts.remote_ddip;
      for (size_t i = 0; i < opts.hosts.size(); ++i) {
        const HostSpec& h = opts.hosts[i];
        const int offset = layout.first_rank[i];
        if (h.local) {
          LaunchEnv here;
          here.world_size = world;
          here.local_world_size = h.ranks;
          here.rank_offset = offset;
          here.group_rank = static_cast<int>(i);
          here.group_world_size = static_cast<int>(opts.hosts.size());
          here.master_addr = addr;
          here.master_port = port;
          here.cores = plan::cpu_count();
          if (!h.gpus.empty())
            here.cuda_visible_devices = resolved_gpus(h.gpus);
          else
            here.cpu_ranks = no_visible_gpu();
          add_ranks(plans, opts.command, here, shown, opts.env);
        } else {
          std::vector<std::string> remote_cmd = {
              ddip, "run", "--node",
              std::to_string(offset) + "," + std::to_string(world) + "," + std::to_string(i) +
                  "," + std::to_string(opts.hosts.size()),
              "--node-name", h.name, "--master-addr", addr, "--master-port", std::to_string(port),
              "--tee", opts.tee};
          if (!cwd.empty()) remote_cmd.insert(remote_cmd.end(), {"--node-cwd", cwd});
          {
            std::ostringstream t;
            t << opts.link_timeout_s;
            remote_cmd.insert(remote_cmd.end(), {"--link-timeout", t.str()});
          }
          for (const auto& e : opts.env) remote_cmd.insert(remote_cmd.end(), {"--env", e});
          if (h.gpus.empty())
            remote_cmd.insert(remote_cmd.end(), {"-n", std::to_string(h.ranks)});
          else
            remote_cmd.insert(remote_cmd.end(), {"--gpus", join(h.gpus)});
          if (!opts.log_dir.empty()) {
            auto abs = std::filesystem::absolute(opts.log_dir, ec);
            remote_cmd.insert(remote_cmd.end(), {"--log-dir", ec ? opts.log_dir : abs.string()});
          }
          remote_cmd.push_back("--");
          remote_cmd.insert(remote_cmd.end(), opts.command.begin(), opts.command.end());
          UnitPlan p;
          p.host = true;
          p.name = h.name;
          p.first_rank = offset;
          p.nranks = h.ranks;
          p.spec.argv = launcher_argv(opts.launcher, h.name, remote_cmd,
                                      uniform_cpus(env_var("SLURM_JOB_CPUS_PER_NODE").value_or("")),
                                      opts.link_timeout_s);
          for (char** e = environ; *e; ++e) p.spec.env.emplace_back(*e);
          p.spec.stdin_pipe = true;
          plans.push_back(std::move(p));
        }
      }
    }
  } catch (const std::invalid_argument& e) {
    return cl.exit(CLI::ValidationError(opts.hosts.empty() ? "--gpus" : "--hosts", e.what()));
  } catch (const CLI::Error& e) {
    return cl.exit(e);
  } catch (const std::exception& e) {  // finding a free port, say: nothing has started
    std::cerr << prog << ": " << e.what() << "\n";
    return 1;
  }
  if (opts.check) return 0;  // the command line and the plan are good; nothing was started
  try {
    if (opts.die_with_parent) {
      // SIGKILL: the ranks then die of their own PR_SET_PDEATHSIG.
      pid_t parent = ::getppid();
      ddip::check(::prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl", "tying ddip run to its parent");
      if (::getppid() != parent) return 1;  // the parent died before prctl took effect
    }
    auto node = opts.node;
    Launcher launcher(std::move(opts), std::move(plans), std::move(node));
    return launcher.run();
  } catch (const CannotStart& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return 1;
  }
}
