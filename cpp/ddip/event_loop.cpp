#include "ddip/event_loop.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <vector>

namespace ddip {

EventLoop::EventLoop(std::string closed_message) : closed_message_(std::move(closed_message)) {
  epoll_ = Fd(check(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1", "creating an event loop"));
  wake_ = Fd(check(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), "eventfd", "creating the wake-up fd"));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  check(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev), "epoll_ctl(ADD)",
        "watching the wake-up fd");
}

void EventLoop::watch(int fd, uint32_t events, FdHandler handler) {
  add(fd, events, std::move(handler), false);
}

bool EventLoop::try_watch(int fd, uint32_t events, FdHandler handler) {
  return add(fd, events, std::move(handler), true);
}

bool EventLoop::add(int fd, uint32_t events, FdHandler handler, bool permissive) {
  if (by_fd_.count(fd)) throw std::logic_error("fd " + std::to_string(fd) + " is watched already");
  uint64_t id = next_watcher_++;
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    if (permissive && errno == EPERM) return false;
    throw_errno("epoll_ctl(ADD)", "watching an fd");
  }
  watchers_.emplace(id, std::make_shared<Watcher>(Watcher{fd, std::move(handler)}));
  by_fd_.emplace(fd, id);
  return true;
}

void EventLoop::modify(int fd, uint32_t events) {
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) throw std::logic_error("fd " + std::to_string(fd) + " is not watched");
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = it->second;
  check(::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &ev), "epoll_ctl(MOD)",
        "changing what an fd is watched for");
}

void EventLoop::unwatch(int fd) {
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  watchers_.erase(it->second);
  by_fd_.erase(it);
}

EventLoop::TimerId EventLoop::at(Clock::time_point when, Task fn) {
  TimerId id = next_timer_++;
  timer_at_.emplace(id, timers_.emplace(when, std::make_pair(id, std::move(fn))));
  return id;
}

void EventLoop::cancel(TimerId id) {
  auto it = timer_at_.find(id);
  if (it == timer_at_.end()) return;
  timers_.erase(it->second);
  timer_at_.erase(it);
}

void EventLoop::run_once(std::optional<Clock::time_point> deadline) {
  std::optional<Clock::time_point> wake = deadline;
  if (!timers_.empty()) wake = wake ? std::min(*wake, timers_.begin()->first) : timers_.begin()->first;
  int timeout = wake ? poll_timeout_ms(*wake) : -1;
  epoll_event evs[64];
  int n = ::epoll_wait(epoll_.get(), evs, 64, timeout);
  if (n < 0 && errno != EINTR) throw_errno("epoll_wait", "waiting in an event loop");
  bool woken = false;
  for (int k = 0; k < n; ++k) {
    uint64_t id = evs[k].data.u64;
    if (id == 0) {
      woken = true;
      continue;
    }
    auto it = watchers_.find(id);
    if (it == watchers_.end()) continue;  // unwatched by an earlier handler of this batch
    std::shared_ptr<Watcher> w = it->second;  // alive while it runs, even if it unwatches itself
    w->handler(evs[k].events);
  }
  if (woken) {
    uint64_t count;
    ssize_t ignored = ::read(wake_.get(), &count, sizeof count);
    (void)ignored;
  }
  run_timers();
  run_commands();
}

void EventLoop::run_timers() {
  auto now = Clock::now();
  // Only timers due now: one that re-arms itself for "now" waits for the next round.
  std::vector<Task> due;
  while (!timers_.empty() && timers_.begin()->first <= now) {
    auto it = timers_.begin();
    due.push_back(std::move(it->second.second));
    timer_at_.erase(it->second.first);
    timers_.erase(it);
  }
  for (auto& fn : due) fn();
}

void EventLoop::run_commands() {
  std::deque<Task> commands;
  {
    std::lock_guard lock(mu_);
    commands.swap(commands_);
  }
  for (auto& c : commands) {
    try {
      c();
    } catch (const std::exception&) {
      // A command that fails (for a worker that is gone, say) must not end the loop.
    }
  }
}

void EventLoop::post(Task fn) {
  {
    std::lock_guard lock(mu_);
    if (closed_) throw std::runtime_error(closed_message_);
    commands_.push_back(std::move(fn));
  }
  wake();
}

void EventLoop::wake() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
  (void)ignored;
}

void EventLoop::close() {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
  }
  wake();
}

bool EventLoop::closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

void EventLoop::discard() {
  std::deque<Task> dropped;
  std::lock_guard lock(mu_);
  dropped.swap(commands_);
}

}  // namespace ddip
