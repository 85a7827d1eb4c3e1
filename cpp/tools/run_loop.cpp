#include "run_loop.hpp"

#include <sys/epoll.h>

#include <algorithm>
#include <cerrno>

namespace ddip::run {

using std::chrono::milliseconds;

EventLoop::EventLoop()
    : epoll_(check(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1", "starting the launcher")) {}

uint64_t EventLoop::add(int fd, Handler on_ready, bool permissive) {
  uint64_t id = next_id_++;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    if (permissive && errno == EPERM) return ~uint64_t{0};
    throw_errno("epoll_ctl", "watching the ranks");
  }
  watches_.emplace(id, std::make_pair(fd, std::move(on_ready)));
  return id;
}

uint64_t EventLoop::watch(int fd, Handler on_ready) { return add(fd, std::move(on_ready), false); }

std::optional<uint64_t> EventLoop::try_watch(int fd, Handler on_ready) {
  uint64_t id = add(fd, std::move(on_ready), true);
  if (id == ~uint64_t{0}) return std::nullopt;
  return id;
}

void EventLoop::unwatch(uint64_t id) {
  auto it = watches_.find(id);
  if (it == watches_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second.first, nullptr);
  watches_.erase(it);
}

void EventLoop::deadline(Next next, Due due) {
  deadlines_.push_back({std::move(next), std::move(due)});
}

void EventLoop::run_until(const std::function<bool()>& done) {
  epoll_event events[64];
  while (!done()) {
    auto now = Clock::now();
    std::optional<Clock::time_point> next;
    for (size_t i = 0; i < deadlines_.size(); ++i)
      if (auto t = deadlines_[i].next(); t && (!next || *t < *next)) next = t;
    int wait_ms = -1;
    if (next) {
      auto left = std::chrono::ceil<milliseconds>(*next - now).count();
      wait_ms = static_cast<int>(std::max<decltype(left)>(left, 0));
    }
    int n = ::epoll_wait(epoll_.get(), events, 64, wait_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("epoll_wait", "watching the ranks");
    }
    for (int i = 0; i < n; ++i) {
      auto it = watches_.find(events[i].data.u64);
      if (it == watches_.end()) continue;  // unwatched by an earlier handler of this round
      Handler h = it->second.second;       // a copy: the handler may unwatch itself
      h();
    }
    now = Clock::now();
    for (size_t i = 0; i < deadlines_.size(); ++i)
      if (auto t = deadlines_[i].next(); t && now >= *t) deadlines_[i].due(now);
  }
}

}  // namespace ddip::run
