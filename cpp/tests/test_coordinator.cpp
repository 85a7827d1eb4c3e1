// The coordinator against real worker processes: this test binary re-executes itself as a
// worker (DDIP_TEST_WORKER=1) that speaks through an Endpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "ddip/coordinator.hpp"
#include "ddip/endpoint.hpp"

using namespace ddip;
using namespace std::chrono_literals;

namespace {

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return std::string(buf, n > 0 ? n : 0);
}

void write_fd(int fd, const std::string& s) {
  ssize_t ignored = ::write(fd, s.data(), s.size());
  (void)ignored;
}

// Requests: "echo:N" prints N lines then replies; "partial:X" prints X without a newline;
// "exit:N" exits with N after a line on stderr.
int worker_main() {
  int rank = std::atoi(std::getenv("DDIP_TEST_RANK"));
  Endpoint ep(std::getenv("DDIP_SOCKET"), rank, "pid=" + std::to_string(::getpid()));
  while (true) {
    std::optional<Frame> f;
    try {
      f = ep.recv(1000ms);
    } catch (const EndpointClosed&) {
      return 0;
    }
    if (!f) continue;
    if (f->kind == kShutdown) return 0;
    const std::string& req = f->data();
    if (req.rfind("echo:", 0) == 0) {
      int n = std::atoi(req.c_str() + 5);
      for (int i = 0; i < n; ++i) write_fd(1, "line " + std::to_string(i) + "\n");
      write_fd(2, "to stderr\n");
      ep.send(Frame::make(kDone, rank, f->seq, "echoed"));
    } else if (req.rfind("partial:", 0) == 0) {
      write_fd(1, req.substr(8));
      ep.send(Frame::make(kDone, rank, f->seq, ""));
    } else if (req.rfind("segment:", 0) == 0) {
      uint64_t id;
      std::memcpy(&id, req.data() + 8, sizeof id);
      std::string got;
      if (f->fds && f->fds->size() == 1) {
        char buf[16] = {};
        ssize_t n = ::pread((*f->fds)[0].get(), buf, 5, 0);
        got.assign(buf, n > 0 ? n : 0);
      }
      ep.send(Frame::make(kDone, rank, f->seq, got));
      ep.send(Frame::make(kRelease, rank, 0, std::string(reinterpret_cast<char*>(&id), 8)));
    } else if (req == "display") {
      write_fd(1, "before\n");
      write_fd(1, std::string(kDisplayMarker));
      ep.send(Frame::make(kDisplay, rank, f->seq, "D"));
      write_fd(1, "after\n");
      ep.send(Frame::make(kDone, rank, f->seq, ""));
    } else if (req.rfind("exit:", 0) == 0) {
      write_fd(2, "about to exit\n");
      ::_exit(std::atoi(req.c_str() + 5));
    }
  }
}

CoordinatorOptions options(int n) {
  CoordinatorOptions o;
  for (int r = 0; r < n; ++r)
    o.workers.push_back(SpawnSpec{
        {self_exe()}, {"DDIP_TEST_WORKER=1", "DDIP_TEST_RANK=" + std::to_string(r)}, "", true});
  o.heartbeat_interval = 20ms;
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

int main(int argc, char** argv) {
  if (std::getenv("DDIP_TEST_WORKER")) return worker_main();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
