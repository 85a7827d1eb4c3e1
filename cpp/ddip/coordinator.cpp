#include "ddip/coordinator.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <future>
#include <stdexcept>
#include <unordered_set>

namespace ddip {
namespace detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum Tag : uint64_t { kListenerTag = 1, kWakeTag, kPidTag, kStdoutTag, kStderrTag, kConnTag };

uint64_t tag(Tag t, size_t slot) { return (static_cast<uint64_t>(t) << 32) | slot; }

int ms_until(Clock::time_point t) {
  auto d = std::chrono::duration_cast<milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(d, 0, 60'000));
}

}  // namespace detail

using detail::Clock;

struct Coordinator::Slot {
  std::optional<Channel> conn;
  std::vector<Frame> waiting;  // frames sent before the worker connected
  RankOutput output;
  Fd out, err;
  Clock::time_point last_output;
  bool exited = false;
  // Exited but not reapable yet (a zombie held by a tracer): its pidfd stays readable, so it is
  // unwatched and looked at again on each tick.
  bool exit_pending = false;
  bool unresponsive = false;
  // stdout read after a display marker whose frame has not arrived yet, one batch per marker.
  std::deque<std::vector<Event>> held;
  // Shared-memory segments this worker was sent and has not released.
  std::unordered_multiset<uint64_t> segments;
};

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)), supervisor_(options_.kill_wait) {
  if (options_.workers.empty()) throw std::invalid_argument("a group needs at least one worker");
  dir_ = std::make_unique<RuntimeDir>();
  socket_path_ = dir_->socket_path();
  for (auto& w : options_.workers) {
    // getenv() finds the first of duplicates: ours must be the only ones (a group started inside
    // a rank inherits that rank's).
    std::erase_if(w.env, [](const std::string& kv) {
      return kv.starts_with("DDIP_SOCKET=") || kv.starts_with("DDIP_KERNEL_PID=");
    });
    w.env.push_back("DDIP_SOCKET=" + socket_path_);
    w.env.push_back("DDIP_KERNEL_PID=" + std::to_string(::getpid()));
  }
  size_t n = options_.workers.size();
  slots_.resize(n);
  last_ack_.resize(n);
  connected_.assign(n, false);
  unread_output_.assign(n, 0);
  dropped_output_.assign(n, 0);
  wake_ = Fd(check(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), "eventfd", "creating the wake-up fd"));
  epoll_ = Fd(check(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1", "creating the event loop"));
  listener_ = std::make_unique<Listener>(socket_path_);

  std::promise<void> started;
  auto ready = started.get_future();
  thread_ = std::thread([this, &started] {
    try {
      start_workers();
    } catch (...) {
      started.set_exception(std::current_exception());
      supervisor_.stop_all(detail::milliseconds(0));
      return;
    }
    started.set_value();
    loop();
  });
  try {
    ready.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

Coordinator::~Coordinator() {
  try {
    close(std::chrono::milliseconds(1000));
  } catch (const std::exception&) {
    // Nothing a destructor could do; the IO thread stops the workers on its own.
  }
}

void Coordinator::start_workers() {
  watch(listener_->fd(), detail::tag(detail::kListenerTag, 0), EPOLLIN);
  watch(wake_.get(), detail::tag(detail::kWakeTag, 0), EPOLLIN);
  for (size_t i = 0; i < options_.workers.size(); ++i) {
    std::optional<ForkedRank> forked;
    if (options_.rank_template) forked = options_.rank_template->fork(options_.workers[i]);
    size_t idx = forked ? supervisor_.adopt(forked->pid, std::move(forked->pidfd),
                                            std::move(forked->out), std::move(forked->err))
                        : supervisor_.spawn(options_.workers[i]);
    Child& c = supervisor_.child(idx);
    pids_.push_back(c.pid());
    Slot& s = slots_[i];
    s.out = std::move(c.stdout_pipe());
    s.err = std::move(c.stderr_pipe());
    watch(c.pidfd(), detail::tag(detail::kPidTag, i), EPOLLIN);
    if (s.out) watch(s.out.get(), detail::tag(detail::kStdoutTag, i), EPOLLIN);
    if (s.err) watch(s.err.get(), detail::tag(detail::kStderrTag, i), EPOLLIN);
  }
}

void Coordinator::watch(int fd, uint64_t tag, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  check(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev), "epoll_ctl(ADD)", "watching an fd");
}

void Coordinator::unwatch(int fd) { ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr); }

void Coordinator::post(std::function<void()> fn) {
  {
    std::lock_guard lock(mu_);
    if (thread_done_) throw std::runtime_error("the group's runtime has stopped");
    commands_.push_back(std::move(fn));
  }
  uint64_t one = 1;
  ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
  (void)ignored;
}

void Coordinator::emit(Event e) {
  {
    std::lock_guard lock(mu_);
    if (e.kind == Event::kOutput) {
      size_t slot = static_cast<size_t>(e.slot);
      size_t& unread = unread_output_[slot];
      size_t& dropped = dropped_output_[slot];
      if (unread + e.text.size() > options_.max_unread_output) {
        if (dropped == 0)
          events_.push_back(output_note(slot, "rank output is being dropped: more than " +
                                                  std::to_string(options_.max_unread_output >> 10) +
                                                  " KiB of it waits unread in the notebook"));
        dropped += e.text.size();
        return;
      }
      if (dropped != 0) {
        events_.push_back(
            output_note(slot, std::to_string(dropped) + " bytes of rank output were dropped"));
        dropped = 0;
      }
      unread += e.text.size();
    }
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

Event Coordinator::output_note(size_t slot, const std::string& what) {
  Event note;
  note.kind = Event::kOutput;
  note.slot = static_cast<int>(slot);
  note.stream = RankOutput::kStderr;
  note.text = "\n[ddip: " + what + "]\n";
  return note;
}

void Coordinator::send(int slot, Frame frame, const std::vector<uint64_t>& segments) {
  if (slot < 0 || static_cast<size_t>(slot) >= slots_.size())
    throw std::out_of_range("no worker slot " + std::to_string(slot));
  if (!segments.empty()) {
    if (segments.size() > kMaxFdsPerFrame)
      throw std::invalid_argument("too many shared-memory segments in one frame");
    frame.fds = std::make_shared<std::vector<Fd>>();
    for (uint64_t id : segments) {
      frame.fds->push_back(pool_.dup_fd(id));
      pool_.retain(id);
    }
  }
  post([this, slot, f = std::move(frame), segments]() mutable {
    Slot& s = slots_[slot];
    if (s.exited) {
      for (uint64_t id : segments) pool_.release(id);
      return;
    }
    s.segments.insert(segments.begin(), segments.end());
    send_now(slot, std::move(f));
  });
}

void Coordinator::release_segments(size_t slot, const std::string& ids) {
  Slot& s = slots_[slot];
  for (size_t off = 0; off + sizeof(uint64_t) <= ids.size(); off += sizeof(uint64_t)) {
    uint64_t id;
    std::memcpy(&id, ids.data() + off, sizeof id);
    auto it = s.segments.find(id);
    if (it == s.segments.end()) continue;  // not one it holds: ignore
    s.segments.erase(it);
    pool_.release(id);
  }
}

void Coordinator::signal(int slot, int sig, bool whole_group) {
  if (slot >= static_cast<int>(slots_.size()))
    throw std::out_of_range("no worker slot " + std::to_string(slot));
  if (sig <= 0 || sig >= NSIG) throw std::invalid_argument("no signal " + std::to_string(sig));
  post([this, slot, sig, whole_group] {
    if (slot < 0)
      supervisor_.signal_all(sig, whole_group);
    else
      supervisor_.signal(slot, sig, whole_group);
  });
}

std::optional<Event> Coordinator::next_event(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  // A zero timeout only looks: a timed wait, even one already expired, costs the timer slack.
  if (timeout.count() > 0)
    cv_.wait_for(lock, timeout, [this] { return !events_.empty() || thread_done_; });
  if (events_.empty()) return std::nullopt;
  Event e = std::move(events_.front());
  events_.pop_front();
  if (e.kind == Event::kOutput) {
    size_t& unread = unread_output_[static_cast<size_t>(e.slot)];
    unread -= std::min(unread, e.text.size());  // notes were never counted
  }
  return e;
}

long long Coordinator::heartbeat_age_ms(int slot) const {
  std::lock_guard lock(mu_);
  if (!connected_.at(slot)) return -1;
  return std::chrono::duration_cast<detail::milliseconds>(Clock::now() - last_ack_.at(slot))
      .count();
}

size_t Coordinator::dropped_output(int slot) const {
  std::lock_guard lock(mu_);
  return dropped_output_.at(slot);
}

bool Coordinator::connected(int slot) const {
  std::lock_guard lock(mu_);
  return connected_.at(slot);
}

bool Coordinator::running() const {
  std::lock_guard lock(mu_);
  return !thread_done_;
}

void Coordinator::begin_close(std::chrono::milliseconds grace) {
  try {
    post([this, grace] { begin_stop(grace); });
  } catch (const std::runtime_error&) {
    // The IO thread already stopped (and stopped the workers).
  }
}

std::optional<std::vector<pid_t>> Coordinator::wait_closed(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (timeout.count() < 0)
    cv_.wait(lock, [this] { return thread_done_; });
  else if (timeout.count() > 0)
    cv_.wait_for(lock, timeout, [this] { return thread_done_; });
  if (!thread_done_) return std::nullopt;
  return unreaped_;
}

std::vector<pid_t> Coordinator::close(std::chrono::milliseconds grace) {
  {
    std::lock_guard lock(join_mu_);
    if (thread_.joinable()) {
      begin_close(grace);
      thread_.join();
    }
  }
  std::lock_guard lock(mu_);
  return unreaped_;
}

void Coordinator::begin_stop(std::chrono::milliseconds grace) {
  auto now = Clock::now();
  if (stop_ == Stop::kRunning) {
    stop_ = Stop::kAsked;
    close_grace_ = grace;
    stop_deadline_ = now + grace;
    // A worker not connected yet gets it when it connects, instead of waiting out the grace.
    for (size_t i = 0; i < slots_.size(); ++i)
      send_now(i, Frame::make(kShutdown, static_cast<int32_t>(i), 0));
    return;
  }
  if (grace < close_grace_) {  // e.g. `%makedip -k` after an interrupted close
    close_grace_ = grace;
    if (stop_ != Stop::kKilled) stop_deadline_ = std::min(stop_deadline_, now + grace);
  }
}

// True once stopping is over: every worker reaped, or the last deadline passed.
bool Coordinator::advance_stop(Clock::time_point now) {
  if (std::all_of(slots_.begin(), slots_.end(), [](auto& s) { return s.exited; })) return true;
  if (now < stop_deadline_) return false;
  auto signal_running = [this](int sig) {
    for (size_t i = 0; i < slots_.size(); ++i) try {
        if (!slots_[i].exited) supervisor_.signal(i, sig);
      } catch (const std::exception&) {
        // One worker we could not signal does not stop the others from being stopped.
      }
  };
  switch (stop_) {
    case Stop::kAsked:
      signal_running(SIGTERM);
      stop_ = Stop::kTerminated;
      stop_deadline_ = now + close_grace_;
      return false;
    case Stop::kTerminated:
      signal_running(SIGKILL);
      stop_ = Stop::kKilled;
      stop_deadline_ = now + options_.kill_wait;
      return false;
    default:
      return true;  // SIGKILLed and still there (uninterruptible sleep): left behind
  }
}

void Coordinator::loop() {
  auto next_tick = Clock::now() + options_.heartbeat_interval;
  epoll_event evs[64];
  try {
    while (true) {
      auto wake_at = next_tick;
      for (auto& s : slots_)
        if (s.output.has_pending())
          wake_at = std::min(wake_at, s.last_output + options_.partial_line_delay);
      if (stop_ != Stop::kRunning) wake_at = std::min(wake_at, stop_deadline_);
      if (listener_paused_) wake_at = std::min(wake_at, listener_retry_);
      int n = ::epoll_wait(epoll_.get(), evs, 64, detail::ms_until(wake_at));
      if (n < 0 && errno != EINTR) throw_errno("epoll_wait", "waiting for worker activity");
      for (int k = 0; k < n; ++k) {
        auto type = static_cast<detail::Tag>(evs[k].data.u64 >> 32);
        size_t slot = evs[k].data.u64 & 0xffffffffu;
        switch (type) {
          case detail::kListenerTag:
            on_accept();
            break;
          case detail::kWakeTag: {
            uint64_t count;
            ssize_t ignored = ::read(wake_.get(), &count, sizeof count);
            (void)ignored;
            break;
          }
          case detail::kPidTag:
            on_exit(slot);
            break;
          case detail::kStdoutTag:
            on_pipe(slot, RankOutput::kStdout, false);
            break;
          case detail::kStderrTag:
            on_pipe(slot, RankOutput::kStderr, false);
            break;
          case detail::kConnTag:
            on_connection(slot, evs[k].events);
            break;
        }
      }
      std::deque<std::function<void()>> commands;
      {
        std::lock_guard lock(mu_);
        commands.swap(commands_);
      }
      for (auto& c : commands) {
        try {
          c();
        } catch (const std::exception&) {
          // A command that fails (a worker that is gone, say) must not take the group down.
        }
      }

      auto now = Clock::now();
      if (now >= next_tick) {
        tick();
        next_tick = now + options_.heartbeat_interval;
      }
      check_responsive(now);
      for (size_t i = 0; i < slots_.size(); ++i) {
        Slot& s = slots_[i];
        if (!s.output.has_pending() || now - s.last_output < options_.partial_line_delay) continue;
        flush_partial(i, false);
        // Kept back (half a UTF-8 character): one more delay for the rest, then it goes anyway.
        if (s.output.has_pending()) s.last_output = now;
      }
      if (listener_paused_ && now >= listener_retry_) {
        listener_paused_ = false;
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = detail::tag(detail::kListenerTag, 0);
        check(::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listener_->fd(), &ev), "epoll_ctl(MOD)",
              "watching the listening socket again");
      }
      if (stop_ != Stop::kRunning && advance_stop(now)) break;
    }
  } catch (const std::exception& e) {
    fail(e.what());
  } catch (...) {
    fail("unknown error");
  }
  finish();
}

// The IO thread can't go on: stop the workers and say why. Runs on an error path, so it may
// not throw (that would be std::terminate, and the notebook's kernel with it).
void Coordinator::fail(const std::string& why) noexcept {
  supervisor_.stop_all(detail::milliseconds(0));
  try {
    Event ev;
    ev.kind = Event::kFailed;
    ev.slot = -1;
    ev.text = "ddip runtime error: " + why;
    emit(std::move(ev));
  } catch (...) {
    // Out of memory for the message: the stopped runtime (running() is false) still tells.
  }
}

void Coordinator::finish() noexcept {
  std::vector<pid_t> unreaped;
  for (size_t i = 0; i < slots_.size(); ++i) {
    try {
      if (!slots_[i].exited) on_exit(i);  // it may have just gone
    } catch (...) {
    }
    if (!slots_[i].exited) unreaped.push_back(pids_[i]);
  }
  {
    std::lock_guard lock(mu_);
    thread_done_ = true;
    unreaped_ = std::move(unreaped);
    commands_.clear();
  }
  cv_.notify_all();
}

void Coordinator::tick() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].conn) send_now(i, Frame::make(kHeartbeat, static_cast<int32_t>(i), 0));
    if (slots_[i].exit_pending) on_exit(i);
  }
  if (options_.pool_idle.count() > 0) pool_.trim(options_.pool_idle);
}

void Coordinator::check_responsive(Clock::time_point now) {
  if (options_.heartbeat_timeout.count() <= 0) return;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.conn || s.unresponsive) continue;
    Clock::time_point last;
    {
      std::lock_guard lock(mu_);
      last = last_ack_[i];
    }
    if (now - last <= options_.heartbeat_timeout) continue;
    s.unresponsive = true;
    Event e;
    e.kind = Event::kUnresponsive;
    e.slot = static_cast<int>(i);
    e.age_ms = std::chrono::duration_cast<detail::milliseconds>(now - last).count();
    emit(std::move(e));
  }
}

// Out of fds (EMFILE / ENFILE): a worker's connection waits in the backlog and the listener is
// tried again in 100 ms, so the IO thread neither spins on a level-triggered fd nor dies.
void Coordinator::pause_listener() {
  epoll_event ev{};
  ev.data.u64 = detail::tag(detail::kListenerTag, 0);
  check(::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listener_->fd(), &ev), "epoll_ctl(MOD)",
        "pausing the listening socket");
  listener_paused_ = true;
  listener_retry_ = Clock::now() + detail::milliseconds(100);
}

void Coordinator::on_accept() {
  while (true) {
    Fd fd = listener_->accept();
    if (!fd) {
      if (listener_->starved()) pause_listener();
      return;
    }
    std::optional<Channel> ch;
    pid_t pid;
    try {
      ch.emplace(std::move(fd));
      pid = ch->peer_pid();
    } catch (const std::system_error&) {
      continue;  // that one connection is dropped; its worker sees EOF
    }
    auto it = std::find(pids_.begin(), pids_.end(), pid);
    if (it == pids_.end()) continue;  // not one of our workers: drop it
    size_t slot = static_cast<size_t>(it - pids_.begin());
    Slot& s = slots_[slot];
    // An exited worker's pid may be someone else's by now: never let it attach.
    if (s.conn || s.exited) continue;
    watch(ch->fd(), detail::tag(detail::kConnTag, slot), EPOLLIN);
    s.conn.emplace(std::move(*ch));
    {
      std::lock_guard lock(mu_);
      connected_[slot] = true;
      last_ack_[slot] = Clock::now();
    }
    std::vector<Frame> waiting;
    waiting.swap(s.waiting);
    for (auto& f : waiting) send_now(slot, std::move(f));
  }
}

void Coordinator::send_now(size_t slot, Frame f) {
  Slot& s = slots_[slot];
  if (!s.conn) {
    if (!s.exited) s.waiting.push_back(std::move(f));
    return;
  }
  bool was_writing = s.conn->wants_write();
  s.conn->queue(std::move(f));
  if (was_writing) return;
  try {
    if (!s.conn->flush()) {
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT;
      ev.data.u64 = detail::tag(detail::kConnTag, slot);
      check(::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, s.conn->fd(), &ev), "epoll_ctl(MOD)",
            "waiting to write to a worker");
    }
  } catch (const std::system_error&) {
    drop_connection(slot);  // the worker is gone; its exit is reported through its pidfd
  }
}

void Coordinator::on_connection(size_t slot, uint32_t events) {
  Slot& s = slots_[slot];
  if (!s.conn) return;
  if (events & EPOLLOUT) {
    try {
      if (s.conn->flush()) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = detail::tag(detail::kConnTag, slot);
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, s.conn->fd(), &ev);
      }
    } catch (const std::system_error&) {
      drop_connection(slot);
      return;
    }
  }
  if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR))) return;
  while (s.conn) {
    Channel::ReadResult r;
    try {
      r = s.conn->read_some();
    } catch (const std::system_error&) {
      r = Channel::ReadResult::kEof;
    } catch (const std::exception&) {
      // A corrupt frame: this worker can't be trusted any more, but the others are fine.
      try {
        supervisor_.signal(slot, SIGKILL);
      } catch (const std::exception&) {
        // Then it is gone already; dropping the connection is all that is left.
      }
      r = Channel::ReadResult::kEof;
    }
    while (s.conn) {
      auto f = s.conn->next();
      if (!f) break;
      if (f->truncated) {
        if (f->kind == kDone) {  // still the end of the request: its output goes first
          drain_output(slot, false);
          flush_partial(slot, true);
          release_held(slot, true);
        }
        Event e;
        e.kind = Event::kTruncated;
        e.slot = static_cast<int>(slot);
        e.frame = std::move(*f);
        emit(std::move(e));
        continue;
      }
      if (f->kind == kHeartbeatAck) {
        {
          std::lock_guard lock(mu_);
          last_ack_[slot] = Clock::now();
        }
        if (s.unresponsive) {
          s.unresponsive = false;
          Event e;
          e.kind = Event::kResponsive;
          e.slot = static_cast<int>(slot);
          emit(std::move(e));
        }
        continue;
      }
      if (f->kind == kDisplay) {
        on_display(slot, std::move(*f));
        continue;
      }
      if (f->kind == kRelease) {
        release_segments(slot, f->data());
        continue;
      }
      if (f->kind == kDone) {
        // Everything the cell printed was written to the pipes before "done" was sent.
        drain_output(slot, false);
        flush_partial(slot, true);
        release_held(slot, true);
      }
      Event e;
      e.kind = Event::kFrame;
      e.slot = static_cast<int>(slot);
      e.frame = std::move(*f);
      emit(std::move(e));
    }
    if (r == Channel::ReadResult::kEof) {
      drop_connection(slot);
      return;
    }
    if (r == Channel::ReadResult::kWouldBlock) return;
  }
}

void Coordinator::drop_connection(size_t slot) {
  Slot& s = slots_[slot];
  if (!s.conn) return;
  unwatch(s.conn->fd());
  s.conn.reset();
  {
    std::lock_guard lock(mu_);
    connected_[slot] = false;
  }
  Event e;
  e.kind = Event::kDisconnected;
  e.slot = static_cast<int>(slot);
  emit(std::move(e));
}

void Coordinator::on_pipe(size_t slot, int stream, bool final) {
  Slot& s = slots_[slot];
  Fd& fd = stream == RankOutput::kStdout ? s.out : s.err;
  if (!fd) return;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {  // EOF or error: the worker (and anything it started) closed it
      unwatch(fd.get());
      fd.reset();
      break;
    }
    auto pieces = s.output.feed(static_cast<RankOutput::Stream>(stream), std::string_view(buf, n));
    s.last_output = Clock::now();
    for (auto& piece : pieces) {
      emit_output(slot, stream, std::move(piece.text));
      if (piece.marker) s.held.emplace_back();
    }
    if (static_cast<size_t>(n) < sizeof buf && !final) break;
  }
}

void Coordinator::drain_output(size_t slot, bool final) {
  on_pipe(slot, RankOutput::kStdout, final);
  on_pipe(slot, RankOutput::kStderr, final);
}

void Coordinator::flush_partial(size_t slot, bool force) {
  Slot& s = slots_[slot];
  for (auto stream : {RankOutput::kStdout, RankOutput::kStderr})
    emit_output(slot, stream, s.output.flush(stream, force));
}

void Coordinator::emit_output(size_t slot, int stream, std::string text) {
  if (text.empty()) return;
  Event e;
  e.kind = Event::kOutput;
  e.slot = static_cast<int>(slot);
  e.stream = stream;
  e.text = std::move(text);
  Slot& s = slots_[slot];
  if (stream == RankOutput::kStdout && !s.held.empty())
    s.held.back().push_back(std::move(e));
  else
    emit(std::move(e));
}

void Coordinator::on_display(size_t slot, Frame f) {
  Slot& s = slots_[slot];
  // The worker wrote the marker before sending the frame, so after a drain it has been read.
  if (s.held.empty()) drain_output(slot, false);
  Event e;
  e.kind = Event::kFrame;
  e.slot = static_cast<int>(slot);
  e.frame = std::move(f);
  emit(std::move(e));
  release_held(slot, false);
}

void Coordinator::release_held(size_t slot, bool all) {
  Slot& s = slots_[slot];
  while (!s.held.empty()) {
    std::vector<Event> batch = std::move(s.held.front());
    s.held.pop_front();
    for (auto& e : batch) emit(std::move(e));
    if (!all) break;
  }
}

void Coordinator::on_exit(size_t slot) {
  Slot& s = slots_[slot];
  if (s.exited) return;
  // Report in the order things happened: its last frames and output, then its death.
  if (s.conn) on_connection(slot, EPOLLIN);
  drain_output(slot, true);
  flush_partial(slot, true);
  release_held(slot, true);
  auto status = supervisor_.poll(slot);
  if (!status) {
    if (!s.exit_pending) {
      // Its pidfd says it exited, yet it can't be reaped: a tracer holds the zombie. Level-
      // triggered, that fd would wake us forever; the tick looks again instead.
      s.exit_pending = true;
      unwatch(supervisor_.child(slot).pidfd());
    }
    return;
  }
  s.exited = true;
  if (!s.exit_pending) unwatch(supervisor_.child(slot).pidfd());
  s.waiting.clear();
  for (uint64_t id : s.segments) pool_.release(id);  // a dead worker's mappings are gone
  s.segments.clear();
  Event e;
  e.kind = Event::kExited;
  e.slot = static_cast<int>(slot);
  e.status = *status;
  e.text = s.output.stderr_tail();
  emit(std::move(e));
}

}  // namespace ddip
