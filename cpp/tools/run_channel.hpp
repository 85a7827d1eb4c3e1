// The control channel between two `ddip run`s: the one that starts another host's ddip run
// through a launcher writes to that launcher's stdin (Downstream); that host's ddip run reads
// its own stdin (Upstream) and writes its records back on its stderr. Messages are
// run_protocol.hpp's. A network that drops without a word closes nothing, so the starting side
// pings, and a host that hears nothing for --link-timeout takes the link for gone.
//
// A node that joined the job itself (run_join.hpp) has the same channel on a TCP connection it
// made (a JoinLink): control to it, and its reports back, on the one socket, every line sealed
// with the job's shared key when there is one.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ddip/auth.hpp"
#include "ddip/fd.hpp"
#include "run_loop.hpp"
#include "run_output.hpp"
#include "run_protocol.hpp"

namespace ddip::run {

// How often the starting side says it is there: link_timeout / 6, between 0.1 s and 5 s.
milliseconds ping_every(milliseconds link_timeout);
// "30", "6", "0.5": the link timeout in seconds, for messages.
std::string seconds_text(milliseconds d);

// The lines of a link that authenticated with a shared key: each carries the HMAC of its text
// and its place in the stream (ddip/auth.hpp's FrameMac, with the link's own keys), so a line
// forged, replayed, dropped or moved from another link fails.
class SealedLines {
 public:
  explicit SealedLines(const LinkKeys& keys) : send_(keys.send), recv_(keys.recv) {}
  // `line` (one record, its '\n' included) with its MAC as a last field.
  std::string seal(std::string_view line);
  // The record sealed in `line`; throws protocol::ProtocolError when its MAC is wrong.
  std::string open(std::string_view line);

 private:
  FrameMac send_, recv_;
};

// One TCP connection between a node and the job's host, for the job's whole life (every
// attempt): its socket, its seal, and what has been read of it but not yet taken, so that
// whoever reads it next (the rendezvous, an attempt's channel) goes on where the last one
// stopped.
class JoinLink {
 public:
  JoinLink(Fd fd, std::string peer) : fd_(std::move(fd)), peer_(std::move(peer)) {}
  int fd() const { return fd_.get(); }
  const std::string& peer() const { return peer_; }
  void seal(const LinkKeys& keys) { seal_.emplace(keys); }
  bool sealed() const { return seal_.has_value(); }

  // Reads what the socket has now (it is non-blocking). False at its end of file; throws
  // std::system_error for a failed read (ECONNRESET, ETIMEDOUT from TCP_USER_TIMEOUT).
  bool fill();
  // The next whole line read (opened, when sealed), or nullopt. Throws ProtocolError for a line
  // without its end after protocol::kMaxControlLine bytes, or a bad seal.
  std::optional<std::string> next_line();
  // The next line, waiting up to `deadline`; throws std::runtime_error when the link ends or
  // the deadline passes first (saying which), ProtocolError as next_line().
  std::string read_line(Clock::time_point deadline);
  // One record (sealed when the link is), within `limit`. False when it could not be sent.
  bool send(std::string_view line, milliseconds limit);

 private:
  Fd fd_;
  std::string peer_;
  std::optional<SealedLines> seal_;
  std::string pending_;
};

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
  // A joined node's channel instead: `link` (kept by run_join) for both ways; `who` names the
  // other end in messages.
  void open(JoinLink& link, std::string who);
  // Sends `report` to the starting side (unless its stream failed before).
  void send(const protocol::Report& report);
  // A joined node's link is up (nothing has failed on it).
  bool linked() const { return link_ != nullptr; }

 private:
  void on_readable();
  void on_link_readable();
  void close();

  RunLoop& loop_;
  JoinLink* link_ = nullptr;
  bool joined_ = false;  // a joined node's: reports go on its link or nowhere
  std::string who_ = "the ddip run that started it";
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
  // A node that joined the job (run_join.hpp): told through its link.
  void add(size_t unit, JoinLink& link);
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
    JoinLink* link = nullptr;  // a joined node's, instead of `in`
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

// The job's host's side of the joined nodes' links: each line a node sends is one of its
// records, handed on as a --hosts launcher's are; the link's end (or a failed read) before the
// node said it was done is that node gone.
class NodeReports {
 public:
  struct Hooks {
    std::function<void(size_t unit, std::string_view line)> on_record;
    std::function<void(size_t unit, std::string why)> on_gone;
  };
  NodeReports(RunLoop& loop, Hooks hooks) : loop_(loop), hooks_(std::move(hooks)) {}
  void add(size_t unit, JoinLink& link);
  // Unit `unit` has said it is done: its link is read no more in this attempt.
  void done(size_t unit);

 private:
  void on_readable(size_t unit);
  RunLoop& loop_;
  Hooks hooks_;
  std::vector<std::pair<size_t, JoinLink*>> links_;
};

}  // namespace ddip::run
