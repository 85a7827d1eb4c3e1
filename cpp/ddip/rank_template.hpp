// A warm rank template: a process that has already imported what ranks need (IPython, torch),
// never touched CUDA, and forks ranks on request.
//
// Kernel side, `RankTemplate`: spawns the template (the Supervisor's clone-based spawn) from a
// thread of its own that lives as long as the object, because PR_SET_PDEATHSIG binds a child to
// the *thread* that created it; that thread also owns every fd of the template (socket, output
// pipes, pidfd). Template side, `ForkServer`: answers fork requests with a raw
// clone(CLONE_PARENT | CLONE_PIDFD), so a rank is a child of the kernel process, not of the
// template, and the kernel's Supervisor waits for it through its pidfd exactly like a spawned one.
//
// Protocol over a Unix socket (Channel frames): the template sends kTemplateReady or
// kTemplateFailed once its imports are done; the kernel sends kForkRequest (argv, env, cwd; the
// write ends of the rank's stdout/stderr pipes as fds) and the template answers kForked (pid;
// the pidfd as fd) or kForkRefused (why; the pidfd when a child was made and failed to set up).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/connection.hpp"
#include "ddip/event_loop.hpp"
#include "ddip/supervisor.hpp"

namespace ddip {

enum TemplateFrameKind : uint16_t {
  kTemplateReady = 101,   // template -> kernel: imports done (payload: opaque, for the caller)
  kTemplateFailed = 102,  // template -> kernel: it can't serve (payload: why); it exits
  kForkRequest = 103,     // kernel -> template: argv, env, cwd; fds: stdout, stderr write ends
  kForked = 104,          // template -> kernel: payload: pid (decimal); fds: the pidfd
  kForkRefused = 105,     // template -> kernel: payload: why; fds: the pidfd of a failed child
};

// A rank forked from the template: owned by whoever adopts it (Supervisor::adopt).
struct ForkedRank {
  pid_t pid = -1;
  Fd pidfd;
  Fd out, err;  // read ends of its stdout/stderr pipes (non-blocking)
};

class RankTemplate {
 public:
  enum class State { kNone, kStarting, kReady, kFailed, kDead };
  struct Status {
    State state = State::kNone;
    pid_t pid = -1;
    std::string detail;  // kReady/kFailed: the template's payload; kDead: how it ended
  };

  RankTemplate();
  RankTemplate(const RankTemplate&) = delete;
  RankTemplate& operator=(const RankTemplate&) = delete;
  // Kills the template and ends the owner thread, so ranks forked from it get their
  // PR_SET_PDEATHSIG: keep this object as long as its ranks should live (the kernel's lifetime).
  ~RankTemplate();

  // Starts a template (stopping the current one first); returns once it is spawned and
  // connected, not once its imports are done. `spec.env` gets DDIP_TEMPLATE_SOCKET added.
  void start(SpawnSpec spec);
  // Kills the current template, if any: state kDead with `why`.
  void stop(const std::string& why);
  Status status() const;
  // Waits up to `timeout` while the template is starting; the status then.
  Status wait_ready(std::chrono::milliseconds timeout) const;

  // Forks one rank with the spec's argv, env and cwd and its output to fresh pipes. nullopt when
  // the template can't (not ready, dead, refused, no answer in `timeout`): last_error() says why.
  // A template that refuses or does not answer is stopped: it is never asked again.
  std::optional<ForkedRank> fork(const SpawnSpec& spec,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(10));
  std::string last_error() const;
  // Ranks forked so far, and fork() calls that returned nullopt (for "how many started cold").
  uint64_t forks() const;
  uint64_t refusals() const;

 private:
  struct Pending;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  Status status_;
  std::string last_error_;
  uint64_t forks_ = 0, refusals_ = 0;
  pid_t owner_pid_ = -1;
  EventLoop loop_{"the rank template's handle is closing"};  // post() is thread-safe

  // Owned by the owner thread.
  Supervisor supervisor_;
  std::optional<size_t> child_;
  std::unique_ptr<Connection> conn_;
  std::unique_ptr<RuntimeDir> dir_;
  std::unique_ptr<Listener> listener_;
  Fd out_, err_;
  std::string tail_;  // last bytes of the template's stdout+stderr
  std::deque<std::shared_ptr<Pending>> pending_;
  std::thread thread_;

  void loop();
  void on_accept();
  void on_connection_end(Connection::End how, const std::string& why);
  void forget_child();  // stops watching the template's fds and lets go of them
  void set_status(State s, std::string detail);
  void do_start(SpawnSpec spec);
  void do_stop(const std::string& why);
  void on_frame(Frame f);
  void on_exit();
  void drain(Fd& fd);
  void fail_pending(const std::string& why);
};

// The template's side. Single-threaded by contract: fork() refuses when the process has more
// than one thread (the copy would hold locks of threads that don't exist in it).
class ForkServer {
 public:
  struct Request {
    std::vector<std::string> argv, env;
    std::string cwd;
    Fd out, err;
  };

  // Connects to the kernel's DDIP_TEMPLATE_SOCKET path.
  explicit ForkServer(const std::string& socket_path);
  void ready(std::string info);
  void failed(std::string why);
  // Waits up to `timeout` for a request; nullopt on timeout. Throws EndOfKernel on EOF.
  std::optional<Request> next(std::chrono::milliseconds timeout);
  // Parent: answers the kernel and returns the child's pid. Child (returns 0): in its own
  // process group, PR_SET_PDEATHSIG set, stdout/stderr on the request's pipes, stdin on
  // /dev/null, in the request's cwd, the template's socket closed, the signal mask emptied.
  // On failure the kernel is told why (kForkRefused) and this throws in the parent.
  pid_t fork(Request& req);
  void refuse(Request& req, const std::string& why);
  bool closed() const { return !sock_; }

 private:
  std::optional<Channel> sock_;
  pid_t kernel_ = -1;
  long tid_offset_ = -1;  // where glibc keeps the thread's tid in its descriptor, if found

  // fork()'s two sides: the child sets itself up (or reports the step that failed on `report`
  // and exits); the parent reads that report and answers the kernel (kForked, kForkRefused).
  void become_rank(Request& req, Pipe& report);
  pid_t answer(Request& req, pid_t pid, Fd pidfd, Pipe& report);
};

// The kernel went away (the template's socket reached EOF).
struct EndOfKernel : std::runtime_error {
  EndOfKernel() : std::runtime_error("the kernel closed the rank template's socket") {}
};

namespace detail {
std::string encode_strings(const std::vector<std::vector<std::string>>& lists);
std::vector<std::vector<std::string>> decode_strings(const std::string& data);
// Threads in this process (entries of /proc/self/task); their names when `names`.
size_t thread_count(std::string* names = nullptr);
}  // namespace detail

}  // namespace ddip
