// The coordinator against real worker processes: this test binary re-executes itself as a
// worker (DDIP_TEST_WORKER=1) that speaks through an Endpoint.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "ddip/coordinator.hpp"
#include "ddip/endpoint.hpp"
#include "helpers.hpp"

using namespace ddip;
using namespace ddip::test;
using namespace std::chrono_literals;

namespace {
size_t g_flood_bytes = 0;

// SIGTERM handler of "flood-on-term": writes g_flood_bytes to stdout (more than a pipe holds), then
// exits with 7. Only a reader on the other end lets it finish.
void flood_then_exit(int) {
  static char chunk[4096];
  std::memset(chunk, 'f', sizeof chunk);
  for (size_t done = 0; done < g_flood_bytes; done += sizeof chunk)
    write_fd(1, {chunk, sizeof chunk});
  ::_exit(7);
}

// Requests: "echo:N" prints N lines then replies; "partial:X" prints X without a newline;
// "exit:N" exits with N after a line on stderr; "hang" replies, then never reads again;
// "flood-on-term:N" sets the SIGTERM handler above; "fds:N" replies with N fds attached;
// "env:NAME" replies with the variable's value; "late:MS" works MS ms, then is "echo:1".
int worker_main() {
  int rank = std::atoi(std::getenv("DDIP_TEST_RANK"));
  Endpoint ep(std::getenv("DDIP_SOCKET"), rank, "pid=" + std::to_string(::getpid()));
  return test::serve_requests(ep, [&](const Frame& f) {
    const std::string& req = f.data();
    if (req.rfind("echo:", 0) == 0 || req.rfind("late:", 0) == 0) {
      int n = 1;
      if (req[0] == 'l')
        std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(req.c_str() + 5)));
      else
        n = std::atoi(req.c_str() + 5);
      for (int i = 0; i < n; ++i) write_fd(1, "line " + std::to_string(i) + "\n");
      write_fd(2, "to stderr\n");
      ep.send(Frame::make(kDone, rank, f.seq, "echoed"));
    } else if (req.rfind("partial:", 0) == 0) {
      write_fd(1, req.substr(8));
      ep.send(Frame::make(kDone, rank, f.seq, ""));
    } else if (req.rfind("segment:", 0) == 0) {
      uint64_t id;
      std::memcpy(&id, req.data() + 8, sizeof id);
      std::string got;
      if (f.fds && f.fds->size() == 1) {
        char buf[16] = {};
        ssize_t n = ::pread((*f.fds)[0].get(), buf, 5, 0);
        got.assign(buf, n > 0 ? n : 0);
      }
      ep.send(Frame::make(kDone, rank, f.seq, got));
      ep.send(Frame::make(kRelease, rank, 0, std::string(reinterpret_cast<char*>(&id), 8)));
    } else if (req == "display") {
      write_fd(1, "before\n");
      write_fd(1, std::string(kDisplayMarker));
      ep.send(Frame::make(kDisplay, rank, f.seq, "D"));
      write_fd(1, "after\n");
      ep.send(Frame::make(kDone, rank, f.seq, ""));
    } else if (req == "hang") {
      ep.send(Frame::make(kDone, rank, f.seq, ""));
      while (true) ::pause();
    } else if (req.rfind("flood-on-term:", 0) == 0) {
      g_flood_bytes = std::stoul(req.substr(14));
      ::signal(SIGTERM, flood_then_exit);
      ep.send(Frame::make(kDone, rank, f.seq, ""));
    } else if (req.rfind("fds:", 0) == 0) {
      Frame done = Frame::make(kDone, rank, f.seq, "with fds");
      done.fds = std::make_shared<std::vector<Fd>>();
      for (int i = 0; i < std::atoi(req.c_str() + 4); ++i) done.fds->push_back(make_pipe().read);
      ep.send(std::move(done));
    } else if (req.rfind("env:", 0) == 0) {
      const char* v = std::getenv(req.c_str() + 4);
      ep.send(Frame::make(kDone, rank, f.seq, v ? v : "(unset)"));
    } else if (req.rfind("exit:", 0) == 0) {
      write_fd(2, "about to exit\n");
      ::_exit(std::atoi(req.c_str() + 5));
    }
  });
}

CoordinatorOptions options(int n) {
  CoordinatorOptions o;
  for (int r = 0; r < n; ++r)
    o.workers.push_back(SpawnSpec{
        {self_exe()}, {"DDIP_TEST_WORKER=1", "DDIP_TEST_RANK=" + std::to_string(r)}, "", true});
  o.heartbeat_interval = 20ms;
  // CTest runs every test here twice: the second time (CallerDrives.*) as the kernel runs them.
  o.caller_drives = std::getenv("DDIP_TEST_CALLER_DRIVES") != nullptr;
  return o;
}

Event next(Coordinator& c) {
  auto e = c.next_event(10s);
  if (!e) throw std::runtime_error("no event within 10 s");
  return std::move(*e);
}

Event wait_for(Coordinator& c, Event::Kind kind, int slot) {
  while (true) {
    Event e = next(c);
    if (e.kind == kind && e.slot == slot) return e;
  }
}

Event request(Coordinator& c, int slot, uint64_t seq, const std::string& what) {
  c.send(slot, Frame::make(kRequest, slot, seq, what));
  while (true) {
    Event e = next(c);
    if ((e.kind == Event::kFrame || e.kind == Event::kTruncated) && e.slot == slot &&
        e.frame.kind == kDone && e.frame.seq == seq)
      return e;
  }
}

Event hello_of(Coordinator& c, int slot) {
  while (true) {
    Event e = next(c);
    if (e.kind == Event::kFrame && e.frame.kind == kHello && e.slot == slot) return e;
  }
}

// The thread each event was queued on (CoordinatorOptions::on_event runs on the one that queues).
class QueuedOn {
 public:
  explicit QueuedOn(CoordinatorOptions& o) {
    o.on_event = [this](const Pushed&) {
      std::lock_guard lock(mu_);
      ids_.push_back(std::this_thread::get_id());
    };
  }
  size_t count() {
    std::lock_guard lock(mu_);
    return ids_.size();
  }
  std::vector<std::thread::id> since(size_t from) {
    std::lock_guard lock(mu_);
    return {ids_.begin() + static_cast<long>(from), ids_.end()};
  }

 private:
  std::mutex mu_;
  std::vector<std::thread::id> ids_;
};

// A process that ptrace-attaches to `pid` and then does nothing: once killed, `pid` stays a
// zombie that only this tracer could reap, as under a debugger that does not let go.
pid_t hold_with_tracer(pid_t pid) {
  int ready[2];
  if (::pipe(ready) != 0) return -1;
  pid_t tracer = ::fork();
  if (tracer == 0) {
    char ok = ::ptrace(PTRACE_SEIZE, pid, nullptr, nullptr) == 0 ? '1' : '0';
    write_fd(ready[1], std::string(1, ok));
    while (true) ::pause();
  }
  char ok = '0';
  ssize_t n = ::read(ready[0], &ok, 1);
  ::close(ready[0]);
  ::close(ready[1]);
  if (n != 1 || ok != '1') {
    ::kill(tracer, SIGKILL);
    ::waitpid(tracer, nullptr, 0);
    return -1;
  }
  return tracer;
}

// Forks a process that gets pid `dead` back (pid reuse, forced through ns_last_pid) and connects
// to the coordinator's socket as a worker would. Whether it was attached (it got a heartbeat);
// nullopt when no fork got that pid.
std::optional<bool> impostor_attached(std::ofstream& last_pid, const std::string& path,
                                      pid_t dead) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    last_pid << dead - 1 << std::flush;
    pid_t pid = ::fork();
    if (pid == 0) {
      if (::getpid() != dead) ::_exit(2);
      std::optional<Channel> ch;
      try {
        ch.emplace(connect_unix(path));
      } catch (...) {
        ::_exit(3);
      }
      try {
        ch->send(Frame::make(kHello, 0, 0, "impostor"));
        // Dropped at once: EOF (or a reset). Attached: the first heartbeat (20 ms) comes.
        ::_exit(ch->recv() ? 1 : 0);
      } catch (...) {
        ::_exit(0);  // reset by the coordinator: dropped
      }
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (WEXITSTATUS(status) == 2) continue;  // another process took the pid first: again
    return WEXITSTATUS(status) != 0;
  }
  return std::nullopt;
}

}  // namespace

TEST(Coordinator, WorkersConnectAndSayHello) {
  Coordinator c(options(2));
  ASSERT_EQ(c.size(), 2u);
  int hellos = 0;
  while (hellos < 2) {
    Event e = next(c);
    if (e.kind == Event::kFrame && e.frame.kind == kHello) {
      EXPECT_EQ(e.frame.data(), "pid=" + std::to_string(c.pids()[e.slot]));
      EXPECT_EQ(e.frame.rank, e.slot);
      ++hellos;
    }
  }
}

TEST(Coordinator, OutputIsCompleteBeforeDone) {
  Coordinator c(options(2));
  c.send(1, Frame::make(kRequest, 1, 9, "echo:500"));
  std::string out, err;
  while (true) {
    Event e = next(c);
    if (e.kind == Event::kOutput && e.slot == 1) (e.stream == 1 ? out : err) += e.text;
    if (e.kind == Event::kFrame && e.frame.kind == kDone) {
      EXPECT_EQ(e.slot, 1);
      EXPECT_EQ(e.frame.seq, 9u);
      EXPECT_EQ(e.frame.data(), "echoed");
      break;
    }
  }
  EXPECT_EQ(out.substr(0, 7), "line 0\n");
  EXPECT_NE(out.find("line 499\n"), std::string::npos);
  EXPECT_EQ(err, "to stderr\n");
}

TEST(Coordinator, PartialLineArrivesBeforeDone) {
  Coordinator c(options(1));
  c.send(0, Frame::make(kRequest, 0, 1, "partial:50%"));
  std::string out;
  while (true) {
    Event e = next(c);
    if (e.kind == Event::kOutput) out += e.text;
    if (e.kind == Event::kFrame && e.frame.kind == kDone) break;
  }
  EXPECT_EQ(out, "50%");
}

TEST(Coordinator, DisplayKeepsItsPlaceAmongPrints) {
  Coordinator c(options(1));
  for (int round = 0; round < 50; ++round) {
    c.send(0, Frame::make(kRequest, 0, round, "display"));
    std::string order;
    while (true) {
      Event e = next(c);
      if (e.kind == Event::kOutput) order += e.text;
      if (e.kind == Event::kFrame && e.frame.kind == kDisplay) order += "[" + e.frame.data() + "]";
      if (e.kind == Event::kFrame && e.frame.kind == kDone) break;
    }
    ASSERT_EQ(order, "before\n[D]after\n") << "round " << round;
  }
}

TEST(Coordinator, SegmentsTravelByFdAndComeBackWhenReleased) {
  Coordinator c(options(2));
  uint64_t id = c.pool().put("hello", 5);
  std::string req = "segment:" + std::string(reinterpret_cast<char*>(&id), 8);
  for (int slot = 0; slot < 2; ++slot) c.send(slot, Frame::make(kRequest, slot, 1, req), {id});
  c.pool().release(id);  // the caller's reference; each frame holds its own
  int done = 0;
  while (done < 2) {
    Event e = next(c);
    if (e.kind == Event::kFrame && e.frame.kind == kDone) {
      EXPECT_EQ(e.frame.data(), "hello");
      ++done;
    }
  }
  for (int i = 0; i < 1000 && c.pool().in_use() > 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(c.pool().in_use(), 0u);
  EXPECT_EQ(c.pool().free_bytes(), SegmentPool::kMinSegment);
}

TEST(Coordinator, OneFrameToSeveralWorkersGivesEachItsOwnFdsAndReference) {
  Coordinator c(options(3));
  uint64_t id = c.pool().put("hello", 5);
  std::string req = "segment:" + std::string(reinterpret_cast<char*>(&id), 8);
  c.send(std::vector<int>{0, 2}, Frame::make(kRequest, -1, 4, req), {id});
  c.pool().release(id);  // the caller's reference; the two frames hold one each
  std::set<int> done;
  while (done.size() < 2) {
    Event e = next(c);
    if (e.kind == Event::kFrame && e.frame.kind == kDone) {
      EXPECT_EQ(e.frame.seq, 4u);
      EXPECT_EQ(e.frame.data(), "hello");
      EXPECT_EQ(e.frame.rank, e.slot);  // each worker's frame named it
      done.insert(e.slot);
    }
  }
  EXPECT_EQ(done, (std::set<int>{0, 2}));
  // Each worker released its own reference: the segment goes back to the pool.
  for (int i = 0; i < 1000 && c.pool().in_use() > 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(c.pool().in_use(), 0u);
  EXPECT_THROW(c.send(std::vector<int>{0, 3}, Frame::make(kRequest, -1, 5, "echo:1")),
               std::out_of_range);
}

TEST(Coordinator, TakeEventsTakesEverythingQueuedWithoutWaiting) {
  Coordinator c(options(2));
  std::vector<Event> got;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  int hellos = 0;
  while (hellos < 2 && std::chrono::steady_clock::now() < deadline) {
    got.clear();
    if (auto e = c.next_event(100ms)) got.push_back(std::move(*e));
    c.take_events(got);
    for (auto& e : got) hellos += e.kind == Event::kFrame && e.frame.kind == kHello;
  }
  EXPECT_EQ(hellos, 2);
  got.clear();
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(c.take_events(got), 0u);  // nothing queued: at once
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
}

// caller_drives: a wait on the main thread runs the loop itself (the events are queued on that
// thread), and the IO thread takes the loop over while the main thread waits for nothing.
TEST(Coordinator, TheWaitingMainThreadRunsTheLoopAndTheIoThreadTakesOverWhenItIsAway) {
  auto o = options(1);
  o.caller_drives = true;
  QueuedOn queued(o);
  Coordinator c(std::move(o));
  hello_of(c, 0);
  auto here = std::this_thread::get_id();
  // Waited for: every event of the request (its output and its reply) was queued here.
  size_t before = queued.count();
  Event e = request(c, 0, 1, "echo:2");
  EXPECT_EQ(e.frame.data(), "echoed");
  auto waited = queued.since(before);
  ASSERT_FALSE(waited.empty());
  for (auto id : waited) EXPECT_EQ(id, here);
  // Not waited for: the reply still comes, queued by another thread.
  before = queued.count();
  c.send(0, Frame::make(kRequest, 0, 2, "echo:1"));
  std::vector<Event> got;
  bool done = false;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    got.clear();
    c.take_events(got);  // never runs the loop
    for (auto& ev : got)
      done |= ev.kind == Event::kFrame && ev.frame.kind == kDone && ev.frame.seq == 2;
    if (!done) std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(done);
  auto unwaited = queued.since(before);
  ASSERT_FALSE(unwaited.empty());
  EXPECT_NE(unwaited.back(), here);
  // And the main thread takes the loop back for its waits. The first request's reply may still
  // be read by the IO thread as it hands the loop over (it yields between two rounds). The
  // worker works 20 ms before it replies, so that the main thread waits for the reply: one
  // that came at once could be read by the IO thread before the main thread asked for it (under
  // load, every time: then the main thread never waited, and never needed the loop).
  bool back_here = false;
  for (uint64_t seq = 3; seq < 13 && !back_here; ++seq) {
    before = queued.count();
    EXPECT_EQ(request(c, 0, seq, "late:20").frame.data(), "echoed");
    back_here = queued.since(before).back() == here;
  }
  EXPECT_TRUE(back_here);
}

// wait_events: a request's replies are taken together, however far apart they come, as long as
// each comes within reply_wait of the first event still queued; waiting for no reply, the first
// event is taken alone.
TEST(Coordinator, AWaitForRepliesTakesThemTogether) {
  auto o = options(2);
  o.reply_wait = 60s;  // what ends the wait below is the replies, never the window
  Coordinator c(std::move(o));
  for (int hellos = 0; hellos < 2;) {
    Event e = next(c);
    hellos += e.kind == Event::kFrame && e.frame.kind == kHello;
  }
  std::vector<Event> got;
  c.send(std::vector<int>{0, 1}, Frame::make(kRequest, 0, 1, "echo:3"));
  c.wait_events(got, 30s, 2);
  int replies = 0, lines = 0;
  for (auto& e : got) {
    replies += e.kind == Event::kFrame && e.frame.kind == kDone;
    lines += e.kind == Event::kOutput;
  }
  EXPECT_EQ(replies, 2);
  EXPECT_GE(lines, 2);  // each worker's output comes before its reply
  got.clear();
  c.send(0, Frame::make(kRequest, 0, 2, "echo:1"));
  c.wait_events(got, 30s, 0);
  ASSERT_FALSE(got.empty());
  while (std::none_of(got.begin(), got.end(), [](const Event& e) {
    return e.kind == Event::kFrame && e.frame.kind == kDone;
  }))
    c.wait_events(got, 30s, 0);
}

// A thread other than the main one never runs the loop: it waits on the queue.
TEST(Coordinator, OnlyTheMainThreadRunsTheLoop) {
  auto o = options(1);
  o.caller_drives = true;
  QueuedOn queued(o);
  Coordinator c(std::move(o));
  hello_of(c, 0);
  std::thread::id other;
  size_t before = 0;
  std::thread t([&] {
    other = std::this_thread::get_id();
    before = queued.count();
    EXPECT_EQ(request(c, 0, 1, "echo:1").frame.data(), "echoed");
  });
  t.join();
  auto during = queued.since(before);
  ASSERT_FALSE(during.empty());
  for (auto id : during) EXPECT_NE(id, other);
}

TEST(Coordinator, ADeadWorkersSegmentsAreReleased) {
  Coordinator c(options(1));
  uint64_t id = c.pool().put("hello", 5);
  c.send(0, Frame::make(kRequest, 0, 1, "exit:0"), {id});
  c.pool().release(id);
  wait_for(c, Event::kExited, 0);
  EXPECT_EQ(c.pool().in_use(), 0u);
}

TEST(Coordinator, ReportsExitWithStderrTail) {
  Coordinator c(options(2));
  c.send(0, Frame::make(kRequest, 0, 1, "exit:3"));
  Event e = wait_for(c, Event::kExited, 0);
  EXPECT_EQ(e.status.code, 3);
  EXPECT_EQ(e.text, "about to exit");
}

TEST(Coordinator, SignalKillsOneWorker) {
  Coordinator c(options(2));
  c.signal(1, SIGKILL);
  Event e = wait_for(c, Event::kExited, 1);
  EXPECT_EQ(e.status.signal, SIGKILL);
  EXPECT_EQ(::kill(c.pids()[0], 0), 0);  // the other rank is untouched
}

TEST(Coordinator, HeartbeatsAreAnswered) {
  Coordinator c(options(1));
  wait_for(c, Event::kFrame, 0);  // hello
  for (int i = 0; i < 200 && c.heartbeat_age_ms(0) < 0; ++i) std::this_thread::sleep_for(5ms);
  std::this_thread::sleep_for(100ms);
  long long age = c.heartbeat_age_ms(0);
  EXPECT_GE(age, 0);
  EXPECT_LT(age, 1000);
}

TEST(Coordinator, CloseStopsEveryWorkerAndRemovesTheSocket) {
  auto c = std::make_unique<Coordinator>(options(3));
  auto pids = c->pids();
  std::string sock = c->socket_path();
  c->close(2000ms);
  for (pid_t p : pids) EXPECT_EQ(::kill(p, 0), -1);
  c.reset();
  EXPECT_NE(::access(sock.c_str(), F_OK), 0);
}

TEST(Coordinator, ExecFailureIsReportedAndNothingIsLeft) {
  CoordinatorOptions o = options(1);
  o.workers.push_back(SpawnSpec{{"/nonexistent/python"}, {}, "", true});
  EXPECT_THROW(Coordinator c(std::move(o)), std::system_error);
}

TEST(Coordinator, KernelPidAndSocketAreOursEvenWhenTheSpecHasOthers) {
  CoordinatorOptions o = options(1);
  o.workers[0].env.insert(o.workers[0].env.begin(), "DDIP_KERNEL_PID=1");
  o.workers[0].env.insert(o.workers[0].env.begin(), "DDIP_SOCKET=/nonexistent/ddip.sock");
  Coordinator c(std::move(o));
  EXPECT_EQ(request(c, 0, 1, "env:DDIP_KERNEL_PID").frame.data(), std::to_string(::getpid()));
}

TEST(Coordinator, HostIgnoringSigchldDoesNotStopTheRuntime) {
  // SIG_IGN for SIGCHLD (some notebook code does it) makes Linux reap our workers for us.
  struct sigaction ign {
  }, old{};
  ign.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGCHLD, &ign, &old), 0);
  {
    Coordinator c(options(2));
    c.signal(1, SIGKILL);
    Event e = wait_for(c, Event::kExited, 1);
    EXPECT_TRUE(e.status.unknown || e.status.signal == SIGKILL);
    EXPECT_EQ(request(c, 0, 2, "echo:1").frame.data(), "echoed");  // the other still works
    EXPECT_TRUE(c.running());
  }
  ::sigaction(SIGCHLD, &old, nullptr);
}

TEST(Coordinator, StoppedWorkerIsReportedUnresponsiveThenResponsive) {
  CoordinatorOptions o = options(2);
  o.heartbeat_timeout = 200ms;
  Coordinator c(std::move(o));
  wait_for(c, Event::kFrame, 0);  // hello
  ::kill(c.pids()[0], SIGSTOP);
  Event e = wait_for(c, Event::kUnresponsive, 0);
  EXPECT_GE(e.age_ms, 200);
  ::kill(c.pids()[0], SIGCONT);
  wait_for(c, Event::kResponsive, 0);
  EXPECT_EQ(request(c, 0, 3, "echo:1").frame.data(), "echoed");
}

// Unresponsive is a heartbeat left unanswered for the timeout, not the time since the last
// answer: with a timeout as long as the interval, the latter flags healthy workers at each tick.
TEST(Coordinator, HealthyWorkersAreNotUnresponsiveWhenTheTimeoutEqualsTheInterval) {
  CoordinatorOptions o = options(2);
  // Long enough that a loaded machine's scheduling delays stay below it.
  o.heartbeat_interval = 200ms;
  o.heartbeat_timeout = 200ms;
  Coordinator c(std::move(o));
  std::set<int> hello;  // in either order
  while (hello.size() < 2) {
    Event e = next(c);
    if (e.kind == Event::kFrame) hello.insert(e.slot);
  }
  auto until = std::chrono::steady_clock::now() + 2s;
  bool flagged = false;
  for (auto now = std::chrono::steady_clock::now(); now < until;
       now = std::chrono::steady_clock::now()) {
    auto e = c.next_event(std::chrono::duration_cast<std::chrono::milliseconds>(until - now));
    if (!e || e->kind != Event::kUnresponsive) continue;
    ADD_FAILURE() << "slot " << e->slot << " reported unresponsive after " << e->age_ms << " ms";
    flagged = true;
  }
  ASSERT_FALSE(flagged);
  ::kill(c.pids()[1], SIGSTOP);
  Event e = wait_for(c, Event::kUnresponsive, 1);  // and a silent one still is
  EXPECT_GE(e.age_ms, 200);
  ::kill(c.pids()[1], SIGCONT);
  wait_for(c, Event::kResponsive, 1);
}

TEST(Coordinator, AReplyWhoseFdsCouldNotBeReceivedIsDeliveredTruncated) {
  if (FdStarvation::sanitized()) GTEST_SKIP() << "needs fds the sanitizers would lack";
  Coordinator c(options(1));
  wait_for(c, Event::kFrame, 0);  // hello: connected before the fd table is full
  Event e;
  {
    FdStarvation starved;
    e = request(c, 0, 4, "fds:3");
  }
  EXPECT_EQ(e.kind, Event::kTruncated);
  EXPECT_EQ(e.frame.data(), "with fds");
  EXPECT_TRUE(!e.frame.fds || e.frame.fds->empty());
  Event ok = request(c, 0, 5, "fds:2");  // nothing was lost in the stream
  EXPECT_EQ(ok.kind, Event::kFrame);
  ASSERT_TRUE(ok.frame.fds);
  EXPECT_EQ(ok.frame.fds->size(), 2u);
}

TEST(Coordinator, OutputIsReadWhileWorkersStopSoAFloodingOneCanExit) {
  CoordinatorOptions o = options(1);
  Coordinator c(std::move(o));
  request(c, 0, 1, "flood-on-term:1048576");
  c.send(0, Frame::make(kRequest, 0, 2, "hang"));  // it won't read the shutdown frame
  wait_for(c, Event::kFrame, 0);
  auto stuck = c.close(200ms);
  EXPECT_TRUE(stuck.empty());
  size_t flooded = 0;
  std::optional<ExitStatus> status;
  while (auto ev = c.next_event(0ms)) {
    if (ev->kind == Event::kOutput && ev->stream == 1) flooded += ev->text.size();
    if (ev->kind == Event::kExited) status = ev->status;
  }
  ASSERT_TRUE(status);
  EXPECT_EQ(status->code, 7);  // its handler finished: not SIGKILLed at a full pipe
  EXPECT_EQ(flooded, 1048576u);
}

TEST(Coordinator, CloseIsBoundedWhenAWorkerCannotBeReaped) {
  CoordinatorOptions o = options(2);
  o.kill_wait = 300ms;
  Coordinator c(std::move(o));
  request(c, 0, 1, "hang");
  pid_t held = c.pids()[0];
  pid_t tracer = hold_with_tracer(held);
  if (tracer < 0) GTEST_SKIP() << "ptrace is not permitted here";
  auto t0 = std::chrono::steady_clock::now();
  auto stuck = c.close(100ms);
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(stuck, std::vector<pid_t>{held});
  EXPECT_LT(took, 5s);                    // 100 ms + 100 ms + 300 ms of deadlines, not forever
  EXPECT_EQ(::kill(c.pids()[1], 0), -1);  // the other one was stopped
  ::kill(tracer, SIGKILL);
  ::waitpid(tracer, nullptr, 0);
}

TEST(Coordinator, CloseInTwoHalvesCanBeHastened) {
  Coordinator c(options(1));
  request(c, 0, 1, "hang");
  c.begin_close(60s);  // returns at once; the worker ignores the shutdown frame
  EXPECT_FALSE(c.wait_closed(50ms));
  EXPECT_TRUE(::kill(c.pids()[0], 0) == 0);
  auto t0 = std::chrono::steady_clock::now();
  auto stuck = c.close(0ms);  // a shorter grace hastens the stop under way
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  EXPECT_TRUE(stuck.empty());
  ASSERT_TRUE(c.wait_closed(0ms));
}

TEST(Coordinator, AnExitedWorkersPidCannotAttachLater) {
  std::ofstream last_pid("/proc/sys/kernel/ns_last_pid");
  if (!last_pid) GTEST_SKIP() << "needs write access to /proc/sys/kernel/ns_last_pid";
  Coordinator c(options(1));
  pid_t dead = c.pids()[0];
  c.send(0, Frame::make(kRequest, 0, 1, "exit:0"));
  wait_for(c, Event::kExited, 0);
  auto attached = impostor_attached(last_pid, c.socket_path(), dead);
  if (!attached) GTEST_SKIP() << "could not get the pid back";
  EXPECT_FALSE(*attached) << "the impostor was attached";
  EXPECT_FALSE(c.connected(0));
}

// A hello from `slot`: the new worker's, once it is started again.
TEST(Coordinator, AKilledWorkerStartedAgainInItsSlotSaysHelloAndAnswers) {
  Coordinator c(options(2));
  pid_t old = c.pids()[1];
  request(c, 1, 1, "echo:0");  // "to stderr": the killed worker's last line
  c.signal(1, SIGKILL);
  wait_for(c, Event::kExited, 1);
  pid_t fresh = c.respawn(1);
  EXPECT_NE(fresh, old);
  EXPECT_EQ(c.pids()[1], fresh);
  EXPECT_EQ(hello_of(c, 1).frame.data(), "pid=" + std::to_string(fresh));
  // It answers, from the slot's spec as before: the same rank's environment.
  EXPECT_EQ(request(c, 1, 8, "env:DDIP_TEST_RANK").frame.data(), "1");
  EXPECT_EQ(request(c, 0, 9, "echo:0").frame.data(), "echoed");  // the other one untouched
  // It dies in turn: reported with its own last lines, not the killed worker's.
  c.send(1, Frame::make(kRequest, 1, 10, "exit:4"));
  Event gone = wait_for(c, Event::kExited, 1);
  EXPECT_EQ(gone.status.code, 4);
  EXPECT_EQ(gone.text, "about to exit");
}

TEST(Coordinator, AWorkerStartedAgainFromANewSpecGetsItsEnvironment) {
  Coordinator c(options(1));
  c.send(0, Frame::make(kRequest, 0, 1, "exit:0"));
  wait_for(c, Event::kExited, 0);
  SpawnSpec spec{
      {self_exe()},
      {"DDIP_TEST_WORKER=1", "DDIP_TEST_RANK=0", "NEW_PORT=4242", "DDIP_SOCKET=/nowhere"},
      "",
      true};
  c.respawn(0, spec);
  hello_of(c, 0);
  EXPECT_EQ(request(c, 0, 2, "env:NEW_PORT").frame.data(), "4242");
  EXPECT_EQ(request(c, 0, 3, "env:DDIP_SOCKET").frame.data(), c.socket_path());
}

TEST(Coordinator, StartingALiveWorkerAgainIsRefusedAndChangesNothing) {
  Coordinator c(options(2));
  hello_of(c, 0);
  pid_t pid = c.pids()[0];
  try {
    c.respawn(0);
    FAIL() << "a live worker was started again";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("worker slot 0 (pid " + std::to_string(pid) +
                                         ") is still running"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(c.respawn(2), std::out_of_range);
  EXPECT_THROW(c.respawn(-1), std::out_of_range);
  EXPECT_EQ(c.pids()[0], pid);
  EXPECT_EQ(request(c, 0, 1, "echo:0").frame.data(), "echoed");
}

TEST(Coordinator, AWorkerThatCannotBeStartedAgainLeavesItsSlotExited) {
  Coordinator c(options(1));
  pid_t old = c.pids()[0];
  c.send(0, Frame::make(kRequest, 0, 1, "exit:0"));
  wait_for(c, Event::kExited, 0);
  SpawnSpec bad{{"/nonexistent/ddip-worker"}, {}, "", true};
  EXPECT_THROW(c.respawn(0, bad), std::system_error);
  EXPECT_EQ(c.pids()[0], old);
  // The first spec is still the slot's: started from it, it works.
  c.respawn(0);
  hello_of(c, 0);
  EXPECT_EQ(request(c, 0, 2, "echo:0").frame.data(), "echoed");
}

TEST(Coordinator, AnExitedWorkersPidNeverAttachesToItsRespawnedSlot) {
  std::ofstream last_pid("/proc/sys/kernel/ns_last_pid");
  if (!last_pid) GTEST_SKIP() << "needs write access to /proc/sys/kernel/ns_last_pid";
  Coordinator c(options(1));
  pid_t dead = c.pids()[0];
  c.send(0, Frame::make(kRequest, 0, 1, "exit:0"));
  wait_for(c, Event::kExited, 0);
  pid_t fresh = c.respawn(0);
  hello_of(c, 0);
  auto attached = impostor_attached(last_pid, c.socket_path(), dead);
  if (!attached) GTEST_SKIP() << "could not get the pid back";
  EXPECT_FALSE(*attached) << "the exited worker's pid was attached to the new slot";
  EXPECT_EQ(c.pids()[0], fresh);
  EXPECT_EQ(request(c, 0, 2, "echo:0").frame.data(), "echoed");  // the new worker keeps it
}

TEST(Coordinator, IdlePoolSegmentsAreFreedWhileTheGroupLives) {
  CoordinatorOptions o = options(1);
  o.pool_idle = 50ms;
  Coordinator c(std::move(o));
  uint64_t id = c.pool().put("x", 1);
  c.pool().release(id);
  EXPECT_EQ(c.pool().free_bytes(), SegmentPool::kMinSegment);
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (c.pool().free_bytes() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(c.pool().free_bytes(), 0u);
}

int main(int argc, char** argv) {
  if (std::getenv("DDIP_TEST_WORKER")) return worker_main();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

TEST(Coordinator, UnreadOutputIsBoundedAndTheDropIsReported) {
  auto o = options(1);
  o.max_unread_output = 64 * 1024;
  Coordinator c(std::move(o));
  c.send(0, Frame::make(kRequest, 0, 3, "echo:20000"));  // ~200 KB while nobody reads events
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (c.dropped_output(0) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);  // polling a condition, not waiting out a race
  ASSERT_GT(c.dropped_output(0), 0u);
  std::string out, notes;
  auto read_until_done = [&] {
    while (true) {
      Event e = next(c);
      if (e.kind == Event::kOutput) (e.stream == 1 ? out : notes) += e.text;
      if (e.kind == Event::kFrame && e.frame.kind == kDone) return;
    }
  };
  read_until_done();
  c.send(0, Frame::make(kRequest, 0, 4, "echo:1"));  // read now: output flows again, with the tally
  read_until_done();
  size_t total = 0;
  for (int i = 0; i < 20000; ++i) total += ("line " + std::to_string(i) + "\n").size();
  total += std::string("line 0\n").size();  // the second request's line
  EXPECT_EQ(out.substr(0, 7), "line 0\n");
  EXPECT_NE(notes.find("rank output is being dropped: more than 64 KiB"), std::string::npos)
      << notes;
  size_t dropped = 0;  // each episode of dropping ends with its tally
  const std::string tally = " bytes of rank output were dropped]";
  for (size_t at = notes.find(tally); at != std::string::npos; at = notes.find(tally, at + 1)) {
    size_t start = notes.rfind("[ddip: ", at) + 7;
    dropped += std::stoul(notes.substr(start, at - start));
  }
  EXPECT_GT(dropped, 0u) << notes;
  EXPECT_EQ(out.size() + dropped, total);  // nothing lost without being counted
  EXPECT_EQ(c.dropped_output(0), 0u);
}
