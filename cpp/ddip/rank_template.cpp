#include "ddip/rank_template.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <future>
#include <stdexcept>
#include <system_error>

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif

namespace ddip {
namespace detail {

using std::chrono::milliseconds;

constexpr size_t kTailBytes = 4096;

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), sizeof v); }

uint32_t get_u32(const std::string& s, size_t& off) {
  if (off + sizeof(uint32_t) > s.size()) throw std::runtime_error("truncated fork request");
  uint32_t v;
  std::memcpy(&v, s.data() + off, sizeof v);
  off += sizeof v;
  return v;
}

std::string encode_strings(const std::vector<std::vector<std::string>>& lists) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(lists.size()));
  for (const auto& list : lists) {
    put_u32(out, static_cast<uint32_t>(list.size()));
    for (const auto& s : list) {
      put_u32(out, static_cast<uint32_t>(s.size()));
      out += s;
    }
  }
  return out;
}

std::vector<std::vector<std::string>> decode_strings(const std::string& data) {
  size_t off = 0;
  std::vector<std::vector<std::string>> lists(get_u32(data, off));
  for (auto& list : lists) {
    list.resize(get_u32(data, off));
    for (auto& s : list) {
      uint32_t n = get_u32(data, off);
      if (off + n > data.size()) throw std::runtime_error("truncated fork request");
      s.assign(data, off, n);
      off += n;
    }
  }
  return lists;
}

size_t thread_count(std::string* names) {
  DIR* d = ::opendir("/proc/self/task");
  if (!d) throw_errno("opendir", "counting the template's threads");
  size_t n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    ++n;
    if (!names) continue;
    std::string path = std::string("/proc/self/task/") + e->d_name + "/comm";
    char comm[64] = {};
    Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    ssize_t got = f ? ::read(f.get(), comm, sizeof comm - 1) : -1;
    if (got > 0 && comm[got - 1] == '\n') comm[got - 1] = 0;
    if (!names->empty()) *names += ", ";
    *names += got > 0 ? comm : "?";
  }
  ::closedir(d);
  return n;
}

// glibc caches each thread's tid in its descriptor (pthread_self()); fork() refreshes it in the
// child, a raw clone does not. The field is private, so find it: the one offset that holds the
// tid in the descriptors of two different threads.
constexpr long kDescriptorScan = 1024;

__attribute__((no_sanitize("address"))) std::vector<long> tid_offsets() {
  std::vector<long> found;
  auto* self = reinterpret_cast<const char*>(::pthread_self());
  pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  for (long off = 0; off + static_cast<long>(sizeof(pid_t)) <= kDescriptorScan;
       off += sizeof(pid_t)) {
    // A plain aligned load: memcpy would be an (instrumented) call under the sanitizers.
    if (*reinterpret_cast<const volatile pid_t*>(self + off) == tid) found.push_back(off);
  }
  return found;
}

long find_tid_offset() {
  std::vector<long> mine = tid_offsets(), theirs;
  std::thread probe([&theirs] { theirs = tid_offsets(); });
  probe.join();
  long only = -1;
  for (long off : mine)
    for (long t : theirs)
      if (off == t) {
        if (only >= 0) return -1;  // ambiguous: leave glibc's cache alone
        only = off;
      }
  return only;
}

struct CloneArgs {  // struct clone_args (linux/sched.h), without that header's clashes
  uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
};

// Runs in the fresh child, which is single-threaded and owns a copy of the template's memory.
// Returns the failing step, or nullptr.
const char* set_up_child(pid_t kernel, ForkServer::Request& req) {
  if (::setpgid(0, 0) < 0) return "setpgid";
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) return "prctl";
  if (::getppid() != kernel) ::_exit(1);  // the kernel already died: don't start an orphan
  if (::dup2(req.out.get(), 1) < 0 || ::dup2(req.err.get(), 2) < 0) return "dup2";
  Fd null(::open("/dev/null", O_RDONLY));
  if (!null || ::dup2(null.get(), 0) < 0) return "open(/dev/null)";
  if (!req.cwd.empty() && ::chdir(req.cwd.c_str()) < 0) return "chdir";
  return nullptr;
}

}  // namespace detail

// -- kernel side ---------------------------------------------------------------------------------

struct RankTemplate::Pending {  // one fork() call; fields guarded by RankTemplate::mu_
  Fd out, err;                  // read ends, handed over with the result
  bool done = false, abandoned = false;
  std::optional<ForkedRank> result;
  std::string error;
};

RankTemplate::RankTemplate() {
  owner_pid_ = ::getpid();
  thread_ = std::thread([this] { loop(); });
}

RankTemplate::~RankTemplate() {
  if (::getpid() != owner_pid_) {  // a fork of the kernel: the owner thread isn't in this copy
    thread_.detach();
    return;
  }
  loop_.close();  // commands already posted still run; the owner thread then ends
  thread_.join();
}

void RankTemplate::set_status(State s, std::string detail) {
  {
    std::lock_guard lock(mu_);
    status_.state = s;
    status_.detail = std::move(detail);
    if (s == State::kNone) status_.pid = -1;
  }
  cv_.notify_all();
}

RankTemplate::Status RankTemplate::status() const {
  std::lock_guard lock(mu_);
  return status_;
}

RankTemplate::Status RankTemplate::wait_ready(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [this] { return status_.state != State::kStarting; });
  return status_;
}

std::string RankTemplate::last_error() const {
  std::lock_guard lock(mu_);
  return last_error_;
}

uint64_t RankTemplate::forks() const {
  std::lock_guard lock(mu_);
  return forks_;
}

uint64_t RankTemplate::refusals() const {
  std::lock_guard lock(mu_);
  return refusals_;
}

void RankTemplate::start(SpawnSpec spec) {
  auto done = std::make_shared<std::promise<void>>();
  auto started = done->get_future();
  loop_.post([this, spec = std::move(spec), done]() mutable {
    try {
      do_start(std::move(spec));
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  });
  started.get();
}

void RankTemplate::stop(const std::string& why) {
  auto done = std::make_shared<std::promise<void>>();
  auto stopped = done->get_future();
  loop_.post([this, why, done] {
    do_stop(why);
    done->set_value();
  });
  stopped.get();
}

void RankTemplate::do_start(SpawnSpec spec) {
  do_stop("replaced by a new template");
  dir_ = std::make_unique<RuntimeDir>();
  listener_ = std::make_unique<Listener>(dir_->socket_path());
  loop_.watch(listener_->fd(), EPOLLIN, [this](uint32_t) { on_accept(); });
  spec.env.push_back("DDIP_TEMPLATE_SOCKET=" + dir_->socket_path());
  spec.capture_output = true;
  tail_.clear();
  size_t idx = supervisor_.spawn(spec);  // this thread's: PR_SET_PDEATHSIG ties it to us
  child_ = idx;
  Child& c = supervisor_.child(idx);
  out_ = std::move(c.stdout_pipe());
  err_ = std::move(c.stderr_pipe());
  loop_.watch(c.pidfd(), EPOLLIN, [this](uint32_t) { on_exit(); });
  if (out_) loop_.watch(out_.get(), EPOLLIN, [this](uint32_t) { drain(out_); });
  if (err_) loop_.watch(err_.get(), EPOLLIN, [this](uint32_t) { drain(err_); });
  {
    std::lock_guard lock(mu_);
    status_.pid = c.pid();
  }
  set_status(State::kStarting, "");
}

void RankTemplate::do_stop(const std::string& why) {
  if (child_ && supervisor_.running(*child_)) {
    supervisor_.signal(*child_, SIGKILL);
    supervisor_.wait(*child_, detail::milliseconds(-1));
    set_status(State::kDead, why);
  }
  forget_child();
  fail_pending(why);
}

void RankTemplate::fail_pending(const std::string& why) {
  {
    std::lock_guard lock(mu_);
    for (auto& p : pending_) {
      p->done = true;
      p->error = why;
    }
  }
  pending_.clear();
  cv_.notify_all();
}

std::optional<ForkedRank> RankTemplate::fork(const SpawnSpec& spec,
                                             std::chrono::milliseconds timeout) {
  auto refuse = [this](std::string why) -> std::optional<ForkedRank> {
    std::lock_guard lock(mu_);
    last_error_ = std::move(why);
    ++refusals_;
    return std::nullopt;
  };
  {
    std::unique_lock lock(mu_);
    if (status_.state != State::kReady) {
      lock.unlock();
      return refuse("the rank template is not ready");
    }
  }
  if (spec.argv.empty()) throw std::invalid_argument("SpawnSpec.argv is empty");
  Pipe out = make_pipe(true), err = make_pipe(true);
  auto p = std::make_shared<Pending>();
  p->out = std::move(out.read);
  p->err = std::move(err.read);
  Frame f =
      Frame::make(kForkRequest, 0, 0, detail::encode_strings({spec.argv, spec.env, {spec.cwd}}));
  f.fds = std::make_shared<std::vector<Fd>>();
  f.fds->push_back(std::move(out.write));
  f.fds->push_back(std::move(err.write));
  try {
    loop_.post([this, p, f = std::move(f)]() mutable {
      if (!conn_) {
        std::lock_guard lock(mu_);
        p->done = true;
        p->error = "the rank template is not connected";
        cv_.notify_all();
        return;
      }
      pending_.push_back(p);
      conn_->send(std::move(f));  // a failure stops the template (on_connection_end)
    });
  } catch (const std::runtime_error& e) {
    return refuse(e.what());
  }
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return p->done; })) {
    p->abandoned = true;  // a late answer's rank is killed by the owner thread
    lock.unlock();
    std::string why = "the rank template did not answer a fork request within " +
                      std::to_string(timeout.count()) + " ms";
    try {
      loop_.post([this, why] { do_stop(why); });
    } catch (const std::runtime_error&) {
    }
    return refuse(why);
  }
  if (!p->result) {
    std::string why = p->error;
    lock.unlock();
    return refuse(why);
  }
  ++forks_;
  return std::move(p->result);
}

void RankTemplate::on_frame(Frame f) {
  switch (f.kind) {
    case kTemplateReady:
      set_status(State::kReady, f.data());
      return;
    case kTemplateFailed:
      set_status(State::kFailed, f.data());
      return;
    case kForked:
    case kForkRefused:
      break;
    default:
      return;  // not ours to act on
  }
  Fd pidfd;
  if (f.fds && !f.fds->empty()) pidfd = std::move(f.fds->front());
  std::shared_ptr<Pending> p;
  if (!pending_.empty()) {
    p = pending_.front();
    pending_.pop_front();
  }
  bool abandoned = true;
  if (p) {
    std::lock_guard lock(mu_);
    abandoned = p->abandoned;
  }
  if (f.kind == kForked && pidfd && !abandoned) {
    ForkedRank r;
    r.pid = static_cast<pid_t>(std::stol(f.data()));
    r.pidfd = std::move(pidfd);
    std::lock_guard lock(mu_);
    r.out = std::move(p->out);
    r.err = std::move(p->err);
    p->result = std::move(r);
    p->done = true;
  } else {
    if (pidfd) {
      // A child nobody will adopt (it failed to set up, or its caller gave up): it is ours to
      // kill and reap. __WALL: its exit signal is the template's, which may be 0.
      ::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0);
      siginfo_t info{};
      while (detail::waitid_pidfd(pidfd.get(), &info, WEXITED | __WALL) < 0 && errno == EINTR) {
      }
    }
    // Refused without a child: the template found itself unsafe to fork; never ask it again
    // (stopped before the caller hears of it, so it sees the template gone).
    if (f.kind == kForkRefused && !pidfd) do_stop("the rank template refused to fork: " + f.data());
    if (p) {
      std::lock_guard lock(mu_);
      p->done = true;
      p->error = f.kind == kForkRefused ? f.data() : "the rank template's answer had no pidfd";
    }
  }
  cv_.notify_all();
}

void RankTemplate::drain(Fd& fd) {
  if (!fd) return;
  char buf[4096];
  auto end = read_available(fd.get(), buf, sizeof buf, [&](std::string_view piece) {
    tail_.append(piece);
    if (tail_.size() > detail::kTailBytes) tail_.erase(0, tail_.size() - detail::kTailBytes);
    return true;
  });
  if (end == ReadEnd::kEnded) {
    loop_.unwatch(fd.get());
    fd.reset();
  }
}

void RankTemplate::on_exit() {
  if (!child_) return;
  drain(out_);
  drain(err_);
  auto st = supervisor_.poll(*child_);
  if (!st) return;
  forget_child();
  std::string why = "the rank template exited (" + st->describe() + ")";
  // The last few lines of what it printed: usually the reason.
  size_t start = tail_.size(), lines = 0;
  while (start > 0 && lines < 6)
    if (tail_[--start] == '\n' && start + 1 < tail_.size()) ++lines;
  std::string last = tail_.substr(start);
  while (!last.empty() && (last.front() == '\n')) last.erase(0, 1);
  while (!last.empty() && (last.back() == '\n')) last.pop_back();
  if (!last.empty()) why += "; its last output:\n" + last;
  fail_pending(why);
  if (status().state != State::kFailed) set_status(State::kDead, why);
}

void RankTemplate::forget_child() {
  if (child_) loop_.unwatch(supervisor_.child(*child_).pidfd());
  child_.reset();
  conn_.reset();
  if (listener_) loop_.unwatch(listener_->fd());
  listener_.reset();
  dir_.reset();
  for (Fd* fd : {&out_, &err_}) {
    if (*fd) loop_.unwatch(fd->get());
    fd->reset();
  }
}

void RankTemplate::on_accept() {
  while (Fd fd = listener_->accept()) {
    Channel ch(std::move(fd));
    if (!child_ || ch.peer_pid() != supervisor_.child(*child_).pid()) continue;
    conn_ = std::make_unique<Connection>(
        loop_, std::move(ch), [this](Frame f) { on_frame(std::move(f)); },
        [this](Connection::End how, const std::string& why) { on_connection_end(how, why); });
    loop_.unwatch(listener_->fd());  // one connection, from our template only
    listener_.reset();
    dir_.reset();
    return;
  }
}

void RankTemplate::on_connection_end(Connection::End how, const std::string& why) {
  // A broken socket or a corrupt frame: this template can't be trusted any more. A plain close:
  // its exit comes by the pidfd.
  if (how != Connection::End::kClosed)
    return do_stop("the rank template's connection failed: " + why);
  conn_.reset();
}

void RankTemplate::loop() {
  while (!loop_.closed()) {
    try {
      loop_.run_once();
    } catch (const std::exception& e) {
      // A failing socket or fd: this template can't be trusted any more.
      try {
        do_stop(std::string("the rank template failed: ") + e.what());
      } catch (const std::exception&) {
      }
    }
  }
  loop_.run_once(std::chrono::steady_clock::now());  // commands posted before close() still run
  try {
    do_stop("the kernel's handle on the rank template was closed");
  } catch (const std::exception&) {
  }
}

// -- template side -------------------------------------------------------------------------------

ForkServer::ForkServer(const std::string& socket_path) {
  sock_.emplace(connect_unix(socket_path));
  kernel_ = ::getppid();
  tid_offset_ = detail::find_tid_offset();
}

void ForkServer::ready(std::string info) {
  if (sock_) sock_->send(Frame::make(kTemplateReady, 0, 0, std::move(info)));
}

void ForkServer::failed(std::string why) {
  if (sock_) sock_->send(Frame::make(kTemplateFailed, 0, 0, std::move(why)));
}

std::optional<ForkServer::Request> ForkServer::next(std::chrono::milliseconds timeout) {
  if (!sock_) throw EndOfKernel();
  while (true) {
    if (!sock_->has_frame()) {  // else the last read brought this one in already
      pollfd p{sock_->fd(), POLLIN, 0};
      int rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
      if (rc < 0 && errno == EINTR) return std::nullopt;
      if (rc < 0) throw_errno("poll", "waiting for a fork request");
      if (rc == 0) return std::nullopt;
    }
    auto f = sock_->recv();
    if (!f) {
      sock_.reset();
      throw EndOfKernel();
    }
    if (f->kind != kForkRequest) continue;
    auto lists = detail::decode_strings(f->data());
    if (lists.size() != 3 || lists[2].size() != 1 || !f->fds || f->fds->size() != 2)
      throw std::runtime_error("malformed fork request");
    Request r;
    r.argv = std::move(lists[0]);
    r.env = std::move(lists[1]);
    r.cwd = std::move(lists[2][0]);
    r.out = std::move((*f->fds)[0]);
    r.err = std::move((*f->fds)[1]);
    return r;
  }
}

void ForkServer::refuse(Request& req, const std::string& why) {
  req.out.reset();
  req.err.reset();
  if (sock_) sock_->send(Frame::make(kForkRefused, 0, 0, why));
}

pid_t ForkServer::fork(Request& req) {
  if (!sock_) throw EndOfKernel();
  std::string names;
  if (size_t n = detail::thread_count(&names); n > 1) {
    std::string why = "the template has " + std::to_string(n) + " threads (" + names +
                      "); forking it would copy locks held by threads the rank would not have";
    refuse(req, why);
    throw std::runtime_error(why);
  }
  Pipe report = make_pipe();
  int pidfd = -1;
  detail::CloneArgs args{};
  // CLONE_PARENT: the rank is the kernel's child (and gets the template's exit signal, as
  // the kernel's Supervisor expects); CLONE_PIDFD: the kernel watches it without pid races.
  args.flags = CLONE_PARENT | CLONE_PIDFD;
  args.pidfd = reinterpret_cast<uint64_t>(&pidfd);
  // No handler may run between the clone and the child's own setup.
  sigset_t all, old;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old);
  long pid = ::syscall(SYS_clone3, &args, sizeof args);
  if (pid == 0) {
    become_rank(req, report);
    return 0;
  }
  int clone_errno = errno;
  ::sigprocmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    std::string why =
        std::string("clone3 failed while forking a rank: ") + std::strerror(clone_errno);
    refuse(req, why);
    throw std::system_error(clone_errno, std::generic_category(),
                            "clone3 failed while forking a rank");
  }
  return answer(req, static_cast<pid_t>(pid), Fd(pidfd), report);
}

void ForkServer::become_rank(Request& req, Pipe& report) {
  if (tid_offset_ >= 0) {
    pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
    std::memcpy(reinterpret_cast<char*>(::pthread_self()) + tid_offset_, &tid, sizeof tid);
  }
  report.read.reset();
  const char* step = detail::set_up_child(kernel_, req);
  if (step) {
    int err = errno;
    char buf[64];
    size_t n = std::strlen(step);
    std::memcpy(buf, step, n + 1);
    std::memcpy(buf + n + 1, &err, sizeof err);
    ssize_t ignored = ::write(report.write.get(), buf, n + 1 + sizeof err);
    (void)ignored;
    ::_exit(err == ENOENT ? 127 : 126);
  }
  req.out.reset();
  req.err.reset();
  sock_.reset();
  report.write.reset();  // EOF: the parent knows setup went well
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

pid_t ForkServer::answer(Request& req, pid_t pid, Fd pidfd, Pipe& report) {
  req.out.reset();
  req.err.reset();
  report.write.reset();
  char buf[64] = {};
  ssize_t n;
  do {
    n = ::read(report.read.get(), buf, sizeof buf);
  } while (n < 0 && errno == EINTR);
  Frame f;
  if (n > 0) {
    size_t len = ::strnlen(buf, sizeof buf);
    int child_errno = 0;
    std::memcpy(&child_errno, buf + len + 1, sizeof child_errno);
    std::string what =
        std::string(buf) + " failed while starting a rank: " + std::strerror(child_errno);
    f = Frame::make(kForkRefused, 0, 0, what);
    f.fds = std::make_shared<std::vector<Fd>>();
    f.fds->push_back(std::move(pidfd));
    sock_->send(std::move(f));
    throw std::system_error(child_errno, std::generic_category(),
                            std::string(buf) + " failed while starting a rank");
  }
  f = Frame::make(kForked, 0, 0, std::to_string(pid));
  f.fds = std::make_shared<std::vector<Fd>>();
  f.fds->push_back(std::move(pidfd));
  sock_->send(std::move(f));
  return pid;
}

}  // namespace ddip
