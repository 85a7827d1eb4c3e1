#include "ddip/endpoint.hpp"

#include <sys/socket.h>
#include <unistd.h>

namespace ddip {

Endpoint::Endpoint(const std::string& socket_path, int rank, std::string hello,
                   std::chrono::milliseconds exit_grace)
    : rank_(rank), exit_grace_(exit_grace), channel_(connect_unix(socket_path)) {
  channel_.send(Frame::make(kHello, rank, 0, std::move(hello)));
  watchdog_ = std::thread([this] { watch(); });
}

Endpoint::~Endpoint() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  ::shutdown(channel_.fd(), SHUT_RDWR);  // wakes the watchdog out of recvmsg
  if (watchdog_.joinable()) watchdog_.join();
}

void Endpoint::send(Frame f) {
  f.rank = rank_;
  std::lock_guard lock(send_mu_);
  channel_.send(std::move(f));
}

std::optional<Frame> Endpoint::recv(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (timeout.count() > 0)
    cv_.wait_for(lock, timeout, [this] { return !inbox_.empty() || closed_; });
  if (!inbox_.empty()) {
    Frame f = std::move(inbox_.front());
    inbox_.pop_front();
    return f;
  }
  if (closed_) throw EndpointClosed("the kernel closed the connection");
  return std::nullopt;
}

bool Endpoint::closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

void Endpoint::watch() {
  while (true) {
    std::optional<Frame> f;
    try {
      f = channel_.recv();
    } catch (const std::exception&) {
      f.reset();
    }
    if (!f) break;
    if (f->kind == kHeartbeat) {
      try {
        send(Frame::make(kHeartbeatAck, rank_, f->seq));
      } catch (const std::exception&) {
        break;
      }
      continue;
    }
    {
      std::lock_guard lock(mu_);
      inbox_.push_back(std::move(*f));
    }
    cv_.notify_all();
  }
  std::unique_lock lock(mu_);
  closed_ = true;
  cv_.notify_all();
  if (stopping_) return;
  // The kernel is gone. Python gets a moment to leave on its own; a stuck worker is ended here.
  if (!cv_.wait_for(lock, exit_grace_, [this] { return stopping_; })) ::_exit(1);
}

}  // namespace ddip
