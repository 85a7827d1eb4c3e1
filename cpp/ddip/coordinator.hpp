// The kernel side of a group: one IO thread runs an EventLoop that owns every fd (listening
// socket, worker connections, output pipes, pidfds). The Coordinator owns the workers' life
// cycle (start, connection, heartbeats, exit, the stop state machine) and their shared-memory
// references; RankStreams (streams.hpp) owns their output and its order against frames, and
// HostLinks (links.hpp) the workers on other hosts. Other threads post commands to the loop and
// take what happened as Events (events.hpp); waiting for an event blocks only the caller.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/connection.hpp"
#include "ddip/event_loop.hpp"
#include "ddip/events.hpp"
#include "ddip/links.hpp"
#include "ddip/rank_template.hpp"
#include "ddip/shm.hpp"
#include "ddip/streams.hpp"
#include "ddip/supervisor.hpp"

namespace ddip {

struct CoordinatorOptions {
  // One spec per worker; each gets DDIP_SOCKET=<socket path> and DDIP_KERNEL_PID=<our pid>
  // added to its environment.
  std::vector<SpawnSpec> workers;
  std::chrono::milliseconds heartbeat_interval{1000};
  // A connected worker that answers no heartbeat for this long is reported unresponsive (a
  // stopped or swapping process, a hung machine); 0: never.
  std::chrono::milliseconds heartbeat_timeout{10000};
  // How long a partial line (no '\n' or '\r' yet) waits before it is delivered anyway.
  std::chrono::milliseconds partial_line_delay{50};
  // When set, workers are forked from this warm template (not owned; used only while the
  // constructor starts them); a worker it can't fork is spawned cold.
  RankTemplate* rank_template = nullptr;
  // After SIGKILL, how long a worker gets to be reaped before it is given up on.
  std::chrono::milliseconds kill_wait = Supervisor::kKillWait;
  // Pooled shared-memory segments unused this long are freed (a 3 GiB push must not pin 3 GiB
  // for the group's life); 0: kept until the pool's own limit.
  std::chrono::milliseconds pool_idle{5000};
  // The segment pool to use (not owned: it must outlive the Coordinator); null: one of its own.
  // A host agent's, which its link receives buffers into before its workers start.
  SegmentPool* pool = nullptr;
  // Output of one worker waiting unread in the event queue beyond this is dropped (and the drop
  // reported in the stream): a rank printing while the notebook reads nothing must not grow the
  // kernel's memory without bound.
  size_t max_unread_output = size_t(16) << 20;
  // Called on the thread that runs the loop each time an event is queued, with what it is (a host
  // agent wakes its own loop with it); must not block, nor call back into this Coordinator.
  std::function<void(const Pushed&)> on_event;
  // The process's main thread, while it waits in next_event(), runs the loop itself, and the IO
  // thread takes it over once that thread has been away kTakeOver (or for closing, a failure, a
  // respawn). A kernel waits for every reply: its own wait reading them saves the two thread
  // switches per request that handing each command and event across threads costs. Off for a
  // host agent, whose main thread waits in a loop of its own (on_event).
  bool caller_drives = false;
  // wait_events(): how long what is queued may wait for the rest of a request's replies. Output
  // and a failure's reply are not held longer than this; the failure policy acts in 0.25 s.
  std::chrono::milliseconds reply_wait{5};

  // Workers on other hosts. Their slots' specs in `workers` hold only what the kernel adds to
  // the host's environment; argv[0] is looked up there.
  std::vector<RemoteHost> hosts;
  // Where hosts connect: a literal address of this machine, and a port (0: any free one).
  std::string bind_address = "127.0.0.1";
  uint16_t bind_port = 0;
  // A connection that has not authenticated within this long is closed.
  std::chrono::milliseconds handshake_timeout{10000};
  // The kernel's standing agents (not owned; must outlive this object): each host's launcher is
  // leased from it, so that agent and its rank template outlive the group (none: one-shot).
  AgentKeeper* agent_keeper = nullptr;
  // With agent_keeper: fork the workers there from the host's rank template (LinkOptions::warm).
  uint32_t remote_warm = 0;
  // How long a host's agent holds its workers' replies to a request for the rest of them, to
  // send them as one frame (LinkOptions::reply_window; 0: ReplyGather::kWindow).
  std::chrono::milliseconds reply_window{0};
};

class Coordinator {
 public:
  // Spawns every worker (from the IO thread, so PR_SET_PDEATHSIG ties them to a thread that
  // lives as long as this object). Throws if a worker can't be started; nothing is left running.
  explicit Coordinator(CoordinatorOptions options);
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;
  ~Coordinator();

  size_t size() const { return pids_.size(); }
  // Each slot's worker pid (-1: on another host); a respawned slot has its new worker's.
  std::vector<pid_t> pids() const;
  const std::string& socket_path() const { return socket_path_; }
  // "address:port" where remote hosts connect; empty without remote hosts.
  std::string link_address() const;
  // Connections closed because they failed to authenticate, and why the last one was.
  size_t rejected_connections() const;
  std::string last_rejection() const;
  // Frames that brought replies from other hosts: one per host and request where their agents
  // gather them (HostLinks::reply_frames).
  uint64_t host_reply_frames() const;
  // What other hosts' agents said for the user, as (host, text) in the order it came: why a
  // host's ranks start cold (host_agent.hpp). Each arrives before its host's workers' frames, so
  // once they said hello, it is here. Kept after close().
  std::vector<std::pair<std::string, std::string>> host_notes() const;
  static constexpr size_t kMaxHostNotes = 64;

  // Queue a frame to one worker; frames to a worker that has not connected yet wait for it.
  // `segments` (ids from pool().put) travel with it as fds; the worker holds a reference to each
  // until it sends a release for it, or exits.
  void send(int slot, Frame frame, const std::vector<uint64_t>& segments = {});
  // The same frame to several workers (its payload shared), in one command to the IO thread;
  // those on another host get one frame per host, which its agent writes to each of them, and
  // their replies to a request (kDone) may come back gathered: one event for several workers
  // that replied alike (Event::slots).
  void send(const std::vector<int>& slots, Frame frame, const std::vector<uint64_t>& segments = {});
  SegmentPool& pool() { return pool_; }
  // Reads what these workers' output pipes hold now into the event queue, and returns once it
  // did (on the main thread at once, the usual case; else the IO thread's, waited for up to
  // 250 ms: a loop that no longer runs must not hold a request up). Called before a request is
  // sent, so that what a rank printed while idle is told apart from what it prints running the
  // request, however late the pipes were read. Workers on other hosts are left out: their output
  // comes over their host's link.
  void catch_up_output(const std::vector<int>& slots);
  // Signal one worker (its process group when whole_group), or every worker when slot < 0.
  void signal(int slot, int sig, bool whole_group = false);
  // Next event, waiting up to `timeout`; nullopt on timeout or once closed and drained. With
  // caller_drives, a wait on the main thread runs the loop meanwhile.
  std::optional<Event> next_event(std::chrono::milliseconds timeout);
  static constexpr std::chrono::milliseconds kTakeOver{10};
  // For a caller that waits for `replies` workers' replies (a request's): waits up to `timeout`
  // until as many are queued, or what is queued has waited options' reply_wait
  // (EventQueue::ready_at), and then appends every queued event to `out`; how many. The many
  // replies of one request are taken in one go, not one wake-up each.
  size_t wait_events(std::vector<Event>& out, std::chrono::milliseconds timeout, size_t replies);
  // Every event queued now, without waiting, appended to `out`; how many.
  size_t take_events(std::vector<Event>& out) { return events_.pop_all(out); }
  // Milliseconds since the worker last answered a heartbeat (-1: never connected).
  long long heartbeat_age_ms(int slot) const;
  bool connected(int slot) const;
  // Bytes of the worker's output dropped since the unread queue was last under the cap.
  size_t dropped_output(int slot) const;
  bool running() const;

  // Starts the worker of `slot` again after it exited (a heal that replaces a dead rank). The
  // slot is reset (connection, hello, heartbeats, frames waiting, shared-memory segments held)
  // and its worker started from `spec` (default: the spec it was first started with; its
  // DDIP_SOCKET and DDIP_KERNEL_PID are ours either way), forked from `rank_template` when one
  // is given and it can (not owned; used only inside this call), else spawned cold. Returns the
  // new pid; the new worker connects and says hello as any worker does, and the exited one's
  // pid never attaches to the slot. A slot on another host is started again there by its host's
  // agent (HostLinks::respawn), forked from that host's own template (`rank_template` is not
  // used), and -1 is returned: its pid is in its hello; when the agent can't start it, its exit
  // comes as an exited event with why. Throws std::out_of_range for no such slot;
  // std::logic_error for a worker still running (or exited and not reaped yet), one whose
  // host's link is gone, or a group that is closing; std::system_error when it can't be started
  // (the slot then stays exited, as it was).
  pid_t respawn(int slot, std::optional<SpawnSpec> spec = std::nullopt,
                RankTemplate* rank_template = nullptr);

  // Asks workers to shut down, waits up to `grace` for them to exit, then SIGTERM, `grace`
  // again, SIGKILL and up to `kill_wait`; output keeps being read all along. Returns the pids of
  // workers that could not be reaped even then (left behind). Idempotent; a later call with a
  // shorter grace hastens a stop under way.
  std::vector<pid_t> close(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));
  // close() in two halves, for callers that wait in slices: start stopping (returns at once),
  // then wait up to `timeout` (negative: forever) for the IO thread to finish; nullopt if it has
  // not yet, else what close() returns.
  void begin_close(std::chrono::milliseconds grace);
  std::optional<std::vector<pid_t>> wait_closed(std::chrono::milliseconds timeout);

 private:
  struct Slot;
  CoordinatorOptions options_;
  std::unique_ptr<RuntimeDir> dir_;
  std::string socket_path_;
  std::vector<pid_t> pids_;
  EventQueue events_;  // thread-safe: filled by the IO thread, taken by the owner
  SegmentPool own_pool_;
  SegmentPool& pool_;  // thread-safe: options_.pool, else own_pool_

  // Shared between the IO thread and callers.
  mutable std::mutex mu_;
  std::vector<std::chrono::steady_clock::time_point> last_ack_;
  std::vector<bool> connected_;
  std::vector<pid_t> unreaped_;
  std::vector<std::pair<std::string, std::string>> host_notes_;
  std::mutex join_mu_;

  // Owned by the IO thread. The loop is declared first: what watches fds on it goes before it.
  EventLoop loop_{"the group's runtime has stopped"};  // post() is thread-safe
  Supervisor supervisor_;
  std::unique_ptr<RankStreams> streams_;
  std::unique_ptr<HostLinks> links_;  // none without remote hosts
  std::vector<Slot> slots_;
  std::vector<int> child_of_;  // per slot: its Supervisor index, -1 on another host
  std::unique_ptr<Listener> listener_;
  // Stopping: shutdown frames sent, then SIGTERM, then SIGKILL; each step has a deadline.
  enum class Stop { kRunning, kAsked, kTerminated, kKilled };
  Stop stop_ = Stop::kRunning;
  std::chrono::steady_clock::time_point stop_deadline_;
  std::chrono::milliseconds close_grace_{1000};
  std::thread thread_;

  // Who runs the loop (options_.caller_drives): whoever holds drive_. turn_mu_ guards the state
  // of the turns; the IO thread waits for its turn on takeover_ (a timerfd armed as the caller
  // leaves) and io_wake_.
  std::timed_mutex drive_;
  std::mutex turn_mu_;
  bool caller_driving_ = false;  // a caller holds drive_, or waits for it
  std::chrono::steady_clock::time_point caller_left_{};
  bool takeover_armed_ = false;
  bool io_wanted_ = false;                     // the IO thread must run the loop now
  bool io_driving_ = false;                    // it does, and will see what is posted
  std::atomic<bool> caller_waits_{false};      // the IO thread yields drive_ between two rounds
  std::atomic<bool> caller_may_drive_{false};  // once started, until stopping or a failure
  std::exception_ptr caller_failure_;          // under drive_: what the loop threw on a caller
  Fd takeover_, io_wake_;

  void start_workers();
  void own_environment(SpawnSpec& w) const;
  void start_slot(size_t slot, RankTemplate* rank_template);
  pid_t start_again(size_t slot, std::optional<SpawnSpec> spec, RankTemplate* rank_template);
  pid_t start_again_there(size_t slot, std::optional<SpawnSpec> spec);
  void loop();
  void step(std::optional<std::chrono::steady_clock::time_point> until);
  bool io_turn(std::chrono::steady_clock::time_point now) const;  // turn_mu_ held
  void park();
  bool drive(std::chrono::steady_clock::time_point deadline, size_t replies);
  void enter();
  void leave(bool hand_over);
  void arm_takeover(std::chrono::steady_clock::duration after);
  void hold(std::unique_lock<std::timed_mutex>& turn) noexcept;
  void want_io();
  void command(EventLoop::Task fn);
  bool run_here(EventLoop::Task& fn);  // command()'s main-thread half: false when it can't
  void read_pipes_now(const std::vector<int>& slots);
  void fail(const std::string& why) noexcept;
  void finish() noexcept;
  void schedule_tick();
  void tick();
  void check_responsive(std::chrono::steady_clock::time_point now);
  void begin_stop(std::chrono::milliseconds grace);
  bool advance_stop(std::chrono::steady_clock::time_point now);
  void on_accept();
  void pause_listener();
  void on_connection_end(size_t slot, Connection::End how);
  void drop_connection(size_t slot);
  void deliver(size_t slot, Frame f);
  void heard_from(size_t slot);
  void on_exit(size_t slot);
  void gone(size_t slot);
  void send_now(size_t slot, Frame f);
  void signal_slot(size_t slot, int sig, bool whole_group);
  void release_segments(size_t slot, const std::string& ids);
  HostLinks::Callbacks link_callbacks();
};

}  // namespace ddip
