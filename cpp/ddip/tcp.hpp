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
  // Stops listening now (the port is free); address() and port() still say where it was.
  void close() { sock_ = Fd(); }
  const std::string& address() const { return address_; }
  uint16_t port() const { return port_; }
  // A new non-blocking connection, with "address:port" of its peer in `peer`; an empty Fd when
  // none is pending or this process is out of fds (then starved() is true).
  Fd accept(std::string* peer);
  bool starved() const { return starved_; }
  // How many accept() calls found this process out of fds (each one a connection left waiting).
  uint64_t starved_count() const { return starved_count_; }

 private:
  Fd sock_;
  std::string address_;
  uint16_t port_ = 0;
  bool starved_ = false;
  uint64_t starved_count_ = 0;
};

// The address part of "address:port" or "[address]:port" (describe_address's form): the peer a
// listener counts connections by.
std::string address_of(const std::string& peer);

// What the kernel's listener writes to a connection it closes before it authenticated, for a
// reason an honest agent should see (too many connections at once), instead of a bare close. A
// stranger learns nothing from it; an agent's handshake sees it where it expected the challenge
// or the proof, and reports it (refusal_in).
inline constexpr std::string_view kRefusalMagic = "ddip-refused: ";
std::string refusal_line(const std::string& why);
// The refusal's text in what an agent read from the kernel (before the read ended), or "" when
// that is none.
std::string refusal_in(std::string_view got);

// "address:port" ("[address]:port" for IPv6) of a socket address.
std::string describe_address(const void* sockaddr, size_t len);

// A blocking connection to host:port (a name or a literal), given up after `timeout`; with
// TCP_NODELAY (frames are small and latency matters) and keepalive.
Fd connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

// Sets TCP_NODELAY and SO_KEEPALIVE.
void tune_tcp(int fd);
// TCP_USER_TIMEOUT: data the peer's host has not acknowledged for this long (the link is cut,
// not merely idle: a heartbeat is always in flight) fails the connection with ETIMEDOUT.
void set_user_timeout(int fd, std::chrono::milliseconds timeout);

using Deadline = std::chrono::steady_clock::time_point;
// Exactly `n` bytes, or throws: std::runtime_error on EOF or when `deadline` passes.
std::string read_exact(int fd, size_t n, Deadline deadline);
// Up to `n` bytes: fewer only when the peer closed first (never throws for that); throws
// std::runtime_error when `deadline` passes, std::system_error for a failed read.
std::string read_upto(int fd, size_t n, Deadline deadline);
void write_all(int fd, std::string_view data, Deadline deadline);

}  // namespace ddip
