// The coordinator's links to other hosts. Each remote host has a launcher here (ssh, srun, a
// template) that starts a HostAgent there (host_agent.hpp); the agent connects back over TCP,
// authenticates (auth.hpp), and from then on one sealed Connection carries the frames of all that
// host's workers (their slot in the frame's rank field), their output (kOutput) and their exits
// (kExit). A link that fails, or a launcher that exits before its host connected, is the death of
// that host's workers (lost). Nothing from a connection reaches a callback before it has
// authenticated. Everything runs on the coordinator's loop thread, except the rejection counters.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ddip/auth.hpp"
#include "ddip/connection.hpp"
#include "ddip/event_loop.hpp"
#include "ddip/keeper.hpp"
#include "ddip/output.hpp"
#include "ddip/shm.hpp"
#include "ddip/supervisor.hpp"
#include "ddip/tcp.hpp"

namespace ddip {

// A host other than this one. Its launcher (ssh, srun, a template) is started here with the
// link's address and key on its stdin and runs a HostAgent there (host_agent.hpp), which connects
// back over authenticated TCP and starts the host's workers.
struct RemoteHost {
  std::string name;  // in messages
  SpawnSpec launcher;
  std::vector<int> slots;  // the workers that run there; their specs are sent to the agent
};

struct LinkOptions {
  std::vector<RemoteHost> hosts;
  // Where hosts connect: a literal address of this machine, and a port (0: any free one).
  std::string bind_address = "127.0.0.1";
  uint16_t bind_port = 0;
  // A connection that has not authenticated within this long is closed.
  std::chrono::milliseconds handshake_timeout{10000};
  // The agent gives up on a kernel silent this long (0: the agent's own default).
  std::chrono::milliseconds kernel_silence{0};
  // Standing agents, kept for the kernel's life (keeper.hpp): each host's launcher is leased
  // from it instead of started for this group alone (none: one-shot launchers, as `ddip run`).
  AgentKeeper* keeper = nullptr;
  // With a keeper: the ticket's `warm` (host_agent.hpp): fork the workers from the host's template.
  uint32_t warm = 0;
  // How long each host's agent holds its workers' replies to a request for the rest of them
  // (LinkTicket::reply_window_ms; 0: the agent's default).
  std::chrono::milliseconds reply_window{0};
};

class HostLinks {
 public:
  struct Callbacks {
    std::function<void(int slot, Frame)> frame;  // any other frame from a worker there
    std::function<void(int slot, int stream, std::string text)> output;
    std::function<void(int slot, ExitStatus, std::string stderr_tail)> exited;
    std::function<void(int slot, const std::string& why)> lost;
    std::function<void(int slot)> hello;  // its first hello, before that frame itself
    // One reply (a kDone frame, rank: the first of them) of several workers there, gathered by
    // its agent (kReplies): those still there, in the order the agent gave.
    std::function<void(std::vector<int> slots, Frame)> replies;
    // What a host's agent has to tell the user (kHostNote: why its ranks start cold), with the
    // host's name.
    std::function<void(const std::string& host, std::string text)> note;
  };
  // Listens on the bind address at once (throws if it can't); nothing is started yet.
  // `workers`: every slot's spec (only the remote ones are read).
  HostLinks(EventLoop& loop, Supervisor& supervisor, SegmentPool& pool, LinkOptions options,
            const std::vector<SpawnSpec>& workers, Callbacks callbacks);
  HostLinks(const HostLinks&) = delete;
  HostLinks& operator=(const HostLinks&) = delete;
  ~HostLinks();

  // On the loop's thread (launchers get PR_SET_PDEATHSIG from it): watches the listener and
  // starts every host's launcher.
  void start();
  // "address:port" where hosts connect.
  std::string address() const;
  bool remote(int slot) const { return slots_.count(slot) != 0; }

  // Queued on the link when it is up, else kept until it is; dropped for a worker that is gone.
  // Its segments cross each host's link once: the first frame for that host that holds one sends
  // it ahead (kSegment, streamed from the segment, which it keeps from reuse until written); the
  // frames refer to it by id, and once the command that sent them is done the host is told to
  // drop its copy (kForget).
  void send(int slot, Frame f, std::vector<uint64_t> segments);
  // `f` to several workers: one frame per host whose link is up (kFanOut where it is for more
  // than one of its workers, each segment shipped once as above), each worker's own frame (as
  // send()) otherwise. Takes one reference to each of `segments`.
  void send(const std::vector<int>& slots, const Frame& f, const std::vector<uint64_t>& segments);
  // Frames that carried replies from hosts (a worker's kDone, or a host's kReplies): one per
  // host and request when their agents gather them. For tests and benchmarks.
  uint64_t reply_frames() const { return reply_frames_; }
  void signal(int slot, int sig, bool whole_group);
  // Asks the host's agent to start the worker of `slot` again (a heal that replaces a dead
  // rank): another kSpawn on the live link, for that slot only, with `spec` (none: the spec it
  // was first started with); the agent forks it from its own template as at the start, or
  // reports it exited (kExit) with why it could not. The slot is reset (no hello, nothing
  // waiting). Throws std::logic_error, changing nothing, for a worker whose exit its host has
  // not reported, a host whose link is gone (its agent with it), or one whose one-shot agent
  // left with its last worker; the message names the host.
  void respawn(int slot, std::optional<SpawnSpec> spec);
  const std::string& host_of(int slot) const { return links_.at(slots_.at(slot).link).host.name; }
  // Heartbeats to every connected host, live workers there or not (its agent takes a silent
  // link for a dead kernel; a standing one keeps its link while its workers are dead, for
  // respawn(), and its workers may take long to say hello), and handshakes that took too long
  // are closed.
  void tick();
  bool launchers_exited() const;
  void signal_launchers(int sig);
  // Drops every link and handshake (the agents stop their workers when they see that).
  void close();

  // Thread-safe: connections refused because they failed to authenticate, and the last why.
  size_t rejected() const;
  std::string last_rejection() const;
  // On the loop's thread: accept() calls that found this process out of fds (after each, the
  // listener rests kAcceptPause instead of spinning on a connection it can't take).
  uint64_t starved_accepts() const { return tcp_->starved_count(); }

  // Connections still authenticating, at most: from one peer address (plus one per host), and
  // from all.
  static constexpr size_t kHandshakesPerPeer = 8;
  static constexpr size_t kMaxHandshakes = 64;
  static constexpr std::chrono::milliseconds kAcceptPause{100};
  // The kernel's log shows this many refusals in full per kLogWindow, then a count.
  static constexpr int kLoggedRefusals = 5;
  static constexpr std::chrono::seconds kLogWindow{60};

 private:
  struct Slot {
    size_t link = 0;
    bool said_hello = false;
    bool gone = false;
    bool lost = false;  // gone without its exit reported by its host
    // Frames for it (with the segments they hold) waiting for the link to come up.
    std::vector<std::pair<Frame, std::vector<uint64_t>>> waiting;
  };
  struct Link {
    RemoteHost host;
    size_t child = 0;  // the launcher's Supervisor index
    Fd out, err;
    RankOutput output;  // the launcher's own output: its stderr tail explains a failed start
    bool launcher_exited = false;
    std::unique_ptr<Connection> conn;
    bool ever_connected = false;
    std::set<uint64_t> shipped;         // segments its agent holds
    bool standing = false;              // its launcher is the keeper's (`child` is unused)
    std::string lost_why;               // why its link ended, once it has
    std::unique_ptr<AgentLease> lease;  // until the group ends there
  };
  struct Handshake {
    Fd fd;
    std::string peer;
    KernelHandshake hs;
    std::string response;
    std::chrono::steady_clock::time_point deadline;
    std::string from;  // the peer's address, without its port
  };

  EventLoop& loop_;
  Supervisor& supervisor_;
  SegmentPool& pool_;
  LinkOptions options_;
  Callbacks cb_;
  std::map<int, SpawnSpec> specs_;
  std::map<int, Slot> slots_;
  std::vector<Link> links_;
  std::unique_ptr<TcpListener> tcp_;
  std::string key_;
  std::map<uint64_t, Handshake> handshakes_;
  uint64_t next_handshake_ = 0;
  mutable std::mutex mu_;
  size_t rejected_ = 0;
  std::string last_rejection_;
  // Defence of the listener (on the loop's thread): its pause while out of fds, the refusals'
  // log and the handshakes closed to make room, and the launchers that ended while their host
  // was connected (lost after a grace, when the link did not end first).
  EventLoop::TimerId accept_timer_ = 0;
  std::chrono::steady_clock::time_point log_window_end_{};
  int logged_ = 0;
  size_t unlogged_ = 0;
  std::string unlogged_last_;
  size_t made_room_ = 0;  // handshakes closed for a newcomer
  std::string made_room_why_;
  std::map<size_t, EventLoop::TimerId> launcher_grace_;

  void on_accept();
  void pause_accepting();
  void make_room(const std::string& from);
  void on_handshake(uint64_t id);
  // `tell`: why, in words for the peer (an agent reports it), written before the close.
  void reject(uint64_t id, const std::string& why, const std::string& tell = "");
  void log_rejection(const std::string& text);
  void flush_rejection_log(const char* when);
  void on_frame(size_t link, Frame f);
  void send_link(size_t link, Frame f);
  void ship(size_t link, uint64_t segment);
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // for what it posts to the loop
  std::atomic<uint64_t> reply_frames_{0};
  void on_replies(Link& l, size_t link, const Frame& f);
  void lose_link(size_t link, const std::string& why);
  void lose_slot(int slot, const std::string& why);
  void on_launcher(size_t link, int stream);
  void on_launcher_exit(size_t link);
  std::optional<ExitStatus> launcher_status(size_t link);  // once it has exited
  std::string launcher_tail(size_t link);
  std::string launcher_gone(size_t link, const ExitStatus& status);  // while it was connected
  // Every worker of the host is gone: its standing agent is free for the next group.
  bool host_done(const Link& l) const;
  void return_lease(Link& l);
  void lease_agent(size_t link);
  bool relaunch(size_t link);  // a kept agent gone before this group's ticket: a new one
};

}  // namespace ddip
