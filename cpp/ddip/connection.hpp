// A Channel served by an EventLoop: the one place where a framed connection is watched, read
// frame by frame into a callback, and written without blocking (queued frames wait for the socket
// to become writable). The coordinator's workers and host links, and the rank template's
// connection, are Connections.
#pragma once

#include <sys/epoll.h>

#include <functional>
#include <memory>
#include <string>

#include "ddip/channel.hpp"
#include "ddip/event_loop.hpp"

namespace ddip {

class Connection {
 public:
  // How a connection ended: the peer closed it; the socket failed (std::system_error); or what
  // came could not be trusted (a corrupt frame, or one that failed to authenticate).
  enum class End { kClosed, kFailed, kCorrupt };
  using OnFrame = std::function<void(Frame)>;
  using OnEnd = std::function<void(End, const std::string& why)>;

  // Watches `channel`'s socket (non-blocking) on `loop`. Callbacks run on the loop's thread and
  // may destroy this Connection; on_end is called once, after every complete frame was delivered,
  // and nothing is delivered after it.
  Connection(EventLoop& loop, Channel channel, OnFrame on_frame, OnEnd on_end);
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection();  // unwatches and closes the socket

  // Queues `f` and writes what the socket takes now; the rest goes when it is writable. A write
  // that fails ends the connection (on_end, maybe before this returns).
  void send(Frame f);
  // Delivers what can be read now without waiting (the last frames of a worker that exited).
  void read_now() { on_ready(EPOLLIN); }
  int fd() const { return channel_.fd(); }
  const Channel& channel() const { return channel_; }
  Channel& channel() { return channel_; }

 private:
  EventLoop& loop_;
  Channel channel_;
  OnFrame on_frame_;
  OnEnd on_end_;
  bool writing_ = false;  // EPOLLOUT is watched
  bool ended_ = false;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);

  void on_ready(uint32_t events);
  void end(End how, const std::string& why);
};

}  // namespace ddip
