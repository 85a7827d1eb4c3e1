// `ddip run`'s one thread: the runtime's event loop (ddip/event_loop.hpp) for file descriptors,
// plus deadlines kept by the launcher's units. Each unit (rank output, the control channels,
// the failure policy) registers here what it waits for, with what to do then; nothing else in
// the launcher waits (but bounded writes).
#pragma once

#include <sys/epoll.h>  // EPOLLIN, what the units watch() for

#include <functional>
#include <optional>
#include <vector>

#include "ddip/event_loop.hpp"

namespace ddip::run {

using Clock = ddip::EventLoop::Clock;

// Deadlines are polled rather than timers: each unit's next deadline follows its state (a
// heartbeat heard, every rank exited), so asking after each wake-up needs no re-arming.
class RunLoop : public ddip::EventLoop {
 public:
  using Next = std::function<std::optional<Clock::time_point>()>;
  using Due = std::function<void(Clock::time_point now)>;

  // A deadline kept by someone else: `next()` says when it is next due (nullopt: nothing to
  // wait for now), `due(now)` runs once it has passed. Checked after every wake-up, in the order
  // added.
  void deadline(Next next, Due due);

  // Waits and dispatches until `done()` holds (asked before each wait).
  void run_until(const std::function<bool()>& done);

 private:
  struct Deadline {
    Next next;
    Due due;
  };
  std::vector<Deadline> deadlines_;
};

}  // namespace ddip::run
