#include "ddip/channel.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

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

// The bytes of an fd that a sealed channel sends in its frame's place.
void append_contents(std::string& out, int fd, std::optional<size_t> bytes) {
  size_t n;
  if (bytes) {
    n = *bytes;
  } else {
    struct stat st {};
    check(::fstat(fd, &st), "fstat", "sizing an fd to send over TCP");
    n = static_cast<size_t>(st.st_size);
  }
  size_t start = out.size();
  out.resize(start + n);
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, out.data() + start + done, n - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno("pread", "copying an fd's contents into a TCP frame");
    if (r == 0) throw std::runtime_error("an fd sent over TCP was shorter than announced");
    done += static_cast<size_t>(r);
  }
}

// A sealed memfd holding `data`: what arrives where a frame's fd was sent over TCP.
Fd memfd_holding(std::string_view data) {
  Fd fd(check(::memfd_create("ddip-link", MFD_CLOEXEC | MFD_ALLOW_SEALING), "memfd_create",
              "receiving a buffer over TCP"));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t r =
        ::pwrite(fd.get(), data.data() + done, data.size() - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno("pwrite", "receiving a buffer over TCP");
    done += static_cast<size_t>(r);
  }
  // Its size is final, as a rank's reply memfd's is: no mapping of it can be cut short.
  check(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), "fcntl(F_ADD_SEALS)",
        "sealing a buffer received over TCP");
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

Channel::Channel(Fd sock) : sock_(std::move(sock)) {}

void Channel::queue(Frame f) {
  size_t nfds = f.fds ? f.fds->size() : 0;
  if (nfds > kMaxFdsPerFrame) throw std::invalid_argument("too many fds in one frame");
  Outgoing o;
  if (sealed()) {
    o.frame = inline_fds(std::move(f), o.header);
  } else {
    detail::WireHeader h{f.payload ? f.payload->size() : 0, f.seq, f.kind,
                         static_cast<uint16_t>(nfds), f.rank};
    std::memcpy(o.header, &h, sizeof h);
    o.frame = std::move(f);
  }
  out_.push_back(std::move(o));
}

// Sealed: [u32 count, u64 length each, the fds' bytes] when there are fds, the payload, the MAC.
// The copy is made now, so a pooled segment may be reused as soon as this returns.
Frame Channel::inline_fds(Frame f, char* header) {
  size_t nfds = f.fds ? f.fds->size() : 0;
  std::string body;
  if (nfds > 0) {
    uint32_t count = static_cast<uint32_t>(nfds);
    body.append(reinterpret_cast<const char*>(&count), sizeof count);
    std::vector<size_t> at(nfds);
    for (size_t i = 0; i < nfds; ++i) {
      at[i] = body.size();
      body.append(sizeof(uint64_t), '\0');
    }
    for (size_t i = 0; i < nfds; ++i) {
      size_t before = body.size();
      std::optional<size_t> bytes;
      if (i < f.fd_bytes.size()) bytes = f.fd_bytes[i];
      detail::append_contents(body, (*f.fds)[i].get(), bytes);
      uint64_t n = body.size() - before;
      std::memcpy(body.data() + at[i], &n, sizeof n);
    }
  }
  body += f.data();
  detail::WireHeader h{body.size() + kMacBytes, f.seq, f.kind, static_cast<uint16_t>(nfds), f.rank};
  std::memcpy(header, &h, sizeof h);
  body += send_mac_.sign(std::string_view(header, sizeof h), body);
  f.payload = std::make_shared<const std::string>(std::move(body));
  f.fds.reset();
  f.fd_bytes.clear();
  return f;
}

void Channel::seal(LinkKeys keys) {
  if (!out_.empty() || header_filled_ || reading_payload_ || !complete_.empty())
    throw std::logic_error("Channel::seal with frames in flight");
  send_mac_ = FrameMac(std::move(keys.send));
  recv_mac_ = FrameMac(std::move(keys.recv));
}

bool Channel::flush() {
  while (!out_.empty()) {
    Outgoing& o = out_.front();
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

Channel::ReadResult Channel::read_some() {
  char* dst;
  size_t want;
  if (reading_payload_) {
    dst = reading_payload_->data() + payload_filled_;
    want = reading_payload_->size() - payload_filled_;
  } else {
    dst = header_ + header_filled_;
    want = sizeof header_ - header_filled_;
  }
  iovec iov{dst, want};
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
  // The kernel drops fds it cannot install here (EMFILE, or RLIMIT_NOFILE): the frame whose
  // header this read belongs to is delivered marked, with the fds that did arrive. Our control
  // buffer fits kMaxFdsPerFrame, the most a sender may attach, so that is the only cause.
  if (msg.msg_flags & MSG_CTRUNC) reading_truncated_ = true;
  if (n == 0) return ReadResult::kEof;
  if (reading_payload_) {
    payload_filled_ += static_cast<size_t>(n);
  } else {
    header_filled_ += static_cast<size_t>(n);
    if (header_filled_ == sizeof header_) {
      detail::WireHeader h;
      std::memcpy(&h, header_, sizeof h);
      if (h.nfds > kMaxFdsPerFrame) throw std::runtime_error("corrupt frame header (fd count)");
      if (sealed() && (h.length < kMacBytes || h.length > kMaxSealedFrame))
        throw AuthError("a frame header failed authentication (impossible length)");
      std::memcpy(reading_header_, header_, sizeof header_);
      reading_.emplace();
      reading_->kind = h.kind;
      reading_->rank = h.rank;
      reading_->seq = h.seq;
      reading_nfds_ = h.nfds;
      reading_payload_ = std::make_shared<std::string>(h.length, '\0');
      payload_filled_ = 0;
      header_filled_ = 0;
    }
  }
  if (reading_payload_ && payload_filled_ == reading_payload_->size()) finish_frame();
  return ReadResult::kProgress;
}

void Channel::finish_frame() {
  Frame f = std::move(*reading_);
  if (sealed()) open_sealed(f);
  f.payload = std::move(reading_payload_);
  size_t nfds = sealed() ? 0 : reading_nfds_;
  if (received_fds_.size() < nfds) {
    if (!reading_truncated_) throw std::runtime_error("frame announced fds that did not arrive");
    nfds = received_fds_.size();
  }
  if (nfds > 0) {
    f.fds = std::make_shared<std::vector<Fd>>();
    for (size_t i = 0; i < nfds; ++i) {
      f.fds->push_back(std::move(received_fds_.front()));
      received_fds_.pop_front();
    }
  }
  f.truncated = reading_truncated_;
  reading_truncated_ = false;
  reading_.reset();
  reading_payload_.reset();
  complete_.push_back(std::move(f));
}

// Checks the MAC, then turns the fds' contents back into fds.
void Channel::open_sealed(Frame& f) {
  std::string& p = *reading_payload_;
  size_t body = p.size() - kMacBytes;
  recv_mac_.verify(std::string_view(reading_header_, sizeof reading_header_),
                   std::string_view(p.data(), body), std::string_view(p.data() + body, kMacBytes));
  p.resize(body);
  if (reading_nfds_ == 0) return;
  // Authenticated, so a bad table is a bug on the other end, not an attack; still, never trust
  // lengths without checking them.
  uint32_t count = 0;
  size_t table = sizeof count + reading_nfds_ * sizeof(uint64_t);
  if (p.size() < table) throw std::runtime_error("corrupt TCP frame (fd table)");
  std::memcpy(&count, p.data(), sizeof count);
  if (count != reading_nfds_) throw std::runtime_error("corrupt TCP frame (fd count)");
  size_t off = table;
  f.fds = std::make_shared<std::vector<Fd>>();
  for (size_t i = 0; i < count; ++i) {
    uint64_t n;
    std::memcpy(&n, p.data() + sizeof count + i * sizeof n, sizeof n);
    if (n > p.size() - off) throw std::runtime_error("corrupt TCP frame (fd length)");
    f.fds->push_back(detail::memfd_holding(std::string_view(p.data() + off, n)));
    off += n;
  }
  p.erase(0, off);
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
