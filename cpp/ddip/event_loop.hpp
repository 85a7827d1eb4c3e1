// One event loop for every IO thread of the runtime (the coordinator's, the rank template's
// owner thread, a host agent's): fds watched through epoll with a callback each, one-shot timers,
// and commands posted from other threads (woken through an eventfd). Single-threaded by contract:
// everything but post(), wake(), close() and closed() is called on the thread that runs it (an
// owner may hand the running over between threads, as the Coordinator does, under a lock of its
// own: one thread at a time).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "ddip/fd.hpp"

namespace ddip {

class EventLoop {
 public:
  using Clock = std::chrono::steady_clock;
  using FdHandler = std::function<void(uint32_t events)>;  // epoll's EPOLLIN, EPOLLOUT, ...
  using Task = std::function<void()>;
  using TimerId = uint64_t;

  // `closed_message`: what post() throws once the loop is closed (names the owner).
  explicit EventLoop(std::string closed_message = "the event loop has stopped");
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Calls `handler` with epoll's events whenever `fd` is ready for `events` (level-triggered).
  // The fd stays the caller's; unwatch it before closing it. Throws if epoll refuses it.
  void watch(int fd, uint32_t events, FdHandler handler);
  // As watch(), but false for what epoll can't watch (EPERM: a regular file, /dev/null).
  bool try_watch(int fd, uint32_t events, FdHandler handler);
  void modify(int fd, uint32_t events);
  // Safe from inside any handler (a pending readiness of that fd is then not delivered).
  void unwatch(int fd);
  bool watching(int fd) const { return by_fd_.count(fd) != 0; }

  // Runs `fn` once, on this loop, at `when` (or at the first run_once after it).
  TimerId at(Clock::time_point when, Task fn);
  TimerId after(std::chrono::milliseconds delay, Task fn) { return at(Clock::now() + delay, fn); }
  void cancel(TimerId id);  // no-op for a timer that ran or was cancelled

  // Waits until an fd is ready, a timer is due, a command was posted or `deadline` (none: no
  // limit but the timers), then runs the ready fds' handlers, the due timers and every posted
  // command, in that order. Exceptions from handlers and timers propagate (the owner decides);
  // a command's std::exception is swallowed: commands report through their own means.
  void run_once(std::optional<Clock::time_point> deadline = std::nullopt);

  // Any thread: queues `fn` for the loop's thread and wakes it. Throws std::runtime_error with
  // the closed message once close() was called.
  void post(Task fn);
  // Any thread: a run_once waiting now (or the next one) returns without waiting.
  void wake();
  // The loop's thread: the commands posted so far, now (as run_once would, after the fds).
  void run_posted() { run_commands(); }
  // Any thread: later posts throw; commands already queued still run in the next run_once,
  // unless discard() drops them first.
  void close();
  bool closed() const;
  void discard();

 private:
  struct Watcher {
    int fd;
    FdHandler handler;
  };
  std::string closed_message_;
  Fd epoll_, wake_;
  // Owned by the loop's thread. epoll's data is a watcher id, never reused, so a readiness
  // reported for an fd unwatched (and maybe reused) meanwhile finds nothing.
  std::unordered_map<uint64_t, std::shared_ptr<Watcher>> watchers_;
  std::unordered_map<int, uint64_t> by_fd_;
  uint64_t next_watcher_ = 1;  // 0 is the eventfd
  std::multimap<Clock::time_point, std::pair<TimerId, Task>> timers_;
  std::unordered_map<TimerId, std::multimap<Clock::time_point, std::pair<TimerId, Task>>::iterator>
      timer_at_;
  TimerId next_timer_ = 1;

  mutable std::mutex mu_;  // guards what other threads touch
  std::deque<Task> commands_;
  bool closed_ = false;

  bool add(int fd, uint32_t events, FdHandler handler, bool permissive);
  void run_timers();
  void run_commands();
};

}  // namespace ddip
