// The worker side of a group's connection. While the worker waits for a request in recv(), that
// thread reads the kernel's frames itself, so a request costs no hand-off between threads. A
// watchdog thread takes the reading over once the worker has been away from recv() for 10 ms
// (it runs a request; a timer the worker arms as it leaves recv() wakes the watchdog, so an idle
// or quick worker costs it nothing): it answers heartbeats (so a worker busy in Python or C still
// looks alive) and stack requests, and, when the kernel goes away, makes the process exit even if
// Python is stuck. Stack, abort and collectives requests are always answered on the watchdog's
// thread.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ddip/channel.hpp"

namespace ddip {

class EndpointClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct EndpointOptions {
  // After the kernel hangs up, how long Python gets to exit before the process is ended (with
  // its whole process group, when it leads one, as a rank the Supervisor started does).
  std::chrono::milliseconds exit_grace{3000};
  // The kernel's pid (DDIP_KERNEL_PID); 0: unknown. When known and this process leads its own
  // process group, the kernel's death kills the whole group at once: the rank and whatever it
  // started (subprocesses, `!cmd`, DataLoader workers) that may hold GPU memory.
  pid_t kernel_pid = 0;
  // No frame at all from the kernel for this long (heartbeats come every second) means it is
  // gone (DDIP_KERNEL_TIMEOUT_MS, for workers on other hosts); 0: only a hang-up means that.
  std::chrono::milliseconds kernel_timeout{0};

  // Options from DDIP_KERNEL_PID and DDIP_KERNEL_TIMEOUT_MS; exit_grace keeps its default.
  static EndpointOptions from_environment();
};

// The signal a rank's parent death is turned into: a C handler kills the rank's process group.
// A real-time one: Python, torch, NCCL and user code leave those alone, while SIGUSR1/2 are
// taken by user code and launchers (Slurm's preemption notice, for one).
int kernel_death_signal();

class Endpoint {
 public:
  // Connects to `socket_path` and sends a Hello frame for `rank` carrying `hello`.
  Endpoint(const std::string& socket_path, int rank, std::string hello,
           EndpointOptions options = {});
  Endpoint(const std::string& socket_path, int rank, std::string hello,
           std::chrono::milliseconds exit_grace)
      : Endpoint(socket_path, rank, std::move(hello), EndpointOptions{exit_grace}) {}
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ~Endpoint();

  int rank() const { return rank_; }
  // Thread-safe.
  void send(Frame f);
  // A frame from the kernel (heartbeats and stack requests excluded), or nullopt after
  // `timeout`, or sooner when a signal interrupted the wait (the caller's Python runs its
  // handlers then: an idle rank need not wake to look for them). Throws EndpointClosed once the
  // kernel has hung up and every frame has been taken.
  std::optional<Frame> recv(std::chrono::milliseconds timeout);
  bool closed() const;

  // Stack requests are answered with what the process writes to the pipe `read_end` when sent
  // `signum` (Python's faulthandler.register(signum, file=<write end>, all_threads=True)). The
  // Endpoint owns `read_end` from now on. The watchdog blocks `signum` for itself, so the handler
  // runs on a Python thread, even one stuck in C code.
  void enable_stack_dumps(int signum, Fd read_end);
  // Heal's abort requests (kAbortRequest) raise `signum` in this process, whose handler
  // (faulthandler's, waking a Python thread that aborts the process groups) is kept as below.
  void enable_abort(int signum);
  // Collectives requests (kCollectivesRequest) are handed to whoever reads the pipe `write_end`
  // belongs to: each request's seq, 8 bytes, written without blocking (a Python thread reads
  // them and answers with kCollectives). Requests that come before (a rank asked right after its
  // hello, while it is still starting) are kept and handed over then.
  void enable_collectives(Fd write_end);

  // The handler now installed for `signum` is the runtime's: kept from here on. Requests are
  // answered by raising a signal on the rank itself, and code the rank runs may reset handlers
  // (Lightning's teardown puts back SIG_DFL over every handler installed in C), while a real-time
  // signal's default action is to terminate. So before raising one, and on every heartbeat, the
  // watchdog puts the kept handler back wherever it finds SIG_DFL or SIG_IGN. A signal another
  // handler has taken over is left to it and not raised: the answer says so.
  void keep_signal(int signum);

 private:
  enum class Kept { kYes, kPutBack, kTaken, kUnknown };
  Kept keep(int signum);  // puts `signum`'s handler back if it was reset
  void keep_all();
  std::string taken_note(int signum, const char* what);
  void abort_collectives();

  int rank_;
  EndpointOptions options_;
  Channel channel_;  // reading: the reader_ thread only; writing: under send_mu_
  std::mutex send_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;        // recv()'s waits
  std::condition_variable watch_cv_;  // the watchdog's (kept apart: a request wakes no one else)
  std::deque<Frame> inbox_;
  bool closed_ = false;
  bool stopping_ = false;
  // Who reads the channel (under mu_): the watchdog, or the thread waiting in recv().
  enum class Reader { kWatchdog, kCaller };
  Reader reader_ = Reader::kWatchdog;
  bool caller_waiting_ = false;  // a thread is in recv()
  // Armed as the caller leaves recv(), left armed when it comes back (two syscalls a request
  // less); the watchdog, woken, takes over only if the caller has been away kTakeOver.
  bool timer_armed_ = false;
  bool timer_long_ = false;  // armed for kBackSoon: the caller left empty-handed
  std::chrono::steady_clock::duration last_wait_{};  // the caller's last time in recv()
  std::chrono::steady_clock::time_point caller_left_{};
  bool hand_back_ = false;       // recv() asked the watchdog for the channel (and wrote wake_)
  std::deque<Frame> chores_;     // read by the caller, answered by the watchdog (stacks, aborts)
  std::atomic<int64_t> last_heard_ns_{0};  // steady clock: when the kernel last sent anything
  Fd wake_;   // eventfd: wakes the watchdog (the channel wanted back, a chore, the end)
  Fd timer_;  // timerfd: armed as the worker leaves recv(), fires if it stays away (kTakeOver)
  void wake_watchdog();
  std::mutex stack_mu_;  // held while a dump is read
  int stack_signal_ = 0;
  Fd stack_pipe_;
  std::mutex signals_mu_;
  std::map<int, struct sigaction> kept_;  // signum -> the runtime's handler
  int abort_signal_ = 0;
  Fd collectives_pipe_;  // under signals_mu_
  std::vector<uint64_t> early_collectives_;  // requests before enable_collectives, under signals_mu_
  void ask_collectives(uint64_t seq);
  void hand_collectives(uint64_t seq);  // under signals_mu_, the pipe set
  std::thread watchdog_;

  void watch();
  // One frame read from the kernel: answered at once (heartbeats), left to the watchdog (chores,
  // when `caller` read it), or queued for recv(). True when it went to the inbox.
  bool take(Frame f, bool caller);
  void chore(const Frame& f);  // a stack, abort or collectives request, on the watchdog's thread
  // The reader's wait for frames until `deadline` (the watchdog also wakes on wake_): false once
  // the kernel is gone (hang-up, or silent for kernel_timeout). A signal ends the wait early,
  // setting `*interrupted`.
  bool read_frames(std::chrono::steady_clock::time_point deadline, bool caller,
                   bool* interrupted = nullptr);
  std::string dump_stacks();
  void tie_group_to_kernel();
};

}  // namespace ddip
