// Workers on "another host": the coordinator's launcher re-executes this test binary as a
// HostAgent (DDIP_TEST_AGENT=1), which connects back over authenticated TCP on loopback and runs
// this binary again as workers (DDIP_TEST_WORKER=1) that speak through an Endpoint.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "ddip/coordinator.hpp"
#include "ddip/endpoint.hpp"
#include "ddip/host_agent.hpp"
#include "ddip/keeper.hpp"
#include "ddip/rank_template.hpp"
#include "ddip/tcp.hpp"
#include "helpers.hpp"

using namespace ddip;
using namespace ddip::test;
using namespace std::chrono_literals;

namespace {
// Requests: "echo:TEXT" prints TEXT on stdout and stderr, then replies "pid"; "exit:N" exits
// with N after a line on stderr; "segment" replies with the first fd's text (a pooled segment
// is larger than what it holds: up to the first NUL); "inode..."
// with its inode; "memfd:TEXT"
// replies with a memfd holding TEXT; "env:NAME" replies with that variable's value.
int worker_main() {
  int slot = std::atoi(std::getenv("DDIP_TEST_SLOT"));
  Endpoint ep(std::getenv("DDIP_SOCKET"), slot, "pid=" + std::to_string(::getpid()),
              EndpointOptions::from_environment());
  return test::serve_requests(ep, [&](const Frame& f) {
    const std::string& req = f.data();
    if (req.rfind("echo:", 0) == 0) {
      write_fd(1, req.substr(5) + "\n");
      write_fd(2, "err " + req.substr(5) + "\n");
      ep.send(Frame::make(kDone, slot, f.seq, std::to_string(::getpid())));
    } else if (req.rfind("exit:", 0) == 0) {
      write_fd(2, "about to exit\n");
      ::_exit(std::atoi(req.c_str() + 5));
    } else if (req == "segment") {
      std::string got;
      if (f.fds && !f.fds->empty()) {
        char buf[64] = {};
        ssize_t n = ::pread((*f.fds)[0].get(), buf, sizeof buf, 0);
        got.assign(buf, n > 0 ? ::strnlen(buf, static_cast<size_t>(n)) : 0);  // the bytes put
      }
      ep.send(Frame::make(kDone, slot, f.seq, got));
    } else if (req.rfind("inode", 0) == 0) {
      // "inode:ID" replies with the inode of the segment it got; "inode-release:ID" lets go of
      // it first, as a rank whose array is gone does.
      struct stat st {};
      if (f.fds && !f.fds->empty()) ::fstat((*f.fds)[0].get(), &st);
      if (req.rfind("inode-release:", 0) == 0) {
        uint64_t id = std::stoull(req.substr(14));
        ep.send(Frame::make(kRelease, slot, 0, std::string(reinterpret_cast<char*>(&id), 8)));
      }
      ep.send(Frame::make(kDone, slot, f.seq, std::to_string(st.st_ino)));
    } else if (req.rfind("after:", 0) == 0) {
      // "after:MS" replies "ok" after (its slot x MS) ms: a host's replies one after another
      std::this_thread::sleep_for(std::chrono::milliseconds(slot * std::atoi(req.c_str() + 6)));
      ep.send(Frame::make(kDone, slot, f.seq, "ok"));
    } else if (req.rfind("gate:", 0) == 0) {
      // "gate:SLOT:PATH": that slot replies once PATH exists (up to 30 s), the others at once
      size_t colon = req.find(':', 5);
      bool gated = std::atoi(req.substr(5, colon - 5).c_str()) == slot;
      std::string path = req.substr(colon + 1);
      for (int i = 0; gated && i < 3000 && ::access(path.c_str(), F_OK) != 0; ++i)
        std::this_thread::sleep_for(10ms);
      ep.send(Frame::make(kDone, slot, f.seq, gated ? "released" : "quick"));
    } else if (req.rfind("env:", 0) == 0) {
      const char* v = std::getenv(req.c_str() + 4);
      ep.send(Frame::make(kDone, slot, f.seq, v ? v : "(unset)"));
    } else if (req.rfind("memfd:", 0) == 0) {
      Frame r = Frame::make(kDone, slot, f.seq, "with a buffer");
      Fd m(::memfd_create("reply", MFD_CLOEXEC));
      write_fd(m.get(), req.substr(6));
      r.fds = std::make_shared<std::vector<Fd>>();
      r.fds->push_back(std::move(m));
      ep.send(std::move(r));
    }
  });
}

// A rank template that fails as rank/template.py does when a module it needs can't be imported.
constexpr const char* kTemplateFailure =
    "importing cloudpickle failed: ModuleNotFoundError: No module named 'cloudpickle'";

int template_main() {
  ForkServer server(std::getenv("DDIP_TEMPLATE_SOCKET"));
  server.failed(std::string(R"({"reason": ")") + kTemplateFailure + "\"}");
  return 1;
}

int agent_main() {
  AgentOptions o;
  o.kernel_timeout = 3000ms;
  if (const char* idle = std::getenv("DDIP_TEST_IDLE_MS"))
    o.idle_timeout = std::chrono::milliseconds(std::atoi(idle));
  // DDIP_TEST_TEMPLATE: this host has a rank template (this binary again, which fails).
  std::optional<SpawnSpec> tmpl;
  if (std::getenv("DDIP_TEST_TEMPLATE"))
    tmpl = SpawnSpec{{self_exe(), "-c", "template"}, {"DDIP_TEST_TEMPLATE_PROCESS=1"}, "", true};
  HostAgent agent(o);
  int rc = agent.serve(0, tmpl);  // as python -m ddip.remote does
  if (rc) std::cerr << "agent: " << agent.why() << "\n";
  return rc;
}

pid_t parent_of(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return -1;
  int self, ppid = -1;
  char comm[256], state;
  if (std::fscanf(f, "%d %255s %c %d", &self, comm, &state, &ppid) != 4) ppid = -1;
  std::fclose(f);
  return ppid;
}

SpawnSpec worker(int slot) {
  return SpawnSpec{
      {self_exe()}, {"DDIP_TEST_WORKER=1", "DDIP_TEST_SLOT=" + std::to_string(slot)}, "", true};
}

// Slot 0 here, slots 1 and 2 on a "host" whose launcher is `launcher`.
CoordinatorOptions options(std::vector<std::string> launcher = {}) {
  CoordinatorOptions o;
  for (int s = 0; s < 3; ++s) o.workers.push_back(worker(s));
  RemoteHost h;
  h.name = "loopback-host";
  h.launcher.argv = launcher.empty() ? std::vector<std::string>{self_exe()} : launcher;
  h.launcher.env = {"DDIP_TEST_AGENT=1", "PATH=/usr/bin:/bin"};
  h.slots = {1, 2};
  o.hosts.push_back(h);
  o.heartbeat_interval = 100ms;
  o.heartbeat_timeout = 1500ms;
  return o;
}

struct Seen {
  std::string out, err;
  std::optional<Event> last;
};

// Events until one of `kind` for `slot` arrives (or the deadline); output is collected.
Seen wait_for(Coordinator& c, Event::Kind kind, int slot, std::chrono::milliseconds limit = 10s,
              int frame_kind = -1) {
  Seen seen;
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    auto e = c.next_event(100ms);
    if (!e) continue;
    if (e->kind == Event::kOutput && e->slot == slot)
      (e->stream == 1 ? seen.out : seen.err) += e->text;
    if (e->kind == kind && e->slot == slot &&
        (frame_kind < 0 || e->frame.kind == static_cast<uint16_t>(frame_kind))) {
      seen.last = std::move(e);
      return seen;
    }
  }
  return seen;
}

// Slot 0 here, slots 1 to 4 on one other host, whose agent gathers their replies to a request.
CoordinatorOptions four_on_a_host() {
  CoordinatorOptions o = options();
  for (int s = 3; s < 5; ++s) o.workers.push_back(worker(s));
  o.hosts[0].slots = {1, 2, 3, 4};
  return o;
}

// The slots that said hello, waiting for `n` of them (up to 20 s).
std::set<int> hellos(Coordinator& c, size_t n) {
  std::set<int> said;
  for (auto until = std::chrono::steady_clock::now() + 20s;
       said.size() < n && std::chrono::steady_clock::now() < until;)
    if (auto e = c.next_event(100ms); e && e->kind == Event::kFrame && e->frame.kind == kHello)
      said.insert(e->slot);
  return said;
}

// Every event of request `seq` until each of `slots` has replied (up to `limit`).
struct Replies {
  std::map<int, std::string> reply;      // by worker
  std::vector<std::vector<int>> events;  // each reply event's workers
  std::map<int, std::string> out;        // each worker's stdout before its reply
  bool output_after_reply = false;
};

Replies replies(Coordinator& c, uint64_t seq, const std::set<int>& slots,
                std::chrono::milliseconds limit = 10s) {
  Replies r;
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (r.reply.size() < slots.size() && std::chrono::steady_clock::now() < deadline) {
    auto e = c.next_event(100ms);
    if (!e) continue;
    if (e->kind == Event::kOutput && e->stream == 1) {
      r.out[e->slot] += e->text;
      if (r.reply.count(e->slot)) r.output_after_reply = true;
    }
    if (e->kind != Event::kFrame || e->frame.kind != kDone || e->frame.seq != seq) continue;
    std::vector<int> who = e->slots.empty() ? std::vector<int>{e->slot} : e->slots;
    EXPECT_EQ(who.front(), e->slot);
    for (int slot : who) r.reply[slot] = e->frame.data();
    r.events.push_back(who);
  }
  return r;
}

// How many times a thread went to sleep (it waits for something, then is woken).
long sleeps_of(pid_t pid, pid_t tid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::stol(line.substr(24));
  return -1;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

}  // namespace

TEST(HostAgent, WorkersOnAHostSpeakThroughTheLink) {
  Coordinator c(options());
  EXPECT_EQ(c.pids()[1], -1);
  EXPECT_FALSE(c.link_address().empty());
  auto hello = wait_for(c, Event::kFrame, 1, 10s, kHello);
  ASSERT_TRUE(hello.last) << "the remote worker never said hello";
  c.send(1, Frame::make(kRequest, 1, 7, "echo:over the link"));
  auto done = wait_for(c, Event::kFrame, 1, 10s, kDone);
  ASSERT_TRUE(done.last);
  EXPECT_EQ(done.last->frame.seq, 7u);
  // Its output came first, labelled with its slot, from its own pipes on its host.
  EXPECT_EQ(done.out, "over the link\n");
  EXPECT_EQ(done.err, "err over the link\n");
  std::this_thread::sleep_for(400ms);
  long long age = c.heartbeat_age_ms(1);
  EXPECT_GE(age, 0);
  EXPECT_LT(age, 1000) << "heartbeats are answered across the link";
  c.close();
}

TEST(HostAgent, BuffersTravelInBandBothWays) {
  Coordinator c(options());
  uint64_t id = c.pool().put("segment bytes", 13);
  c.send(2, Frame::make(kRequest, 2, 1, "segment"), {id});
  c.pool().release(id);
  auto done = wait_for(c, Event::kFrame, 2, 10s, kDone);
  ASSERT_TRUE(done.last);
  EXPECT_EQ(done.last->frame.data(), "segment bytes");
  EXPECT_EQ(c.pool().in_use(), 0u) << "a remote slot holds no segment once its frame is copied";
  c.send(2, Frame::make(kRequest, 2, 2, "memfd:reply bytes"));
  done = wait_for(c, Event::kFrame, 2, 10s, kDone);
  ASSERT_TRUE(done.last);
  ASSERT_TRUE(done.last->frame.fds);
  ASSERT_EQ(done.last->frame.fds->size(), 1u);
  char buf[32] = {};
  ssize_t n = ::pread((*done.last->frame.fds)[0].get(), buf, sizeof buf, 0);
  EXPECT_EQ(std::string(buf, n), "reply bytes");
  c.close();
}

TEST(HostAgent, OneSegmentReachesEveryWorkerOfAHostFromTheAgentsOneCopy) {
  Coordinator c(options());
  uint64_t id = c.pool().put("shared bytes", 12);
  c.send(std::vector<int>{1, 2}, Frame::make(kRequest, 0, 3, "segment"), {id});
  c.pool().release(id);
  // Each worker's reply, in whichever order they come.
  auto replies = [&c](uint64_t seq) {
    std::map<int, std::string> got;
    auto deadline = std::chrono::steady_clock::now() + 10s;
    while (got.size() < 2 && std::chrono::steady_clock::now() < deadline) {
      auto e = c.next_event(100ms);
      if (e && e->kind == Event::kFrame && e->frame.kind == kDone && e->frame.seq == seq) {
        got[e->slot] = e->frame.data();
        for (int slot : e->slots) got[slot] = e->frame.data();  // gathered by the host's agent
      }
    }
    return got;
  };
  EXPECT_EQ(replies(3), (std::map<int, std::string>{{1, "shared bytes"}, {2, "shared bytes"}}));
  EXPECT_EQ(c.pool().in_use(), 0u);
  // A later request with a new segment: the agent's copy of the first is gone, the new one used.
  id = c.pool().put("later bytes", 11);
  c.send(std::vector<int>{2, 1}, Frame::make(kRequest, 0, 4, "segment"), {id});
  c.pool().release(id);
  EXPECT_EQ(replies(4), (std::map<int, std::string>{{1, "later bytes"}, {2, "later bytes"}}));
  c.close();
}

// The agent keeps a segment in a pool of its own: once its workers released it and the kernel
// forgot it, the host's next segment is received into the same memfd (no pages freed by a worker,
// none allocated by the agent); one a worker still holds is not reused.
TEST(HostAgent, AHostsNextSegmentIsReceivedIntoOneItsWorkersReleased) {
  Coordinator c(options());
  const std::string bytes(3 << 20, 'p');
  auto push = [&](uint64_t seq, const std::string& what) {
    uint64_t id = c.pool().put(bytes.data(), bytes.size());
    c.send(std::vector<int>{1, 2}, Frame::make(kRequest, 0, seq, what + std::to_string(id)), {id});
    c.pool().release(id);
    std::set<std::string> inodes;
    std::set<int> replied;
    auto deadline = std::chrono::steady_clock::now() + 10s;
    while (replied.size() < 2 && std::chrono::steady_clock::now() < deadline) {
      auto e = c.next_event(100ms);
      if (e && e->kind == Event::kFrame && e->frame.kind == kDone && e->frame.seq == seq) {
        inodes.insert(e->frame.data());
        replied.insert(e->slot);
        replied.insert(e->slots.begin(), e->slots.end());  // gathered by the host's agent
      }
    }
    EXPECT_EQ(replied, (std::set<int>{1, 2}));
    EXPECT_EQ(inodes.size(), 1u) << "one copy for the host";
    return inodes.empty() ? std::string() : *inodes.begin();
  };
  std::string first = push(1, "inode-release:");
  std::string second = push(2, "inode:");  // kept by both workers
  EXPECT_EQ(second, first) << "received into the pages of the one its workers released";
  std::string third = push(3, "inode:");
  EXPECT_NE(third, second) << "the workers still hold the second";
  c.close();
}

// Four workers on one host: a request to all of them is one frame on the link, and their replies
// one frame back, alike ones as one event naming them all, each worker's output before it.
TEST(HostAgent, AHostsAgentFansARequestOutAndGathersItsWorkersRepliesIntoOneFrame) {
  CoordinatorOptions o = four_on_a_host();
  o.reply_window = 60s;  // every reply is held until the host's last: one frame, however slow
  Coordinator c(std::move(o));
  ASSERT_EQ(hellos(c, 5), (std::set<int>{0, 1, 2, 3, 4}));
  uint64_t before = c.host_reply_frames();
  c.send(std::vector<int>{1, 2, 3, 4}, Frame::make(kRequest, 0, 5, "env:DDIP_TEST_AGENT"));
  Replies same = replies(c, 5, {1, 2, 3, 4});
  EXPECT_EQ(same.reply, (std::map<int, std::string>{{1, "1"}, {2, "1"}, {3, "1"}, {4, "1"}}));
  ASSERT_EQ(same.events.size(), 1u) << "four alike replies are one event";
  EXPECT_EQ(std::set<int>(same.events[0].begin(), same.events[0].end()),
            (std::set<int>{1, 2, 3, 4}));
  EXPECT_EQ(c.host_reply_frames() - before, 1u) << "one frame brought the host's four replies";
  // Replies that differ (each worker's pid) are entries of their own, each with its output first.
  before = c.host_reply_frames();
  c.send(std::vector<int>{2, 3, 4}, Frame::make(kRequest, 0, 6, "echo:hi"));
  Replies differ = replies(c, 6, {2, 3, 4});
  EXPECT_EQ(differ.reply.size(), 3u);
  EXPECT_EQ(differ.events.size(), 3u);
  for (int slot : {2, 3, 4}) EXPECT_EQ(differ.out[slot], "hi\n") << "worker " << slot;
  EXPECT_FALSE(differ.output_after_reply);
  EXPECT_EQ(c.host_reply_frames() - before, 1u);
  // One worker's reply goes by itself, as before.
  c.send(3, Frame::make(kRequest, 3, 7, "env:DDIP_TEST_SLOT"));
  Replies one = replies(c, 7, {3});
  EXPECT_EQ(one.reply, (std::map<int, std::string>{{3, "3"}}));
  c.close();
}

TEST(HostAgent, AHostsAgentIsWokenForAGatheredRequestsFirstAndLastReplyNotForEach) {
  CoordinatorOptions o = four_on_a_host();
  o.reply_window = 60s;
  o.heartbeat_interval = 1000ms;  // the host's heartbeat wakes its agent too: rarely, here
  o.heartbeat_timeout = 10s;
  Coordinator c(std::move(o));
  ASSERT_EQ(hellos(c, 5).size(), 5u);
  // The agent: the parent of its workers, whose main thread relays (the workers' IO thread
  // queues their replies).
  c.send(1, Frame::make(kRequest, 1, 1, "echo:pid"));
  Replies first = replies(c, 1, {1});
  ASSERT_EQ(first.reply.size(), 1u);
  pid_t agent = parent_of(std::stoi(first.reply[1]));
  ASSERT_GT(agent, 1);
  long before = sleeps_of(agent, agent);
  ASSERT_GE(before, 0);
  // Replies 20 ms apart (slot x 20 ms): each would be a wake of its own.
  constexpr int kRequests = 20;
  for (uint64_t seq = 10; seq < 10 + kRequests; ++seq) {
    c.send(std::vector<int>{1, 2, 3, 4}, Frame::make(kRequest, 0, seq, "after:20"));
    Replies r = replies(c, seq, {1, 2, 3, 4});
    ASSERT_EQ(r.reply.size(), 4u) << "request " << seq;
    ASSERT_EQ(r.events.size(), 1u) << "one gathered reply";
  }
  long wakes = sleeps_of(agent, agent) - before;
  // Each request: its frame from the kernel, its first reply (the window starts) and its last;
  // besides, the host's heartbeat, and a lock the workers' thread holds now and then (more often
  // on a loaded machine). Woken for each reply, it would be 5 a request at least.
  EXPECT_LE(wakes, 4 * kRequests + 5) << "the agent's relaying thread woke " << wakes << " times";
  c.close();
}

TEST(HostAgent, RepliesThatWokeNoOneGoOutAtTheirWindowsEndWhileARankStillRuns) {
  CoordinatorOptions o = four_on_a_host();
  o.reply_window = 100ms;
  Coordinator c(std::move(o));
  ASSERT_EQ(hellos(c, 5).size(), 5u);
  std::string gate = ::testing::TempDir() + "ddip-gate-" + std::to_string(::getpid());
  ::unlink(gate.c_str());
  c.send(std::vector<int>{1, 2, 3, 4}, Frame::make(kRequest, 0, 3, "gate:4:" + gate));
  // The three quick replies reach the kernel while slot 4 waits at its gate: the agent was woken
  // for the first, and the window's end brings those queued after it.
  Replies quick = replies(c, 3, {1, 2, 3}, 20s);
  EXPECT_EQ(quick.reply, (std::map<int, std::string>{{1, "quick"}, {2, "quick"}, {3, "quick"}}));
  std::ofstream(gate) << "open";
  Replies late = replies(c, 3, {4}, 20s);
  ::unlink(gate.c_str());
  EXPECT_EQ(late.reply, (std::map<int, std::string>{{4, "released"}}));
  c.close();
}

TEST(HostAgent, ExitStatusAndStderrTailComeBack) {
  Coordinator c(options());
  c.send(1, Frame::make(kRequest, 1, 1, "exit:3"));
  auto exited = wait_for(c, Event::kExited, 1);
  ASSERT_TRUE(exited.last);
  EXPECT_EQ(exited.last->status.code, 3);
  EXPECT_NE(exited.last->text.find("about to exit"), std::string::npos);
  // The other worker on that host goes on.
  c.send(2, Frame::make(kRequest, 2, 2, "echo:still here"));
  EXPECT_TRUE(wait_for(c, Event::kFrame, 2, 10s, kDone).last);
  c.close();
}

TEST(HostAgent, SignalsReachTheRemoteWorker) {
  Coordinator c(options());
  ASSERT_TRUE(wait_for(c, Event::kFrame, 2, 10s, kHello).last);
  c.signal(2, SIGKILL, true);
  auto exited = wait_for(c, Event::kExited, 2);
  ASSERT_TRUE(exited.last);
  EXPECT_EQ(exited.last->status.signal, SIGKILL);
  c.close();
}

TEST(HostAgent, LauncherThatFailsNamesItsCause) {
  Coordinator c(
      options({"/bin/sh", "-c", "echo 'ssh: connect to host nowhere: refused' >&2; exit 255"}));
  auto lost = wait_for(c, Event::kLost, 1);
  ASSERT_TRUE(lost.last);
  EXPECT_NE(lost.last->text.find("exit code 255"), std::string::npos) << lost.last->text;
  EXPECT_NE(lost.last->text.find("connect to host nowhere"), std::string::npos) << lost.last->text;
  EXPECT_TRUE(c.close().empty());
}

TEST(HostAgent, WrongKeyAndGarbageAreRefusedAndTheGroupGoesOn) {
  Coordinator c(options());
  ASSERT_TRUE(wait_for(c, Event::kFrame, 1, 10s, kHello).last);
  std::string addr = c.link_address();
  auto colon = addr.rfind(':');
  uint16_t port = static_cast<uint16_t>(std::stoi(addr.substr(colon + 1)));
  auto deadline = std::chrono::steady_clock::now() + 5s;
  {  // garbage
    Fd s = connect_tcp("127.0.0.1", port, 5s);
    read_exact(s.get(), KernelHandshake::kChallengeBytes, deadline);
    write_all(s.get(), std::string(KernelHandshake::kResponseBytes, 'G'), deadline);
    char b;
    EXPECT_LE(::recv(s.get(), &b, 1, 0), 0) << "closed without an answer";
  }
  {  // a well-formed response made with the wrong key
    Fd s = connect_tcp("127.0.0.1", port, 5s);
    HostHandshake hs(random_bytes(kKeyBytes), 0);
    write_all(s.get(), hs.respond(read_exact(s.get(), KernelHandshake::kChallengeBytes, deadline)),
              deadline);
    char b;
    EXPECT_LE(::recv(s.get(), &b, 1, 0), 0);
  }
  EXPECT_EQ(c.rejected_connections(), 2u);
  EXPECT_NE(c.last_rejection().find("not made with the group's key"), std::string::npos);
  c.send(1, Frame::make(kRequest, 1, 9, "echo:unharmed"));
  EXPECT_TRUE(wait_for(c, Event::kFrame, 1, 10s, kDone).last);
  c.close();
}

TEST(HostAgent, AgentDeathIsItsWorkersDeathAndLeavesNoneBehind) {
  Coordinator c(options());
  c.send(1, Frame::make(kRequest, 1, 1, "echo:x"));
  auto done = wait_for(c, Event::kFrame, 1, 10s, kDone);
  ASSERT_TRUE(done.last);
  pid_t worker = std::stoi(done.last->frame.data());
  ASSERT_TRUE(alive(worker));
  // The agent is the worker's parent.
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", worker);
  FILE* f = std::fopen(path, "r");
  ASSERT_TRUE(f);
  int pid, ppid;
  char comm[256], state;
  ASSERT_EQ(std::fscanf(f, "%d %255s %c %d", &pid, comm, &state, &ppid), 4);
  std::fclose(f);
  ::kill(ppid, SIGKILL);
  auto lost = wait_for(c, Event::kLost, 1, 5s);
  ASSERT_TRUE(lost.last);
  EXPECT_NE(lost.last->text.find("loopback-host"), std::string::npos);
  for (int i = 0; i < 50 && alive(worker); ++i) std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(alive(worker)) << "a worker outlived its agent";
  c.close();
}

TEST(HostAgent, CloseEndsEveryRemoteWorker) {
  pid_t worker;
  {
    Coordinator c(options());
    c.send(2, Frame::make(kRequest, 2, 1, "echo:x"));
    auto done = wait_for(c, Event::kFrame, 2, 10s, kDone);
    ASSERT_TRUE(done.last);
    worker = std::stoi(done.last->frame.data());
    std::string address = c.link_address();
    uint16_t port = static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
    EXPECT_TRUE(c.close().empty());
    // Its port is free once it is closed, while the object still lives (a Python traceback may
    // hold it): nothing listens there.
    EXPECT_EQ(c.link_address(), address);
    EXPECT_THROW(connect_tcp("127.0.0.1", port, 2000ms), std::exception)
        << "the closed group still listens on " << address;
  }
  for (int i = 0; i < 30 && alive(worker); ++i) std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(alive(worker));
}

// The remote worker of slot `slot` answers an echo with its pid.
pid_t remote_pid(Coordinator& c, int slot, uint64_t seq) {
  c.send(slot, Frame::make(kRequest, slot, seq, "echo:x"));
  auto done = wait_for(c, Event::kFrame, slot, 10s, kDone);
  return done.last ? std::stoi(done.last->frame.data()) : -1;
}

TEST(HostAgent, AStandingAgentServesOneGroupAfterAnotherUntilTheKernelLetsItGo) {
  AgentKeeper keeper(3000ms);
  auto o = options();
  o.agent_keeper = &keeper;
  pid_t agent, first;
  {
    Coordinator c(o);
    first = remote_pid(c, 1, 1);
    ASSERT_GT(first, 0);
    ASSERT_EQ(keeper.launchers().size(), 1u);
    agent = keeper.launchers()[0];
    EXPECT_EQ(parent_of(first), agent);
    EXPECT_TRUE(c.close().empty());
  }
  // The group is over: its workers are gone, its agent stays for the next one.
  for (int i = 0; i < 50 && alive(first); ++i) std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(alive(first));
  EXPECT_EQ(keeper.launchers(), std::vector<pid_t>{agent});
  for (int round = 0; round < 2; ++round) {
    Coordinator c(o);
    pid_t w = remote_pid(c, 2, 2);
    ASSERT_GT(w, 0);
    EXPECT_EQ(parent_of(w), agent) << "a later group's workers are the same agent's";
    EXPECT_EQ(keeper.launchers(), std::vector<pid_t>{agent});
    c.close();
  }
  EXPECT_EQ(keeper.release(5000ms), 1u);
  EXPECT_FALSE(alive(agent));
  EXPECT_TRUE(keeper.launchers().empty());
}

TEST(HostAgent, AnIdleStandingAgentStaysWhileTheKeeperSpeaksAndGoesWhenItFallsSilent) {
  AgentKeeper keeper(3000ms, 100ms);
  auto o = options();
  o.agent_keeper = &keeper;
  o.hosts[0].launcher.env.push_back("DDIP_TEST_IDLE_MS=600");
  pid_t agent;
  {
    Coordinator c(o);
    ASSERT_GT(remote_pid(c, 1, 1), 0);
    agent = keeper.launchers().at(0);
    c.close();
  }
  // Idle for several of its silence limits: the keeper's empty lines keep it.
  std::this_thread::sleep_for(2000ms);
  ASSERT_EQ(keeper.launchers(), std::vector<pid_t>{agent});
  {
    Coordinator c(o);
    EXPECT_GT(remote_pid(c, 1, 2), 0);
    EXPECT_EQ(keeper.launchers(), std::vector<pid_t>{agent});
    c.close();
  }
  // An agent nobody speaks to (its kernel gone without closing its stdin) leaves on its own.
  Pipe in = make_pipe();
  AgentOptions ao;
  ao.idle_timeout = 300ms;
  HostAgent silent(ao);
  EXPECT_EQ(silent.serve(in.read.get(), std::nullopt), 1);
  EXPECT_NE(silent.why().find("nothing from the kernel for 300 ms"), std::string::npos)
      << silent.why();
}

TEST(HostAgent, AKeptAgentThatDiesBeforeTheNextGroupsTicketIsReplacedByANewOne) {
  AgentKeeper keeper(3000ms);
  auto o = options();
  o.agent_keeper = &keeper;
  pid_t agent;
  {
    Coordinator c(o);
    ASSERT_GT(remote_pid(c, 1, 1), 0);
    agent = keeper.launchers().at(0);
    c.close();
  }
  ::kill(agent, SIGSTOP);  // leased by the next group, but it will never read that ticket
  Coordinator c(o);
  ::kill(agent, SIGKILL);
  pid_t w = remote_pid(c, 1, 2);
  ASSERT_GT(w, 0) << "the group did not start on a new agent";
  ASSERT_EQ(keeper.launchers().size(), 1u);
  EXPECT_NE(keeper.launchers()[0], agent);
  EXPECT_EQ(parent_of(w), keeper.launchers()[0]);
  c.close();
}

TEST(HostAgent, AStandingAgentWhoseGroupEndsUncleanlyIsLetGoWithItsWorkers) {
  AgentKeeper keeper(3000ms);
  auto o = options();
  o.agent_keeper = &keeper;
  pid_t agent, worker;
  {
    Coordinator c(o);
    worker = remote_pid(c, 1, 1);
    ASSERT_GT(worker, 0);
    agent = keeper.launchers().at(0);
    c.close(0ms);  // no grace: the kernel closes the link while the workers may still run
  }
  for (int i = 0; i < 50 && (alive(worker) || alive(agent)); ++i)
    std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(alive(worker));
  // Whether the agent still had a worker to report when the kernel closed is a race; either
  // way nothing is left but, at most, an idle agent ready for the next group.
  auto left = keeper.launchers();
  EXPECT_TRUE(left.empty() || (left == std::vector<pid_t>{agent} && alive(agent)));
  Coordinator c(o);
  EXPECT_GT(remote_pid(c, 2, 3), 0) << "the next group starts either way";
  c.close();
}

TEST(HostAgent, TheEndOfTheKeeperEndsItsAgentsAndTheirWorkers) {
  pid_t agent, worker;
  auto keeper = std::make_unique<AgentKeeper>(3000ms);
  auto o = options();
  o.agent_keeper = keeper.get();
  auto c = std::make_unique<Coordinator>(o);
  worker = remote_pid(*c, 1, 1);
  ASSERT_GT(worker, 0);
  agent = keeper->launchers().at(0);
  keeper.reset();  // the kernel lets its hosts go while a group runs: end of file for the agent
  EXPECT_FALSE(alive(agent));
  for (int i = 0; i < 50 && alive(worker); ++i) std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(alive(worker));
  auto lost = wait_for(*c, Event::kLost, 1, 10s);
  ASSERT_TRUE(lost.last);
  EXPECT_NE(lost.last->text.find("loopback-host"), std::string::npos) << lost.last->text;
  c->close();
}

// Events until every slot of `slots` has exited (or the deadline): slot -> its exit event.
std::map<int, Event> wait_exits(Coordinator& c, std::vector<int> slots,
                                std::chrono::milliseconds limit = 10s) {
  std::map<int, Event> got;
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (got.size() < slots.size() && std::chrono::steady_clock::now() < deadline) {
    auto e = c.next_event(100ms);
    if (e && e->kind == Event::kExited &&
        std::find(slots.begin(), slots.end(), e->slot) != slots.end())
      got.emplace(e->slot, std::move(*e));
  }
  return got;
}

std::string reply(Coordinator& c, int slot, uint64_t seq, const std::string& request) {
  c.send(slot, Frame::make(kRequest, slot, seq, request));
  auto done = wait_for(c, Event::kFrame, slot, 10s, kDone);
  return done.last ? done.last->frame.data() : "(no reply)";
}

TEST(HostAgent, AHostsAgentStartsItsExitedWorkersAgainInTheirSlotsWhenTheKernelAsks) {
  AgentKeeper keeper(3000ms);
  auto o = options();
  o.agent_keeper = &keeper;
  Coordinator c(o);
  pid_t one = remote_pid(c, 1, 1), two = remote_pid(c, 2, 2);
  ASSERT_GT(one, 0);
  ASSERT_GT(two, 0);
  pid_t agent = keeper.launchers().at(0);
  try {
    c.respawn(1);
    ADD_FAILURE() << "a running remote worker was started again";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("worker slot 1 on host loopback-host is still running"),
              std::string::npos)
        << e.what();
  }
  // Every worker of the host dies; its standing agent keeps the link (the kernel's heartbeats)
  // for longer than it waits for a silent kernel (3 s, agent_main).
  c.signal(1, SIGKILL, true);
  c.signal(2, SIGKILL, true);
  ASSERT_EQ(wait_exits(c, {1, 2}).size(), 2u);
  std::this_thread::sleep_for(3500ms);
  SpawnSpec spec = worker(1);
  spec.env.push_back("DDIP_TEST_NOTE=started again");
  EXPECT_EQ(c.respawn(1, spec), -1) << "a remote worker's pid is its host's";
  EXPECT_EQ(c.respawn(2), -1);
  // Frames sent before they connect wait for them, there.
  pid_t again = remote_pid(c, 1, 3);
  ASSERT_GT(again, 0) << "slot 1 was not started again";
  EXPECT_NE(again, one);
  EXPECT_EQ(parent_of(again), agent) << "started by the same agent";
  EXPECT_EQ(reply(c, 1, 4, "env:DDIP_TEST_NOTE"), "started again");
  EXPECT_EQ(reply(c, 1, 5, "env:DDIP_TEST_SLOT"), "1");
  pid_t again2 = remote_pid(c, 2, 6);
  EXPECT_GT(again2, 0);
  EXPECT_NE(again2, two);
  EXPECT_EQ(reply(c, 2, 7, "env:DDIP_TEST_NOTE"), "(unset)") << "slot 2 has its first spec";
  // One the agent can't start is reported exited, with why.
  c.signal(2, SIGKILL, true);
  ASSERT_EQ(wait_exits(c, {2}).size(), 1u);
  SpawnSpec bad = worker(2);
  bad.argv = {"/nonexistent/ddip-worker"};
  EXPECT_EQ(c.respawn(2, bad), -1);
  auto failed = wait_exits(c, {2});
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[2].status.code, 127);
  EXPECT_NE(failed[2].text.find("could not start the worker again"), std::string::npos)
      << failed[2].text;
  EXPECT_NE(failed[2].text.find("/nonexistent/ddip-worker"), std::string::npos) << failed[2].text;
  EXPECT_EQ(remote_pid(c, 1, 8), again) << "the other worker there goes on";
  EXPECT_TRUE(c.close().empty());
  for (int i = 0; i < 50 && alive(again); ++i) std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(alive(again));
  EXPECT_EQ(keeper.launchers(), std::vector<pid_t>{agent}) << "the group ended cleanly there";
}

TEST(HostAgent, AWorkerWhoseHostsAgentIsGoneIsNotStartedAgainAndTheErrorNamesTheHost) {
  {
    Coordinator c(options());  // a one-shot agent: it leaves with its last worker
    ASSERT_GT(remote_pid(c, 1, 1), 0);
    ASSERT_GT(remote_pid(c, 2, 2), 0);
    c.signal(1, SIGKILL, true);
    c.signal(2, SIGKILL, true);
    ASSERT_EQ(wait_exits(c, {1, 2}).size(), 2u);
    try {
      c.respawn(1);
      ADD_FAILURE() << "a worker of a one-shot agent that left was started again";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("worker slot 1 on host loopback-host can't be started "
                                           "again there: that host's agent was a one-shot one"),
                std::string::npos)
          << e.what();
    }
    c.close();
  }
  // A standing agent killed: its link is gone, and the slot can't come back there.
  AgentKeeper keeper(3000ms);
  auto o = options();
  o.agent_keeper = &keeper;
  Coordinator c(o);
  ASSERT_GT(remote_pid(c, 1, 1), 0);
  ::kill(keeper.launchers().at(0), SIGKILL);
  auto lost = wait_for(c, Event::kLost, 1, 10s);
  ASSERT_TRUE(lost.last);
  try {
    c.respawn(1);
    ADD_FAILURE() << "a worker whose host's agent is gone was started again";
  } catch (const std::logic_error& e) {
    std::string why = e.what();
    EXPECT_NE(why.find("worker slot 1 on host loopback-host can't be started again there: the "
                       "link to that host's agent is gone ("),
              std::string::npos)
        << why;
    std::string prefix = "lost the link to its host loopback-host: ";
    ASSERT_EQ(lost.last->text.rfind(prefix, 0), 0u) << lost.last->text;
    EXPECT_NE(why.find(lost.last->text.substr(prefix.size())), std::string::npos)
        << "the cause its loss was reported with: " << why;
  }
  c.close();
}

// A host's agent whose workers can't be forked from its rank template says why (kHostNote) at
// each group's start there, before its workers' frames, and the kernel keeps it with the host's
// name; the workers start cold and work.
TEST(HostAgent, AHostsAgentSaysWhyItsWorkersStartColdAtEachGroupStartAndTheyStillWork) {
  AgentKeeper keeper(3000ms);
  auto o = options();
  o.agent_keeper = &keeper;
  o.remote_warm = 2;  // wait for the host's template, as a group whose ranks use torch does
  o.hosts[0].launcher.env.push_back("DDIP_TEST_TEMPLATE=1");
  // As a Python rank's `python -c ...`, so that they could be forks of the template.
  for (auto& w : o.workers) w.argv = {self_exe(), "-c", "worker"};
  using Notes = std::vector<std::pair<std::string, std::string>>;
  std::string failed =
      std::string("ranks start cold: the rank template failed: ") + kTemplateFailure;
  for (int group = 0; group < 2; ++group) {
    Coordinator c(o);
    ASSERT_GT(remote_pid(c, 1, 1), 0) << "a worker started cold works";
    ASSERT_GT(remote_pid(c, 2, 2), 0);
    EXPECT_EQ(c.host_notes(), (Notes{{"loopback-host", failed}})) << "group " << group;
    c.close();
  }
  // Workers that run another program than the template's can't be its forks either.
  for (auto& w : o.workers) w.argv = {self_exe()};
  Coordinator c(o);
  ASSERT_GT(remote_pid(c, 1, 1), 0);
  EXPECT_EQ(c.host_notes(), (Notes{{"loopback-host", "ranks start cold: ranks run " + self_exe() +
                                                         ", not `" + self_exe() + " -c ...`"}}));
  c.close();
  // Cold ranks by the kernel's choice: nothing to say.
  o.remote_warm = 0;
  Coordinator cold(o);
  ASSERT_GT(remote_pid(cold, 1, 1), 0);
  EXPECT_TRUE(cold.host_notes().empty());
  cold.close();
  EXPECT_EQ(keeper.release(5000ms), 1u);
}

int main(int argc, char** argv) {
  if (std::getenv("DDIP_TEST_TEMPLATE_PROCESS")) return template_main();
  if (std::getenv("DDIP_TEST_WORKER")) return worker_main();
  if (std::getenv("DDIP_TEST_AGENT")) return agent_main();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
