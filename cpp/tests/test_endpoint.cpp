#include <dirent.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "ddip/endpoint.hpp"

using namespace ddip;
using namespace std::chrono_literals;

namespace {

Channel accept_one(Listener& l) {
  Fd fd;
  while (!(fd = l.accept())) std::this_thread::sleep_for(1ms);
  return Channel(std::move(fd));
}

std::optional<Frame> read_frame(Channel& c) {
  for (int i = 0; i < 10000; ++i) {
    if (auto f = c.next()) return f;
    if (c.read_some() == Channel::ReadResult::kEof) return std::nullopt;
    std::this_thread::sleep_for(1ms);
  }
  return std::nullopt;
}

void send_frame(Channel& c, Frame f) {
  set_nonblocking(c.fd());
  c.queue(std::move(f));
  while (!c.flush()) {
  }
}

// Alive and not a zombie.
bool alive(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (!f) return false;
  char state = 0;
  int ignored_pid;
  char comm[256];
  bool ok = std::fscanf(f, "%d %255s %c", &ignored_pid, comm, &state) == 3;
  std::fclose(f);
  return ok && state != 'Z' && state != 'X';
}

bool gone_within(pid_t pid, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (alive(pid) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  return !alive(pid);
}

// Stands in for faulthandler: a C handler that writes "stack of <tid>" to a pipe.
int g_dump_fd = -1;
void fake_faulthandler(int) {
  char buf[64];
  int n =
      std::snprintf(buf, sizeof buf, "stack of %ld\n", static_cast<long>(::syscall(SYS_gettid)));
  ssize_t ignored = ::write(g_dump_fd, buf, static_cast<size_t>(n));
  (void)ignored;
}

// fake_faulthandler on SIGRTMAX - 1, enabled for `ep`'s stack requests; the signal's earlier
// action is put back when this goes.
struct FakeFaulthandler {
  const int sig = SIGRTMAX - 1;
  Fd write;
  struct sigaction old {};

  explicit FakeFaulthandler(Endpoint& ep) {
    Pipe p = make_pipe();
    write = std::move(p.write);
    g_dump_fd = write.get();
    struct sigaction sa {};
    sa.sa_handler = fake_faulthandler;
    if (::sigaction(sig, &sa, &old) != 0) throw std::system_error(errno, std::generic_category());
    ep.enable_stack_dumps(sig, std::move(p.read));
  }
  ~FakeFaulthandler() { ::sigaction(sig, &old, nullptr); }
  FakeFaulthandler(const FakeFaulthandler&) = delete;
  FakeFaulthandler& operator=(const FakeFaulthandler&) = delete;
};

std::set<std::string> threads() {
  std::set<std::string> out;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') out.insert(e->d_name);
    ::closedir(d);
  }
  return out;
}

// How many times thread `tid` of this process went to sleep.
long sleeps(const std::string& tid) {
  std::ifstream status("/proc/self/task/" + tid + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::stol(line.substr(24));
  return -1;
}

// An Endpoint and the kernel's end of its socket; `watchdog`: the thread it started (its tid).
struct Served {
  RuntimeDir dir;
  Listener listener{dir.socket_path()};
  std::set<std::string> before = threads();
  Endpoint ep{dir.socket_path(), 0, ""};
  std::string watchdog;
  Channel server{Fd()};

  // Its hello read and a first request served: the caller left recv() with it (the watchdog's
  // timer armed).
  void first_request() {
    for (const auto& tid : threads())
      if (!before.count(tid)) watchdog = tid;
    ASSERT_FALSE(watchdog.empty());
    server = accept_one(listener);
    ASSERT_TRUE(read_frame(server));  // hello
    send_frame(server, Frame::make(kRequest, 0, 0, "work"));
    ASSERT_TRUE(ep.recv(5s));
  }
};

pid_t read_pid(int fd) {
  pid_t pid = 0;
  EXPECT_EQ(::read(fd, &pid, sizeof pid), static_cast<ssize_t>(sizeof pid));
  return pid;
}

}  // namespace

TEST(Endpoint, SaysHelloAndExchangesFrames) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 4, "hi");
  Channel server = accept_one(l);
  auto hello = read_frame(server);
  ASSERT_TRUE(hello);
  EXPECT_EQ(hello->kind, kHello);
  EXPECT_EQ(hello->rank, 4);
  EXPECT_EQ(hello->data(), "hi");

  EXPECT_FALSE(ep.recv(10ms));  // nothing yet: times out
  set_nonblocking(server.fd());
  server.queue(Frame::make(kRequest, 4, 11, "work"));
  while (!server.flush()) {
  }
  auto req = ep.recv(5s);
  ASSERT_TRUE(req);
  EXPECT_EQ(req->seq, 11u);
  EXPECT_EQ(req->data(), "work");
  ep.send(Frame::make(kDone, 0, 11, "result"));
  auto done = read_frame(server);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->rank, 4);  // the endpoint stamps its own rank
  EXPECT_EQ(done->data(), "result");
}

// The binding waits in 50 ms slices (Python's signal handlers run between them): an idle worker's
// caller leaves recv() empty-handed at each, and is back at once. Its watchdog must sleep on, not
// wake once per slice to find the caller back.
TEST(Endpoint, AnIdleCallerWaitingInSlicesLeavesTheWatchdogAsleep) {
  Served s;
  ASSERT_NO_FATAL_FAILURE(s.first_request());
  Endpoint& ep = s.ep;
  EXPECT_FALSE(ep.recv(30ms));  // back, and the timer fired meanwhile: the watchdog looked once
  long slept = sleeps(s.watchdog);
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(ep.recv(25ms));
  EXPECT_LE(sleeps(s.watchdog) - slept, 2) << "the watchdog woke while the caller idled in slices";
}

// A signal ends the caller's wait empty-handed, so that its Python runs the signal's handler at
// once rather than at the end of a slice: the binding's slices can then be long, and an idle
// worker sleeps. Frames still come after.
TEST(Endpoint, ASignalEndsTheCallersWaitEmptyHanded) {
  Served s;
  ASSERT_NO_FATAL_FAILURE(s.first_request());
  struct sigaction quiet {
  }, old{};
  quiet.sa_handler = [](int) {};
  sigemptyset(&quiet.sa_mask);
  quiet.sa_flags = 0;  // no SA_RESTART: as Python installs its handlers
  ASSERT_EQ(::sigaction(SIGUSR2, &quiet, &old), 0);
  pthread_t caller = ::pthread_self();
  std::atomic<bool> back{false};
  std::thread signaller([&] {
    // Until the caller is back: a signal sent before it waits interrupts nothing. If 20 did not
    // bring it back, a request does (and the test fails).
    for (int i = 0; i < 20 && !back; ++i) {
      ::pthread_kill(caller, SIGUSR2);
      std::this_thread::sleep_for(5ms);
    }
    if (!back) send_frame(s.server, Frame::make(kRequest, 0, 99, "not interrupted"));
  });
  auto f = s.ep.recv(60s);
  back = true;
  signaller.join();
  EXPECT_FALSE(f) << "the wait went on after the signal, until request " << f->seq;
  send_frame(s.server, Frame::make(kRequest, 0, 5, "after"));
  std::optional<Frame> next = s.ep.recv(5s);
  if (next && next->seq == 99) next = s.ep.recv(5s);
  ASSERT_TRUE(next);
  EXPECT_EQ(next->seq, 5u);
  ::sigaction(SIGUSR2, &old, nullptr);
}

// Requests that come further apart than the takeover (a notebook's cells; many ranks on few
// cores): the timer armed as the caller leaves with one is disarmed when it is back, rather than
// wake the watchdog once per request to find it back.
TEST(Endpoint, RequestsFarApartLeaveTheWatchdogAsleep) {
  Served s;
  ASSERT_NO_FATAL_FAILURE(s.first_request());
  Endpoint& ep = s.ep;
  Channel& server = s.server;
  long slept = -1;
  std::thread kernel([&server] {
    for (uint64_t seq = 1; seq <= 10; ++seq) {
      std::this_thread::sleep_for(30ms);  // the pace of the requests, which the test is about
      send_frame(server, Frame::make(kRequest, 0, seq, "work"));
    }
  });
  for (uint64_t seq = 1; seq <= 10; ++seq) {
    auto f = ep.recv(5s);
    ASSERT_TRUE(f);
    EXPECT_EQ(f->seq, seq);
    if (seq == 1) slept = sleeps(s.watchdog);  // from the second wait on, the last one was long
  }
  kernel.join();
  EXPECT_LE(sleeps(s.watchdog) - slept, 2) << "the watchdog woke once per request";
}

// A caller that left empty-handed and does not come back (it went to work after all): the
// watchdog still takes the channel over, and answers the kernel's heartbeats.
TEST(Endpoint, ACallerThatLeftEmptyHandedAndStaysAwayHasItsHeartbeatsAnswered) {
  Served s;
  ASSERT_NO_FATAL_FAILURE(s.first_request());
  Endpoint& ep = s.ep;
  Channel& server = s.server;
  EXPECT_FALSE(ep.recv(1ms));  // empty-handed, and then away for good
  send_frame(server, Frame::make(kHeartbeat, 0, 78, ""));
  auto ack = read_frame(server);
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  EXPECT_EQ(ack->seq, 78u);
}

TEST(Endpoint, WatchdogAnswersHeartbeatsWhileTheCallerIsBusy) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));  // hello
  server.queue(Frame::make(kHeartbeat, 0, 77, ""));
  while (!server.flush()) {
  }
  auto ack = read_frame(server);  // nobody called ep.recv()
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  EXPECT_EQ(ack->seq, 77u);
}

TEST(Endpoint, TheWaitingCallerAnswersHeartbeatsAndTheWatchdogOnceTheCallerIsBusy) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));  // hello
  // The caller waits in recv() and reads the channel itself: a heartbeat meanwhile is answered,
  // and a request comes back from that same wait.
  std::optional<Frame> got;
  std::thread caller([&] { got = ep.recv(10s); });
  send_frame(server, Frame::make(kHeartbeat, 0, 1, ""));
  auto ack = read_frame(server);
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  send_frame(server, Frame::make(kRequest, 0, 2, "work"));
  caller.join();
  ASSERT_TRUE(got);
  EXPECT_EQ(got->seq, 2u);
  // Now the caller is "busy" (it does not call recv() again): the watchdog reads for it.
  send_frame(server, Frame::make(kHeartbeat, 0, 3, ""));
  ack = read_frame(server);
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  EXPECT_EQ(ack->seq, 3u);
  // A request that came while it was busy waits for the next recv(), which takes the channel back.
  send_frame(server, Frame::make(kRequest, 0, 4, "more"));
  got = ep.recv(10s);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->seq, 4u);
  send_frame(server, Frame::make(kRequest, 0, 5, "again"));
  got = ep.recv(10s);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->seq, 5u);
}

TEST(Endpoint, AStackRequestTheWaitingCallerReadsIsAnsweredOnTheWatchdogsThread) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));  // hello
  FakeFaulthandler dumps(ep);
  std::optional<Frame> got;
  std::thread caller([&] {
    got = ep.recv(10s);  // reads the stack request, hands it to the watchdog, goes on waiting
  });
  send_frame(server, Frame::make(kStackRequest, 0, 6, ""));
  auto reply = read_frame(server);
  send_frame(server, Frame::make(kRequest, 0, 7, "work"));
  caller.join();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->kind, kStacks);
  EXPECT_EQ(reply->seq, 6u);
  EXPECT_EQ(reply->data().rfind("stack of ", 0), 0u) << reply->data();
  ASSERT_TRUE(got);  // the stack request did not go to the caller
  EXPECT_EQ(got->seq, 7u);
}

TEST(Endpoint, RecvThrowsOnceTheKernelIsGone) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "", 60s);
  {
    Channel server = accept_one(l);
    server.queue(Frame::make(kRequest, 0, 1, "last"));
    while (!server.flush()) {
    }
  }
  auto last = ep.recv(5s);  // frames that arrived before the hang-up are still delivered
  ASSERT_TRUE(last);
  EXPECT_EQ(last->data(), "last");
  EXPECT_THROW(ep.recv(5s), EndpointClosed);
}

TEST(Endpoint, BusyProcessExitsWhenTheKernelGoesAway) {
  RuntimeDir d;
  Listener l(d.socket_path());
  pid_t pid = ::fork();
  if (pid == 0) {
    Endpoint ep(d.socket_path(), 0, "", 100ms);
    ::pause();  // "stuck in user code": never calls recv
    ::_exit(0);
  }
  {
    Channel server = accept_one(l);
    ASSERT_TRUE(read_frame(server));  // hello: hanging up before it would fail its send instead
  }  // the kernel hangs up
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}

TEST(Endpoint, StackRequestIsAnsweredByTheWatchdogWithTheDumpAPythonThreadWrote) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));  // hello
  FakeFaulthandler dumps(ep);
  // Nobody calls ep.recv(): this thread is "busy"; the watchdog answers.
  send_frame(server, Frame::make(kStackRequest, 0, 5, ""));
  auto reply = read_frame(server);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->kind, kStacks);
  EXPECT_EQ(reply->seq, 5u);
  // The handler ran on this (the main) thread, not on the watchdog, which blocks the signal.
  EXPECT_EQ(reply->data(), "stack of " + std::to_string(::syscall(SYS_gettid)) + "\n");
}

TEST(Endpoint, StackRequestWithoutDumpsEnabledSaysSo) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));
  send_frame(server, Frame::make(kStackRequest, 0, 6, ""));
  auto reply = read_frame(server);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->kind, kStacks);
  EXPECT_EQ(reply->seq, 6u);
  EXPECT_NE(reply->data().find("not enabled"), std::string::npos);
}

TEST(Endpoint, CollectivesRequestsGoToTheirReaderEvenOnesThatCameBeforeIt) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));  // hello
  // Asked right after the hello, before the rank's reader is there: kept, not lost.
  send_frame(server, Frame::make(kCollectivesRequest, 0, 3, ""));
  send_frame(server, Frame::make(kHeartbeat, 0, 4, ""));  // the watchdog has taken the request
  auto ack = read_frame(server);
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  Pipe p = make_pipe();
  ep.enable_collectives(std::move(p.write));
  // Nobody calls ep.recv(): the requests reach the reader all the same, not the inbox.
  send_frame(server, Frame::make(kCollectivesRequest, 0, 9, ""));
  auto next_seq = [&] {
    uint64_t seq = 0;
    pollfd pfd{p.read.get(), POLLIN, 0};
    EXPECT_EQ(::poll(&pfd, 1, 5000), 1);
    EXPECT_EQ(::read(p.read.get(), &seq, sizeof seq), static_cast<ssize_t>(sizeof seq));
    return seq;
  };
  EXPECT_EQ(next_seq(), 3u);
  EXPECT_EQ(next_seq(), 9u);
  ep.send(Frame::make(kCollectives, 0, 9, "{}"));
  auto reply = read_frame(server);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->kind, kCollectives);
  EXPECT_EQ(reply->data(), "{}");
  EXPECT_FALSE(ep.recv(std::chrono::milliseconds(0)));
}

// Lightning's teardown (and any code that resets every handler) puts SIG_DFL over handlers
// installed in C; a real-time signal's default action terminates. The watchdog puts the kept
// handler back before raising it: the request is answered and the process lives.
TEST(Endpoint, StackRequestPutsBackAHandlerOtherCodeResetToTheDefault) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));
  FakeFaulthandler dumps(ep);
  int sig = dumps.sig;
  ::signal(sig, SIG_DFL);  // what Lightning's _SignalConnector.teardown does
  send_frame(server, Frame::make(kStackRequest, 0, 7, ""));
  auto reply = read_frame(server);  // reaching here at all: the signal did not kill this process
  struct sigaction now{};
  ::sigaction(sig, nullptr, &now);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->seq, 7u);
  EXPECT_EQ(reply->data(), "stack of " + std::to_string(::syscall(SYS_gettid)) + "\n");
  EXPECT_EQ(now.sa_handler, fake_faulthandler);
}

volatile sig_atomic_t g_other_calls = 0;
void other_handler(int) { g_other_calls = g_other_calls + 1; }

TEST(Endpoint, AHandlerAnotherPartInstalledIsLeftAloneAndTheAnswerSaysSo) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 3, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));
  FakeFaulthandler dumps(ep);
  int sig = dumps.sig;
  ::signal(sig, other_handler);
  g_other_calls = 0;
  send_frame(server, Frame::make(kStackRequest, 0, 8, ""));
  auto reply = read_frame(server);
  struct sigaction now{};
  ::sigaction(sig, nullptr, &now);
  ASSERT_TRUE(reply);
  EXPECT_NE(reply->data().find("rank 3 has another handler for signal " + std::to_string(sig)),
            std::string::npos)
      << reply->data();
  EXPECT_EQ(g_other_calls, 0);  // not raised
  EXPECT_EQ(now.sa_handler, other_handler);  // not replaced
}

volatile sig_atomic_t g_abort_calls = 0;
void abort_handler(int) { g_abort_calls = g_abort_calls + 1; }

TEST(Endpoint, AbortRequestRaisesTheAbortSignalHereEvenAfterAReset) {
  // In a child: the signal may be delivered to any thread of this process.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    RuntimeDir d;
    Listener l(d.socket_path());
    Endpoint ep(d.socket_path(), 0, "");
    Channel server = accept_one(l);
    if (!read_frame(server)) ::_exit(10);
    int sig = SIGRTMAX - 2;
    struct sigaction sa{};
    sa.sa_handler = abort_handler;
    ::sigaction(sig, &sa, nullptr);
    ep.enable_abort(sig);
    ::signal(sig, SIG_DFL);  // reset by other code: a signal sent now would kill
    send_frame(server, Frame::make(kAbortRequest, 0, 9, ""));
    for (int i = 0; i < 5000 && g_abort_calls == 0; ++i) std::this_thread::sleep_for(1ms);
    ::_exit(g_abort_calls == 1 ? 0 : 11);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(Endpoint, HeartbeatsPutBackAResetHandler) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));
  int sig = SIGRTMAX - 2;
  struct sigaction sa{}, old{};
  sa.sa_handler = abort_handler;
  ASSERT_EQ(::sigaction(sig, &sa, &old), 0);
  ep.enable_abort(sig);
  ::signal(sig, SIG_IGN);
  send_frame(server, Frame::make(kHeartbeat, 0, 1, ""));
  auto ack = read_frame(server);
  struct sigaction now{};
  ::sigaction(sig, nullptr, &now);
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  EXPECT_EQ(now.sa_handler, abort_handler);
}

TEST(Endpoint, OnlyAnInstalledHandlerCanBeKept) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));
  struct sigaction old{};
  ::sigaction(SIGRTMAX - 3, nullptr, &old);
  ::signal(SIGRTMAX - 3, SIG_DFL);
  EXPECT_THROW(ep.enable_abort(SIGRTMAX - 3), std::invalid_argument);
  EXPECT_THROW(ep.enable_abort(0), std::invalid_argument);
  ::sigaction(SIGRTMAX - 3, &old, nullptr);
}

TEST(Endpoint, KernelSilenceCountsAsTheKernelGone) {
  RuntimeDir d;
  Listener l(d.socket_path());
  EndpointOptions o;
  o.exit_grace = 60s;
  o.kernel_timeout = 100ms;
  Endpoint ep(d.socket_path(), 0, "", o);
  Channel server = accept_one(l);  // connected, but never says anything
  EXPECT_THROW(ep.recv(5s), EndpointClosed);
  EXPECT_TRUE(ep.closed());
}

TEST(Endpoint, KernelTimeoutIsReadFromTheEnvironment) {
  ::setenv("DDIP_KERNEL_TIMEOUT_MS", "250", 1);
  ::setenv("DDIP_KERNEL_PID", "123", 1);
  EndpointOptions o = EndpointOptions::from_environment();
  EXPECT_EQ(o.kernel_timeout, 250ms);
  EXPECT_EQ(o.kernel_pid, 123);
  ::setenv("DDIP_KERNEL_TIMEOUT_MS", "soon", 1);
  EXPECT_THROW(EndpointOptions::from_environment(), std::invalid_argument);
  ::unsetenv("DDIP_KERNEL_TIMEOUT_MS");
  ::unsetenv("DDIP_KERNEL_PID");
  EXPECT_EQ(EndpointOptions::from_environment().kernel_timeout, 0ms);
}

TEST(Endpoint, AStuckRankThatLeadsItsGroupTakesTheGroupAlongWhenTheKernelGoes) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Pipe report = make_pipe();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);  // as the Supervisor starts a rank
    pid_t grandchild = ::fork();
    if (grandchild == 0) {
      ::pause();  // a DataLoader worker, a `!sleep`
      ::_exit(0);
    }
    ssize_t ignored = ::write(report.write.get(), &grandchild, sizeof grandchild);
    (void)ignored;
    Endpoint ep(d.socket_path(), 0, "", 100ms);
    ::pause();  // stuck in user code
    ::_exit(0);
  }
  pid_t grandchild = read_pid(report.read.get());
  {
    Channel server = accept_one(l);
    ASSERT_TRUE(read_frame(server));  // hello: hanging up before it would fail its send instead
  }  // the kernel hangs up
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  EXPECT_TRUE(gone_within(grandchild, 5s));
}

TEST(Endpoint, TheKernelsDeathKillsTheRanksWholeProcessGroupAtOnce) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Pipe report = make_pipe();
  pid_t kernel = ::fork();
  if (kernel == 0) {
    pid_t me = ::getpid();
    pid_t rank = ::fork();
    if (rank == 0) {
      ::setpgid(0, 0);
      pid_t grandchild = ::fork();
      if (grandchild == 0) {
        ::pause();
        ::_exit(0);
      }
      EndpointOptions o;
      o.kernel_pid = me;
      o.exit_grace = 60s;  // not the watchdog: the connection stays open
      Endpoint ep(d.socket_path(), 0, "", o);
      ssize_t ignored = ::write(report.write.get(), &grandchild, sizeof grandchild);
      (void)ignored;
      while (true) ::pause();
    }
    while (true) ::pause();
  }
  Channel server = accept_one(l);
  pid_t grandchild = read_pid(report.read.get());
  ASSERT_TRUE(alive(grandchild));
  ::kill(kernel, SIGKILL);
  ::waitpid(kernel, nullptr, 0);
  EXPECT_TRUE(gone_within(grandchild, 2s));
}
