#include "ddip/keeper.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <future>
#include <mutex>
#include <stdexcept>

#include "ddip/event_loop.hpp"

namespace ddip {
namespace detail {

namespace {
constexpr size_t kTailBytes = 16384;
constexpr size_t kTailLines = 20;
}  // namespace

struct StandingAgent {
  std::vector<std::string> argv;
  std::string key;  // its environment and cwd: an agent is reused only for the same ones
  // The keeper thread's.
  size_t child = 0;
  Fd in, out, err;
  // Guarded by KeeperCore::mu.
  pid_t pid = -1;
  bool leased = false;
  bool retired = false;   // its group did not end cleanly there: never reused
  bool released = false;  // the kernel let its host go: stopped once its group ends
  bool let_go = false;    // its stdin is closed
  std::optional<ExitStatus> status;
  std::string tail;  // what the launcher printed since its lease began
  std::function<void()> on_exit;
};

struct KeeperCore {
  KeeperCore(std::chrono::milliseconds g, std::chrono::milliseconds k) : grace(g), keepalive(k) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<StandingAgent>> agents;  // until reaped
  const std::chrono::milliseconds grace;
  // An empty line to every agent this often: an idle agent that hears nothing for much longer
  // (a host cut off while no group ran: no link, no heartbeats) knows the kernel is gone.
  const std::chrono::milliseconds keepalive;
  EventLoop loop{"the kernel's standing host agents are being let go"};  // post() is thread-safe
  Supervisor supervisor;                                                 // the keeper thread's

  void spawn(const std::shared_ptr<StandingAgent>& a, SpawnSpec spec);
  void let_go(const std::shared_ptr<StandingAgent>& a);
  void drain(const std::shared_ptr<StandingAgent>& a, Fd& fd);
  void on_exit(const std::shared_ptr<StandingAgent>& a);
  void run();
  bool any_running();
  void keep_alive();
};

void KeeperCore::keep_alive() {
  std::vector<std::shared_ptr<StandingAgent>> all;
  {
    std::lock_guard lock(mu);
    all = agents;
  }
  for (auto& a : all) {
    if (!a->in) continue;
    ssize_t ignored = ::write(a->in.get(), "\n", 1);  // EAGAIN, EPIPE: its exit says the rest
    (void)ignored;
  }
  loop.after(keepalive, [this] { keep_alive(); });
}

void KeeperCore::spawn(const std::shared_ptr<StandingAgent>& a, SpawnSpec spec) {
  spec.stdin_pipe = true;  // tickets go there; its end of file ends the agent
  spec.null_stdin = false;
  spec.stdin_data.clear();
  spec.capture_output = true;
  size_t idx = supervisor.spawn(spec);  // this thread's: PR_SET_PDEATHSIG ties it to the keeper
  Child& c = supervisor.child(idx);
  a->child = idx;
  a->in = std::move(c.stdin_pipe());
  a->out = std::move(c.stdout_pipe());
  a->err = std::move(c.stderr_pipe());
  // A ticket is one short line into an empty pipe; never let a stuck agent block this thread.
  if (a->in) ::fcntl(a->in.get(), F_SETFL, ::fcntl(a->in.get(), F_GETFL) | O_NONBLOCK);
  loop.watch(c.pidfd(), EPOLLIN, [this, a](uint32_t) { on_exit(a); });
  if (a->out) loop.watch(a->out.get(), EPOLLIN, [this, a](uint32_t) { drain(a, a->out); });
  if (a->err) loop.watch(a->err.get(), EPOLLIN, [this, a](uint32_t) { drain(a, a->err); });
  std::lock_guard lock(mu);
  a->pid = c.pid();
  agents.push_back(a);
}

void KeeperCore::let_go(const std::shared_ptr<StandingAgent>& a) {
  {
    std::lock_guard lock(mu);
    if (a->let_go || a->status) return;
    a->let_go = true;
  }
  a->in.reset();  // end of file: the agent stops its ranks and template and exits
  loop.after(grace, [this, a] {
    std::lock_guard lock(mu);
    if (a->status) return;
    try {
      supervisor.signal(a->child, SIGKILL, true);  // the pidfd then reports its exit
    } catch (const std::exception&) {
    }
  });
}

void KeeperCore::drain(const std::shared_ptr<StandingAgent>& a, Fd& fd) {
  if (!fd) return;
  char buf[4096];
  auto end = read_available(fd.get(), buf, sizeof buf, [&](std::string_view piece) {
    std::lock_guard lock(mu);
    a->tail.append(piece);
    if (a->tail.size() > kTailBytes) a->tail.erase(0, a->tail.size() - kTailBytes);
    return true;
  });
  if (end == ReadEnd::kEnded) {
    loop.unwatch(fd.get());
    fd.reset();
  }
}

void KeeperCore::on_exit(const std::shared_ptr<StandingAgent>& a) {
  drain(a, a->out);
  drain(a, a->err);
  auto st = supervisor.poll(a->child);
  if (!st) return;  // woken early; the pidfd stays watched
  loop.unwatch(supervisor.child(a->child).pidfd());
  for (Fd* fd : {&a->out, &a->err})
    if (*fd) {
      loop.unwatch(fd->get());
      fd->reset();
    }
  a->in.reset();
  std::lock_guard lock(mu);
  a->status = *st;
  std::erase(agents, a);
  if (a->on_exit) a->on_exit();  // only posts: see lease()
  cv.notify_all();
}

bool KeeperCore::any_running() {
  std::lock_guard lock(mu);
  return !agents.empty();
}

void KeeperCore::run() {
  // A ticket written to an agent that just died must be an error (EPIPE), not this process's
  // death: SIGPIPE stays blocked on this thread (its children start with an empty mask).
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  loop.after(keepalive, [this] { keep_alive(); });
  while (!loop.closed()) {
    try {
      loop.run_once();
    } catch (const std::exception&) {
      // A failing fd of one launcher: its exit still comes by its pidfd.
    }
  }
  loop.run_once(std::chrono::steady_clock::now());  // commands posted before close() still run
  // The kernel is letting its hosts go: every agent's stdin closed, the grace, then SIGKILL.
  std::vector<std::shared_ptr<StandingAgent>> all;
  {
    std::lock_guard lock(mu);
    all = agents;
  }
  for (auto& a : all) let_go(a);
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (any_running() && std::chrono::steady_clock::now() < deadline) {
    try {
      loop.run_once(deadline);
    } catch (const std::exception&) {
    }
  }
  supervisor.stop_all(std::chrono::milliseconds(0));
}

}  // namespace detail

AgentKeeper::AgentKeeper(std::chrono::milliseconds stop_grace, std::chrono::milliseconds keepalive)
    : core_(std::make_shared<detail::KeeperCore>(stop_grace, keepalive)) {
  owner_pid_ = ::getpid();
  thread_ = std::thread([core = core_] { core->run(); });
}

AgentKeeper::~AgentKeeper() {
  if (::getpid() != owner_pid_) {  // a fork of the kernel: the keeper thread isn't in this copy
    thread_.detach();
    return;
  }
  core_->loop.close();
  thread_.join();
}

std::unique_ptr<AgentLease> AgentKeeper::lease(const SpawnSpec& launcher,
                                               std::function<void()> on_exit) {
  std::string key = launcher.cwd;
  for (const auto& kv : launcher.env) key += '\0' + kv;
  std::vector<std::shared_ptr<detail::StandingAgent>> stale;
  {
    std::lock_guard lock(core_->mu);
    for (auto& a : core_->agents) {
      if (a->leased || a->retired || a->released || a->let_go || a->status ||
          a->argv != launcher.argv)
        continue;
      if (a->key != key) {
        // Same host, other environment: one standing agent per host, the one started as asked.
        a->retired = true;
        stale.push_back(a);
        continue;
      }
      a->leased = true;
      a->tail.clear();
      a->on_exit = std::move(on_exit);
      for (auto& s : stale) core_->loop.post([core = core_, s] { core->let_go(s); });
      return std::make_unique<AgentLease>(core_, a, true);
    }
  }
  for (auto& s : stale) core_->loop.post([core = core_, s] { core->let_go(s); });
  auto a = std::make_shared<detail::StandingAgent>();
  a->argv = launcher.argv;
  a->key = std::move(key);
  a->leased = true;
  a->on_exit = std::move(on_exit);
  auto done = std::make_shared<std::promise<void>>();
  auto spawned = done->get_future();
  core_->loop.post([core = core_, a, spec = launcher, done]() mutable {
    try {
      core->spawn(a, std::move(spec));
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  });
  spawned.get();
  return std::make_unique<AgentLease>(core_, a, false);
}

size_t AgentKeeper::release(std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<detail::StandingAgent>> idle;
  {
    std::lock_guard lock(core_->mu);
    for (auto& a : core_->agents) {
      a->released = true;
      if (!a->leased) idle.push_back(a);
    }
  }
  for (auto& a : idle) core_->loop.post([core = core_, a] { core->let_go(a); });
  std::unique_lock lock(core_->mu);
  core_->cv.wait_for(lock, timeout, [&] {
    for (auto& a : idle)
      if (!a->status) return false;
    return true;
  });
  return idle.size();
}

std::vector<pid_t> AgentKeeper::launchers() const {
  std::lock_guard lock(core_->mu);
  std::vector<pid_t> out;
  for (auto& a : core_->agents) out.push_back(a->pid);
  return out;
}

AgentLease::AgentLease(std::shared_ptr<detail::KeeperCore> core,
                       std::shared_ptr<detail::StandingAgent> a, bool reused)
    : core_(std::move(core)), agent_(std::move(a)), reused_(reused) {}

AgentLease::~AgentLease() {
  bool go;
  {
    std::lock_guard lock(core_->mu);
    agent_->leased = false;
    agent_->on_exit = nullptr;
    go = (agent_->retired || agent_->released) && !agent_->status;
  }
  if (!go) return;
  try {
    core_->loop.post([core = core_, a = agent_] { core->let_go(a); });
  } catch (const std::runtime_error&) {
    // The keeper is going: it lets every agent go itself.
  }
}

pid_t AgentLease::pid() const {
  std::lock_guard lock(core_->mu);
  return agent_->pid;
}

void AgentLease::send(std::string line) {
  try {
    core_->loop.post([a = agent_, line = std::move(line)] {
      size_t done = 0;
      while (a->in && done < line.size()) {
        ssize_t n = ::write(a->in.get(), line.data() + done, line.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;  // the agent is gone (EPIPE): its launcher's exit says so
        done += static_cast<size_t>(n);
      }
    });
  } catch (const std::runtime_error&) {
    // The keeper is going, and the agent with it: its launcher's exit says so.
  }
}

void AgentLease::retire() {
  {
    std::lock_guard lock(core_->mu);
    if (agent_->retired) return;
    agent_->retired = true;
  }
  try {
    core_->loop.post([core = core_, a = agent_] { core->let_go(a); });
  } catch (const std::runtime_error&) {
  }
}

bool AgentLease::retired() const {
  std::lock_guard lock(core_->mu);
  return agent_->retired;
}

std::optional<ExitStatus> AgentLease::exit_status() const {
  std::lock_guard lock(core_->mu);
  return agent_->status;
}

std::string AgentLease::tail() const {
  std::string t;
  {
    std::lock_guard lock(core_->mu);
    t = agent_->tail;
  }
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r')) t.pop_back();
  size_t start = t.size(), lines = 0;
  while (start > 0) {
    if (t[start - 1] == '\n' && ++lines == detail::kTailLines) break;
    --start;
  }
  return t.substr(start);
}

}  // namespace ddip
