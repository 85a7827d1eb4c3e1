// `ddip run`'s one thread: an epoll set over file descriptors, and deadlines. Each unit of the
// launcher (rank output, the control channels, the failure policy) registers here what it waits
// for, with what to do then; nothing else in the launcher waits (but bounded writes).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ddip/fd.hpp"

namespace ddip::run {

using Clock = std::chrono::steady_clock;

class EventLoop {
 public:
  using Handler = std::function<void()>;
  using Next = std::function<std::optional<Clock::time_point>()>;
  using Due = std::function<void(Clock::time_point now)>;

  EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Calls `on_ready` whenever `fd` is readable or closed, until unwatch(id). Throws
  // std::system_error.
  uint64_t watch(int fd, Handler on_ready);
  // As watch(), but nullopt for what epoll can't watch (EPERM: a regular file, /dev/null).
  std::optional<uint64_t> try_watch(int fd, Handler on_ready);
  // Before `fd` is closed. An event of this round not yet handled is dropped.
  void unwatch(uint64_t id);

  // A deadline kept by someone else: `next()` says when it is next due (nullopt: nothing to
  // wait for now), `due(now)` runs once it has passed. Checked after every wake-up, in the order
  // added; ids are never reused, so a handler may unwatch anything, itself included.
  void deadline(Next next, Due due);

  // Waits and dispatches until `done()` holds (asked before each wait).
  void run_until(const std::function<bool()>& done);

 private:
  struct Deadline {
    Next next;
    Due due;
  };
  uint64_t add(int fd, Handler on_ready, bool permissive);

  Fd epoll_;
  std::unordered_map<uint64_t, std::pair<int, Handler>> watches_;
  uint64_t next_id_ = 0;
  std::vector<Deadline> deadlines_;
};

}  // namespace ddip::run
