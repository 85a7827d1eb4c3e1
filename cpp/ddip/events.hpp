// What a group's runtime tells its owner (the notebook's Group, a host agent): Events, and the
// queue they wait in between the IO thread that makes them and the thread that takes them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/supervisor.hpp"

namespace ddip {

struct Event {
  enum Kind : int {
    kOutput = 0,        // `text` written to fd `stream` (1 or 2) by worker `slot`
    kFrame = 1,         // `frame` arrived from worker `slot`
    kExited = 2,        // worker `slot` exited: `status`, `text` = last lines of its stderr
    kDisconnected = 3,  // worker `slot` closed its connection
    kFailed = 4,        // the IO thread hit an error it cannot recover from (`text`)
    kUnresponsive = 5,  // worker `slot` has answered no heartbeat for `age_ms` (said once)
    kResponsive = 6,    // worker `slot`, unresponsive before, answers again
    kTruncated = 7,     // `frame` from worker `slot` came without all its fds: out of fds here
    kLost = 8,          // worker `slot` on another host is gone with its host's link (`text`: why)
  };
  Kind kind = kOutput;
  int slot = 0;
  int stream = 0;
  long long age_ms = 0;
  std::string text;
  Frame frame;
  // A reply (kFrame, kDone) that a host's agent gathered: every worker that sent this payload,
  // `slot` first; empty for one worker's own. Each of them has its output before it, as for one.
  std::vector<int> slots;
  ExitStatus status;

  static Event output(int slot, int stream, std::string text);
  static Event of_frame(int slot, Frame f);  // kFrame, or kTruncated for a frame that lost fds
};

// What EventQueue's on_push is told of the event it just queued.
struct Pushed {
  size_t replies = 0;        // the workers whose reply (or end) it is, as ready_at counts them
  bool plain_reply = false;  // a request's reply (kDone) without buffers: one an agent may gather
  uint64_t seq = 0;          // its frame's sequence number (a frame's)
};

// Thread-safe. Output of one worker waiting unread beyond `max_unread_output` bytes is dropped,
// and the drop reported in its stderr: a rank printing while nobody reads must not grow the
// kernel's memory without bound. Once dropping, all its output is dropped until the reader has
// taken some of it: a later small piece that happens to fit would make holes in the text.
class EventQueue {
 public:
  // Queued output of one worker and stream is joined up to this many bytes per event.
  static constexpr size_t kJoinedOutput = size_t(64) << 10;
  // `on_push`: called after each event is queued, on the pushing thread (must not block).
  EventQueue(size_t slots, size_t max_unread_output,
             std::function<void(const Pushed&)> on_push = {});
  void push(Event e);
  // The next event, waiting up to `timeout` (0: only looks); nullopt on timeout, or at once once
  // closed and drained.
  std::optional<Event> pop(std::chrono::milliseconds timeout);
  // Every event queued now, without waiting (appended to `out`); how many.
  size_t pop_all(std::vector<Event>& out);
  bool empty() const;
  // When a reader that waits for `replies` workers' replies should take what is queued: nullopt
  // while nothing is; else at once when that many replies are queued (a kDone frame for each
  // worker it speaks for, a truncated frame, an exit or a loss: a worker that will not reply),
  // or `window` after the first event still queued (its output, say, is not held longer).
  std::optional<std::chrono::steady_clock::time_point> ready_at(
      size_t replies, std::chrono::steady_clock::duration window) const;
  // Waits until that time has come, or `deadline`; whether anything is queued.
  bool wait_ready(size_t replies, std::chrono::steady_clock::duration window,
                  std::chrono::steady_clock::time_point deadline) const;
  // No more events will come: waiters wake. Events already queued can still be taken.
  void close();
  bool closed() const;
  // Waits up to `timeout` (negative: forever) for close(); true once closed.
  bool wait_closed(std::chrono::milliseconds timeout) const;
  // Bytes of `slot`'s output dropped since its unread output was last under the cap.
  size_t dropped_output(int slot) const;

 private:
  const size_t max_unread_;
  std::function<void(const Pushed&)> on_push_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<Event> events_;
  std::vector<size_t> unread_;   // bytes of each worker's output in events_
  std::vector<size_t> dropped_;  // bytes dropped since the reader last took this worker's output
  std::vector<bool> dropping_;   // over the cap, and the reader has taken nothing since
  bool closed_ = false;
  size_t replies_ = 0;                              // in events_ (ready_at)
  std::chrono::steady_clock::time_point first_at_;  // when events_ was last empty before a push

  static Event note(size_t slot, const std::string& what);
  void taken(const Event& e);  // with mu_ held
  std::optional<std::chrono::steady_clock::time_point> ready_locked(  // ready_at, mu_ held
      size_t replies, std::chrono::steady_clock::duration window) const;
};

}  // namespace ddip
