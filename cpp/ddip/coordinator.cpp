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
  // stdout read after a display marker whose frame has not arrived yet, one batch per marker.
  std::deque<std::vector<Event>> held;
  // Shared-memory segments this worker was sent and has not released.
  std::unordered_multiset<uint64_t> segments;
};

Coordinator::Coordinator(CoordinatorOptions options) : options_(std::move(options)) {
  if (options_.workers.empty()) throw std::invalid_argument("a group needs at least one worker");
  dir_ = std::make_unique<RuntimeDir>();
  socket_path_ = dir_->socket_path();
  for (auto& w : options_.workers) w.env.push_back("DDIP_SOCKET=" + socket_path_);
  size_t n = options_.workers.size();
  slots_.resize(n);
  last_ack_.resize(n);
  connected_.assign(n, false);
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

Coordinator::~Coordinator() { close(std::chrono::milliseconds(1000)); }

void Coordinator::start_workers() {
  watch(listener_->fd(), detail::tag(detail::kListenerTag, 0), EPOLLIN);
  watch(wake_.get(), detail::tag(detail::kWakeTag, 0), EPOLLIN);
  for (size_t i = 0; i < options_.workers.size(); ++i) {
    size_t idx = supervisor_.spawn(options_.workers[i]);
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
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
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
  return e;
}

long long Coordinator::heartbeat_age_ms(int slot) const {
  std::lock_guard lock(mu_);
  if (!connected_.at(slot)) return -1;
  return std::chrono::duration_cast<detail::milliseconds>(Clock::now() - last_ack_.at(slot))
      .count();
}

bool Coordinator::connected(int slot) const {
  std::lock_guard lock(mu_);
  return connected_.at(slot);
}

bool Coordinator::running() const {
  std::lock_guard lock(mu_);
  return !thread_done_;
}

void Coordinator::close(std::chrono::milliseconds grace) {
  if (!thread_.joinable()) return;
  auto begin_shutdown = [this, grace] {
    shutting_down_ = true;
    close_grace_ = grace;
    shutdown_deadline_ = Clock::now() + grace;
    for (size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].conn) send_now(i, Frame::make(kShutdown, static_cast<int32_t>(i), 0));
  };
  try {
    post(begin_shutdown);
  } catch (const std::runtime_error&) {
    // The IO thread already stopped (and stopped the workers); just join it.
  }
  thread_.join();
}

void Coordinator::loop() {
  auto next_heartbeat = Clock::now() + options_.heartbeat_interval;
  epoll_event evs[64];
  try {
    while (true) {
      auto wake_at = next_heartbeat;
      for (auto& s : slots_)
        if (s.output.has_pending())
          wake_at = std::min(wake_at, s.last_output + options_.partial_line_delay);
      if (shutting_down_) wake_at = std::min(wake_at, shutdown_deadline_);
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
      if (now >= next_heartbeat) {
        for (size_t i = 0; i < slots_.size(); ++i)
          if (slots_[i].conn) send_now(i, Frame::make(kHeartbeat, static_cast<int32_t>(i), 0));
        next_heartbeat = now + options_.heartbeat_interval;
      }
      for (size_t i = 0; i < slots_.size(); ++i)
        if (slots_[i].output.has_pending() &&
            now - slots_[i].last_output >= options_.partial_line_delay)
          flush_partial(i);
      if (shutting_down_) {
        bool all_exited =
            std::all_of(slots_.begin(), slots_.end(), [](auto& s) { return s.exited; });
        if (all_exited || now >= shutdown_deadline_) break;
      }
    }
    supervisor_.stop_all(close_grace_);
  } catch (const std::exception& e) {
    supervisor_.stop_all(detail::milliseconds(0));
    Event ev;
    ev.kind = Event::kFailed;
    ev.text = std::string("ddip runtime error: ") + e.what();
    emit(std::move(ev));
  }
  {
    std::lock_guard lock(mu_);
    thread_done_ = true;
    commands_.clear();
  }
  cv_.notify_all();
}

void Coordinator::on_accept() {
  while (true) {
    Fd fd = listener_->accept();
    if (!fd) return;
    Channel ch(std::move(fd));
    pid_t pid = ch.peer_pid();
    auto it = std::find(pids_.begin(), pids_.end(), pid);
    if (it == pids_.end()) continue;  // not one of our workers: drop it
    size_t slot = static_cast<size_t>(it - pids_.begin());
    Slot& s = slots_[slot];
    if (s.conn) continue;
    watch(ch.fd(), detail::tag(detail::kConnTag, slot), EPOLLIN);
    s.conn.emplace(std::move(ch));
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
      supervisor_.signal(slot, SIGKILL);
      r = Channel::ReadResult::kEof;
    }
    while (s.conn) {
      auto f = s.conn->next();
      if (!f) break;
      if (f->kind == kHeartbeatAck) {
        std::lock_guard lock(mu_);
        last_ack_[slot] = Clock::now();
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
        flush_partial(slot);
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

void Coordinator::flush_partial(size_t slot) {
  Slot& s = slots_[slot];
  for (auto stream : {RankOutput::kStdout, RankOutput::kStderr})
    emit_output(slot, stream, s.output.flush(stream));
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
  flush_partial(slot);
  release_held(slot, true);
  auto status = supervisor_.poll(slot);
  if (!status) return;
  s.exited = true;
  unwatch(supervisor_.child(slot).pidfd());
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
