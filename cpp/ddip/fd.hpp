// Move-only owner of a file descriptor, and the one helper every failing system call goes through.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <string_view>
#include <utility>

namespace ddip {

// Throws std::system_error naming the call, what we were doing, and errno's text.
[[noreturn]] void throw_errno(std::string_view call, std::string_view doing);

// Returns `rc` when it is not -1; otherwise throws with errno.
template <typename T>
T check(T rc, std::string_view call, std::string_view doing) {
  if (rc == static_cast<T>(-1)) throw_errno(call, doing);
  return rc;
}

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~Fd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read;
  Fd write;
};

// How read_available() stopped.
enum class ReadEnd { kWouldBlock, kStopped, kEnded };

// Reads a non-blocking `fd` through `buf` until it would block, `take(piece)` returns false, or
// the stream ends (end of file, or an error, which ends it the same way); EINTR is retried.
template <typename Take>
ReadEnd read_available(int fd, char* buf, size_t size, Take&& take) {
  while (true) {
    ssize_t n = ::read(fd, buf, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return ReadEnd::kWouldBlock;
    if (n <= 0) return ReadEnd::kEnded;
    if (!take(std::string_view(buf, static_cast<size_t>(n)))) return ReadEnd::kStopped;
  }
}

// A close-on-exec pipe; `nonblocking_read` makes the read end O_NONBLOCK.
Pipe make_pipe(bool nonblocking_read = false);
void set_nonblocking(int fd);

// poll()'s and epoll_wait()'s timeout until `deadline`: rounded up, so that a wait never ends
// just before its deadline and spins on poll(0) through the last millisecond; at most a minute.
int poll_timeout_ms(std::chrono::steady_clock::time_point deadline);

// Arms the timerfd `fd` to fire once, `after` from now; 0 (or less) disarms it.
void set_timer(int fd, std::chrono::nanoseconds after);

}  // namespace ddip
