// HostLinks against a "host" played by this test: the launcher (/bin/sh) writes the ticket it
// got on its stdin to a file, and a thread here connects with it, as an agent would, over TCP on
// loopback.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include "ddip/host_agent.hpp"
#include "ddip/link_protocol.hpp"
#include "ddip/links.hpp"
#include "helpers.hpp"

using namespace ddip;
using test::FdStarvation;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

struct Seen {
  std::vector<std::string> log;  // in order: "hello:S", "frame:S:KIND", "out:S:TEXT", ...
  std::optional<std::string> lost_why;
};

struct Kernel {
  fs::path dir;
  EventLoop loop;
  Supervisor supervisor;
  SegmentPool pool;
  Seen seen;
  std::unique_ptr<HostLinks> links;

  // Slots 0 (local, never started here) and 1, 2 on host "far"; its launcher runs `script`
  // after saving its stdin (the ticket) to DIR/ticket.
  explicit Kernel(const std::string& script = "exec sleep 30") {
    dir = fs::temp_directory_path() / ("ddip-test-links-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    LinkOptions o;
    RemoteHost h;
    h.name = "far";
    h.launcher =
        test::sh("cat > " + (dir / "ticket.part").string() + " && mv " +
                 (dir / "ticket.part").string() + " " + (dir / "ticket").string() + "; " + script);
    h.slots = {1, 2};
    o.hosts.push_back(h);
    o.handshake_timeout = 2000ms;
    std::vector<SpawnSpec> workers(3);
    workers[1].argv = {"worker-one"};
    workers[2].argv = {"worker-two"};
    HostLinks::Callbacks cb;
    cb.frame = [this](int s, Frame f) {
      seen.log.push_back("frame:" + std::to_string(s) + ":" + std::to_string(f.kind));
    };
    cb.output = [this](int s, int stream, std::string t) {
      seen.log.push_back("out:" + std::to_string(s) + ":" + std::to_string(stream) + ":" + t);
    };
    cb.exited = [this](int s, ExitStatus st, std::string tail) {
      seen.log.push_back("exit:" + std::to_string(s) + ":" + std::to_string(st.code) + ":" + tail);
    };
    cb.lost = [this](int s, const std::string& why) {
      seen.log.push_back("lost:" + std::to_string(s));
      seen.lost_why = why;
    };
    cb.hello = [this](int s) { seen.log.push_back("hello:" + std::to_string(s)); };
    links = std::make_unique<HostLinks>(loop, supervisor, pool, o, workers, cb);
    links->start();
  }
  ~Kernel() {
    links.reset();
    fs::remove_all(dir);
  }

  template <typename Pred>
  bool run_until(Pred done, std::chrono::milliseconds limit = 10s) {
    auto deadline = Clock::now() + limit;
    while (!done() && Clock::now() < deadline) loop.run_once(Clock::now() + 20ms);
    return done();
  }
  // `agent` (an agent's side of the handshake) on a thread while this loop serves it.
  Channel connect(const std::function<Channel()>& agent) {
    std::optional<Channel> host;
    std::atomic<bool> done{false};
    std::thread t([&] {
      host.emplace(agent());
      done = true;
    });
    bool connected = run_until([&] { return done.load(); });
    t.join();
    if (!connected) throw std::runtime_error("the host did not connect");
    return std::move(*host);
  }
  LinkTicket ticket() {
    run_until([&] { return fs::exists(dir / "ticket"); });
    std::ifstream in(dir / "ticket");
    std::string line;
    std::getline(in, line);
    return LinkTicket::decode(line);
  }
};

// The agent's side of the handshake; the sealed channel it gets.
Channel connect_as_host(const LinkTicket& t, const std::string& key) {
  auto deadline = Clock::now() + 5s;
  Fd sock = connect_tcp(t.address, t.port, 5s);
  HostHandshake hs(key, t.host);
  write_all(sock.get(),
            hs.respond(read_exact(sock.get(), KernelHandshake::kChallengeBytes, deadline)),
            deadline);
  LinkKeys keys = hs.verify(read_exact(sock.get(), KernelHandshake::kProofBytes, deadline));
  Channel ch(std::move(sock));
  ch.seal(std::move(keys));
  return ch;
}

// An idle connection to the ticket's listener from `source` (any loopback address is this
// machine's): a stranger holding the port busy.
Fd stranger(const LinkTicket& t, const std::string& source = "127.0.0.1") {
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &a.sin_addr);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw std::runtime_error("bind " + source);
  a.sin_port = htons(t.port);
  ::inet_pton(AF_INET, t.address.c_str(), &a.sin_addr);
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw std::runtime_error("connect from " + source);
  return s;
}

// Everything the kernel wrote to `fd` until it closed it.
std::string until_closed(int fd) { return read_upto(fd, 4096, Clock::now() + 5s); }

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(HostLinks, AnAuthenticatedHostGetsItsWorkersAndSpeaksForThem) {
  Kernel k;
  LinkTicket t = k.ticket();
  EXPECT_EQ(k.links->address(), "127.0.0.1:" + std::to_string(t.port));
  // Sent before the host connected: waits for the link, after the list of workers.
  k.links->send(2, Frame::make(kRequest, 2, 9, "early"), {});
  std::optional<Channel> host;
  std::atomic<bool> connected{false};
  std::thread agent([&] {
    host.emplace(connect_as_host(t, t.key));
    connected = true;
  });
  std::vector<Frame> got;
  ASSERT_TRUE(k.run_until([&] {
    if (!connected) return false;
    set_nonblocking(host->fd());
    while (host->read_some() == Channel::ReadResult::kProgress) {
      while (auto f = host->next()) got.push_back(std::move(*f));
      if (got.size() >= 2) break;
    }
    return got.size() >= 2;
  }));
  agent.join();
  ASSERT_EQ(got[0].kind, kSpawn);
  auto specs = decode_spawn(got[0].data());
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].first, 1);
  EXPECT_EQ(specs[0].second.argv, std::vector<std::string>{"worker-one"});
  EXPECT_EQ(specs[1].second.argv, std::vector<std::string>{"worker-two"});
  EXPECT_EQ(got[1].kind, kRequest);
  EXPECT_EQ(got[1].rank, 2);
  EXPECT_EQ(got[1].data(), "early");

  host->send(Frame::make(kHello, 1, 0, "pid=1"));
  host->send(Frame::make(kOutput, 1, 2, "to stderr\n"));
  host->send(Frame::make(kDone, 1, 9, "reply"));
  host->send(Frame::make(kExit, 1, 0, encode_exit(ExitStatus{3, 0, false}, "last line")));
  host->send(Frame::make(kDone, 1, 10, "after its exit: ignored"));
  ASSERT_TRUE(k.run_until([&] { return k.seen.log.size() >= 5; }));
  k.loop.run_once(Clock::now() + 50ms);
  EXPECT_EQ(k.seen.log, (std::vector<std::string>{
                            "hello:1", "frame:1:" + std::to_string(kHello), "out:1:2:to stderr\n",
                            "frame:1:" + std::to_string(kDone), "exit:1:3:last line"}));
  EXPECT_EQ(k.links->rejected(), 0u);
}

TEST(HostLinks, OneHeartbeatPerHostAndItsAckSpeaksForEveryWorkerItVouchesFor) {
  Kernel k;
  LinkTicket t = k.ticket();
  std::optional<Channel> host = k.connect([&] { return connect_as_host(t, t.key); });
  set_nonblocking(host->fd());
  std::vector<Frame> got;
  auto read_host = [&] {
    while (host->read_some() == Channel::ReadResult::kProgress)
      while (auto f = host->next()) got.push_back(std::move(*f));
  };
  ASSERT_TRUE(k.run_until([&] {
    read_host();
    return !got.empty();
  }));
  ASSERT_EQ(got[0].kind, kSpawn);
  got.clear();
  // Two workers on the host: one heartbeat for the host, not one per worker.
  k.links->tick();
  ASSERT_TRUE(k.run_until([&] {
    read_host();
    return !got.empty();
  }));
  k.loop.run_once(Clock::now() + 50ms);
  read_host();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].kind, kHeartbeat);
  EXPECT_EQ(got[0].rank, kHostRank);

  // The agent vouches for worker 2 only: only worker 2 is heard from.
  host->send(Frame::make(kHeartbeatAck, kHostRank, 0, encode_slots({2})));
  ASSERT_TRUE(k.run_until([&] { return !k.seen.log.empty(); }));
  EXPECT_EQ(k.seen.log, std::vector<std::string>{"frame:2:" + std::to_string(kHeartbeatAck)});

  // Vouching for a slot that is not on that host is corruption: the host is lost.
  host->send(Frame::make(kHeartbeatAck, kHostRank, 0, encode_slots({1, 0})));
  ASSERT_TRUE(k.run_until([&] { return k.seen.lost_why.has_value(); }));
  EXPECT_NE(k.seen.lost_why->find("vouched for rank slot 0, which is not on that host"),
            std::string::npos)
      << *k.seen.lost_why;
}

TEST(HostLinks, ASegmentForSeveralWorkersOfAHostCrossesItsLinkOnce) {
  Kernel k;
  LinkTicket t = k.ticket();
  std::optional<Channel> host = k.connect([&] { return connect_as_host(t, t.key); });
  set_nonblocking(host->fd());
  // As Coordinator::send does for slots 1 and 2: each frame with its fd and its reference.
  std::string bytes(3 << 20, 'b');
  uint64_t id = k.pool.put(bytes.data(), bytes.size());
  for (int slot : {1, 2}) {
    Frame f = Frame::make(kRequest, slot, 5, "table");
    f.fds = std::make_shared<std::vector<Fd>>();
    f.fds->push_back(k.pool.dup_fd(id));
    f.fd_bytes.push_back(bytes.size());
    k.pool.retain(id);
    k.links->send(slot, std::move(f), {id});
  }
  k.pool.release(id);  // the caller's own
  std::vector<Frame> got;
  ASSERT_TRUE(k.run_until([&] {
    while (host->read_some() == Channel::ReadResult::kProgress)
      while (auto f = host->next()) got.push_back(std::move(*f));
    return got.size() >= 5;
  }));
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[0].kind, kSpawn);
  EXPECT_EQ(got[1].kind, kSegment);
  EXPECT_EQ(got[1].seq, id);
  ASSERT_TRUE(got[1].fds);
  ASSERT_EQ(got[1].fds->size(), 1u);
  char head[4] = {};
  EXPECT_EQ(::pread((*got[1].fds)[0].get(), head, 4, 0), 4);
  EXPECT_EQ(std::string(head, 4), "bbbb");
  EXPECT_EQ(::lseek((*got[1].fds)[0].get(), 0, SEEK_END), static_cast<off_t>(bytes.size()));
  for (int i : {2, 3}) {
    EXPECT_EQ(got[i].kind, kRequest);
    EXPECT_EQ(got[i].rank, i - 1);
    EXPECT_EQ(got[i].refs, std::vector<uint64_t>{id}) << "refers to it instead of carrying it";
    EXPECT_EQ(got[i].data(), "table");
  }
  EXPECT_EQ(got[4].kind, kForget);
  EXPECT_EQ(got[4].seq, id);
  EXPECT_EQ(k.pool.in_use(), 0u) << "written, so the pool has it back";
}

TEST(HostLinks, AWrongKeyIsRefusedAndCounted) {
  Kernel k;
  LinkTicket t = k.ticket();
  std::atomic<bool> refused{false};
  std::thread intruder([&] {
    try {
      connect_as_host(t, std::string(t.key.size(), 'x'));
    } catch (const std::exception&) {
      refused = true;  // no proof comes back: the kernel closed the connection
    }
  });
  ASSERT_TRUE(k.run_until([&] { return k.links->rejected() == 1; }));
  intruder.join();
  EXPECT_TRUE(refused);
  EXPECT_NE(k.links->last_rejection().find("refused a connection from 127.0.0.1"),
            std::string::npos)
      << k.links->last_rejection();
  EXPECT_TRUE(k.seen.log.empty());
}

TEST(HostLinks, ALauncherThatExitsBeforeItsHostConnectedLosesItsWorkersWithItsLastLines) {
  Kernel k("echo 'ssh: could not resolve hostname far' >&2; exit 255");
  ASSERT_TRUE(k.run_until([&] { return k.seen.log.size() >= 2; }));
  EXPECT_EQ(k.seen.log, (std::vector<std::string>{"lost:1", "lost:2"}));
  ASSERT_TRUE(k.seen.lost_why);
  EXPECT_NE(k.seen.lost_why->find("its launcher (/bin/sh) ended with exit code 255 before host "
                                  "far connected"),
            std::string::npos)
      << *k.seen.lost_why;
  EXPECT_NE(k.seen.lost_why->find("could not resolve hostname far"), std::string::npos)
      << *k.seen.lost_why;
  EXPECT_TRUE(k.links->launchers_exited());
}

TEST(HostLinks, ALinkThatClosesLosesEveryWorkerOfItsHost) {
  Kernel k;
  LinkTicket t = k.ticket();
  std::optional<Channel> host = k.connect([&] { return connect_as_host(t, t.key); });
  host.reset();  // the host's end closes
  ASSERT_TRUE(k.run_until([&] { return k.seen.log.size() >= 2; }));
  EXPECT_EQ(k.seen.log, (std::vector<std::string>{"lost:1", "lost:2"}));
  EXPECT_NE(k.seen.lost_why->find("lost the link to its host far"), std::string::npos)
      << *k.seen.lost_why;
}

TEST(HostLinks, ALauncherThatExitsAfterItsHostConnectedLosesTheHost) {
  // ssh that ends while the link is up (killed, or its connection dropped): the host is lost,
  // and the link closed, so that its agent stops the workers.
  Kernel k;
  LinkTicket t = k.ticket();
  std::optional<Channel> host = k.connect([&] { return connect_as_host(t, t.key); });
  EXPECT_TRUE(k.seen.log.empty());  // connected, the launcher still running: nothing lost
  k.links->signal_launchers(SIGKILL);
  ASSERT_TRUE(k.run_until([&] { return k.seen.log.size() >= 2; }));
  EXPECT_EQ(k.seen.log, (std::vector<std::string>{"lost:1", "lost:2"}));
  EXPECT_NE(k.seen.lost_why->find("lost the link to its host far: its launcher (/bin/sh) ended "
                                  "with killed by SIGKILL while host far was connected"),
            std::string::npos)
      << *k.seen.lost_why;
  set_nonblocking(host->fd());
  Channel::ReadResult r;
  ASSERT_TRUE(k.run_until([&] {
    while ((r = host->read_some()) == Channel::ReadResult::kProgress)
      while (host->next()) {
      }
    return r == Channel::ReadResult::kEof;
  }));
}

TEST(HostLinks, OutOfFdsTheListenerRestsInsteadOfSpinning) {
  if (FdStarvation::sanitized()) GTEST_SKIP() << "needs fds the sanitizers would lack";
  Kernel k;
  LinkTicket t = k.ticket();
  Fd client = connect_tcp(t.address, t.port, 5s);  // waits in the backlog, to be accepted
  uint64_t tries = 0;
  {
    FdStarvation starved;
    for (int i = 0; i < 50; ++i) k.loop.run_once(Clock::now());  // 50 rounds that never wait
    tries = k.links->starved_accepts();
  }
  EXPECT_GE(tries, 1u);
  // A listener still watched would be tried (and fail) on every round: 50 times.
  EXPECT_LE(tries, 5u) << "the listener was tried on every round of the loop: it spins";
  // With fds again, the waiting connection is taken: it gets its challenge.
  std::string got;
  set_nonblocking(client.get());
  ASSERT_TRUE(k.run_until([&] {
    char buf[64];
    ssize_t n = ::recv(client.get(), buf, sizeof buf, 0);
    if (n > 0) got.append(buf, static_cast<size_t>(n));
    return got.size() >= KernelHandshake::kChallengeBytes;
  }));
  EXPECT_EQ(k.links->rejected(), 0u);
}

TEST(HostLinks, StrangersFromOneAddressCantCrowdOutTheHostsAgent) {
  Kernel k;
  LinkTicket t = k.ticket();
  const size_t cap = HostLinks::kHandshakesPerPeer + 1;  // one host here
  testing::internal::CaptureStderr();
  std::vector<Fd> idle;
  for (int i = 0; i < 70; ++i) idle.push_back(stranger(t));
  ASSERT_TRUE(k.run_until([&] { return k.links->rejected() == 70 - cap; }));
  // The oldest were closed for the newer ones, each told why after its challenge.
  std::string first = until_closed(idle[0].get());
  ASSERT_GE(first.size(), KernelHandshake::kChallengeBytes);
  EXPECT_EQ(refusal_in(first.substr(KernelHandshake::kChallengeBytes)),
            "the kernel's listener refused the connection: too many unauthenticated connections "
            "at once from 127.0.0.1 (" +
                std::to_string(cap) + "; the oldest is closed for each new one)");
  // The host's agent, from that same address, gets in and authenticates.
  std::optional<Channel> host = k.connect([&] { return connect_to_kernel(t, 5s, 0ms); });
  // The kernel's log: a few refusals in full, the rest counted once the group closes.
  k.links->close();
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(log, "ddip: refused a connection from"), size_t(HostLinks::kLoggedRefusals))
      << log;
  EXPECT_NE(
      log.find("ddip: refused " + std::to_string(k.links->rejected() - HostLinks::kLoggedRefusals) +
               " more connection(s) before the group closed; the last: refused a connection "
               "from 127.0.0.1:"),
      std::string::npos)
      << log;
}

TEST(HostLinks, StrangersFromManyAddressesAreHeldToTheCapAndTheAgentStillGetsIn) {
  Kernel k;
  LinkTicket t = k.ticket();
  // 8 from each of 10 addresses: none over its own cap, 80 over the cap of all.
  std::vector<Fd> idle;
  for (int a = 2; a < 12; ++a)
    for (int i = 0; i < 8; ++i) idle.push_back(stranger(t, "127.0.0." + std::to_string(a)));
  testing::internal::CaptureStderr();
  ASSERT_TRUE(k.run_until([&] { return k.links->rejected() == 80 - HostLinks::kMaxHandshakes; }));
  EXPECT_NE(
      k.links->last_rejection().find("too many unauthenticated connections at once (64, from 10 "
                                     "addresses"),
      std::string::npos)
      << k.links->last_rejection();
  std::optional<Channel> host = k.connect([&] { return connect_to_kernel(t, 5s, 0ms); });
  EXPECT_EQ(k.links->rejected(), 80 - HostLinks::kMaxHandshakes + 1);  // one more made room
  testing::internal::GetCapturedStderr();
}

// A kernel's listener played by a thread: refuses the first `refusals` connections after the
// challenge (as one closed to make room), then authenticates the next one.
struct FakeListener {
  TcpListener tcp{"127.0.0.1", 0};
  std::string key = random_bytes(kKeyBytes);
  std::atomic<int> connections{0};
  std::atomic<bool> stop{false};
  std::thread thread;
  explicit FakeListener(int refusals) {
    thread = std::thread([this, refusals] {
      for (int i = 0; i <= refusals && !stop;) {
        pollfd p{tcp.fd(), POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        Fd fd = tcp.accept(nullptr);
        if (!fd) continue;
        ++i;
        ++connections;
        KernelHandshake hs(key);
        auto deadline = Clock::now() + 5s;
        try {
          write_all(fd.get(), hs.challenge(), deadline);
          std::string response = read_exact(fd.get(), KernelHandshake::kResponseBytes, deadline);
          if (i <= refusals) {
            write_all(fd.get(),
                      refusal_line("the kernel's listener refused the connection: too "
                                   "many unauthenticated connections at once from "
                                   "127.0.0.1"),
                      deadline);
            continue;
          }
          write_all(fd.get(), hs.accept(response).proof, deadline);
          read_upto(fd.get(), 1, deadline);  // until the agent's side closes
        } catch (const std::exception&) {
        }
      }
    });
  }
  ~FakeListener() {
    stop = true;
    thread.join();
  }
  LinkTicket ticket() const { return LinkTicket{"127.0.0.1", tcp.port(), 0, key}; }
};

TEST(ConnectToKernel, AnAgentRefusedToMakeRoomTriesAgain) {
  FakeListener kernel(2);
  { Channel ch = connect_to_kernel(kernel.ticket(), 10s, 0ms); }
  EXPECT_EQ(kernel.connections.load(), 3);
}

TEST(ConnectToKernel, AnAgentThatNeverGetsInSaysWhatTheListenerSaid) {
  FakeListener kernel(1000);
  try {
    connect_to_kernel(kernel.ticket(), 1500ms, 0ms);
    FAIL() << "connected";
  } catch (const std::runtime_error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("could not connect to the kernel at 127.0.0.1:"), std::string::npos)
        << what;
    EXPECT_NE(what.find("the kernel's listener refused the connection: too many unauthenticated "
                        "connections at once from 127.0.0.1"),
              std::string::npos)
        << what;
  }
  EXPECT_GT(kernel.connections.load(), 1);
}

TEST(HostLinks, AStartThatFailsWhileStrangersHeldThePortSaysSo) {
  // The agent never got in (its launcher ends): the loss names what the listener closed.
  fs::path go = fs::temp_directory_path() / ("ddip-test-links-go-" + std::to_string(::getpid()));
  Kernel k("while [ ! -e " + go.string() + " ]; do sleep 0.02; done; echo 'no way in' >&2; exit 1");
  LinkTicket t = k.ticket();
  testing::internal::CaptureStderr();
  std::vector<Fd> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(stranger(t));
  ASSERT_TRUE(
      k.run_until([&] { return k.links->rejected() == 20 - HostLinks::kHandshakesPerPeer - 1; }));
  { std::ofstream(go.string()) << "go"; }
  ASSERT_TRUE(k.run_until([&] { return k.seen.log.size() >= 2; }));
  fs::remove(go);
  testing::internal::GetCapturedStderr();
  ASSERT_TRUE(k.seen.lost_why);
  EXPECT_NE(k.seen.lost_why->find("ended with exit code 1 before host far connected (meanwhile the "
                                  "kernel's listener closed 11 unauthenticated connection(s): too "
                                  "many unauthenticated connections at once from 127.0.0.1"),
            std::string::npos)
      << *k.seen.lost_why;
  EXPECT_NE(k.seen.lost_why->find("no way in"), std::string::npos) << *k.seen.lost_why;
}
