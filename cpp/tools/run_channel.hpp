// The control channel between two `ddip run`s: the one that starts another host's ddip run
// through a launcher writes to that launcher's stdin (Downstream); that host's ddip run reads
// its own stdin (Upstream) and writes its records back on its stderr. Messages are
// run_protocol.hpp's. A network that drops without a word closes nothing, so the starting side
// pings, and a host that hears nothing for --link-timeout takes the link for gone.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ddip/fd.hpp"
#include "run_loop.hpp"
#include "run_output.hpp"
#include "run_protocol.hpp"

namespace ddip::run {

// How often the starting side says it is there: link_timeout / 6, between 0.1 s and 5 s.
milliseconds ping_every(milliseconds link_timeout);
// "30", "6", "0.5": the link timeout in seconds, for messages.
std::string seconds_text(milliseconds d);

// A host's ddip run's end of the channel.
class Upstream {
 public:
  struct Hooks {
    std::function<void(const protocol::Control&)> on_message;
    // End of file: the starting side exited, or its host or the network went away.
    std::function<void(std::string why)> on_closed;
    // Nothing heard for the link timeout, or a message that can't be read.
    std::function<void(std::string why)> on_lost;
  };
  // Writes back through `terminal` (stderr, bounded by the link timeout).
  Upstream(RunLoop& loop, Terminal& terminal, milliseconds link_timeout, Hooks hooks);

  // Takes `fd` (this process's stdin, duplicated) as the channel. Returns "" or why it can't be
  // one (a file, /dev/null: the launcher gave no stdin).
  std::string open(Fd fd);
  // Sends `report` to the starting side (unless its stream failed before).
  void send(const protocol::Report& report);

 private:
  void on_readable();
  void close();

  RunLoop& loop_;
  Terminal& terminal_;
  milliseconds link_timeout_;
  Hooks hooks_;
  Fd fd_;
  protocol::ControlReader in_;
  Clock::time_point heard_at_;
  bool silent_ = false;  // the link timeout has passed once: said, not again
};

// The starting side's end: one channel per host, the stdin of that host's launcher.
class Downstream {
 public:
  // `kill_launcher(unit)`: SIGKILL to a host's launcher that could not be told to kill.
  // `kill_after`: from Kill to the launchers' SIGKILL.
  Downstream(RunLoop& loop, milliseconds link_timeout,
             std::function<void(size_t unit)> kill_launcher,
             milliseconds kill_after = milliseconds(3000));

  void add(size_t unit, Fd stdin_pipe);
  // Sends `bytes` (the shipped files, run_ship.hpp) to a host before any message: written as
  // its launcher takes them, never blocking the loop; messages told meanwhile queue behind.
  void ship(size_t unit, std::string bytes);
  // The host's launcher has exited: its channel closes.
  void ended(size_t unit);
  // To every host whose launcher still runs; a host that can't take it is told no more.
  void tell(const protocol::Control& message);
  // To the host of launcher `unit` only (an Answer for one of its ranks).
  void tell(size_t unit, const protocol::Control& message);
  // Kill to every host; a host that can't hear it (its network gone) must not keep ddip run
  // waiting: its launcher is killed a little later, and its ddip run then stops its ranks on
  // losing this channel.
  void kill();

 private:
  struct Host {
    size_t unit;
    Fd in;
    bool running = true;
    std::string queued;  // not yet written (shipped files, then what was told meanwhile)
  };
  bool any_running() const;
  void flush(Host& h);
  void drop(Host& h);
  void tell(Host& h, const std::string& line);

  RunLoop& loop_;

  milliseconds link_timeout_, kill_after_;
  std::function<void(size_t)> kill_launcher_;
  std::vector<Host> hosts_;
  Clock::time_point next_ping_;
  std::optional<Clock::time_point> kill_launchers_at_;
  bool kill_armed_ = false;
};

}  // namespace ddip::run
