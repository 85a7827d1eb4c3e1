// The worker side of a group's connection. A watchdog thread reads every frame from the kernel:
// it answers heartbeats itself (so a worker busy in Python or C still looks alive) and, when the
// kernel goes away, makes the process exit even if Python is stuck.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "ddip/channel.hpp"

namespace ddip {

class EndpointClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Endpoint {
 public:
  // Connects to `socket_path` and sends a Hello frame for `rank` carrying `hello`.
  // `exit_grace`: after the kernel hangs up, how long Python gets to exit before _exit(1).
  Endpoint(const std::string& socket_path, int rank, std::string hello,
           std::chrono::milliseconds exit_grace = std::chrono::milliseconds(3000));
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ~Endpoint();

  int rank() const { return rank_; }
  // Thread-safe.
  void send(Frame f);
  // A frame from the kernel (heartbeats excluded), or nullopt after `timeout`.
  // Throws EndpointClosed once the kernel has hung up and every frame has been taken.
  std::optional<Frame> recv(std::chrono::milliseconds timeout);
  bool closed() const;

 private:
  int rank_;
  std::chrono::milliseconds exit_grace_;
  Channel channel_;  // reading: watchdog thread only; writing: under send_mu_
  std::mutex send_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Frame> inbox_;
  bool closed_ = false;
  bool stopping_ = false;
  std::thread watchdog_;

  void watch();
};

}  // namespace ddip
