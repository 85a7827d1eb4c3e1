// Framed messages over Unix stream sockets, with file descriptors passed out of band (SCM_RIGHTS),
// and over authenticated TCP links to other hosts.
//
// A frame on the wire is a fixed 24-byte header (payload length, sequence number, kind, number of
// fds, rank) followed by the payload. On a Unix socket the fds of a frame ride on the sendmsg that
// carries its header. On a sealed channel (TCP, after the link's handshake) no fd can travel:
//
//   header (24; its length: the body's) | fd table (u64 per fd: its length, or kRefBit | a
//   segment id) | MAC of header and table | body (the fds' bytes, the payload) | AES-GCM tag of
//   it all (auth.hpp's BodyMac)
//
// The first MAC is checked before anything is allocated for the lengths announced, so a forged
// header costs the receiver at most 208 bytes and the link, never memory. The fds' bytes are
// written straight from the fds (mapped, never copied into a buffer) and received into sealed
// memfds, fresh or the receiver's own (receive_buffers_from), written in through the small stage,
// the MAC fed as they stream, so a frame looks the same to both ends either way. A "ref" stands for
// a segment sent before on the same link (kSegment): the receiver keeps those, and the frame's refs
// name them (HostLinks sends a buffer once per host).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddip/auth.hpp"
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
  kAbortRequest = 18,  // kernel -> worker: heal's abort; the watchdog raises the abort signal
  // kernel -> worker: its collectives (torch's flight recorder), answered by a Python thread the
  // watchdog wakes (it needs the GIL, which a rank waiting in a collective has let go of)
  kCollectivesRequest = 19,
  kCollectives = 20,  // worker -> kernel: that answer (JSON; empty: no flight recorder here)
  // 12 to 17 and 21 on: only on links to other hosts (LinkFrameKind, link_protocol.hpp)
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
  // On a sealed channel, how many bytes of each fd travel (a pooled segment is larger than what
  // it holds); empty: each fd's whole size. A frame read from one says how many came.
  std::vector<size_t> fd_bytes;
  // On a sealed channel: where refs[i] != 0, the frame's i-th fd is the segment of that id, sent
  // before on the same channel (kSegment) and kept by the receiver, which fills it in; fds[i] is
  // then empty. Empty: every fd travels with the frame.
  std::vector<uint64_t> refs;
  // Whatever must live until the frame is written (a pooled segment's reference, so that the
  // pool does not reuse it while its bytes stream out of it).
  std::shared_ptr<void> hold;

  static Frame make(uint16_t kind, int32_t rank, uint64_t seq, std::string payload = {});
  const std::string& data() const;
};

class Channel {
 public:
  enum class ReadResult { kProgress, kWouldBlock, kEof };

  explicit Channel(Fd sock);
  Channel(Channel&&) noexcept;
  Channel& operator=(Channel&&) noexcept;
  ~Channel();

  int fd() const { return sock_.get(); }

  // Queue a frame; nothing is written until flush().
  void queue(Frame f);
  // Write as much as the socket takes. True when nothing is left queued. A blocking socket
  // writes everything. Throws on a broken peer.
  bool flush();
  bool wants_write() const { return !out_.empty(); }
  // Bytes held for frames being read or written beyond their fds and payloads (which are the
  // frames' own): bounded, whatever the frames' sizes. For tests.
  size_t buffered_bytes() const;
  // Bytes allocated so far for the frame being read (its payload and memfds). For tests: a
  // header that failed to authenticate allocated nothing.
  size_t reading_allocated() const;
  void send(Frame f) {
    queue(std::move(f));
    flush();
  }

  // One recvmsg. Complete frames are collected for next().
  ReadResult read_some();
  std::optional<Frame> next();
  // A frame is whole and waiting for next(): one read may bring several, so a caller that polls
  // the socket before recv() must look here first.
  bool has_frame() const { return !complete_.empty(); }
  // Blocking: read until a frame is complete; nullopt on EOF.
  std::optional<Frame> recv();

  // The pid of the process on the other end (SO_PEERCRED).
  pid_t peer_pid() const;

  // From now on, frames are authenticated with these keys and fds travel in band (a TCP link
  // after its handshake). A frame that fails to verify makes read_some() throw AuthError.
  void seal(LinkKeys keys);
  bool sealed() const { return send_mac_.enabled(); }
  // Where a sealed channel receives a buffer of n bytes: a memfd of at least n bytes from
  // `source` (a host agent's segment pool, whose pages a later push reuses), or a fresh one when
  // it gives an empty Fd or none is set.
  void receive_buffers_from(std::function<Fd(size_t)> source) { buffers_ = std::move(source); }
  // The largest frame a sealed channel accepts: a length beyond it is corruption, and must not
  // make us allocate before the frame's MAC is checked.
  static constexpr uint64_t kMaxSealedFrame = uint64_t(1) << 36;
  static constexpr uint64_t kRefBit = uint64_t(1) << 63;
  // What a sealed channel receives into its own buffer: small pieces (headers, MACs, tables) and
  // the fds' bytes (on their way into the fds) come through it, a large payload goes straight into
  // its string. 256 KiB: a read per 256 KiB of a buffer, not per 64, and still within the cache
  // the MAC and the write into the fd read it from.
  static constexpr size_t kStageBytes = 256 * 1024;

 private:
  struct Mapping;  // a window onto an fd being sent
  struct Piece {
    const char* data;  // or, for an fd's bytes, `map`
    size_t size;
    bool body;  // fed to the body's MAC
    Mapping* map = nullptr;
    bool mac = false;  // the body's MAC, made once everything before it was written
  };
  struct Outgoing {
    char header[24];
    Frame frame;
    size_t offset = 0;  // bytes of header + payload already written
    // Sealed: the pieces in order (the last is the body's MAC, made once the body is written).
    std::vector<Piece> pieces;
    size_t piece = 0, piece_offset = 0;
    std::string head;  // header, its MAC, the fd table
    std::string mac;
    std::shared_ptr<BodyMac> body_mac;
    std::vector<std::shared_ptr<Mapping>> maps;
  };
  struct Incoming;  // a sealed frame being read

  bool flush_sealed(Outgoing& o);
  ReadResult read_sealed();
  void sealed_take(const char* src, size_t n);
  void sealed_advance(size_t n);
  void sealed_header();  // authenticates a frame's header and fd table, makes its memfds
  Frame sealed_frame();   // authenticates the whole frame and hands it over

  Fd sock_;
  std::deque<Outgoing> out_;
  // Reading: first the header, then the payload straight into its own string.
  char header_[24];
  size_t header_filled_ = 0;
  std::optional<Frame> reading_;
  std::shared_ptr<std::string> reading_payload_;
  size_t payload_filled_ = 0;
  uint16_t reading_nfds_ = 0;
  bool fds_dropped_ = false;          // the kernel could not install some fds (MSG_CTRUNC)
  std::unique_ptr<char[]> read_buf_;  // kReadBytes: where a plain channel's reads land first
  static constexpr size_t kReadBytes = 16 * 1024;
  std::deque<Fd> received_fds_;
  std::deque<Frame> complete_;
  FrameMac send_mac_, recv_mac_;
  std::unique_ptr<Incoming> in_;
  std::unique_ptr<char[]> stage_;  // sealed: what one read brought (kStageBytes)
  std::function<Fd(size_t)> buffers_;

  void start_frame();  // the header is complete: its frame begins
  void finish_frame();
  void seal_into(Outgoing& o, Frame f);
};

// A connected pair, for tests and in-process use.
std::pair<Channel, Channel> channel_pair();

// A private directory (mode 0700) that holds the group's socket; removed with everything in it.
// Its `lock` file is flock()ed for the directory's life, so a directory whose process was killed
// (SIGKILL skips the destructor) can be told apart: creating one removes such leftovers.
class RuntimeDir {
 public:
  RuntimeDir();  // under $XDG_RUNTIME_DIR if set and writable, else $TMPDIR or /tmp
  RuntimeDir(const RuntimeDir&) = delete;
  RuntimeDir& operator=(const RuntimeDir&) = delete;
  ~RuntimeDir();
  const std::string& path() const { return path_; }
  std::string socket_path() const { return path_ + "/ddip.sock"; }

  // Removes this user's ddip-* directories under `base` whose lock nobody holds, unchanged for
  // `min_age_s` (a new one takes its lock just after it is made); returns how many.
  static int sweep(const std::string& base, long min_age_s = 60);

 private:
  std::string path_;
  Fd lock_;
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
