#include "ddip/tcp.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace ddip {
namespace detail {
namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo resolve(const std::string& host, uint16_t port, int flags) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* out = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out);
  if (rc != 0) throw std::invalid_argument("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  return AddrInfo(out);
}

// Waits for `events` on fd; false when the deadline passed first.
bool wait_for(int fd, short events, Deadline deadline) {
  while (true) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    check(rc, "poll", "waiting on a TCP connection");
    if (rc > 0) return true;
  }
}

}  // namespace
}  // namespace detail

std::string describe_address(const void* sa, size_t len) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (::getnameinfo(static_cast<const sockaddr*>(sa), static_cast<socklen_t>(len), host,
                    sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  if (static_cast<const sockaddr*>(sa)->sa_family == AF_INET6)
    return std::string("[") + host + "]:" + serv;
  return std::string(host) + ":" + serv;
}

void tune_tcp(int fd) {
  int one = 1;
  check(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one), "setsockopt(TCP_NODELAY)",
        "tuning a TCP connection");
  check(::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one), "setsockopt(SO_KEEPALIVE)",
        "tuning a TCP connection");
}

void set_user_timeout(int fd, std::chrono::milliseconds timeout) {
  unsigned int ms = static_cast<unsigned int>(std::clamp<long long>(timeout.count(), 1, 1LL << 31));
  check(::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms),
        "setsockopt(TCP_USER_TIMEOUT)", "tuning a TCP connection");
}

std::string address_of(const std::string& peer) {
  if (peer.starts_with("[")) {
    auto end = peer.find(']');
    return end == std::string::npos ? peer : peer.substr(1, end - 1);
  }
  auto colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

std::string refusal_line(const std::string& why) { return std::string(kRefusalMagic) + why + "\n"; }

std::string refusal_in(std::string_view got) {
  if (!got.starts_with(kRefusalMagic)) return "";
  got.remove_prefix(kRefusalMagic.size());
  std::string out;
  // Shown to the user: printable text only, and not much of it.
  for (char c : got.substr(0, 300)) {
    if (c == '\n') break;
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return out.empty() ? "no reason given" : out;
}

TcpListener::TcpListener(const std::string& address, uint16_t port) {
  auto ai = detail::resolve(address, port, AI_NUMERICHOST | AI_PASSIVE);
  sock_ = Fd(check(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), "socket",
                   "creating the TCP listening socket"));
  int one = 1;
  check(::setsockopt(sock_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one),
        "setsockopt(SO_REUSEADDR)", "creating the TCP listening socket");
  check(::bind(sock_.get(), ai->ai_addr, ai->ai_addrlen), "bind",
        "binding the TCP listening socket to " + address + ":" + std::to_string(port));
  check(::listen(sock_.get(), 128), "listen", "listening for remote hosts");
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  check(::getsockname(sock_.get(), reinterpret_cast<sockaddr*>(&ss), &len), "getsockname",
        "finding the TCP listening port");
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  address_ = address;
}

Fd TcpListener::accept(std::string* peer) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  int fd =
      ::accept4(sock_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  // Out of fds: the connection stays in the backlog for a later try, as for the Unix listener.
  starved_ = fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM);
  if (starved_) ++starved_count_;
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED ||
        starved_)
      return Fd();
    throw_errno("accept4", "accepting a remote host's connection");
  }
  Fd out(fd);
  if (peer) *peer = describe_address(&ss, len);
  try {
    tune_tcp(fd);
  } catch (const std::system_error&) {
    // Only latency and dead-peer detection suffer; the heartbeat still catches a dead peer.
  }
  return out;
}

Fd connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  auto ai = detail::resolve(host, port, 0);
  std::string last = "no address";
  for (addrinfo* a = ai.get(); a; a = a->ai_next) {
    Fd s(check(::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), "socket",
               "creating a TCP socket"));
    int rc = ::connect(s.get(), a->ai_addr, a->ai_addrlen);
    if (rc < 0 && errno != EINPROGRESS) {
      last = std::strerror(errno);
      continue;
    }
    if (rc < 0) {
      if (!detail::wait_for(s.get(), POLLOUT, deadline)) {
        last = "timed out";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      check(::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len), "getsockopt(SO_ERROR)",
            "connecting to " + host);
      if (err) {
        last = std::strerror(err);
        continue;
      }
    }
    int flags = check(::fcntl(s.get(), F_GETFL), "fcntl(F_GETFL)", "connecting");
    check(::fcntl(s.get(), F_SETFL, flags & ~O_NONBLOCK), "fcntl(F_SETFL)", "connecting");
    tune_tcp(s.get());
    return s;
  }
  throw std::runtime_error("cannot connect to " + host + ":" + std::to_string(port) + ": " + last);
}

std::string read_upto(int fd, size_t n, Deadline deadline) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    if (!detail::wait_for(fd, POLLIN, deadline))
      throw std::runtime_error("timed out after " + std::to_string(done) + " of " +
                               std::to_string(n) + " bytes");
    ssize_t r = ::recv(fd, out.data() + done, n - done, MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r < 0) throw_errno("recv", "reading a handshake");
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  out.resize(done);
  return out;
}

std::string read_exact(int fd, size_t n, Deadline deadline) {
  std::string out = read_upto(fd, n, deadline);
  if (out.size() < n)
    throw std::runtime_error("connection closed after " + std::to_string(out.size()) + " of " +
                             std::to_string(n) + " bytes");
  return out;
}

void write_all(int fd, std::string_view data, Deadline deadline) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t r = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!detail::wait_for(fd, POLLOUT, deadline)) throw std::runtime_error("timed out writing");
      continue;
    }
    if (r < 0) throw_errno("send", "writing a handshake");
    done += static_cast<size_t>(r);
  }
}

}  // namespace ddip
