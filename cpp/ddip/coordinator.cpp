#include "ddip/coordinator.hpp"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <future>
#include <stdexcept>
#include <unordered_set>

#include "ddip/auth.hpp"
#include "ddip/remote.hpp"

namespace ddip {
namespace detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

}  // namespace detail

using detail::Clock;

struct Coordinator::Slot {
  std::unique_ptr<Connection> conn;
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
  // A worker on another host: its link, whether it said hello, and frames for it (with the
  // segments they hold until the link has copied them) waiting for the link to come up.
  int link = -1;
  bool said_hello = false;
  std::vector<std::pair<Frame, std::vector<uint64_t>>> link_waiting;
};

struct Coordinator::Link {
  RemoteHost host;
  size_t child = 0;  // the launcher's Supervisor index
  Fd out, err;
  RankOutput output;  // the launcher's own output: its stderr tail explains a failed start
  bool launcher_exited = false;
  std::unique_ptr<Connection> conn;
  bool ever_connected = false;
};

struct Coordinator::Handshake {
  Fd fd;
  std::string peer;
  KernelHandshake hs;
  std::string response;
  Clock::time_point deadline;
};

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)), supervisor_(options_.kill_wait) {
  if (options_.workers.empty()) throw std::invalid_argument("a group needs at least one worker");
  dir_ = std::make_unique<RuntimeDir>();
  socket_path_ = dir_->socket_path();
  size_t n = options_.workers.size();
  slots_.resize(n);
  for (size_t h = 0; h < options_.hosts.size(); ++h)
    for (int slot : options_.hosts[h].slots) {
      if (slot < 0 || static_cast<size_t>(slot) >= n || slots_[slot].link >= 0)
        throw std::invalid_argument("a remote host's slots must be distinct workers");
      slots_[slot].link = static_cast<int>(h);
    }
  for (size_t i = 0; i < n; ++i) {
    auto& w = options_.workers[i];
    if (slots_[i].link >= 0) continue;  // its host's agent gives it an address of its own
    // getenv() finds the first of duplicates: ours must be the only ones (a group started inside
    // a rank inherits that rank's).
    std::erase_if(w.env, [](const std::string& kv) {
      return kv.starts_with("DDIP_SOCKET=") || kv.starts_with("DDIP_KERNEL_PID=");
    });
    w.env.push_back("DDIP_SOCKET=" + socket_path_);
    w.env.push_back("DDIP_KERNEL_PID=" + std::to_string(::getpid()));
  }
  last_ack_.resize(n);
  connected_.assign(n, false);
  unread_output_.assign(n, 0);
  dropped_output_.assign(n, 0);
  listener_ = std::make_unique<Listener>(socket_path_);
  if (!options_.hosts.empty()) {
    tcp_ = std::make_unique<TcpListener>(options_.bind_address, options_.bind_port);
    key_ = random_bytes(kKeyBytes);
  }

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
  loop_.watch(listener_->fd(), EPOLLIN, [this](uint32_t) { on_accept(); });
  child_of_.assign(options_.workers.size(), -1);
  for (size_t i = 0; i < options_.workers.size(); ++i) {
    if (slots_[i].link >= 0) {
      pids_.push_back(-1);  // its pid is on another host (the hello says which)
      continue;
    }
    std::optional<ForkedRank> forked;
    if (options_.rank_template) forked = options_.rank_template->fork(options_.workers[i]);
    size_t idx = forked ? supervisor_.adopt(forked->pid, std::move(forked->pidfd),
                                            std::move(forked->out), std::move(forked->err))
                        : supervisor_.spawn(options_.workers[i]);
    Child& c = supervisor_.child(idx);
    child_of_[i] = static_cast<int>(idx);
    pids_.push_back(c.pid());
    Slot& s = slots_[i];
    s.out = std::move(c.stdout_pipe());
    s.err = std::move(c.stderr_pipe());
    loop_.watch(c.pidfd(), EPOLLIN, [this, i](uint32_t) { on_exit(i); });
    if (s.out)
      loop_.watch(s.out.get(), EPOLLIN,
                  [this, i](uint32_t) { on_pipe(i, RankOutput::kStdout, false); });
    if (s.err)
      loop_.watch(s.err.get(), EPOLLIN,
                  [this, i](uint32_t) { on_pipe(i, RankOutput::kStderr, false); });
  }
  start_links();
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
  if (options_.on_event) options_.on_event();
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
      frame.fd_bytes.push_back(pool_.length(id));  // a TCP link sends only the bytes put there
    }
  }
  loop_.post([this, slot, f = std::move(frame), segments]() mutable {
    Slot& s = slots_[slot];
    if (s.link >= 0) {
      send_remote(slot, std::move(f), std::move(segments));
      return;
    }
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
  loop_.post([this, slot, sig, whole_group] {
    if (slot >= 0) return signal_slot(slot, sig, whole_group);
    for (size_t i = 0; i < slots_.size(); ++i) try {
        signal_slot(i, sig, whole_group);
      } catch (const std::exception&) {
        // One worker we could not signal does not keep the others from it.
      }
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
    loop_.post([this, grace] { begin_stop(grace); });
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
  if (std::all_of(slots_.begin(), slots_.end(), [](auto& s) { return s.exited; }) &&
      std::all_of(links_.begin(), links_.end(), [](auto& l) { return l.launcher_exited; }))
    return true;
  if (now < stop_deadline_) return false;
  auto signal_running = [this](int sig) {
    for (size_t i = 0; i < slots_.size(); ++i) try {
        if (!slots_[i].exited) signal_slot(i, sig, true);
      } catch (const std::exception&) {
        // One worker we could not signal does not stop the others from being stopped.
      }
    // A launcher normally leaves with its agent; one still there after the grace is stopped.
    for (auto& l : links_) try {
        if (!l.launcher_exited) supervisor_.signal(l.child, sig);
      } catch (const std::exception&) {
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

void Coordinator::schedule_tick() {
  loop_.after(options_.heartbeat_interval, [this] {
    tick();
    schedule_tick();
  });
}

void Coordinator::loop() {
  try {
    schedule_tick();
    while (true) {
      std::optional<Clock::time_point> wake_at;
      auto earlier = [&](Clock::time_point t) { wake_at = wake_at ? std::min(*wake_at, t) : t; };
      for (auto& s : slots_)
        if (s.output.has_pending()) earlier(s.last_output + options_.partial_line_delay);
      if (stop_ != Stop::kRunning) earlier(stop_deadline_);
      loop_.run_once(wake_at);

      auto now = Clock::now();
      check_responsive(now);
      for (size_t i = 0; i < slots_.size(); ++i) {
        Slot& s = slots_[i];
        if (!s.output.has_pending() || now - s.last_output < options_.partial_line_delay) continue;
        flush_partial(i, false);
        // Kept back (half a UTF-8 character): one more delay for the rest, then it goes anyway.
        if (s.output.has_pending()) s.last_output = now;
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
    if (slots_[i].link >= 0) continue;  // its agent stops it when the link closes, just below
    try {
      if (!slots_[i].exited) on_exit(i);  // it may have just gone
    } catch (...) {
    }
    if (!slots_[i].exited) unreaped.push_back(pids_[i]);
  }
  for (auto& l : links_) l.conn.reset();
  handshakes_.clear();
  loop_.close();
  loop_.discard();
  {
    std::lock_guard lock(mu_);
    thread_done_ = true;
    unreaped_ = std::move(unreaped);
  }
  cv_.notify_all();
}

void Coordinator::tick() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    // A host's link hears heartbeats from the start: its agent takes a silent link for a dead
    // kernel, and its workers may take long to say hello (importing torch, say).
    bool linked = s.link >= 0 && !s.exited && links_[s.link].conn;
    if (s.conn || linked) send_now(i, Frame::make(kHeartbeat, static_cast<int32_t>(i), 0));
    if (s.exit_pending) on_exit(i);
  }
  expire_handshakes(Clock::now());
  if (options_.pool_idle.count() > 0) pool_.trim(options_.pool_idle);
}

void Coordinator::check_responsive(Clock::time_point now) {
  if (options_.heartbeat_timeout.count() <= 0) return;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    bool live = s.conn || (s.said_hello && !s.exited);
    if (!live || s.unresponsive) continue;
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
  loop_.modify(listener_->fd(), 0);
  loop_.after(detail::milliseconds(100), [this] { loop_.modify(listener_->fd(), EPOLLIN); });
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
    s.conn = std::make_unique<Connection>(
        loop_, std::move(*ch), [this, slot](Frame f) { deliver(slot, std::move(f)); },
        [this, slot](Connection::End how, const std::string&) { on_connection_end(slot, how); });
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
  if (s.link >= 0) return send_remote(slot, std::move(f), {});
  if (!s.conn) {
    if (!s.exited) s.waiting.push_back(std::move(f));
    return;
  }
  s.conn->send(std::move(f));  // a failure drops the connection; its exit comes by its pidfd
}

void Coordinator::on_connection_end(size_t slot, Connection::End how) {
  if (how == Connection::End::kCorrupt) {
    // A corrupt frame: this worker can't be trusted any more, but the others are fine.
    try {
      supervisor_.signal(child_of_[slot], SIGKILL);
    } catch (const std::exception&) {
      // Then it is gone already; dropping the connection is all that is left.
    }
  }
  drop_connection(slot);
}

// A frame from worker `slot` (over its Unix socket, or its host's link), in arrival order.
void Coordinator::deliver(size_t slot, Frame f) {
  Slot& s = slots_[slot];
  if (f.truncated) {
    if (f.kind == kDone) {  // still the end of the request: its output goes first
      drain_output(slot, false);
      flush_partial(slot, true);
      release_held(slot, true);
    }
    Event e;
    e.kind = Event::kTruncated;
    e.slot = static_cast<int>(slot);
    e.frame = std::move(f);
    emit(std::move(e));
    return;
  }
  if (f.kind == kHeartbeatAck) {
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
    return;
  }
  if (f.kind == kDisplay) {
    on_display(slot, std::move(f));
    return;
  }
  if (f.kind == kRelease) {
    release_segments(slot, f.data());
    return;
  }
  if (f.kind == kDone) {
    // Everything the cell printed was written to the pipes before "done" was sent.
    drain_output(slot, false);
    flush_partial(slot, true);
    release_held(slot, true);
  }
  Event e;
  e.kind = Event::kFrame;
  e.slot = static_cast<int>(slot);
  e.frame = std::move(f);
  emit(std::move(e));
}

void Coordinator::drop_connection(size_t slot) {
  Slot& s = slots_[slot];
  if (!s.conn) return;
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
      loop_.unwatch(fd.get());
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
  if (s.conn) s.conn->read_now();
  drain_output(slot, true);
  flush_partial(slot, true);
  release_held(slot, true);
  auto status = supervisor_.poll(child_of_[slot]);
  if (!status) {
    if (!s.exit_pending) {
      // Its pidfd says it exited, yet it can't be reaped: a tracer holds the zombie. Level-
      // triggered, that fd would wake us forever; the tick looks again instead.
      s.exit_pending = true;
      loop_.unwatch(supervisor_.child(child_of_[slot]).pidfd());
    }
    return;
  }
  s.exited = true;
  if (!s.exit_pending) loop_.unwatch(supervisor_.child(child_of_[slot]).pidfd());
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

// ---- Workers on other hosts ----------------------------------------------------------------
//
// Each remote host has a launcher here and, once its agent has authenticated, a sealed TCP link
// that carries the frames of all its workers (their slot in the frame's rank field), their output
// (kOutput) and their exits (kExit). A link that fails, or a launcher that exits before its host
// connected, is the death of that host's workers (kLost). Nothing from a connection reaches a
// handler before it has authenticated.

std::string Coordinator::link_address() const {
  if (!tcp_) return {};
  const std::string& a = tcp_->address();
  std::string host = a.find(':') != std::string::npos ? "[" + a + "]" : a;
  return host + ":" + std::to_string(tcp_->port());
}

size_t Coordinator::rejected_connections() const {
  std::lock_guard lock(mu_);
  return rejected_;
}

std::string Coordinator::last_rejection() const {
  std::lock_guard lock(mu_);
  return last_rejection_;
}

void Coordinator::start_links() {
  if (!tcp_) return;
  loop_.watch(tcp_->fd(), EPOLLIN, [this](uint32_t) { on_tcp_accept(); });
  links_.resize(options_.hosts.size());
  for (size_t h = 0; h < options_.hosts.size(); ++h) {
    Link& l = links_[h];
    l.host = options_.hosts[h];
    LinkTicket ticket{tcp_->address(), tcp_->port(), static_cast<uint32_t>(h), key_};
    // The agent gives up on a silent kernel as soon as the kernel gives up on a silent host; a
    // kernel that never does (0) still gets the agent's 10 s.
    if (options_.heartbeat_timeout.count() > 0)
      ticket.timeout_ms = static_cast<uint32_t>(std::max<long long>(
          options_.heartbeat_timeout.count(), 3 * options_.heartbeat_interval.count()));
    // The key goes on the launcher's stdin: ssh and srun forward it to the agent, and no
    // command line or environment shows it.
    l.host.launcher.stdin_data = ticket.encode();
    l.host.launcher.null_stdin = false;
    l.child = supervisor_.spawn(l.host.launcher);
    Child& c = supervisor_.child(l.child);
    l.out = std::move(c.stdout_pipe());
    l.err = std::move(c.stderr_pipe());
    loop_.watch(c.pidfd(), EPOLLIN, [this, h](uint32_t) { on_launcher_exit(h); });
    if (l.out)
      loop_.watch(l.out.get(), EPOLLIN, [this, h](uint32_t) { on_launcher(h, RankOutput::kStdout); });
    if (l.err)
      loop_.watch(l.err.get(), EPOLLIN, [this, h](uint32_t) { on_launcher(h, RankOutput::kStderr); });
  }
}

void Coordinator::on_tcp_accept() {
  while (true) {
    std::string peer;
    Fd fd = tcp_->accept(&peer);
    if (!fd) return;  // out of fds: the connection waits in the backlog, the heartbeat retries
    uint64_t id = next_handshake_++ & 0xffffffffu;
    // Connections still authenticating are few (one per host): many means someone is probing.
    if (handshakes_.size() >= 64) {
      Handshake dropped{std::move(fd), peer, KernelHandshake(key_), {}, Clock::now()};
      handshakes_.emplace(id, std::move(dropped));
      reject(id, "too many connections authenticating at once");
      continue;
    }
    Handshake h{
        std::move(fd), peer, KernelHandshake(key_), {}, Clock::now() + options_.handshake_timeout};
    ssize_t n = ::send(h.fd.get(), h.hs.challenge().data(), h.hs.challenge().size(),
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    int fdnum = h.fd.get();
    handshakes_.emplace(id, std::move(h));
    if (n != static_cast<ssize_t>(KernelHandshake::kChallengeBytes)) {
      reject(id, "could not send the challenge");
      continue;
    }
    loop_.watch(fdnum, EPOLLIN, [this, id](uint32_t) { on_handshake(id); });
  }
}

void Coordinator::reject(uint64_t id, const std::string& why) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  std::string text = "refused a connection from " + it->second.peer + ": " + why;
  {
    std::lock_guard lock(mu_);
    ++rejected_;
    last_rejection_ = text;
  }
  loop_.unwatch(it->second.fd.get());
  handshakes_.erase(it);  // closes it: nothing it sent was ever parsed beyond the handshake
  // The kernel's log (the terminal that runs Jupyter): someone may be probing the port.
  std::fprintf(stderr, "ddip: %s\n", text.c_str());
}

void Coordinator::expire_handshakes(Clock::time_point now) {
  std::vector<uint64_t> late;
  for (auto& [id, h] : handshakes_)
    if (now >= h.deadline) late.push_back(id);
  for (uint64_t id : late)
    reject(id, "no valid handshake within " + std::to_string(options_.handshake_timeout.count()) +
                   " ms");
}

void Coordinator::on_handshake(uint64_t id) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  Handshake& h = it->second;
  char buf[KernelHandshake::kResponseBytes];
  size_t want = KernelHandshake::kResponseBytes - h.response.size();
  ssize_t n = ::recv(h.fd.get(), buf, want, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) return reject(id, "closed during the handshake");
  h.response.append(buf, static_cast<size_t>(n));
  if (h.response.size() < KernelHandshake::kResponseBytes) return;
  KernelHandshake::Accepted accepted;
  try {
    accepted = h.hs.accept(h.response);
  } catch (const AuthError& e) {
    return reject(id, e.what());
  }
  if (accepted.host >= links_.size() || links_[accepted.host].conn)
    return reject(id, "authenticated, but for host " + std::to_string(accepted.host) +
                          ", which is not expected (or already connected)");
  Link& l = links_[accepted.host];
  if (::send(h.fd.get(), accepted.proof.data(), accepted.proof.size(),
             MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(accepted.proof.size()))
    return reject(id, "could not send the proof");
  loop_.unwatch(h.fd.get());
  Channel ch(std::move(h.fd));
  handshakes_.erase(it);
  ch.seal(std::move(accepted.keys));
  size_t link = accepted.host;
  l.conn = std::make_unique<Connection>(
      loop_, std::move(ch), [this, link](Frame f) { on_link_frame(link, std::move(f)); },
      [this, link](Connection::End how, const std::string& why) {
        if (how == Connection::End::kCorrupt)
          std::fprintf(stderr, "ddip: dropped the link to host %s: %s\n",
                       links_[link].host.name.c_str(), why.c_str());
        lose_link(link, why);
      });
  l.ever_connected = true;
  std::vector<std::pair<int, SpawnSpec>> specs;
  for (int slot : l.host.slots)
    if (!slots_[slot].exited) specs.emplace_back(slot, options_.workers[slot]);
  send_link(link, Frame::make(kSpawn, l.host.slots.front(), 0, encode_spawn(specs)));
  for (int slot : l.host.slots) {
    auto waiting = std::move(slots_[slot].link_waiting);
    slots_[slot].link_waiting.clear();
    for (auto& [f, segments] : waiting) send_remote(slot, std::move(f), std::move(segments));
  }
}

// Queued on the link when it is up (the sealed channel copies the segments' bytes at once, so
// they are released here), else kept until it is.
void Coordinator::send_remote(size_t slot, Frame f, std::vector<uint64_t> segments) {
  Slot& s = slots_[slot];
  if (!s.exited && !links_[s.link].conn) {
    s.link_waiting.emplace_back(std::move(f), std::move(segments));
    return;
  }
  if (!s.exited) send_link(s.link, std::move(f));
  for (uint64_t id : segments) pool_.release(id);
}

void Coordinator::send_link(size_t link, Frame f) {
  Link& l = links_[link];
  if (!l.conn) return;
  l.conn->send(std::move(f));  // a failure loses the link
}

void Coordinator::signal_slot(size_t slot, int sig, bool whole_group) {
  Slot& s = slots_[slot];
  if (s.link < 0) return supervisor_.signal(child_of_[slot], sig, whole_group);
  if (s.exited) return;
  if (!links_[s.link].conn && sig == SIGKILL) {
    // Never connected and being killed: its launcher goes, and with it any hope of the host.
    return lose_slot(slot, "stopped before its host " + links_[s.link].host.name + " connected");
  }
  send_remote(slot,
              Frame::make(kSignal, static_cast<int32_t>(slot), 0, encode_signal(sig, whole_group)),
              {});
}

void Coordinator::on_link_frame(size_t link, Frame f) {
  Link& l = links_[link];
  int slot = f.rank;
  if (std::find(l.host.slots.begin(), l.host.slots.end(), slot) == l.host.slots.end())
    return lose_link(link, "it sent a frame for rank slot " + std::to_string(slot) +
                               ", which is not on that host");
  Slot& s = slots_[slot];
  if (s.exited) return;
  if (f.kind == kOutput) {
    emit_output(slot, f.seq == RankOutput::kStderr ? RankOutput::kStderr : RankOutput::kStdout,
                std::string(f.data()));
    return;
  }
  if (f.kind == kExit) {
    std::pair<ExitStatus, std::string> exit;
    try {
      exit = decode_exit(f.data());
    } catch (const std::exception& e) {
      return lose_link(link, e.what());
    }
    s.exited = true;
    s.link_waiting.clear();
    {
      std::lock_guard lock(mu_);
      connected_[slot] = false;
    }
    Event e;
    e.kind = Event::kExited;
    e.slot = slot;
    e.status = exit.first;
    e.text = std::move(exit.second);
    emit(std::move(e));
    return;
  }
  if (f.kind == kHello && !s.said_hello) {
    s.said_hello = true;
    std::lock_guard lock(mu_);
    connected_[slot] = true;
    last_ack_[slot] = Clock::now();
  }
  deliver(slot, std::move(f));
}

void Coordinator::lose_slot(size_t slot, const std::string& why) {
  Slot& s = slots_[slot];
  if (s.exited) return;
  s.exited = true;
  for (auto& [f, segments] : s.link_waiting)
    for (uint64_t id : segments) pool_.release(id);
  s.link_waiting.clear();
  {
    std::lock_guard lock(mu_);
    connected_[slot] = false;
  }
  Event e;
  e.kind = Event::kLost;
  e.slot = static_cast<int>(slot);
  e.text = why;
  emit(std::move(e));
}

void Coordinator::lose_link(size_t link, const std::string& why) {
  Link& l = links_[link];
  l.conn.reset();  // closed: the agent stops its workers when it sees that
  for (int slot : l.host.slots)
    lose_slot(slot, "lost the link to its host " + l.host.name + ": " + why);
}

void Coordinator::on_launcher(size_t link, int stream) {
  Link& l = links_[link];
  Fd& fd = stream == RankOutput::kStdout ? l.out : l.err;
  if (!fd) return;
  char buf[8192];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      loop_.unwatch(fd.get());
      fd.reset();
      return;
    }
    // Kept for the tail only (ssh's and the agent's own complaints), both streams as one.
    l.output.feed(RankOutput::kStderr, std::string_view(buf, static_cast<size_t>(n)));
  }
}

void Coordinator::on_launcher_exit(size_t link) {
  Link& l = links_[link];
  if (l.launcher_exited) return;
  on_launcher(link, RankOutput::kStdout);
  on_launcher(link, RankOutput::kStderr);
  auto status = supervisor_.poll(l.child);
  if (!status) return;  // woken early; the pidfd stays watched
  l.launcher_exited = true;
  loop_.unwatch(supervisor_.child(l.child).pidfd());
  if (l.conn || l.ever_connected) return;  // the link speaks for its workers now
  std::string tail = l.output.flush(RankOutput::kStderr, true);
  std::string lines = l.output.stderr_tail();
  if (!tail.empty()) lines += (lines.empty() ? "" : "\n") + tail;
  std::string why = "its launcher (" + l.host.launcher.argv.front() + ") ended with " +
                    status->describe() + " before host " + l.host.name + " connected";
  if (!lines.empty()) why += "; its last lines:\n" + lines;
  for (int slot : l.host.slots) lose_slot(slot, why);
}

}  // namespace ddip
