// Small helpers the runtime's tests share: re-executing the test binary, writing to and reading
// from pipes, and a /bin/sh child spec.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "ddip/endpoint.hpp"
#include "ddip/fd.hpp"
#include "ddip/supervisor.hpp"

namespace ddip::test {

// A test worker's request loop: each request to `answer` (which replies) until a shutdown or the
// kernel's hang-up; 0 then, as a worker's exit code.
template <class Answer>
int serve_requests(Endpoint& ep, Answer&& answer) {
  while (true) {
    std::optional<Frame> f;
    try {
      f = ep.recv(std::chrono::milliseconds(1000));
    } catch (const EndpointClosed&) {
      return 0;
    }
    if (!f) continue;
    if (f->kind == kShutdown) return 0;
    answer(*f);
  }
}

// This test binary's own path, for tests that re-execute it as a worker or an agent.
inline std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
}

inline void write_fd(int fd, const std::string& s) {
  ssize_t ignored = ::write(fd, s.data(), s.size());
  (void)ignored;
}

inline SpawnSpec sh(const std::string& script, std::vector<std::string> env = {},
                    std::string cwd = "") {
  env.push_back("PATH=/usr/bin:/bin");
  return SpawnSpec{{"/bin/sh", "-c", script}, env, cwd, true};
}

// Everything until the writer closes (polling a non-blocking pipe).
inline std::string read_all(Fd& fd) {
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EAGAIN) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      return out;
    }
  }
}

// What a non-blocking fd holds now (up to end of file).
inline std::string read_ready(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

// One line, without its '\n' (or what is left at end of file).
inline std::string read_line(Fd& fd) {
  std::string line;
  char c;
  while (true) {
    ssize_t n = ::read(fd.get(), &c, 1);
    if (n == 1 && c == '\n') return line;
    if (n == 1) line += c;
    if (n == 0) return line;
    if (n < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Everything queued on a socket's far end so far, as raw bytes (never waits).
inline std::string drain(int fd) {
  std::string out;
  char buf[65536];
  while (true) {
    ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// While alive, this process can open at most `spare` more fds: a stand-in for a notebook that
// has run out of them (too many open files, DataLoader workers).
class FdStarvation {
 public:
  // The sanitizers check memory through a pipe of their own: with no fd to spare they report
  // errors that are not there. Tests that starve receives run in the plain build only.
  static bool sanitized() {
#if defined(__SANITIZE_ADDRESS__)
    return true;
#else
    return false;
#endif
  }

  explicit FdStarvation(int spare = 0) {
    ::getrlimit(RLIMIT_NOFILE, &old_);
    filler_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // the lowest free fd: all below are used
    rlimit low = old_;
    low.rlim_cur = static_cast<rlim_t>(filler_ + 1 + spare);
    ::setrlimit(RLIMIT_NOFILE, &low);
  }
  ~FdStarvation() {
    ::setrlimit(RLIMIT_NOFILE, &old_);
    ::close(filler_);
  }

 private:
  rlimit old_{};
  int filler_ = -1;
};

}  // namespace ddip::test
