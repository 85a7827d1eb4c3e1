#include "ddip/coordinator.hpp"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <future>
#include <optional>
#include <stdexcept>
#include <unordered_set>
#include <utility>

namespace ddip {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// Whether this is the process's main thread: the one caller_drives lets run the loop. Asked
// once per thread (two syscalls each time otherwise); a thread that fork() copied keeps the
// answer its parent had, so at worst a child's main thread waits on the queue.
bool main_thread() {
  static thread_local const bool is_main = ::gettid() == ::getpid();
  return is_main;
}

milliseconds left(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

}  // namespace

struct Coordinator::Slot {
  bool remote = false;  // on another host: HostLinks speaks for it
  std::unique_ptr<Connection> conn;
  std::vector<Frame> waiting;  // frames sent before the worker connected
  bool said_hello = false;     // a remote worker's, through its link
  bool exited = false;
  // Exited but not reapable yet (a zombie held by a tracer): its pidfd stays readable, so it is
  // unwatched and looked at again on each tick.
  bool exit_pending = false;
  bool unresponsive = false;
  // When the oldest heartbeat it has not answered was sent. Unresponsive means a heartbeat left
  // unanswered for the timeout, not the time since the last answer: a kernel that was itself
  // descheduled (a loaded machine) or a timeout no longer than the interval would otherwise
  // take a healthy worker for a silent one.
  std::optional<Clock::time_point> unanswered_since;
  // Shared-memory segments this worker was sent and has not released.
  std::unordered_multiset<uint64_t> segments;
};

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)),
      events_(options_.workers.size(), options_.max_unread_output, options_.on_event),
      pool_(options_.pool ? *options_.pool : own_pool_),
      supervisor_(options_.kill_wait) {
  if (options_.workers.empty()) throw std::invalid_argument("a group needs at least one worker");
  dir_ = std::make_unique<RuntimeDir>();
  socket_path_ = dir_->socket_path();
  size_t n = options_.workers.size();
  slots_.resize(n);
  last_ack_.resize(n);
  connected_.assign(n, false);
  streams_ = std::make_unique<RankStreams>(loop_, n, options_.partial_line_delay,
                                           [this](Event e) { events_.push(std::move(e)); });
  if (!options_.hosts.empty()) {
    LinkOptions lo;
    lo.hosts = options_.hosts;
    lo.bind_address = options_.bind_address;
    lo.bind_port = options_.bind_port;
    lo.handshake_timeout = options_.handshake_timeout;
    lo.keeper = options_.agent_keeper;
    lo.warm = options_.remote_warm;
    lo.reply_window = options_.reply_window;
    // The agent gives up on a silent kernel as soon as the kernel gives up on a silent host; a
    // kernel that never does (0) still gets the agent's 10 s.
    if (options_.heartbeat_timeout.count() > 0)
      lo.kernel_silence = milliseconds(std::max<long long>(
          options_.heartbeat_timeout.count(), 3 * options_.heartbeat_interval.count()));
    links_ = std::make_unique<HostLinks>(loop_, supervisor_, pool_, std::move(lo), options_.workers,
                                         link_callbacks());
    for (auto& h : options_.hosts)
      for (int slot : h.slots) slots_[static_cast<size_t>(slot)].remote = true;
  }
  for (size_t i = 0; i < n; ++i)
    if (!slots_[i].remote) own_environment(options_.workers[i]);  // a remote host's agent: its own
  listener_ = std::make_unique<Listener>(socket_path_);
  if (options_.caller_drives) {
    takeover_ = Fd(check(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK),
                         "timerfd_create", "creating the group's takeover timer"));
    io_wake_ = Fd(check(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), "eventfd",
                        "creating the group's wake-up fd"));
  }

  std::promise<void> started;
  auto ready = started.get_future();
  thread_ = std::thread([this, &started] {
    try {
      start_workers();
      schedule_tick();  // before a caller may run the loop
    } catch (...) {
      started.set_exception(std::current_exception());
      supervisor_.stop_all(milliseconds(0));
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
  caller_may_drive_ = options_.caller_drives;
}

Coordinator::~Coordinator() {
  try {
    close(milliseconds(1000));
  } catch (const std::exception&) {
    // Nothing a destructor could do; the IO thread stops the workers on its own.
  }
}

void Coordinator::start_workers() {
  loop_.watch(listener_->fd(), EPOLLIN, [this](uint32_t) { on_accept(); });
  child_of_.assign(options_.workers.size(), -1);
  pids_.assign(options_.workers.size(), -1);  // -1: its pid is on another host (its hello says)
  for (size_t i = 0; i < options_.workers.size(); ++i)
    if (!slots_[i].remote) start_slot(i, options_.rank_template);
  if (links_) links_->start();
}

// getenv() finds the first of duplicates: ours must be the only ones (a group started inside a
// rank inherits that rank's).
void Coordinator::own_environment(SpawnSpec& w) const {
  std::erase_if(w.env, [](const std::string& kv) {
    return kv.starts_with("DDIP_SOCKET=") || kv.starts_with("DDIP_KERNEL_PID=");
  });
  w.env.push_back("DDIP_SOCKET=" + socket_path_);
  w.env.push_back("DDIP_KERNEL_PID=" + std::to_string(::getpid()));
}

// On the IO thread: the worker of a local slot, forked from the template when it can, else
// spawned; watched for its exit, its output read.
void Coordinator::start_slot(size_t slot, RankTemplate* rank_template) {
  std::optional<ForkedRank> forked;
  if (rank_template) forked = rank_template->fork(options_.workers[slot]);
  size_t idx = forked ? supervisor_.adopt(forked->pid, std::move(forked->pidfd),
                                          std::move(forked->out), std::move(forked->err))
                      : supervisor_.spawn(options_.workers[slot]);
  Child& c = supervisor_.child(idx);
  child_of_[slot] = static_cast<int>(idx);
  {
    std::lock_guard lock(mu_);
    pids_[slot] = c.pid();
  }
  loop_.watch(c.pidfd(), EPOLLIN, [this, slot](uint32_t) { on_exit(slot); });
  streams_->attach(slot, std::move(c.stdout_pipe()), std::move(c.stderr_pipe()));
}

pid_t Coordinator::respawn(int slot, std::optional<SpawnSpec> spec, RankTemplate* rank_template) {
  if (slot < 0 || static_cast<size_t>(slot) >= slots_.size())
    throw std::out_of_range("no worker slot " + std::to_string(slot));
  // A remote slot's spec holds only what the kernel adds; its host's agent adds its own.
  if (spec && !slots_[slot].remote) own_environment(*spec);
  auto started = std::make_shared<std::promise<pid_t>>();
  auto pid = started->get_future();
  try {
    loop_.post([this, slot, spec = std::move(spec), rank_template, started]() mutable {
      try {
        started->set_value(start_again(static_cast<size_t>(slot), std::move(spec), rank_template));
      } catch (...) {
        started->set_exception(std::current_exception());
      }
    });
    want_io();  // spawned from the IO thread: PR_SET_PDEATHSIG ties the worker to it
  } catch (const std::runtime_error&) {
    throw std::logic_error("the group's runtime has stopped: worker slot " + std::to_string(slot) +
                           " can't be started again");
  }
  try {
    return pid.get();
  } catch (const std::future_error&) {  // the loop closed before it ran the command
    throw std::logic_error("the group's runtime stopped before worker slot " +
                           std::to_string(slot) + " could be started again");
  }
}

// On the IO thread: respawn()'s work. Nothing changes unless the new worker started.
pid_t Coordinator::start_again(size_t slot, std::optional<SpawnSpec> spec,
                               RankTemplate* rank_template) {
  Slot& s = slots_[slot];
  std::string which = "worker slot " + std::to_string(slot);
  if (stop_ != Stop::kRunning)
    throw std::logic_error("the group is closing: " + which + " can't be started again");
  if (s.remote) return start_again_there(slot, std::move(spec));
  if (!s.exited)
    throw std::logic_error(
        which + " (pid " + std::to_string(pids_[slot]) + ") " +
        (s.exit_pending ? "exited but has not been reaped yet" : "is still running") +
        ": only a worker that exited can be started again");
  std::optional<SpawnSpec> before;
  if (spec) before = std::exchange(options_.workers[slot], std::move(*spec));
  try {
    start_slot(slot, rank_template);
  } catch (...) {
    if (before) options_.workers[slot] = std::move(*before);
    throw;
  }
  drop_connection(slot);  // the exited worker's, if its end has not been read yet
  s = Slot{};  // no hello, no heartbeat owed, nothing waiting, no segments: a new worker's slot
  {
    std::lock_guard lock(mu_);
    last_ack_[slot] = Clock::now();
  }
  std::lock_guard lock(mu_);
  return pids_[slot];
}

// On the IO thread: a remote slot's worker started again by its host's agent, forked from that
// host's own template as at the start. Its pid is that host's: -1 here, as pids() says.
pid_t Coordinator::start_again_there(size_t slot, std::optional<SpawnSpec> spec) {
  Slot& s = slots_[slot];
  if (!s.exited)
    throw std::logic_error("worker slot " + std::to_string(slot) + " on host " +
                           links_->host_of(static_cast<int>(slot)) +
                           " is still running: only a worker that exited can be started again");
  links_->respawn(static_cast<int>(slot), spec);  // throws, changing nothing
  if (spec) options_.workers[slot] = std::move(*spec);
  s = Slot{};
  s.remote = true;
  std::lock_guard lock(mu_);
  connected_[slot] = false;
  last_ack_[slot] = Clock::now();
  return -1;
}

// ---- What callers on other threads ask ------------------------------------------------------

std::string Coordinator::link_address() const { return links_ ? links_->address() : ""; }

size_t Coordinator::rejected_connections() const { return links_ ? links_->rejected() : 0; }

std::string Coordinator::last_rejection() const { return links_ ? links_->last_rejection() : ""; }

uint64_t Coordinator::host_reply_frames() const { return links_ ? links_->reply_frames() : 0; }

std::vector<std::pair<std::string, std::string>> Coordinator::host_notes() const {
  std::lock_guard lock(mu_);
  return host_notes_;
}

void Coordinator::send(int slot, Frame frame, const std::vector<uint64_t>& segments) {
  send(std::vector<int>{slot}, std::move(frame), segments);
}

void Coordinator::send(const std::vector<int>& slots, Frame frame,
                       const std::vector<uint64_t>& segments) {
  for (int slot : slots)
    if (slot < 0 || static_cast<size_t>(slot) >= slots_.size())
      throw std::out_of_range("no worker slot " + std::to_string(slot));
  if (segments.size() > kMaxFdsPerFrame)
    throw std::invalid_argument("too many shared-memory segments in one frame");
  // Workers on other hosts get one frame per host (HostLinks): it holds one reference to each
  // segment, and ships each once per host.
  std::vector<int> here, there;
  for (int slot : slots) (links_ && links_->remote(slot) ? there : here).push_back(slot);
  if (!there.empty())
    for (uint64_t id : segments) pool_.retain(id);
  // Each local worker's frame holds its own fds and its own reference to every segment.
  std::vector<Frame> frames;
  for (int slot : here) {
    Frame f = frame;
    f.rank = slot;
    if (!segments.empty()) {
      f.fds = std::make_shared<std::vector<Fd>>();
      f.fd_bytes.clear();
      for (uint64_t id : segments) {
        f.fds->push_back(pool_.dup_fd(id));
        pool_.retain(id);
      }
    }
    frames.push_back(std::move(f));
  }
  // One command for all: one wake-up of the IO thread per request, not one per rank.
  command([this, here = std::move(here), there = std::move(there), frames = std::move(frames),
           frame = std::move(frame), segments]() mutable {
    if (!there.empty()) links_->send(there, frame, segments);
    for (size_t k = 0; k < here.size(); ++k) {
      Slot& s = slots_[here[k]];
      if (s.exited) {
        for (uint64_t id : segments) pool_.release(id);
        continue;
      }
      s.segments.insert(segments.begin(), segments.end());
      send_now(here[k], std::move(frames[k]));
    }
  });
}

void Coordinator::catch_up_output(const std::vector<int>& slots) {
  // The usual case: read on this thread now, with nothing to wait for (no promise, no futex).
  EventLoop::Task here = [this, &slots] { read_pipes_now(slots); };
  if (run_here(here)) return;
  auto done = std::make_shared<std::promise<void>>();
  auto ran = done->get_future();
  try {
    command([this, slots, done] {
      read_pipes_now(slots);
      done->set_value();
    });
  } catch (const std::runtime_error&) {
    return;  // the loop is closing: nothing more will be read
  }
  ran.wait_for(std::chrono::milliseconds(250));
}

// On the loop's thread: what this host's live workers' pipes hold now, read into the queue.
void Coordinator::read_pipes_now(const std::vector<int>& slots) {
  std::vector<size_t> here;
  for (int slot : slots)
    if (slot >= 0 && static_cast<size_t>(slot) < slots_.size() && !slots_[slot].exited &&
        !(links_ && links_->remote(slot)))
      here.push_back(static_cast<size_t>(slot));
  streams_->read_now(here);
}

void Coordinator::signal(int slot, int sig, bool whole_group) {
  if (slot >= static_cast<int>(slots_.size()))
    throw std::out_of_range("no worker slot " + std::to_string(slot));
  if (sig <= 0 || sig >= NSIG) throw std::invalid_argument("no signal " + std::to_string(sig));
  command([this, slot, sig, whole_group] {
    if (slot >= 0) return signal_slot(slot, sig, whole_group);
    for (size_t i = 0; i < slots_.size(); ++i) try {
        signal_slot(i, sig, whole_group);
      } catch (const std::exception&) {
        // One worker we could not signal does not keep the others from it.
      }
  });
}

std::optional<Event> Coordinator::next_event(milliseconds timeout) {
  if (timeout.count() <= 0 || !events_.empty()) return events_.pop(timeout);
  auto deadline = Clock::now() + timeout;
  if (!drive(deadline, 0)) want_io();  // this wait is on the queue: the loop must run meanwhile
  return events_.pop(left(deadline));
}

size_t Coordinator::wait_events(std::vector<Event>& out, milliseconds timeout, size_t replies) {
  size_t before = out.size();
  auto deadline = Clock::now() + timeout;
  if (timeout.count() > 0 && !drive(deadline, replies)) {
    want_io();  // this wait is on the queue: the loop must run meanwhile
    events_.wait_ready(replies, options_.reply_wait, deadline);
  }
  events_.pop_all(out);
  return out.size() - before;
}

long long Coordinator::heartbeat_age_ms(int slot) const {
  std::lock_guard lock(mu_);
  if (!connected_.at(slot)) return -1;
  return std::chrono::duration_cast<milliseconds>(Clock::now() - last_ack_.at(slot)).count();
}

size_t Coordinator::dropped_output(int slot) const { return events_.dropped_output(slot); }

bool Coordinator::connected(int slot) const {
  std::lock_guard lock(mu_);
  return connected_.at(slot);
}

bool Coordinator::running() const { return !events_.closed(); }

std::vector<pid_t> Coordinator::pids() const {
  std::lock_guard lock(mu_);
  return pids_;
}

void Coordinator::begin_close(milliseconds grace) {
  try {
    loop_.post([this, grace] { begin_stop(grace); });
    want_io();  // the stop's steps and the end are the IO thread's
  } catch (const std::runtime_error&) {
    // The IO thread already stopped (and stopped the workers).
  }
}

std::optional<std::vector<pid_t>> Coordinator::wait_closed(milliseconds timeout) {
  if (!events_.wait_closed(timeout)) return std::nullopt;
  std::lock_guard lock(mu_);
  return unreaped_;
}

std::vector<pid_t> Coordinator::close(milliseconds grace) {
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

// ---- The IO thread --------------------------------------------------------------------------

void Coordinator::schedule_tick() {
  loop_.after(options_.heartbeat_interval, [this] {
    tick();
    schedule_tick();
  });
}

void Coordinator::loop() {
  // Held whenever this thread runs the loop, and through the end: no caller runs it then.
  std::unique_lock turn(drive_, std::defer_lock);
  try {
    while (true) {
      turn.lock();
      if (caller_failure_) std::rethrow_exception(caller_failure_);
      {
        std::lock_guard t(turn_mu_);
        if (io_turn(Clock::now()))
          io_wanted_ = false, io_driving_ = true;
        else
          turn.unlock();
      }
      if (turn) {
        bool stopped = false;
        while (!stopped && !(caller_waits_ && stop_ == Stop::kRunning)) {
          step(std::nullopt);
          stopped = stop_ != Stop::kRunning && advance_stop(Clock::now());
        }
        if (stopped) break;
        {
          std::lock_guard t(turn_mu_);
          io_driving_ = false;
        }
        turn.unlock();  // to the caller that waits for it
      }
      park();
    }
  } catch (const std::exception& e) {
    hold(turn);
    fail(e.what());
  } catch (...) {
    hold(turn);
    fail("unknown error");
  }
  finish();
}

// On the IO thread's error path: the loop is its own again before it ends (a caller that runs
// it gives it up within its slice). May not throw: see fail().
void Coordinator::hold(std::unique_lock<std::timed_mutex>& turn) noexcept {
  caller_may_drive_ = false;
  try {
    if (!turn.owns_lock()) turn.lock();
  } catch (const std::system_error&) {
    // Only a broken mutex throws; ending without it is all that is left.
  }
}

// One round of the loop, on whichever thread runs it: what is ready, due or posted, waiting up
// to `until` at most.
void Coordinator::step(std::optional<Clock::time_point> until) {
  std::optional<Clock::time_point> wake_at = streams_->next_due();
  if (stop_ != Stop::kRunning)
    wake_at = wake_at ? std::min(*wake_at, stop_deadline_) : stop_deadline_;
  if (until) wake_at = wake_at ? std::min(*wake_at, *until) : *until;
  loop_.run_once(wake_at);
  auto now = Clock::now();
  check_responsive(now);
  streams_->flush_due(now);
}

// ---- Turns: who runs the loop (CoordinatorOptions::caller_drives) ---------------------------

// Without caller_drives the IO thread's turn never ends.
bool Coordinator::io_turn(Clock::time_point now) const {
  return !options_.caller_drives || io_wanted_ ||
         (!caller_driving_ && now - caller_left_ >= kTakeOver);
}

// The IO thread, between turns: sleeps until its turn comes (the takeover timer, or want_io()).
void Coordinator::park() {
  while (true) {
    {
      std::lock_guard t(turn_mu_);
      auto now = Clock::now();
      if (io_turn(now)) return;
      // A caller that drives arms the timer as it leaves.
      if (!caller_driving_ && !takeover_armed_) arm_takeover(kTakeOver - (now - caller_left_));
    }
    pollfd fds[2] = {{takeover_.get(), POLLIN, 0}, {io_wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR)
      throw_errno("poll", "waiting for the loop's turn");
    uint64_t count;
    if (fds[0].revents && ::read(takeover_.get(), &count, sizeof count) > 0) {
      std::lock_guard t(turn_mu_);
      takeover_armed_ = false;
    }
    if (fds[1].revents) {
      ssize_t ignored = ::read(io_wake_.get(), &count, sizeof count);
      (void)ignored;
    }
  }
}

// turn_mu_ held: the IO thread's takeover timer fires `after` from now (at least 1 ns: armed).
void Coordinator::arm_takeover(Clock::duration after) {
  set_timer(takeover_.get(),
            std::max<std::chrono::nanoseconds>(after, std::chrono::nanoseconds(1)));
  takeover_armed_ = true;
}

// turn_mu_ not held: a caller wants the loop, or has it (what io_turn() reads).
void Coordinator::enter() {
  std::lock_guard t(turn_mu_);
  caller_driving_ = true;
}

// A caller (the process's main thread, waiting for events) runs the loop until an event is
// queued or `deadline`; false when it could not (not that thread, closing, the IO thread would
// not yield in time): the caller then waits on the queue.
bool Coordinator::drive(Clock::time_point deadline, size_t replies) {
  if (!caller_may_drive_ || !main_thread()) return false;
  enter();
  std::unique_lock turn(drive_, std::try_to_lock);
  if (!turn) {  // the IO thread runs the loop: it yields between two rounds
    caller_waits_ = true;
    loop_.wake();
    turn.try_lock_until(deadline);
    caller_waits_ = false;
  }
  bool drove = turn.owns_lock() && caller_may_drive_;
  if (drove) try {
      while (true) {
        auto ready = events_.ready_at(replies, options_.reply_wait);
        if ((ready && *ready <= Clock::now()) || Clock::now() >= deadline) break;
        step(ready ? std::min(*ready, deadline) : deadline);
        if (!caller_may_drive_) break;  // begin_stop() ran: the rest is the IO thread's
      }
    } catch (...) {
      caller_failure_ = std::current_exception();
      caller_may_drive_ = false;
    }
  if (turn) turn.unlock();
  leave(!caller_may_drive_);
  return drove;
}

// The caller's turn ends: the IO thread takes over kTakeOver from now unless the caller is back
// by then, or at once when `hand_over`.
void Coordinator::leave(bool hand_over) {
  {
    std::lock_guard t(turn_mu_);
    caller_driving_ = false;
    caller_left_ = Clock::now();
    if (hand_over) io_wanted_ = true;
    if (!hand_over && !takeover_armed_) arm_takeover(kTakeOver);
  }
  if (hand_over) {
    uint64_t one = 1;
    ssize_t ignored = ::write(io_wake_.get(), &one, sizeof one);
    (void)ignored;
  }
}

// Any thread: the IO thread runs the loop now, until a caller waits for it again. Already
// running it, it has nothing to do: what was posted woke it.
void Coordinator::want_io() {
  if (!options_.caller_drives) return;
  {
    std::lock_guard t(turn_mu_);
    if (io_driving_) return;
    io_wanted_ = true;
  }
  uint64_t one = 1;
  ssize_t ignored = ::write(io_wake_.get(), &one, sizeof one);
  (void)ignored;
}

// A command for the loop: run at once on the main thread when no one else runs the loop (a
// request's frames leave before send() returns, and no one is woken for them), else posted to
// whoever runs it.
void Coordinator::command(EventLoop::Task fn) {
  if (run_here(fn)) return;
  loop_.post(std::move(fn));
  want_io();  // the IO thread may be parked
}

// command()'s first choice: on the main thread while no one else runs the loop, `fn` runs now,
// in the loop's place (what other threads posted before goes first). False when it can't.
bool Coordinator::run_here(EventLoop::Task& fn) {
  if (!options_.caller_drives || !caller_may_drive_ || !main_thread()) return false;
  std::unique_lock turn(drive_, std::try_to_lock);
  if (!turn) return false;
  enter();
  bool failed = false;
  try {
    loop_.run_posted();
    fn();
  } catch (const std::exception&) {
    // As a posted command's: it reports through its own means (EventLoop::run_once).
  } catch (...) {
    caller_failure_ = std::current_exception();  // as the loop's own: the IO thread ends it
    caller_may_drive_ = false;
    failed = true;
  }
  turn.unlock();
  leave(failed);
  return true;
}

// The IO thread can't go on: stop the workers and say why. Runs on an error path, so it may
// not throw (that would be std::terminate, and the notebook's kernel with it).
void Coordinator::fail(const std::string& why) noexcept {
  caller_may_drive_ = false;
  supervisor_.stop_all(milliseconds(0));
  try {
    Event ev;
    ev.kind = Event::kFailed;
    ev.slot = -1;
    ev.text = "ddip runtime error: " + why;
    events_.push(std::move(ev));
  } catch (...) {
    // Out of memory for the message: the stopped runtime (running() is false) still tells.
  }
}

void Coordinator::finish() noexcept {
  std::vector<pid_t> unreaped;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].remote) continue;  // its agent stops it when the link closes, just below
    try {
      if (!slots_[i].exited) on_exit(i);  // it may have just gone
    } catch (...) {
    }
    if (!slots_[i].exited) unreaped.push_back(pids_[i]);
  }
  if (links_) links_->close();
  loop_.close();
  loop_.discard();
  {
    std::lock_guard lock(mu_);
    unreaped_ = std::move(unreaped);
  }
  events_.close();  // after unreaped_ is set: wait_closed() reads it
}

void Coordinator::tick() {
  auto now = Clock::now();
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    // A remote worker's heartbeat goes out with its host's, in links_->tick() just below.
    bool beating = s.conn || (s.remote && s.said_hello && !s.exited);
    if (beating && !s.unanswered_since) s.unanswered_since = now;
    if (s.conn) send_now(i, Frame::make(kHeartbeat, static_cast<int32_t>(i), 0));
    if (s.exit_pending) on_exit(i);
  }
  if (links_) links_->tick();
  if (options_.pool_idle.count() > 0) pool_.trim(options_.pool_idle);
}

void Coordinator::check_responsive(Clock::time_point now) {
  if (options_.heartbeat_timeout.count() <= 0) return;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    bool live = s.conn || (s.said_hello && !s.exited);
    if (!live || s.unresponsive || !s.unanswered_since) continue;
    if (now - *s.unanswered_since <= options_.heartbeat_timeout) continue;
    Clock::time_point last;
    {
      std::lock_guard lock(mu_);
      last = last_ack_[i];
    }
    s.unresponsive = true;
    Event e;
    e.kind = Event::kUnresponsive;
    e.slot = static_cast<int>(i);
    e.age_ms = std::chrono::duration_cast<milliseconds>(now - last).count();
    events_.push(std::move(e));
  }
}

// ---- Stopping -------------------------------------------------------------------------------

void Coordinator::begin_stop(milliseconds grace) {
  auto now = Clock::now();
  if (stop_ == Stop::kRunning) {
    caller_may_drive_ = false;  // the stop's steps and the end are the IO thread's
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
      (!links_ || links_->launchers_exited()))
    return true;
  if (now < stop_deadline_) return false;
  auto signal_running = [this](int sig) {
    for (size_t i = 0; i < slots_.size(); ++i) try {
        if (!slots_[i].exited) signal_slot(i, sig, true);
      } catch (const std::exception&) {
        // One worker we could not signal does not stop the others from being stopped.
      }
    if (links_) links_->signal_launchers(sig);
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

// ---- Local workers: connection, frames, exit -------------------------------------------------

// Out of fds (EMFILE / ENFILE): a worker's connection waits in the backlog and the listener is
// tried again in 100 ms, so the IO thread neither spins on a level-triggered fd nor dies.
void Coordinator::pause_listener() {
  loop_.modify(listener_->fd(), 0);
  loop_.after(milliseconds(100), [this] { loop_.modify(listener_->fd(), EPOLLIN); });
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
  if (s.remote) return links_->send(static_cast<int>(slot), std::move(f), {});
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
  events_.push(std::move(e));
}

void Coordinator::heard_from(size_t slot) {
  {
    std::lock_guard lock(mu_);
    last_ack_[slot] = Clock::now();
  }
  Slot& s = slots_[slot];
  s.unanswered_since.reset();
  if (s.unresponsive) {
    s.unresponsive = false;
    Event e;
    e.kind = Event::kResponsive;
    e.slot = static_cast<int>(slot);
    events_.push(std::move(e));
  }
}

// A frame from worker `slot` (over its Unix socket, or its host's link), in arrival order.
void Coordinator::deliver(size_t slot, Frame f) {
  if (f.kind == kHeartbeatAck && !f.truncated) return heard_from(slot);
  if (f.kind == kRelease && !f.truncated) return release_segments(slot, f.data());
  bool display = f.kind == kDisplay && !f.truncated;
  bool done = f.kind == kDone;  // truncated too: still the end of the request
  Event e = Event::of_frame(static_cast<int>(slot), std::move(f));
  if (display) return streams_->display(slot, std::move(e));
  // Everything the cell printed was written to the pipes before "done" was sent.
  if (done) return streams_->after_output(slot, std::move(e));
  events_.push(std::move(e));
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

void Coordinator::on_exit(size_t slot) {
  Slot& s = slots_[slot];
  if (s.exited) return;
  // Report in the order things happened: its last frames and output, then its death.
  if (s.conn) s.conn->read_now();
  streams_->catch_up(slot, true);
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
  loop_.unwatch(supervisor_.child(child_of_[slot]).pidfd());
  gone(slot);
  Event e;
  e.kind = Event::kExited;
  e.slot = static_cast<int>(slot);
  e.status = *status;
  streams_->exited(slot, std::move(e));  // with the last lines of its stderr
}

// The worker is gone for good: nothing more is sent to it, and what it held is released.
void Coordinator::gone(size_t slot) {
  Slot& s = slots_[slot];
  s.exited = true;
  s.waiting.clear();
  for (uint64_t id : s.segments) pool_.release(id);  // a dead worker's mappings are gone
  s.segments.clear();
}

void Coordinator::signal_slot(size_t slot, int sig, bool whole_group) {
  Slot& s = slots_[slot];
  if (s.remote) return links_->signal(static_cast<int>(slot), sig, whole_group);
  supervisor_.signal(child_of_[slot], sig, whole_group);
}

// ---- Workers on other hosts (HostLinks speaks for them) --------------------------------------

HostLinks::Callbacks Coordinator::link_callbacks() {
  HostLinks::Callbacks cb;
  cb.frame = [this](int slot, Frame f) { deliver(static_cast<size_t>(slot), std::move(f)); };
  cb.output = [this](int slot, int stream, std::string text) {
    streams_->output(static_cast<size_t>(slot), stream, std::move(text));
  };
  cb.replies = [this](std::vector<int> slots, Frame f) {
    // Each worker's output came on the link before its reply: what is held of it goes first.
    for (int slot : slots) streams_->catch_up(static_cast<size_t>(slot), false);
    Event e = Event::of_frame(slots.front(), std::move(f));
    if (slots.size() > 1) e.slots = std::move(slots);
    events_.push(std::move(e));
  };
  cb.note = [this](const std::string& host, std::string text) {
    std::lock_guard lock(mu_);
    // Said again (a worker started again, cold for the same reason): kept once. Bounded, as
    // nothing an agent sends may grow the kernel's memory for the group's life.
    for (const auto& [h, t] : host_notes_)
      if (h == host && t == text) return;
    if (host_notes_.size() < kMaxHostNotes) host_notes_.emplace_back(host, std::move(text));
  };
  cb.hello = [this](int slot) {
    slots_[static_cast<size_t>(slot)].said_hello = true;
    std::lock_guard lock(mu_);
    connected_[static_cast<size_t>(slot)] = true;
    last_ack_[static_cast<size_t>(slot)] = Clock::now();
  };
  auto ended = [this](int slot, Event e) {
    gone(static_cast<size_t>(slot));
    {
      std::lock_guard lock(mu_);
      connected_[static_cast<size_t>(slot)] = false;
    }
    events_.push(std::move(e));
  };
  cb.exited = [ended](int slot, ExitStatus status, std::string tail) {
    Event e;
    e.kind = Event::kExited;
    e.slot = slot;
    e.status = status;
    e.text = std::move(tail);
    ended(slot, std::move(e));
  };
  cb.lost = [ended](int slot, const std::string& why) {
    Event e;
    e.kind = Event::kLost;
    e.slot = slot;
    e.text = why;
    ended(slot, std::move(e));
  };
  return cb;
}

}  // namespace ddip
