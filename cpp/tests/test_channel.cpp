#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sys/mman.h>
#include <sys/socket.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "ddip/auth.hpp"
#include "ddip/channel.hpp"
#include "helpers.hpp"

using namespace ddip;
using test::drain;
using test::FdStarvation;

namespace {

Frame with_fds(uint64_t seq, int n) {
  Frame f = Frame::make(kDone, 0, seq, "payload");
  f.fds = std::make_shared<std::vector<Fd>>();
  for (int i = 0; i < n; ++i) f.fds->push_back(make_pipe().read);
  return f;
}

}  // namespace

TEST(Channel, FramesKeepKindRankSeqAndPayload) {
  auto [a, b] = channel_pair();
  a.send(Frame::make(kRequest, 3, 42, "hello"));
  a.send(Frame::make(kDone, -1, 7, ""));
  auto f = b.recv();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->kind, kRequest);
  EXPECT_EQ(f->rank, 3);
  EXPECT_EQ(f->seq, 42u);
  EXPECT_EQ(f->data(), "hello");
  auto g = b.recv();
  ASSERT_TRUE(g);
  EXPECT_EQ(g->kind, kDone);
  EXPECT_EQ(g->rank, -1);
  EXPECT_EQ(g->data(), "");
}

TEST(Channel, LargePayloadThroughANonBlockingWriter) {
  auto [a, b] = channel_pair();
  set_nonblocking(a.fd());
  std::string big(8 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131);
  a.queue(Frame::make(kRequest, 0, 1, big));
  std::optional<Frame> got;
  std::thread reader([&, &b = b] { got = b.recv(); });
  while (!a.flush()) std::this_thread::yield();  // partial writes resume where they stopped
  reader.join();
  ASSERT_TRUE(got);
  EXPECT_EQ(got->data(), big);
}

TEST(Channel, PassesFileDescriptors) {
  auto [a, b] = channel_pair();
  Pipe p = make_pipe();
  Frame f = Frame::make(kRequest, 0, 1, "with fd");
  f.fds = std::make_shared<std::vector<Fd>>();
  f.fds->push_back(std::move(p.write));
  a.send(std::move(f));
  auto got = b.recv();
  ASSERT_TRUE(got && got->fds);
  ASSERT_EQ(got->fds->size(), 1u);
  int fd = (*got->fds)[0].get();
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC);
  ASSERT_EQ(::write(fd, "x", 1), 1);  // the received fd is the pipe's write end
  char c = 0;
  ASSERT_EQ(::read(p.read.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
}

// A plain channel reads through a small buffer: one recvmsg brings a frame's header and payload
// and the frames after it, up to and with the next frame that carries fds (the kernel hands over
// one frame's fds per recvmsg, and stops after them), each frame with its own fds.
TEST(Channel, OneReadDeliversEveryFrameItBroughtEachWithItsFds) {
  auto [a, b] = channel_pair();
  a.send(Frame::make(kRequest, 1, 1, "first"));
  a.send(Frame::make(kRequest, 1, 2, ""));
  Frame with = Frame::make(kRequest, 1, 3, "third, with two fds");
  with.fds = std::make_shared<std::vector<Fd>>();
  Pipe p1 = make_pipe(), p2 = make_pipe();
  with.fds->push_back(std::move(p1.write));
  with.fds->push_back(std::move(p2.write));
  a.send(std::move(with));
  a.send(Frame::make(kRequest, 1, 4, "fourth"));
  ASSERT_EQ(b.read_some(), Channel::ReadResult::kProgress);
  std::vector<uint64_t> seqs;
  std::vector<size_t> fds;
  while (auto f = b.next()) {
    seqs.push_back(f->seq);
    fds.push_back(f->fds ? f->fds->size() : 0);
    if (f->seq == 3) {
      EXPECT_EQ(f->data(), "third, with two fds");
    }
  }
  EXPECT_EQ(seqs, (std::vector<uint64_t>{1, 2, 3})) << "one read, three frames";
  EXPECT_EQ(fds, (std::vector<size_t>{0, 0, 2}));
  EXPECT_FALSE(b.has_frame());
  ASSERT_EQ(b.read_some(), Channel::ReadResult::kProgress);
  auto fourth = b.next();
  ASSERT_TRUE(fourth);
  EXPECT_EQ(fourth->data(), "fourth");
  EXPECT_FALSE(fourth->fds);
}

TEST(Channel, EofWhenThePeerCloses) {
  auto pair = channel_pair();
  {
    Channel gone = std::move(pair.first);
  }
  EXPECT_FALSE(pair.second.recv());
}

TEST(Channel, FlushToAClosedPeerThrows) {
  auto pair = channel_pair();
  {
    Channel gone = std::move(pair.second);
  }
  EXPECT_THROW(pair.first.send(Frame::make(kRequest, 0, 0, "x")), std::system_error);
}

TEST(RuntimeDir, PrivateAndRemoved) {
  std::string path;
  {
    RuntimeDir d;
    path = d.path();
    struct stat st{};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700);
    Listener l(d.socket_path());
    EXPECT_TRUE(std::filesystem::exists(d.socket_path()));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(RuntimeDir, LeftoversOfKilledProcessesAreSweptLiveOnesKept) {
  char base_tmpl[] = "/tmp/ddip-sweep-test-XXXXXX";
  ASSERT_NE(::mkdtemp(base_tmpl), nullptr);
  const std::string base = base_tmpl;
  auto make = [&](const std::string& name, bool with_lock) {
    std::filesystem::create_directory(base + "/" + name);
    if (with_lock) Fd(::open((base + "/" + name + "/lock").c_str(), O_RDWR | O_CREAT, 0600));
  };
  make("ddip-killed", true);  // its holder is gone: nobody has its lock
  make("ddip-nolock", false);  // not ours to judge
  make("ddip-fresh1", true);   // too new: its maker may not have locked it yet
  ::setenv("TMPDIR", base.c_str(), 1);
  ::unsetenv("XDG_RUNTIME_DIR");
  {
    RuntimeDir live;  // holds its lock while it exists
    const std::string live_name = std::filesystem::path(live.path()).filename().string();
    // Everything old enough to be judged, the live one too.
    for (const auto& e : std::filesystem::directory_iterator(base)) {
      struct timespec old[2] = {{::time(nullptr) - 3600, 0}, {::time(nullptr) - 3600, 0}};
      if (e.path().filename() != "ddip-fresh1") ::utimensat(AT_FDCWD, e.path().c_str(), old, 0);
    }
    EXPECT_EQ(RuntimeDir::sweep(base), 1);
    EXPECT_FALSE(std::filesystem::exists(base + "/ddip-killed"));
    EXPECT_TRUE(std::filesystem::exists(base + "/ddip-nolock"));
    EXPECT_TRUE(std::filesystem::exists(base + "/ddip-fresh1"));
    EXPECT_TRUE(std::filesystem::exists(base + "/" + live_name));
  }
  ::unsetenv("TMPDIR");
  std::filesystem::remove_all(base);
}

TEST(Listener, AcceptsAndKnowsThePeer) {
  RuntimeDir d;
  Listener l(d.socket_path());
  EXPECT_FALSE(l.accept());  // nothing pending: non-blocking
  Channel client(connect_unix(d.socket_path()));
  Fd server_fd;
  while (!(server_fd = l.accept())) std::this_thread::yield();
  Channel server(std::move(server_fd));
  EXPECT_EQ(server.peer_pid(), ::getpid());
  client.send(Frame::make(kHello, 5, 0, "hi"));
  set_nonblocking(client.fd());
  std::optional<Frame> f;
  while (!(f = server.next())) server.read_some();
  EXPECT_EQ(f->rank, 5);
}

TEST(Listener, TooLongAPathIsAClearError) {
  std::string path = "/tmp/" + std::string(200, 'x');
  try {
    Listener l(path);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("TMPDIR"), std::string::npos);
  }
}

TEST(Channel, AFrameWhoseFdsCouldNotBeReceivedIsMarkedTruncated) {
  if (FdStarvation::sanitized()) GTEST_SKIP() << "needs fds the sanitizers would lack";
  auto [a, b] = channel_pair();
  a.send(with_fds(1, 3));
  a.send(with_fds(2, 1));
  std::optional<Frame> first;
  {
    FdStarvation starved(1);  // room for one of the three
    first = b.recv();
  }
  ASSERT_TRUE(first);
  EXPECT_TRUE(first->truncated);
  EXPECT_EQ(first->seq, 1u);
  EXPECT_EQ(first->data(), "payload");
  ASSERT_TRUE(first->fds);
  EXPECT_EQ(first->fds->size(), 1u);  // the one that arrived, for the receiver to close
  auto second = b.recv();             // the stream is still in step
  ASSERT_TRUE(second);
  EXPECT_FALSE(second->truncated);
  EXPECT_EQ(second->seq, 2u);
  ASSERT_TRUE(second->fds);
  EXPECT_EQ(second->fds->size(), 1u);
}

TEST(Channel, NoFdAtAllIsTruncatedToo) {
  if (FdStarvation::sanitized()) GTEST_SKIP() << "needs fds the sanitizers would lack";
  auto [a, b] = channel_pair();
  a.send(with_fds(1, 2));
  std::optional<Frame> f;
  {
    FdStarvation starved;
    f = b.recv();
  }
  ASSERT_TRUE(f);
  EXPECT_TRUE(f->truncated);
  EXPECT_TRUE(!f->fds || f->fds->empty());
}

TEST(Listener, OutOfFdsLeavesTheConnectionWaitingInsteadOfThrowing) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Channel client(connect_unix(d.socket_path()));
  {
    FdStarvation starved;
    Fd none;
    EXPECT_NO_THROW(none = l.accept());
    EXPECT_FALSE(none);
    EXPECT_TRUE(l.starved());
  }
  Fd fd = l.accept();  // still there once fds are free again
  EXPECT_TRUE(fd);
  EXPECT_FALSE(l.starved());
}

// ---- Sealed channels (TCP links between hosts): framing, streaming, authentication ----------

namespace {

const std::string kLinkKey = random_bytes(kKeyBytes);

// Both ends' frame keys, as a link's handshake gives them.
std::pair<LinkKeys, LinkKeys> link_keys() {
  KernelHandshake kernel(kLinkKey);
  HostHandshake host(kLinkKey, 0);
  auto accepted = kernel.accept(host.respond(kernel.challenge()));
  return {accepted.keys, host.verify(accepted.proof)};
}

std::pair<Channel, Channel> sealed_pair() {
  auto [a, b] = channel_pair();
  auto [ka, kb] = link_keys();
  a.seal(ka);
  b.seal(kb);
  return {std::move(a), std::move(b)};
}

std::string pattern(size_t n, unsigned seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

Fd memfd_holding(const std::string& bytes, size_t padding = 0) {
  Fd m(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  std::string all = bytes + std::string(padding, 'p');
  size_t done = 0;
  while (done < all.size()) {
    ssize_t n = ::write(m.get(), all.data() + done, all.size() - done);
    if (n <= 0) throw std::runtime_error("write to memfd");
    done += static_cast<size_t>(n);
  }
  return m;
}

std::string contents(int fd) {
  struct stat st {};
  ::fstat(fd, &st);
  std::string s(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::pread(fd, s.data() + done, s.size() - done, static_cast<off_t>(done));
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  s.resize(done);
  return s;
}

// This process's peak resident memory (kB), after resetting it where the kernel lets us.
long peak_rss_kb(bool reset = false) {
  if (reset) {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
  }
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}


// A frame with two buffers (one with padding past what counts) and a payload.
Frame big_frame(size_t a, size_t b, size_t payload) {
  Frame f = Frame::make(kRequest, 3, 9, pattern(payload, 3));
  f.fds = std::make_shared<std::vector<Fd>>();
  f.fds->push_back(memfd_holding(pattern(a, 1), 4096));
  f.fd_bytes.push_back(a);
  f.fds->push_back(memfd_holding(pattern(b, 2)));
  f.fd_bytes.push_back(b);
  return f;
}

}  // namespace

TEST(SealedFrames, AForgedHeaderInALiveStreamFailsItWithoutAllocatingItsLength) {
  auto [sender, receiver] = sealed_pair();
  set_nonblocking(receiver.fd());
  sender.send(Frame::make(kDone, 1, 1, "before the attack"));
  // What an attacker on the path can write without the key: a header announcing 1 GiB (within
  // what a link accepts), and anything where its MAC goes.
  char forged[24 + kMacBytes];
  std::memset(forged, 'x', sizeof forged);
  uint64_t length = uint64_t(1) << 30, seq = 2;
  uint16_t kind = kDone, nfds = 0;
  int32_t rank = 1;
  std::memcpy(forged, &length, 8);
  std::memcpy(forged + 8, &seq, 8);
  std::memcpy(forged + 16, &kind, 2);
  std::memcpy(forged + 18, &nfds, 2);
  std::memcpy(forged + 20, &rank, 4);
  ASSERT_EQ(::write(sender.fd(), forged, sizeof forged), static_cast<ssize_t>(sizeof forged));
  long before = peak_rss_kb(true);
  std::vector<Frame> got;
  std::string why;
  try {
    while (receiver.read_some() == Channel::ReadResult::kProgress)
      while (auto f = receiver.next()) got.push_back(std::move(*f));
  } catch (const AuthError& e) {
    why = e.what();
  }
  while (auto f = receiver.next()) got.push_back(std::move(*f));
  long after = peak_rss_kb();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].data(), "before the attack");
  EXPECT_NE(why.find("frame header failed authentication"), std::string::npos)
      << "the forged header must fail the link, not wait for its body; got: '" << why << "'";
  EXPECT_EQ(receiver.reading_allocated(), 0u);
  EXPECT_LT(after - before, 16 * 1024) << "kB of peak RSS grew while reading a forged header";
}

TEST(SealedFrames, LargeBuffersStreamFromTheirFdsAndArriveIntact) {
  auto [sender, receiver] = sealed_pair();
  const size_t a = (size_t(24) << 20) + 3, b = (size_t(5) << 20) + 17, payload = 300000;
  sender.queue(big_frame(a, b, payload));
  // Queued, not copied: the buffers are written from their fds.
  EXPECT_LT(sender.buffered_bytes(), 1024u);
  std::thread writer([&] { sender.flush(); });
  auto f = receiver.recv();
  writer.join();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->kind, kRequest);
  EXPECT_EQ(f->rank, 3);
  EXPECT_EQ(f->seq, 9u);
  EXPECT_EQ(f->data(), pattern(payload, 3));
  ASSERT_TRUE(f->fds);
  ASSERT_EQ(f->fds->size(), 2u);
  EXPECT_TRUE(f->refs.empty());
  EXPECT_EQ(contents((*f->fds)[0].get()), pattern(a, 1)) << "only the bytes that count travel";
  EXPECT_EQ(contents((*f->fds)[1].get()), pattern(b, 2));
  for (auto& fd : *f->fds) {
    int seals = ::fcntl(fd.get(), F_GET_SEALS);
    EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
  }
  EXPECT_LE(receiver.buffered_bytes(), Channel::kStageBytes);
  // The next frame on the same link still verifies: both ends counted the same frames.
  sender.send(Frame::make(kDone, 3, 10, "after"));
  f = receiver.recv();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->data(), "after");
}

TEST(SealedFrames, BuffersOfEverySizeAroundTheStageArriveIntactFrameAfterFrame) {
  // An fd's bytes are written into their memfd from the stage, which a read may fill with the
  // end of one buffer and the start of the next piece: every boundary case, back to back.
  auto [sender, receiver] = sealed_pair();
  const size_t k = Channel::kStageBytes;
  const std::vector<size_t> sizes = {0, 1, k - 1, k, k + 1, 3 * k + 5};
  const size_t payload = k + 7;  // read straight into its string
  std::thread writer([&, &sender = sender] {
    for (unsigned i = 0; i < 3; ++i) {
      Frame f = Frame::make(kDone, 2, 20 + i, pattern(payload, 100 + i));
      f.fds = std::make_shared<std::vector<Fd>>();
      for (size_t j = 0; j < sizes.size(); ++j)
        f.fds->push_back(memfd_holding(pattern(sizes[j], 10 * i + static_cast<unsigned>(j))));
      sender.send(std::move(f));
    }
  });
  for (unsigned i = 0; i < 3; ++i) {
    SCOPED_TRACE("frame " + std::to_string(i));
    auto f = receiver.recv();
    ASSERT_TRUE(f);
    EXPECT_EQ(f->seq, 20u + i);
    EXPECT_EQ(f->data(), pattern(payload, 100 + i));
    ASSERT_TRUE(f->fds);
    ASSERT_EQ(f->fds->size(), sizes.size());
    for (size_t j = 0; j < sizes.size(); ++j) {
      SCOPED_TRACE("buffer of " + std::to_string(sizes[j]) + " bytes");
      EXPECT_EQ(contents((*f->fds)[j].get()), pattern(sizes[j], 10 * i + static_cast<unsigned>(j)));
      int seals = ::fcntl((*f->fds)[j].get(), F_GET_SEALS);
      EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
    }
  }
  writer.join();
  EXPECT_LE(receiver.buffered_bytes(), Channel::kStageBytes);
}

TEST(SealedFrames, BuffersAreReceivedIntoTheMemfdsTheReceiverGives) {
  auto [sender, receiver] = sealed_pair();
  std::vector<size_t> asked;
  std::vector<int> given;
  receiver.receive_buffers_from([&](size_t n) {
    asked.push_back(n);
    if (asked.size() == 2) return Fd();  // none to give: a fresh one
    Fd m(::memfd_create("given", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ::ftruncate(m.get(), static_cast<off_t>(n + 4096));  // larger than asked, as a pool's are
    ::pwrite(m.get(), "stale", 5, static_cast<off_t>(n));
    given.push_back(m.get());
    return m;
  });
  Frame f = Frame::make(kRequest, 1, 4, "table");
  f.fds = std::make_shared<std::vector<Fd>>();
  f.fds->push_back(memfd_holding("first buffer"));
  f.fds->push_back(memfd_holding("second buffer"));
  f.fds->push_back(memfd_holding("third"));
  sender.send(std::move(f));
  auto got = receiver.recv();
  ASSERT_TRUE(got);
  EXPECT_EQ(asked, (std::vector<size_t>{12, 13, 5}));
  ASSERT_TRUE(got->fds);
  ASSERT_EQ(got->fds->size(), 3u);
  EXPECT_EQ((*got->fds)[0].get(), given[0]) << "the very memfd given";
  EXPECT_EQ((*got->fds)[2].get(), given[1]);
  EXPECT_EQ(contents((*got->fds)[0].get()).substr(0, 12), "first buffer");
  EXPECT_EQ(contents((*got->fds)[1].get()), "second buffer");
  EXPECT_EQ(contents((*got->fds)[2].get()).substr(0, 5), "third");
  EXPECT_EQ(got->fd_bytes, (std::vector<size_t>{12, 13, 5})) << "what came, in a larger memfd";
}

TEST(SealedFrames, RefsTravelAsIdsBesideInlineBuffers) {
  auto [sender, receiver] = sealed_pair();
  Frame f = Frame::make(kRequest, 1, 4, "table");
  f.fds = std::make_shared<std::vector<Fd>>();
  f.fds->push_back(memfd_holding("inline bytes"));
  f.fds->push_back(Fd());
  f.refs = {0, 77};
  sender.send(std::move(f));
  auto got = receiver.recv();
  ASSERT_TRUE(got);
  ASSERT_TRUE(got->fds);
  ASSERT_EQ(got->fds->size(), 2u);
  EXPECT_EQ(contents((*got->fds)[0].get()), "inline bytes");
  EXPECT_FALSE((*got->fds)[1]);
  EXPECT_EQ(got->refs, (std::vector<uint64_t>{0, 77}));
  // A ref is the receiver's to fill in: a plain channel has no segments to refer to.
  auto [plain, far] = channel_pair();
  Frame r = Frame::make(kRequest, 1, 5, "");
  r.refs = {5};
  EXPECT_THROW(plain.queue(std::move(r)), std::logic_error);
}

TEST(SealedFrames, TamperingWithAnyPartFailsTheFrame) {
  // Offsets into the frame's bytes: header, fd table, their MAC, a buffer, payload, body MAC.
  const size_t a = 200000, b = 10, payload = 5000;
  const size_t head = 24 + 16 + kMacBytes;  // header, fd table, their MAC
  const size_t total = head + a + b + payload + kBodyMacBytes;
  struct Case {
    const char* part;
    size_t offset;
    bool header;
  };
  for (Case c :
       {Case{"length", 0, true}, Case{"kind", 16, true}, Case{"fd table", 24 + 3, true},
        Case{"header MAC", 24 + 16 + 5, true}, Case{"buffer", head + 150000, false},
        Case{"payload", total - kBodyMacBytes - 7, false}, Case{"body MAC", total - 5, false}}) {
    SCOPED_TRACE(c.part);
    auto [s, s_far] = channel_pair();
    auto [r, r_far] = channel_pair();
    auto [ks, kr] = link_keys();
    s.seal(ks);
    r.seal(kr);
    std::string bytes;
    std::thread reader([&, &s_far = s_far] {
      while (bytes.size() < total) {
        std::string more = drain(s_far.fd());
        if (more.empty()) std::this_thread::yield();
        bytes += more;
      }
    });
    s.send(big_frame(a, b, payload));
    reader.join();
    ASSERT_EQ(bytes.size(), total);
    bytes[c.offset] ^= 0x10;
    std::thread writer([&, &r_far = r_far] {
      size_t done = 0;
      while (done < bytes.size()) {
        ssize_t n = ::send(r_far.fd(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      ::shutdown(r_far.fd(), SHUT_WR);
    });
    std::string why;
    std::optional<Frame> got;
    try {
      got = r.recv();
    } catch (const AuthError& e) {
      why = e.what();
    }
    ::shutdown(r.fd(), SHUT_RDWR);  // the rest of the frame, if any, is not read
    writer.join();
    EXPECT_FALSE(got) << "a tampered frame was delivered";
    EXPECT_NE(why.find(c.header ? "frame header failed authentication" : "frame failed authentication"),
              std::string::npos)
        << why;
  }
}
