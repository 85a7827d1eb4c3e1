// The kernel side of a group: one IO thread owns every fd (listening socket, worker connections,
// output pipes, pidfds) through epoll. Other threads talk to it through a command queue and
// receive what happened as Events; waiting for an event blocks only the caller.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/connection.hpp"
#include "ddip/event_loop.hpp"
#include "ddip/output.hpp"
#include "ddip/rank_template.hpp"
#include "ddip/shm.hpp"
#include "ddip/supervisor.hpp"
#include "ddip/tcp.hpp"

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
  ExitStatus status;
};

// A host other than this one. Its launcher (ssh, srun, a template) is started here with the
// link's address and key on its stdin and runs a HostAgent there (remote.hpp), which connects
// back over authenticated TCP and starts the host's workers.
struct RemoteHost {
  std::string name;  // in messages
  SpawnSpec launcher;
  std::vector<int> slots;  // the workers that run there; their specs are sent to the agent
};

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
  // Output of one worker waiting unread in the event queue beyond this is dropped (and the drop
  // reported in the stream): a rank printing while the notebook reads nothing must not grow the
  // kernel's memory without bound.
  size_t max_unread_output = size_t(16) << 20;
  // Called on the IO thread each time an event is queued (a host agent wakes its own loop with
  // it); must not block, nor call back into this Coordinator.
  std::function<void()> on_event;

  // Workers on other hosts. Their slots' specs in `workers` hold only what the kernel adds to
  // the host's environment; argv[0] is looked up there.
  std::vector<RemoteHost> hosts;
  // Where hosts connect: a literal address of this machine, and a port (0: any free one).
  std::string bind_address = "127.0.0.1";
  uint16_t bind_port = 0;
  // A connection that has not authenticated within this long is closed.
  std::chrono::milliseconds handshake_timeout{10000};
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
  const std::vector<pid_t>& pids() const { return pids_; }
  const std::string& socket_path() const { return socket_path_; }
  // "address:port" where remote hosts connect; empty without remote hosts.
  std::string link_address() const;
  // Connections closed because they failed to authenticate, and why the last one was.
  size_t rejected_connections() const;
  std::string last_rejection() const;

  // Queue a frame to one worker; frames to a worker that has not connected yet wait for it.
  // `segments` (ids from pool().put) travel with it as fds; the worker holds a reference to each
  // until it sends a release for it, or exits.
  void send(int slot, Frame frame, const std::vector<uint64_t>& segments = {});
  SegmentPool& pool() { return pool_; }
  // Signal one worker (its process group when whole_group), or every worker when slot < 0.
  void signal(int slot, int sig, bool whole_group = false);
  // Next event, waiting up to `timeout`; nullopt on timeout or once closed and drained.
  std::optional<Event> next_event(std::chrono::milliseconds timeout);
  // Milliseconds since the worker last answered a heartbeat (-1: never connected).
  long long heartbeat_age_ms(int slot) const;
  bool connected(int slot) const;
  // Bytes of the worker's output dropped since the unread queue was last under the cap.
  size_t dropped_output(int slot) const;
  bool running() const;

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
  struct Link;
  struct Handshake;
  CoordinatorOptions options_;
  std::unique_ptr<RuntimeDir> dir_;
  std::string socket_path_;
  std::vector<pid_t> pids_;

  // Shared between the IO thread and callers.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::vector<size_t> unread_output_;   // bytes of each worker's output in events_
  std::vector<size_t> dropped_output_;  // bytes dropped since the queue was last below the cap
  std::vector<std::chrono::steady_clock::time_point> last_ack_;
  std::vector<bool> connected_;
  bool thread_done_ = false;
  std::vector<pid_t> unreaped_;
  size_t rejected_ = 0;
  std::string last_rejection_;
  std::mutex join_mu_;

  SegmentPool pool_;  // thread-safe

  // Owned by the IO thread.
  Supervisor supervisor_;
  std::vector<Slot> slots_;
  EventLoop loop_{"the group's runtime has stopped"};  // post() is thread-safe
  std::unique_ptr<Listener> listener_;
  // Stopping: shutdown frames sent, then SIGTERM, then SIGKILL; each step has a deadline.
  enum class Stop { kRunning, kAsked, kTerminated, kKilled };
  Stop stop_ = Stop::kRunning;
  std::chrono::steady_clock::time_point stop_deadline_;
  std::chrono::milliseconds close_grace_{1000};
  std::thread thread_;

  // Remote hosts, owned by the IO thread.
  std::vector<int> child_of_;  // per slot: its Supervisor index, -1 on another host
  std::vector<Link> links_;
  std::unique_ptr<TcpListener> tcp_;
  std::string key_;
  std::map<uint64_t, Handshake> handshakes_;
  uint64_t next_handshake_ = 0;

  void start_workers();
  void start_links();
  void on_tcp_accept();
  void on_handshake(uint64_t id);
  void reject(uint64_t id, const std::string& why);
  void on_link_frame(size_t link, Frame f);
  void lose_link(size_t link, const std::string& why);
  void lose_slot(size_t slot, const std::string& why);
  void on_launcher(size_t link, int stream);
  void on_launcher_exit(size_t link);
  void send_remote(size_t slot, Frame f, std::vector<uint64_t> segments);
  void send_link(size_t link, Frame f);
  void signal_slot(size_t slot, int sig, bool whole_group);
  void deliver(size_t slot, Frame f);
  void expire_handshakes(std::chrono::steady_clock::time_point now);
  void loop();
  void fail(const std::string& why) noexcept;
  void begin_stop(std::chrono::milliseconds grace);
  bool advance_stop(std::chrono::steady_clock::time_point now);
  void finish() noexcept;
  void tick();
  void schedule_tick();
  void check_responsive(std::chrono::steady_clock::time_point now);
  void pause_listener();
  void emit(Event e);
  static Event output_note(size_t slot, const std::string& what);
  void on_accept();
  void on_connection_end(size_t slot, Connection::End how);
  void on_pipe(size_t slot, int stream, bool final);
  void on_exit(size_t slot);
  void drain_output(size_t slot, bool final);
  // `force`: also text held back as the start of an incomplete UTF-8 character.
  void flush_partial(size_t slot, bool force);
  void emit_output(size_t slot, int stream, std::string text);
  void on_display(size_t slot, Frame f);
  void release_held(size_t slot, bool all);
  void release_segments(size_t slot, const std::string& ids);
  void send_now(size_t slot, Frame f);
  void drop_connection(size_t slot);
};

}  // namespace ddip
