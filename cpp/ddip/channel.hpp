// Framed messages over Unix stream sockets, with file descriptors passed out of band (SCM_RIGHTS).
//
// A frame on the wire is a fixed 24-byte header (payload length, sequence number, kind, number of
// fds, rank) followed by the payload. The fds of a frame ride on the sendmsg that carries its
// header.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddip/fd.hpp"

namespace ddip {

// Frame kinds the runtime itself acts on; any other kind is passed through untouched.
enum FrameKind : uint16_t {
  kHello = 1,    // worker -> kernel, first frame: "rank N is up" (payload: opaque)
  kRequest = 2,  // kernel -> worker: work to do (payload: opaque)
  kDone = 3,     // worker -> kernel: a request finished; the kernel drains that rank's output first
  kDisplay = 4,  // worker -> kernel: rich output (payload: opaque)
  kHeartbeat = 5,      // kernel -> worker, answered by the worker's watchdog thread
  kHeartbeatAck = 6,   // worker -> kernel
  kShutdown = 7,       // kernel -> worker: leave the worker loop and exit
  kMessage = 8,        // worker -> kernel: a note for whoever waits on the request (opaque)
  kRelease = 9,        // worker -> kernel: shared-memory segments it no longer uses (u64 ids)
  kStackRequest = 10,  // kernel -> worker: dump every thread's stack, answered by the watchdog
  kStacks = 11,        // worker -> kernel: the dump (text), with the request's seq
};

inline constexpr size_t kMaxFdsPerFrame = 16;

struct Frame {
  uint16_t kind = 0;
  int32_t rank = 0;
  uint64_t seq = 0;
  // Shared so that one request can be queued to N ranks without N copies.
  std::shared_ptr<const std::string> payload;
  std::shared_ptr<std::vector<Fd>> fds;
  // Received with fewer fds than it was sent with: the receiver was out of file descriptors
  // (recvmsg's MSG_CTRUNC). `fds` holds those that arrived.
  bool truncated = false;

  static Frame make(uint16_t kind, int32_t rank, uint64_t seq, std::string payload = {});
  const std::string& data() const;
};

class Channel {
 public:
  enum class ReadResult { kProgress, kWouldBlock, kEof };

  explicit Channel(Fd sock);
  Channel(Channel&&) noexcept = default;
  Channel& operator=(Channel&&) noexcept = default;

  int fd() const { return sock_.get(); }

  // Queue a frame; nothing is written until flush().
  void queue(Frame f);
  // Write as much as the socket takes. True when nothing is left queued. A blocking socket
  // writes everything. Throws on a broken peer.
  bool flush();
  bool wants_write() const { return !out_.empty(); }
  void send(Frame f) {
    queue(std::move(f));
    flush();
  }

  // One recvmsg. Complete frames are collected for next().
  ReadResult read_some();
  std::optional<Frame> next();
  // Blocking: read until a frame is complete; nullopt on EOF.
  std::optional<Frame> recv();

  // The pid of the process on the other end (SO_PEERCRED).
  pid_t peer_pid() const;

 private:
  struct Outgoing {
    char header[24];
    Frame frame;
    size_t offset = 0;  // bytes of header + payload already written
  };

  Fd sock_;
  std::deque<Outgoing> out_;
  // Reading: first the header, then the payload straight into its own string.
  char header_[24];
  size_t header_filled_ = 0;
  std::optional<Frame> reading_;
  std::shared_ptr<std::string> reading_payload_;
  size_t payload_filled_ = 0;
  uint16_t reading_nfds_ = 0;
  bool reading_truncated_ = false;
  std::deque<Fd> received_fds_;
  std::deque<Frame> complete_;

  void finish_frame();
};

// A connected pair, for tests and in-process use.
std::pair<Channel, Channel> channel_pair();

// A private directory (mode 0700) that holds the group's socket; removed with everything in it.
class RuntimeDir {
 public:
  RuntimeDir();  // under $XDG_RUNTIME_DIR if set and writable, else $TMPDIR or /tmp
  RuntimeDir(const RuntimeDir&) = delete;
  RuntimeDir& operator=(const RuntimeDir&) = delete;
  ~RuntimeDir();
  const std::string& path() const { return path_; }
  std::string socket_path() const { return path_ + "/ddip.sock"; }

 private:
  std::string path_;
};

class Listener {
 public:
  explicit Listener(const std::string& path);  // non-blocking listening socket
  int fd() const { return sock_.get(); }
  // A new connection (non-blocking), or an empty Fd when none is pending or when this process is
  // out of file descriptors: then starved() is true and the connection waits in the backlog.
  Fd accept();
  bool starved() const { return starved_; }

 private:
  Fd sock_;
  bool starved_ = false;
};

// A blocking connection to a listening socket.
Fd connect_unix(const std::string& path);

}  // namespace ddip
