#include "ddip/fd.hpp"

#include <fcntl.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace ddip {

void throw_errno(std::string_view call, std::string_view doing) {
  int err = errno;
  std::string what(call);
  what += " failed while ";
  what += doing;
  throw std::system_error(err, std::generic_category(), what);
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Pipe make_pipe(bool nonblocking_read) {
  int fds[2];
  check(::pipe2(fds, O_CLOEXEC), "pipe2", "creating a pipe");
  Pipe p{Fd(fds[0]), Fd(fds[1])};
  if (nonblocking_read) set_nonblocking(p.read.get());
  return p;
}

void set_nonblocking(int fd) {
  int flags = check(::fcntl(fd, F_GETFL), "fcntl(F_GETFL)", "making an fd non-blocking");
  check(::fcntl(fd, F_SETFL, flags | O_NONBLOCK), "fcntl(F_SETFL)", "making an fd non-blocking");
}

int poll_timeout_ms(std::chrono::steady_clock::time_point deadline) {
  auto ms =
      std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::clamp<long long>(ms.count(), 0, 60'000));
}

void set_timer(int fd, std::chrono::nanoseconds after) {
  itimerspec t{};
  long long ns = std::max<long long>(after.count(), 0);
  t.it_value.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
  t.it_value.tv_nsec = static_cast<long>(ns % 1'000'000'000);
  ::timerfd_settime(fd, 0, &t, nullptr);
}

}  // namespace ddip
