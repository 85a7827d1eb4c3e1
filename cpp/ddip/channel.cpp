#include "ddip/channel.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <stdexcept>

namespace ddip {
namespace detail {

struct WireHeader {
  uint64_t length;
  uint64_t seq;
  uint16_t kind;
  uint16_t nfds;
  int32_t rank;
};
static_assert(sizeof(WireHeader) == 24);

sockaddr_un unix_address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path))
    throw std::invalid_argument("socket path too long for AF_UNIX (" + std::to_string(path.size()) +
                                " bytes): " + path + "; set TMPDIR to a shorter directory");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

// A fresh memfd of `n` bytes: where a buffer sent over TCP is received (written in as it comes).
Fd memfd_sized(size_t n) {
  Fd fd(check(::memfd_create("ddip-link", MFD_CLOEXEC | MFD_ALLOW_SEALING), "memfd_create",
              "receiving a buffer over TCP"));
  check(::ftruncate(fd.get(), static_cast<off_t>(n)), "ftruncate", "receiving a buffer over TCP");
  return fd;
}

}  // namespace detail

Frame Frame::make(uint16_t kind, int32_t rank, uint64_t seq, std::string payload) {
  Frame f;
  f.kind = kind;
  f.rank = rank;
  f.seq = seq;
  f.payload = std::make_shared<const std::string>(std::move(payload));
  return f;
}

const std::string& Frame::data() const {
  static const std::string empty;
  return payload ? *payload : empty;
}


// The bytes of an fd that a sealed frame sends are written from a moving window onto it (mapped
// read-only, never copied): its pages count in this process's RSS a window at a time, not whole.
struct Channel::Mapping {
  static constexpr size_t kWindow = size_t(4) << 20;
  int fd;  // the frame's own, open until it is written
  size_t len;
  void* addr = nullptr;
  size_t off = 0, size = 0;  // the window
  Mapping(int f, size_t n) : fd(f), len(n) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { unmap(); }
  void unmap() {
    if (addr) ::munmap(addr, size);
    addr = nullptr;
  }
  // The bytes from `pos` on that the window holds (mapping it there first if it must).
  std::pair<const char*, size_t> at(size_t pos) {
    if (!addr || pos < off || pos >= off + size) {
      unmap();
      static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      off = pos / page * page;
      size = std::min(kWindow, len - off);
      // Populated at once: one call maps the window's pages instead of a fault every few pages.
      void* a = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd,
                       static_cast<off_t>(off));
      if (a == MAP_FAILED) throw_errno("mmap", "mapping a buffer to send over TCP");
      addr = a;
    }
    return {static_cast<const char*>(addr) + (pos - off), off + size - pos};
  }
};

// A sealed frame being read: header and its MAC, then the body piece by piece, then its MAC.
struct Channel::Incoming {
  // kHead: the 24-byte header; kHeadRest: the fd table and the MAC of both.
  enum Stage { kHead, kHeadRest, kFd, kPayload, kMac } stage = kHead;
  char head[sizeof(detail::WireHeader) + kMaxFdsPerFrame * sizeof(uint64_t) + kMacBytes];
  size_t head_size = sizeof(detail::WireHeader);  // of what is in `head` when it is complete
  size_t filled = 0;  // of the current stage's piece
  detail::WireHeader h{};
  std::optional<BodyMac> mac;
  std::vector<uint64_t> entries;
  size_t entry = 0;  // the fd being received
  struct Received {
    Fd fd;
    size_t size = 0;
  };
  std::vector<Received> fds;  // one per entry; empty fd for a ref
  std::shared_ptr<std::string> payload;
  char body_mac[kBodyMacBytes];

  // Where the next bytes go, and how many the current piece still wants there. An fd's bytes have
  // no address: they are written into it (sealed_take).
  std::pair<char*, size_t> target() {
    switch (stage) {
      case kHead:
      case kHeadRest:
        return {head + filled, head_size - filled};
      case kFd:
        return {nullptr, fds[entry].size - filled};
      case kPayload:
        return {payload->data() + filled, payload->size() - filled};
      case kMac:
        return {body_mac + filled, kBodyMacBytes - filled};
    }
    return {nullptr, 0};
  }
  size_t allocated() const {
    size_t n = payload ? payload->size() : 0;
    for (auto& r : fds) n += r.size;
    return n;
  }
  // On to the first fd from `from` that has bytes to receive, else to the payload.
  void next_fd(size_t from) {
    for (entry = from; entry < fds.size(); ++entry) {
      auto& r = fds[entry];
      if (r.fd && r.size > 0) {
        stage = kFd;
        filled = 0;
        return;
      }
    }
    start_payload();
  }
  void start_payload() {
    uint64_t used = 0;
    for (auto& r : fds) used += r.size;
    payload = std::make_shared<std::string>(h.length - used, '\0');
    stage = kPayload;
    filled = 0;
  }
};

Channel::Channel(Fd sock) : sock_(std::move(sock)) {}
Channel::Channel(Channel&&) noexcept = default;
Channel& Channel::operator=(Channel&&) noexcept = default;
Channel::~Channel() = default;

void Channel::queue(Frame f) {
  size_t nfds = f.fds ? f.fds->size() : 0;
  if (nfds > kMaxFdsPerFrame || f.refs.size() > kMaxFdsPerFrame)
    throw std::invalid_argument("too many fds in one frame");
  if (sealed()) {
    out_.emplace_back();  // built in place: its pieces point into it
    try {
      seal_into(out_.back(), std::move(f));
    } catch (...) {
      out_.pop_back();
      throw;
    }
    return;
  }
  if (!f.refs.empty()) throw std::logic_error("segment refs on a channel that is not sealed");
  Outgoing o;
  detail::WireHeader h{f.payload ? f.payload->size() : 0, f.seq, f.kind,
                       static_cast<uint16_t>(nfds), f.rank};
  std::memcpy(o.header, &h, sizeof h);
  o.frame = std::move(f);
  out_.push_back(std::move(o));
}

// The fds' bytes are mapped, not copied: they are written from the mapping, and the frame's
// `hold` keeps a pooled segment from being reused until they are.
void Channel::seal_into(Outgoing& o, Frame f) {
  size_t nfds = f.fds ? f.fds->size() : 0;
  size_t entries = std::max(nfds, f.refs.size());
  std::string table;
  uint64_t length = 0;
  for (size_t i = 0; i < entries; ++i) {
    uint64_t word;
    if (i < f.refs.size() && f.refs[i] != 0) {
      if (f.refs[i] & kRefBit) throw std::invalid_argument("a segment id too large for a ref");
      word = kRefBit | f.refs[i];
    } else {
      if (i >= nfds || !(*f.fds)[i]) throw std::invalid_argument("a frame's fd is missing");
      int fd = (*f.fds)[i].get();
      struct stat st {};
      check(::fstat(fd, &st), "fstat", "sizing an fd to send over TCP");
      size_t n = i < f.fd_bytes.size() ? f.fd_bytes[i] : static_cast<size_t>(st.st_size);
      // Reading past the file's end through a mapping is a SIGBUS, not an error.
      if (n > static_cast<size_t>(st.st_size))
        throw std::runtime_error("an fd sent over TCP was shorter than announced");
      o.maps.push_back(std::make_shared<Mapping>(fd, n));
      word = n;
      length += n;
    }
    table.append(reinterpret_cast<const char*>(&word), sizeof word);
  }
  length += f.data().size();
  detail::WireHeader h{length, f.seq, f.kind, static_cast<uint16_t>(entries), f.rank};
  o.head.reserve(sizeof h + table.size() + kMacBytes);
  o.head.append(reinterpret_cast<const char*>(&h), sizeof h);
  o.head += table;
  o.body_mac = std::make_shared<BodyMac>(send_mac_.body_mac(o.head));
  o.head += send_mac_.header_mac(o.head);
  send_mac_.advance();
  o.pieces.push_back({o.head.data(), o.head.size(), false});
  for (auto& m : o.maps)
    if (m->len) o.pieces.push_back({nullptr, m->len, true, m.get()});
  if (!f.data().empty()) o.pieces.push_back({f.payload->data(), f.payload->size(), true});
  o.pieces.push_back({nullptr, kBodyMacBytes, false, nullptr, true});
  f.fd_bytes.clear();
  o.frame = std::move(f);  // with its fds, which the windows map
}

bool Channel::flush_sealed(Outgoing& o) {
  while (o.piece < o.pieces.size()) {
    iovec iov[8];
    int niov = 0;
    for (size_t k = o.piece; k < o.pieces.size() && niov < 8; ++k) {
      Piece& p = o.pieces[k];
      if (p.mac && !p.data) {  // made once everything before it was written
        if (k != o.piece) break;
        o.mac = o.body_mac->final();
        p.data = o.mac.data();
      }
      size_t skip = k == o.piece ? o.piece_offset : 0;
      if (p.map) {
        auto [at, n] = p.map->at(skip);
        iov[niov++] = {const_cast<char*>(at), std::min(n, p.size - skip)};
        if (n < p.size - skip) break;  // the rest of it after this window is written
        continue;
      }
      iov[niov++] = {const_cast<char*>(p.data) + skip, p.size - skip};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    ssize_t n = ::sendmsg(sock_.get(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      throw_errno("sendmsg", "writing a frame");
    }
    // The body's MAC takes exactly what was written, as it was written.
    size_t left = static_cast<size_t>(n);
    while (left > 0) {
      Piece& p = o.pieces[o.piece];
      size_t k = std::min(left, p.size - o.piece_offset);
      if (p.body)
        o.body_mac->update(std::string_view(
            p.map ? p.map->at(o.piece_offset).first : p.data + o.piece_offset, k));
      o.piece_offset += k;
      left -= k;
      if (o.piece_offset == p.size) {
        ++o.piece;
        o.piece_offset = 0;
      }
    }
  }
  return true;
}

void Channel::seal(LinkKeys keys) {
  if (!out_.empty() || header_filled_ || reading_payload_ || !complete_.empty() || in_)
    throw std::logic_error("Channel::seal with frames in flight");
  send_mac_ = FrameMac(std::move(keys.send));
  recv_mac_ = FrameMac(std::move(keys.recv));
}

size_t Channel::buffered_bytes() const {
  size_t n = stage_ ? kStageBytes : 0;
  for (auto& o : out_) n += o.head.size() + o.mac.size();
  return n;
}

size_t Channel::reading_allocated() const {
  if (in_) return in_->allocated();
  return reading_payload_ ? reading_payload_->size() : 0;
}

bool Channel::flush() {
  while (!out_.empty()) {
    Outgoing& o = out_.front();
    if (!o.pieces.empty()) {
      if (!flush_sealed(o)) return false;
      out_.pop_front();  // its mappings and its hold go with it
      continue;
    }
    const std::string& payload = o.frame.data();
    size_t total = sizeof o.header + payload.size();
    iovec iov[2];
    int niov = 0;
    if (o.offset < sizeof o.header) {
      iov[niov++] = {o.header + o.offset, sizeof o.header - o.offset};
      if (!payload.empty()) iov[niov++] = {const_cast<char*>(payload.data()), payload.size()};
    } else {
      size_t off = o.offset - sizeof o.header;
      iov[niov++] = {const_cast<char*>(payload.data()) + off, payload.size() - off};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
    size_t nfds = o.frame.fds ? o.frame.fds->size() : 0;
    if (o.offset == 0 && nfds > 0) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      int* out = reinterpret_cast<int*>(CMSG_DATA(c));
      for (size_t i = 0; i < nfds; ++i) out[i] = (*o.frame.fds)[i].get();
    }
    ssize_t n = ::sendmsg(sock_.get(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      throw_errno("sendmsg", "writing a frame");
    }
    o.offset += static_cast<size_t>(n);
    if (o.offset == total) out_.pop_front();
  }
  return true;
}

Channel::ReadResult Channel::read_sealed() {
  if (!in_) in_ = std::make_unique<Incoming>();
  auto [dst, want] = in_->target();
  // A large payload is read straight where it belongs. An fd's bytes come through the stage and
  // are written into the fd: a fresh memfd's pages then need no zeroing (a write that covers a
  // whole page skips it; a fault on a mapping clears each page first, which cost more than the
  // copy), and the MAC reads them while they are in cache.
  const bool direct = want >= kStageBytes && in_->stage != Incoming::kFd;
  ssize_t n;
  if (direct) {
    do {
      n = ::recv(sock_.get(), dst, want, 0);
    } while (n < 0 && errno == EINTR);
  } else {
    if (!stage_) stage_ = std::make_unique<char[]>(kStageBytes);
    do {
      n = ::recv(sock_.get(), stage_.get(), kStageBytes, 0);
    } while (n < 0 && errno == EINTR);
  }
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadResult::kWouldBlock;
    if (errno == ECONNRESET) return ReadResult::kEof;
    throw_errno("recv", "reading a frame");
  }
  if (n == 0) return ReadResult::kEof;
  if (direct) {
    sealed_take(dst, static_cast<size_t>(n));
    return ReadResult::kProgress;
  }
  // Staged: consumed at once, piece by piece (many small frames may have come in one read).
  size_t at = 0;
  while (at < static_cast<size_t>(n)) {
    if (!in_) in_ = std::make_unique<Incoming>();
    size_t k = std::min(in_->target().second, static_cast<size_t>(n) - at);
    sealed_take(stage_.get() + at, k);
    at += k;
  }
  return ReadResult::kProgress;
}

// `n` more bytes of the current piece, at `src` (for a piece with an address, maybe already there):
// put where they belong and fed to the body's MAC.
void Channel::sealed_take(const char* src, size_t n) {
  Incoming& in = *in_;
  if (in.stage == Incoming::kFd) {
    const int fd = in.fds[in.entry].fd.get();
    for (size_t done = 0; done < n;) {
      ssize_t w = ::pwrite(fd, src + done, n - done, static_cast<off_t>(in.filled + done));
      if (w < 0 && errno == EINTR) continue;
      if (w == 0) errno = ENOSPC;  // no progress: the memfd can't grow (out of shared memory)
      if (w <= 0) throw_errno("pwrite", "receiving a buffer over TCP");
      done += static_cast<size_t>(w);
    }
  } else if (n > 0) {
    char* dst = in.target().first;
    if (dst != src) std::memcpy(dst, src, n);
  }
  if (in.stage == Incoming::kFd || in.stage == Incoming::kPayload)
    in.mac->update(std::string_view(src, n));
  sealed_advance(n);
}

// `n` more bytes of the current piece arrived; moves to the next piece when it is complete.
void Channel::sealed_advance(size_t n) {
  Incoming& in = *in_;
  in.filled += n;
  // Moves on through pieces that are complete (or empty).
  while (true) {
    if (in.target().second > 0) return;
    switch (in.stage) {
      case Incoming::kHead: {
        std::memcpy(&in.h, in.head, sizeof in.h);
        // Not authenticated yet: only bounds what is read next (at most 16 table entries).
        if (in.h.nfds > kMaxFdsPerFrame)
          throw AuthError("a frame header failed authentication (impossible fd count)");
        in.head_size = sizeof in.h + in.h.nfds * sizeof(uint64_t) + kMacBytes;
        in.stage = Incoming::kHeadRest;
        break;
      }
      case Incoming::kHeadRest:
        sealed_header();
        in.filled = 0;
        in.next_fd(0);
        break;
      case Incoming::kFd:
        in.next_fd(in.entry + 1);
        break;
      case Incoming::kPayload:
        in.stage = Incoming::kMac;
        in.filled = 0;
        break;
      case Incoming::kMac:
        complete_.push_back(sealed_frame());
        return;
    }
  }
}

void Channel::sealed_header() {
  Incoming& in = *in_;
  // Nothing is allocated for the frame before its header and fd table are authenticated.
  std::string_view head(in.head, in.head_size - kMacBytes);
  recv_mac_.verify_header(head, std::string_view(in.head + head.size(), kMacBytes));
  in.mac.emplace(recv_mac_.body_mac(head));
  in.entries.resize(in.h.nfds);
  if (in.h.nfds > 0)
    std::memcpy(in.entries.data(), in.head + sizeof in.h, in.h.nfds * sizeof(uint64_t));
  // Authenticated: what is wrong now is a bug on the other end; still, never trust lengths.
  if (in.h.length > kMaxSealedFrame) throw std::runtime_error("corrupt TCP frame (length)");
  uint64_t left = in.h.length;
  in.fds.resize(in.entries.size());
  for (size_t i = 0; i < in.entries.size(); ++i) {
    uint64_t e = in.entries[i];
    if (e & kRefBit) {
      if ((e & ~kRefBit) == 0) throw std::runtime_error("corrupt TCP frame (segment ref)");
      continue;
    }
    if (e > left) throw std::runtime_error("corrupt TCP frame (fd length)");
    left -= e;
    auto& r = in.fds[i];
    if (buffers_) r.fd = buffers_(e);
    if (!r.fd) r.fd = detail::memfd_sized(e);
    r.size = e;
  }
}

Frame Channel::sealed_frame() {
  Incoming& in = *in_;
  if (!same_mac(in.mac->final(), std::string_view(in.body_mac, kBodyMacBytes)))
    throw AuthError("a frame failed authentication (wrong key, tampered, replayed or reordered)");
  recv_mac_.advance();
  Frame f;
  f.kind = in.h.kind;
  f.rank = in.h.rank;
  f.seq = in.h.seq;
  f.payload = std::move(in.payload);
  if (!in.fds.empty()) {
    f.fds = std::make_shared<std::vector<Fd>>();
    for (size_t i = 0; i < in.fds.size(); ++i) {
      auto& r = in.fds[i];
      if (in.entries[i] & kRefBit) {
        if (f.refs.empty()) f.refs.assign(in.fds.size(), 0);
        f.refs[i] = in.entries[i] & ~kRefBit;
      } else {
        // Its size is final, as a rank's reply memfd's is: no mapping of it can be cut short.
        check(::fcntl(r.fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), "fcntl(F_ADD_SEALS)",
              "sealing a buffer received over TCP");
      }
      f.fds->push_back(std::move(r.fd));
      f.fd_bytes.push_back(r.size);  // a pooled memfd may be larger
    }
  }
  in_.reset();
  return f;
}

Channel::ReadResult Channel::read_some() {
  if (sealed()) return read_sealed();
  // The rest of a large payload is read straight into it; anything else through a small buffer,
  // so that a frame's header and payload (and whatever frames follow) come in one recvmsg, and
  // every byte read is taken into its frame at once (nothing waits here that no readiness would
  // report). A frame's fds come with its first byte: the kernel hands over one frame's fds per
  // recvmsg and stops after them, so they are the last frame's that begins in it, in order.
  const size_t left = reading_payload_ ? reading_payload_->size() - payload_filled_ : 0;
  const bool direct = left >= kReadBytes;
  if (!direct && !read_buf_) read_buf_ = std::make_unique<char[]>(kReadBytes);
  iovec iov{direct ? reading_payload_->data() + payload_filled_ : read_buf_.get(),
            direct ? left : kReadBytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(sock_.get(), &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadResult::kWouldBlock;
    if (errno == ECONNRESET) return ReadResult::kEof;
    throw_errno("recvmsg", "reading a frame");
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* in = reinterpret_cast<const int*>(CMSG_DATA(c));
    for (size_t i = 0; i < count; ++i) received_fds_.emplace_back(in[i]);
  }
  // The kernel drops fds it cannot install here (EMFILE, or RLIMIT_NOFILE): the next frame that
  // lacks some of its fds is delivered marked, with those that did arrive. Our control buffer fits
  // kMaxFdsPerFrame, the most a sender may attach, so that is the only cause.
  if (msg.msg_flags & MSG_CTRUNC) fds_dropped_ = true;
  if (n == 0) return ReadResult::kEof;
  if (direct) {
    payload_filled_ += static_cast<size_t>(n);
    if (payload_filled_ == reading_payload_->size()) finish_frame();
    return ReadResult::kProgress;
  }
  const char* at = read_buf_.get();
  size_t rest = static_cast<size_t>(n);
  while (rest > 0) {
    if (!reading_payload_) {
      size_t k = std::min(rest, sizeof header_ - header_filled_);
      std::memcpy(header_ + header_filled_, at, k);
      header_filled_ += k;
      at += k;
      rest -= k;
      if (header_filled_ < sizeof header_) break;
      start_frame();
    }
    size_t k = std::min(rest, reading_payload_->size() - payload_filled_);
    std::memcpy(reading_payload_->data() + payload_filled_, at, k);
    payload_filled_ += k;
    at += k;
    rest -= k;
    if (payload_filled_ == reading_payload_->size()) finish_frame();
  }
  return ReadResult::kProgress;
}

void Channel::start_frame() {
  detail::WireHeader h;
  std::memcpy(&h, header_, sizeof h);
  if (h.nfds > kMaxFdsPerFrame) throw std::runtime_error("corrupt frame header (fd count)");
  reading_.emplace();
  reading_->kind = h.kind;
  reading_->rank = h.rank;
  reading_->seq = h.seq;
  reading_nfds_ = h.nfds;
  reading_payload_ = std::make_shared<std::string>(h.length, '\0');
  payload_filled_ = 0;
  header_filled_ = 0;
}

void Channel::finish_frame() {
  Frame f = std::move(*reading_);
  f.payload = std::move(reading_payload_);
  size_t nfds = reading_nfds_;
  if (received_fds_.size() < nfds) {
    if (!fds_dropped_) throw std::runtime_error("frame announced fds that did not arrive");
    nfds = received_fds_.size();
    f.truncated = true;
    fds_dropped_ = false;
  }
  if (nfds > 0) {
    f.fds = std::make_shared<std::vector<Fd>>();
    for (size_t i = 0; i < nfds; ++i) {
      f.fds->push_back(std::move(received_fds_.front()));
      received_fds_.pop_front();
    }
  }
  reading_.reset();
  reading_payload_.reset();
  complete_.push_back(std::move(f));
}

std::optional<Frame> Channel::next() {
  if (complete_.empty()) return std::nullopt;
  Frame f = std::move(complete_.front());
  complete_.pop_front();
  return f;
}

std::optional<Frame> Channel::recv() {
  while (complete_.empty()) {
    ReadResult r = read_some();
    if (r == ReadResult::kEof) return std::nullopt;
    if (r == ReadResult::kWouldBlock)
      throw std::logic_error("Channel::recv on a non-blocking socket");
  }
  return next();
}

pid_t Channel::peer_pid() const {
  ucred cred{};
  socklen_t len = sizeof cred;
  check(::getsockopt(sock_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len), "getsockopt(SO_PEERCRED)",
        "asking who is on the other end of a socket");
  return cred.pid;
}

std::pair<Channel, Channel> channel_pair() {
  int sv[2];
  check(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), "socketpair",
        "creating a connected socket pair");
  return {Channel(Fd(sv[0])), Channel(Fd(sv[1]))};
}

RuntimeDir::RuntimeDir() {
  std::string base;
  for (const char* var : {"XDG_RUNTIME_DIR", "TMPDIR"}) {
    const char* v = std::getenv(var);
    if (v && *v && ::access(v, W_OK | X_OK) == 0) {
      base = v;
      break;
    }
  }
  if (base.empty()) base = "/tmp";
  sweep(base);
  std::string tmpl = base + "/ddip-XXXXXX";
  if (!::mkdtemp(tmpl.data())) throw_errno("mkdtemp", "creating the private runtime directory");
  path_ = tmpl;  // mkdtemp creates it with mode 0700
  // Without a lock the directory still works; it is only never swept if its process is killed.
  lock_ = Fd(::open((path_ + "/lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (lock_ && ::flock(lock_.get(), LOCK_EX | LOCK_NB) != 0) lock_ = Fd();
}

int RuntimeDir::sweep(const std::string& base, long min_age_s) {
  std::error_code ec;
  std::filesystem::directory_iterator it(base, ec);
  int removed = 0;
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("ddip-", 0) != 0 || name.size() != 11) continue;  // mkdtemp's ddip-XXXXXX
    const std::string dir = it->path().string();
    struct stat st{};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    if (::time(nullptr) - st.st_mtime < min_age_s) continue;
    // No lock file: not one of ours (or from before locks), left alone.
    Fd lock(::open((dir + "/lock").c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!lock || ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) continue;  // held: its group lives
    std::error_code rm;
    if (std::filesystem::remove_all(dir, rm) > 0 && !rm) ++removed;
  }
  return removed;
}

RuntimeDir::~RuntimeDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Listener::Listener(const std::string& path) {
  sockaddr_un addr = detail::unix_address(path);
  sock_ = Fd(check(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), "socket",
                   "creating the listening socket"));
  check(::bind(sock_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), "bind",
        "binding the listening socket " + path);
  check(::listen(sock_.get(), 128), "listen", "listening on " + path);
}

Fd Listener::accept() {
  int fd = ::accept4(sock_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  // Out of fds: the connection stays in the backlog for a later try, and the caller is told.
  starved_ = fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED ||
        starved_)
      return Fd();
    throw_errno("accept4", "accepting a worker connection");
  }
  return Fd(fd);
}

Fd connect_unix(const std::string& path) {
  sockaddr_un addr = detail::unix_address(path);
  Fd s(check(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), "socket", "creating a socket"));
  int rc;
  do {
    rc = ::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  } while (rc < 0 && errno == EINTR);
  check(rc, "connect", "connecting to " + path);
  return s;
}

}  // namespace ddip
