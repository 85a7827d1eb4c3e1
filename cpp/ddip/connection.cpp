#include "ddip/connection.hpp"

#include <sys/epoll.h>

#include <system_error>

namespace ddip {

Connection::Connection(EventLoop& loop, Channel channel, OnFrame on_frame, OnEnd on_end)
    : loop_(loop),
      channel_(std::move(channel)),
      on_frame_(std::move(on_frame)),
      on_end_(std::move(on_end)) {
  set_nonblocking(channel_.fd());  // a read or write never blocks the loop
  loop_.watch(channel_.fd(), EPOLLIN, [this, alive = alive_](uint32_t events) {
    if (*alive) on_ready(events);
  });
}

Connection::~Connection() {
  *alive_ = false;
  loop_.unwatch(channel_.fd());
}

void Connection::send(Frame f) {
  if (ended_) return;
  channel_.queue(std::move(f));
  if (writing_) return;  // frames already wait for the socket: this one goes after them
  bool done;
  try {
    done = channel_.flush();
  } catch (const std::exception& e) {
    return end(End::kFailed, std::string("could not write to it: ") + e.what());
  }
  if (!done) {
    loop_.modify(channel_.fd(), EPOLLIN | EPOLLOUT);
    writing_ = true;
  }
}

void Connection::end(End how, const std::string& why) {
  if (ended_) return;
  ended_ = true;
  loop_.unwatch(channel_.fd());
  on_end_(how, why);  // may destroy this
}

void Connection::on_ready(uint32_t events) {
  auto alive = alive_;
  if (events & EPOLLOUT) {
    try {
      if (channel_.flush()) {
        loop_.modify(channel_.fd(), EPOLLIN);
        writing_ = false;
      }
    } catch (const std::exception& e) {
      return end(End::kFailed, std::string("could not write to it: ") + e.what());
    }
  }
  if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR))) return;
  while (true) {
    Channel::ReadResult r = Channel::ReadResult::kProgress;
    std::optional<std::pair<End, std::string>> failed;
    try {
      r = channel_.read_some();
    } catch (const std::system_error& e) {
      failed.emplace(End::kFailed, e.what());
    } catch (const std::exception& e) {
      failed.emplace(End::kCorrupt, e.what());
    }
    // Frames that arrived whole are delivered, even from a connection that just failed.
    bool delivered = false;
    while (auto f = channel_.next()) {
      on_frame_(std::move(*f));
      if (!*alive || ended_) return;
      delivered = true;
    }
    if (failed) return end(failed->first, failed->second);
    if (r == Channel::ReadResult::kEof) return end(End::kClosed, "the connection closed");
    if (r == Channel::ReadResult::kWouldBlock) return;
    // A frame came: whatever follows it is the loop's to report (level-triggered), which spares
    // the read that would find the socket empty, the usual case. A sealed channel may hold
    // bytes it read and has not opened yet, which no readiness would report: it reads on.
    if (delivered && !channel_.sealed()) return;
  }
}

}  // namespace ddip
