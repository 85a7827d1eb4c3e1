// Every rank's output streams on the coordinator's loop: its stdout and stderr pipes read into
// lines, and their order kept against the frames that travel separately. A display frame comes
// right after the text its marker ends; a reply ("done") and an exit come after everything the
// rank printed before them. Output from a host link (already in order) goes through here too.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ddip/event_loop.hpp"
#include "ddip/events.hpp"
#include "ddip/fd.hpp"
#include "ddip/output.hpp"

namespace ddip {

class RankStreams {
 public:
  using Emit = std::function<void(Event)>;
  // `partial_line_delay`: how long a partial line (no '\n' or '\r' yet) waits before it is
  // delivered anyway. Events go to `emit`, in the order they belong in.
  RankStreams(EventLoop& loop, size_t slots, std::chrono::milliseconds partial_line_delay,
              Emit emit);
  RankStreams(const RankStreams&) = delete;
  RankStreams& operator=(const RankStreams&) = delete;
  ~RankStreams();

  // A local rank's pipes (non-blocking read ends): read whenever they are readable. Again for a
  // slot whose worker was started again: the old pipes and output state are dropped.
  void attach(size_t slot, Fd out, Fd err);
  // Text a rank on another host printed (it arrives in order with its frames).
  void output(size_t slot, int stream, std::string text);
  // `e` (a frame from the rank) after everything the rank printed before sending it: a reply.
  void after_output(size_t slot, Event e);
  // A display frame: at its marker's place in stdout, before what was printed after it.
  void display(size_t slot, Event e);
  // What these ranks' pipes hold now is read and emitted (a partial line stays pending): one
  // poll for all of them, then a read of each that has something.
  void read_now(const std::vector<size_t>& slots);
  // Everything the rank printed so far is emitted, held text included (`to_eof`: read its pipes
  // to their end, for a rank that exited).
  void catch_up(size_t slot, bool to_eof);
  // The rank exited: everything left in its pipes (to EOF) is emitted, then `e`, its exit, with
  // the last lines of its stderr as `e.text` unless `e.text` is set already.
  void exited(size_t slot, Event e);
  // Partial lines older than the delay are emitted; called by the owner after each loop round.
  void flush_due(std::chrono::steady_clock::time_point now);
  // When flush_due has something to do next, if ever.
  std::optional<std::chrono::steady_clock::time_point> next_due() const;

 private:
  struct Stream {
    Fd out, err;
    RankOutput output;
    std::chrono::steady_clock::time_point last_output;
    // stdout read after a display marker whose frame has not arrived yet, one batch per marker.
    std::deque<std::vector<Event>> held;
  };
  EventLoop& loop_;
  std::chrono::milliseconds delay_;
  Emit emit_;
  std::vector<Stream> streams_;

  void read(size_t slot, int stream, bool to_eof);
  void drain(size_t slot, bool to_eof);
  void flush_partial(size_t slot, bool force);  // force: also half a UTF-8 character
  void text(size_t slot, int stream, std::string text);
  void release_held(size_t slot, bool all);
};

}  // namespace ddip
