#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "ddip/channel.hpp"

using namespace ddip;

namespace {

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
