// TCP for links to other hosts: a listening socket on one chosen address (never the wildcard
// unless asked), a connect with a deadline, and exact reads and writes for handshakes.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "ddip/fd.hpp"

namespace ddip {

class TcpListener {
 public:
  // Non-blocking, on `address` (an IPv4 or IPv6 literal) and `port` (0: any free one).
  TcpListener(const std::string& address, uint16_t port);
  int fd() const { return sock_.get(); }
  const std::string& address() const { return address_; }
  uint16_t port() const { return port_; }
  // A new non-blocking connection, with "address:port" of its peer in `peer`; an empty Fd when
  // none is pending or this process is out of fds (then starved() is true).
  Fd accept(std::string* peer);
  bool starved() const { return starved_; }

 private:
  Fd sock_;
  std::string address_;
  uint16_t port_ = 0;
  bool starved_ = false;
};

// "address:port" ("[address]:port" for IPv6) of a socket address.
std::string describe_address(const void* sockaddr, size_t len);

// A blocking connection to host:port (a name or a literal), given up after `timeout`; with
// TCP_NODELAY (frames are small and latency matters) and keepalive.
Fd connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

// Sets TCP_NODELAY and SO_KEEPALIVE.
void tune_tcp(int fd);

using Deadline = std::chrono::steady_clock::time_point;
// Exactly `n` bytes, or throws: std::runtime_error on EOF or when `deadline` passes.
std::string read_exact(int fd, size_t n, Deadline deadline);
void write_all(int fd, std::string_view data, Deadline deadline);

}  // namespace ddip
