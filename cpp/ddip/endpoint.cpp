#include "ddip/endpoint.hpp"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace ddip {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Runs in a signal handler: kill() is async-signal-safe. Group 0 is ours, this process included.
void kill_own_group(int) { ::kill(0, SIGKILL); }

long long env_count(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  errno = 0;
  long long n = std::strtoll(v, &end, 10);
  if (*end || errno || n < 0)
    throw std::invalid_argument(std::string(name) + " must be a whole number >= 0, not '" + v +
                                "'");
  return n;
}

// A dump is read until it has been quiet this long (faulthandler writes it in many small
// writes), but never longer than kDumpMax in all, nor more than kDumpBytes.
constexpr milliseconds kDumpQuiet{200};
constexpr milliseconds kDumpMax{2000};
constexpr size_t kDumpBytes = size_t(4) << 20;

// How long the worker may be away from recv() before the watchdog reads for it: a request's
// heartbeats, stack and abort requests wait at most this long for a reader.
constexpr milliseconds kTakeOver{10};
// A caller that left recv() empty-handed (its timeout: the binding waits in 1 s slices, or a
// signal, whose Python handler it runs) is taken to be back at once: the watchdog looks only
// after this long. An idle worker's watchdog then wakes once a second at most.
constexpr milliseconds kBackSoon{1000};

int64_t now_ns() { return Clock::now().time_since_epoch().count(); }

}  // namespace
}  // namespace detail

int kernel_death_signal() { return SIGRTMAX; }

EndpointOptions EndpointOptions::from_environment() {
  EndpointOptions o;
  o.kernel_pid = static_cast<pid_t>(detail::env_count("DDIP_KERNEL_PID"));
  o.kernel_timeout = std::chrono::milliseconds(detail::env_count("DDIP_KERNEL_TIMEOUT_MS"));
  return o;
}

Endpoint::Endpoint(const std::string& socket_path, int rank, std::string hello,
                   EndpointOptions options)
    : rank_(rank), options_(options), channel_(connect_unix(socket_path)) {
  wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) throw std::system_error(errno, std::generic_category(), "eventfd for the endpoint");
  timer_ = Fd(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  if (!timer_) throw std::system_error(errno, std::generic_category(), "timerfd for the endpoint");
  last_heard_ns_ = detail::now_ns();
  channel_.send(Frame::make(kHello, rank, 0, std::move(hello)));
  // Only a process that leads its own group may kill the group: otherwise it is someone else's
  // (a test runner's, a batch job's).
  if (options_.kernel_pid > 0 && ::getpgrp() == ::getpid()) tie_group_to_kernel();
  watchdog_ = std::thread([this] { watch(); });
}

void Endpoint::tie_group_to_kernel() {
  // PR_SET_PDEATHSIG was SIGKILL since before exec: that kills the rank alone, and what it
  // started lives on, holding GPU memory. A handler turns the kernel's death into the group's.
  struct sigaction sa{};
  sa.sa_handler = detail::kill_own_group;
  sigemptyset(&sa.sa_mask);
  check(::sigaction(kernel_death_signal(), &sa, nullptr), "sigaction",
        "preparing for the kernel's death");
  keep_signal(kernel_death_signal());
  check(::prctl(PR_SET_PDEATHSIG, kernel_death_signal()), "prctl(PR_SET_PDEATHSIG)",
        "tying the rank's process group to the kernel");
  // The kernel may have died before the switch: then no signal is coming.
  if (::getppid() != options_.kernel_pid) ::kill(0, SIGKILL);
}

Endpoint::~Endpoint() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  watch_cv_.notify_all();
  ::shutdown(channel_.fd(), SHUT_RDWR);  // wakes the watchdog out of poll
  wake_watchdog();
  if (watchdog_.joinable()) watchdog_.join();
}

void Endpoint::send(Frame f) {
  f.rank = rank_;
  std::lock_guard lock(send_mu_);
  channel_.send(std::move(f));
}

std::optional<Frame> Endpoint::recv(std::chrono::milliseconds timeout) {
  const auto entered = detail::Clock::now();
  auto deadline = entered + std::max(timeout, std::chrono::milliseconds(0));
  std::unique_lock lock(mu_);
  caller_waiting_ = true;
  // The timer stays armed (the watchdog, woken, sees the caller is back), unless the caller's
  // last wait outlasted it: requests come slower than kTakeOver apart (a notebook's cells, or many
  // ranks on few cores), so it would only wake the watchdog once per request. One syscall instead.
  if (timer_armed_ && !timer_long_ && reader_ == Reader::kCaller &&
      last_wait_ >= detail::kTakeOver) {
    set_timer(timer_.get(), std::chrono::nanoseconds(0));
    timer_armed_ = false;
  }
  struct Away {  // leaving recv(), however: the watchdog reads if the worker stays away
    Endpoint& ep;
    detail::Clock::time_point entered;
    bool with_frame = false;  // off to work on it; else back at once (kBackSoon)
    ~Away() {
      ep.caller_waiting_ = false;
      ep.caller_left_ = detail::Clock::now();
      ep.last_wait_ = ep.caller_left_ - entered;
      if (ep.reader_ != Reader::kCaller) return;
      if (with_frame ? !ep.timer_armed_ || ep.timer_long_ : !ep.timer_armed_) {
        set_timer(ep.timer_.get(), with_frame ? detail::kTakeOver : detail::kBackSoon);
        ep.timer_armed_ = true;
        ep.timer_long_ = !with_frame;
      }
    }
  } away{*this, entered};
  bool interrupted = false;  // by a signal, which the caller's Python is to handle
  while (true) {
    if (!inbox_.empty()) {
      Frame f = std::move(inbox_.front());
      inbox_.pop_front();
      away.with_frame = true;
      return f;
    }
    if (closed_) throw EndpointClosed("the kernel closed the connection");
    if (interrupted || timeout.count() <= 0 || detail::Clock::now() >= deadline)
      return std::nullopt;
    if (reader_ == Reader::kWatchdog) {
      // Ask for the channel: the watchdog hands it over between two of its reads.
      if (!hand_back_) {
        hand_back_ = true;
        wake_watchdog();
      }
      cv_.wait_until(lock, deadline,
                     [this] { return reader_ == Reader::kCaller || !inbox_.empty() || closed_; });
      continue;
    }
    lock.unlock();
    bool alive;
    try {
      alive = read_frames(deadline, true, &interrupted);
    } catch (const std::exception&) {
      alive = false;  // a heartbeat's answer could not be sent: the kernel is gone
    }
    lock.lock();
    if (!alive && !closed_) {
      closed_ = true;  // the watchdog, woken, ends a process whose Python does not leave
      wake_watchdog();
    }
  }
}

bool Endpoint::closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

void Endpoint::enable_stack_dumps(int signum, Fd read_end) {
  if (signum <= 0 || signum >= NSIG)
    throw std::invalid_argument("no signal " + std::to_string(signum));
  set_nonblocking(read_end.get());
  keep_signal(signum);
  std::lock_guard lock(stack_mu_);
  stack_signal_ = signum;
  stack_pipe_ = std::move(read_end);
}

void Endpoint::enable_abort(int signum) {
  if (signum <= 0 || signum >= NSIG)
    throw std::invalid_argument("no signal " + std::to_string(signum));
  keep_signal(signum);
  std::lock_guard lock(signals_mu_);
  abort_signal_ = signum;
}

void Endpoint::enable_collectives(Fd write_end) {
  set_nonblocking(write_end.get());
  std::lock_guard lock(signals_mu_);
  collectives_pipe_ = std::move(write_end);
  std::vector<uint64_t> early;
  early.swap(early_collectives_);
  for (uint64_t seq : early) hand_collectives(seq);
}

void Endpoint::ask_collectives(uint64_t seq) {
  std::lock_guard lock(signals_mu_);
  if (!collectives_pipe_) {
    // Still starting: kept for the reader (a bounded few; the kernel asks one at a time).
    if (early_collectives_.size() < 64) early_collectives_.push_back(seq);
    return;
  }
  hand_collectives(seq);
}

void Endpoint::hand_collectives(uint64_t seq) {
  // A full pipe (the reader stopped reading) leaves this request unanswered, as a stuck rank's.
  ssize_t n;
  do {
    n = ::write(collectives_pipe_.get(), &seq, sizeof seq);
  } while (n < 0 && errno == EINTR);
}

void Endpoint::keep_signal(int signum) {
  struct sigaction now{};
  if (::sigaction(signum, nullptr, &now) < 0)
    throw std::invalid_argument("no signal " + std::to_string(signum));
  if (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN)
    throw std::invalid_argument("signal " + std::to_string(signum) +
                                " has no handler to keep: install it first");
  std::lock_guard lock(signals_mu_);
  kept_[signum] = now;
}

Endpoint::Kept Endpoint::keep(int signum) {
  std::lock_guard lock(signals_mu_);
  auto it = kept_.find(signum);
  if (it == kept_.end()) return Kept::kUnknown;
  struct sigaction now{};
  if (::sigaction(signum, nullptr, &now) < 0) return Kept::kUnknown;
  if (now.sa_handler == it->second.sa_handler) return Kept::kYes;
  if (now.sa_handler != SIG_DFL && now.sa_handler != SIG_IGN) return Kept::kTaken;
  // Reset by other code: raising it now would terminate the rank (or be lost).
  if (::sigaction(signum, &it->second, nullptr) < 0) return Kept::kUnknown;
  return Kept::kPutBack;
}

void Endpoint::keep_all() {
  std::vector<int> signums;
  {
    std::lock_guard lock(signals_mu_);
    for (auto& [signum, sa] : kept_) signums.push_back(signum);
  }
  for (int signum : signums) keep(signum);
}

std::string Endpoint::taken_note(int signum, const char* what) {
  return "ddip: rank " + std::to_string(rank_) + " has another handler for signal " +
         std::to_string(signum) + ", which ddip uses for " + what +
         "; code this rank ran installed it, and ddip did not raise the signal (it leaves a "
         "handler it did not install alone). Reset it with signal.signal(" +
         std::to_string(signum) + ", signal.SIG_DFL) in the rank, and ddip puts its own back.\n";
}

void Endpoint::abort_collectives() {
  int signum;
  {
    std::lock_guard lock(signals_mu_);
    signum = abort_signal_;
  }
  std::string note;
  if (signum == 0) {
    note = "ddip: rank " + std::to_string(rank_) +
           " got heal's abort request but listens for none (its group has no torch.distributed "
           "that ddip set up)\n";
  } else if (keep(signum) == Kept::kTaken) {
    note = taken_note(signum, "heal's abort of a broken collective");
  } else {
    // Not on this thread: faulthandler's handler then runs on one of Python's.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, signum);
    ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::kill(::getpid(), signum);
    return;
  }
  ssize_t ignored = ::write(STDERR_FILENO, note.data(), note.size());  // the rank's own output
  (void)ignored;
}

std::string Endpoint::dump_stacks() {
  std::lock_guard lock(stack_mu_);
  if (!stack_pipe_) return "stack dumps are not enabled in this worker\n";
  if (keep(stack_signal_) == Kept::kTaken) return taken_note(stack_signal_, "stack dumps");
  // Not on this thread: it reads the pipe, and the dump would show no Python thread's state.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, stack_signal_);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  int fd = stack_pipe_.get();
  char buf[65536];
  while (::read(fd, buf, sizeof buf) > 0) {
  }  // the tail of an earlier dump that came after its reply
  if (::kill(::getpid(), stack_signal_) < 0)
    return std::string("could not signal the worker for a stack dump: ") + std::strerror(errno);
  std::string out;
  auto deadline = detail::Clock::now() + detail::kDumpMax;
  while (out.size() < detail::kDumpBytes) {
    auto wait_until = deadline;
    if (!out.empty()) wait_until = std::min(deadline, detail::Clock::now() + detail::kDumpQuiet);
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, poll_timeout_ms(wait_until));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) break;  // quiet: the dump is complete (or the deadline passed)
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0)
      out.append(buf, static_cast<size_t>(n));
    else if (n == 0 || (errno != EAGAIN && errno != EINTR))
      break;
  }
  if (out.empty())
    return "no stack dump came within " + std::to_string(detail::kDumpMax.count()) +
           " ms of signal " + std::to_string(stack_signal_) + " (did other code take it over?)\n";
  return out;
}

void Endpoint::wake_watchdog() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
  (void)ignored;
}

bool Endpoint::take(Frame f, bool caller) {
  if (f.kind == kHeartbeat) {
    keep_all();  // a reset handler is put back before a signal can find it missing
    send(Frame::make(kHeartbeatAck, rank_, f.seq));
    return false;
  }
  if (f.kind == kAbortRequest || f.kind == kCollectivesRequest || f.kind == kStackRequest) {
    if (!caller) {
      chore(f);
      return false;
    }
    {
      std::lock_guard lock(mu_);
      chores_.push_back(std::move(f));
    }
    wake_watchdog();
    return false;
  }
  {
    std::lock_guard lock(mu_);
    inbox_.push_back(std::move(f));
  }
  if (!caller) cv_.notify_all();  // the caller read it itself: nobody to wake
  return true;
}

void Endpoint::chore(const Frame& f) {
  if (f.kind == kAbortRequest)
    abort_collectives();
  else if (f.kind == kCollectivesRequest)
    ask_collectives(f.seq);
  else if (f.kind == kStackRequest)
    send(Frame::make(kStacks, rank_, f.seq, dump_stacks()));
}

bool Endpoint::read_frames(detail::Clock::time_point deadline, bool caller, bool* interrupted) {
  // Frames a read already brought in first: one recvmsg may carry several.
  bool queued = false;
  while (std::optional<Frame> f = channel_.next()) queued |= take(std::move(*f), caller);
  if (queued) return true;
  auto timeout = options_.kernel_timeout;
  int64_t heard = last_heard_ns_.load();
  auto silent_until = detail::Clock::time_point(detail::Clock::duration(heard)) + timeout;
  if (timeout.count() > 0) deadline = std::min(deadline, silent_until);
  pollfd p[2] = {{channel_.fd(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
  int wait_ms = deadline == detail::Clock::time_point::max() ? -1 : poll_timeout_ms(deadline);
  int rc = ::poll(p, caller ? 1 : 2, wait_ms);
  if (rc < 0) {
    if (errno != EINTR) return false;
    if (interrupted) *interrupted = true;  // the caller's Python runs its handlers
    return true;
  }
  if (rc == 0) {
    // Silence for kernel_timeout, heartbeats included: the kernel (or its host) is gone.
    return !(timeout.count() > 0 && detail::Clock::now() >= silent_until);
  }
  if (!caller && (p[1].revents & POLLIN)) {
    uint64_t n;
    ssize_t ignored = ::read(wake_.get(), &n, sizeof n);  // recv() wants the channel
    (void)ignored;
  }
  if (p[0].revents == 0) return true;
  // Read on until a frame is whole (its payload mostly came with its header: no poll between
  // them), or the socket is empty.
  bool whole = false;
  while (!whole) {
    Channel::ReadResult r;
    try {
      r = channel_.read_some();
    } catch (const std::exception&) {
      return false;
    }
    if (r == Channel::ReadResult::kEof) return false;
    if (r == Channel::ReadResult::kWouldBlock) break;
    last_heard_ns_ = detail::now_ns();
    while (std::optional<Frame> f = channel_.next()) {
      take(std::move(*f), caller);
      whole = true;
    }
  }
  return true;
}

void Endpoint::watch() {
  std::unique_lock lock(mu_);
  while (!stopping_ && !closed_) {
    while (!chores_.empty()) {
      Frame f = std::move(chores_.front());
      chores_.pop_front();
      lock.unlock();
      try {
        chore(f);
      } catch (const std::exception&) {
        // the kernel is gone: the reader finds out
      }
      lock.lock();
    }
    if (stopping_ || closed_) break;
    if (reader_ == Reader::kCaller) {
      // The worker reads while it waits in recv(). Its timer fires once it has been away from
      // recv() for kTakeOver (it runs a request): the channel is the watchdog's until recv()
      // asks for it again.
      lock.unlock();
      pollfd p[2] = {{timer_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
      int rc = ::poll(p, 2, -1);
      uint64_t n;
      bool fired = rc > 0 && (p[0].revents & POLLIN);
      if (fired) {
        ssize_t ignored = ::read(timer_.get(), &n, sizeof n);
        (void)ignored;
      }
      if (rc > 0 && (p[1].revents & POLLIN)) {
        ssize_t ignored = ::read(wake_.get(), &n, sizeof n);
        (void)ignored;
      }
      lock.lock();
      if (fired) {
        timer_armed_ = timer_long_ = false;
        // A caller that came back and left again since: the rest of its kTakeOver first.
        auto away = detail::Clock::now() - caller_left_;
        if (!caller_waiting_ && reader_ == Reader::kCaller) {
          if (away >= detail::kTakeOver) {
            reader_ = Reader::kWatchdog;
          } else {
            set_timer(timer_.get(), detail::kTakeOver - away);
            timer_armed_ = true;
          }
        }
      }
      continue;
    }
    if (hand_back_) {
      hand_back_ = false;
      reader_ = Reader::kCaller;
      cv_.notify_all();
      continue;
    }
    lock.unlock();
    bool alive = true;
    try {
      alive = read_frames(detail::Clock::time_point::max(), false);
    } catch (const std::exception&) {
      alive = false;  // the kernel is gone
    }
    lock.lock();
    if (!alive) {
      closed_ = true;
      cv_.notify_all();
    }
  }
  closed_ = true;
  cv_.notify_all();
  if (stopping_) return;
  // The kernel is gone. Python gets a moment to leave on its own; a stuck worker is ended here,
  // with what it started when its process group is its own.
  if (!watch_cv_.wait_for(lock, options_.exit_grace, [this] { return stopping_; })) {
    if (::getpgrp() == ::getpid()) ::kill(0, SIGKILL);
    ::_exit(1);
  }
}

}  // namespace ddip
