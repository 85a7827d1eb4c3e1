#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "ddip/coordinator.hpp"
#include "ddip/rank_template.hpp"
#include "ddip/supervisor.hpp"
#include "helpers.hpp"

using namespace ddip;
using namespace ddip::test;
using namespace std::chrono_literals;

extern char** environ;

namespace {
// This test binary is its own template: started with DDIP_TEMPLATE_SOCKET set, it serves fork
// requests and execs each request's argv in the child (a C++ stand-in for the Python template).
[[noreturn]] void serve_as_template(const char* socket) {
  ForkServer server(socket);
  std::thread extra;
  if (std::getenv("DDIP_TEST_EXTRA_THREAD"))  // a template that is not single-threaded
    extra = std::thread([] { ::pause(); });
  server.ready("c++ template");
  while (true) {
    std::optional<ForkServer::Request> req;
    try {
      req = server.next(1000ms);
    } catch (const EndOfKernel&) {
      ::_exit(0);
    }
    if (!req) continue;
    pid_t pid;
    try {
      pid = server.fork(*req);
    } catch (const std::exception&) {
      continue;  // the kernel was told why
    }
    if (pid == 0) {
      std::vector<char*> argv, envp;
      for (auto& a : req->argv) argv.push_back(a.data());
      argv.push_back(nullptr);
      for (auto& e : req->env) envp.push_back(e.data());
      envp.push_back(nullptr);
      ::execvpe(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
  }
}

const int kTemplateRole = [] {
  if (const char* socket = std::getenv("DDIP_TEMPLATE_SOCKET")) serve_as_template(socket);
  return 0;
}();

SpawnSpec template_spec(std::vector<std::string> extra_env = {}) {
  extra_env.push_back("PATH=/usr/bin:/bin");
  // The sanitizers' settings, so the template (this binary) runs under them as the test does.
  for (char** e = environ; *e; ++e)
    if (std::string(*e).rfind("ASAN_", 0) == 0 || std::string(*e).rfind("UBSAN_", 0) == 0)
      extra_env.push_back(*e);
  return SpawnSpec{{"/proc/self/exe"}, extra_env, "", true};
}

// Fields of /proc/<pid>/stat after the command name: state, ppid, pgrp.
struct Stat {
  char state = 0;
  pid_t ppid = 0, pgrp = 0;
};
std::optional<Stat> stat_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto close = s.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(s.substr(close + 2));
  Stat st;
  rest >> st.state >> st.ppid >> st.pgrp;
  return st;
}

void start_ready(RankTemplate& t, std::vector<std::string> env = {}) {
  t.start(template_spec(std::move(env)));
  auto st = t.wait_ready(20s);
  ASSERT_EQ(st.state, RankTemplate::State::kReady) << st.detail;
  EXPECT_EQ(st.detail, "c++ template");
}

}  // namespace

TEST(RankTemplateCodec, RoundTrips) {
  std::vector<std::vector<std::string>> lists{{"a", "", std::string("x\0y", 3)}, {}, {"cwd"}};
  EXPECT_EQ(detail::decode_strings(detail::encode_strings(lists)), lists);
  EXPECT_THROW(detail::decode_strings(std::string("\x05\0\0\0", 4)), std::runtime_error);
}

TEST(RankTemplate, RefusesUntilStarted) {
  RankTemplate t;
  EXPECT_EQ(t.status().state, RankTemplate::State::kNone);
  EXPECT_FALSE(t.fork(sh("true")));
  EXPECT_NE(t.last_error().find("not ready"), std::string::npos);
  EXPECT_EQ(t.refusals(), 1u);
}

TEST(RankTemplate, ForkedRankIsTheKernelsChildWithItsOwnEnvCwdAndGroup) {
  RankTemplate t;
  start_ready(t);
  auto r = t.fork(sh("echo \"$FOO\"; pwd; echo started; exec sleep 30", {"FOO=bar"}, "/tmp"));
  ASSERT_TRUE(r) << t.last_error();
  Supervisor sup;
  pid_t pid = r->pid;
  size_t i = sup.adopt(r->pid, std::move(r->pidfd), std::move(r->out), std::move(r->err));
  std::string out;
  char buf[256];
  while (out.find("started\n") == std::string::npos) {
    ssize_t n = ::read(sup.child(i).stdout_pipe().get(), buf, sizeof buf);
    if (n > 0) out.append(buf, n);
    if (n == 0) break;
    if (n < 0) std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(out, "bar\n/tmp\nstarted\n");
  auto st = stat_of(pid);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->ppid, ::getpid());  // CLONE_PARENT: ours, not the template's
  EXPECT_EQ(st->pgrp, pid);         // its own process group
  EXPECT_TRUE(sup.running(i));
  sup.signal(i, SIGKILL);
  auto status = sup.wait(i, 5s);
  ASSERT_TRUE(status);
  EXPECT_EQ(status->signal, SIGKILL);
  EXPECT_EQ(t.forks(), 1u);
}

TEST(RankTemplate, ExitCodeAndStderrReachTheSupervisor) {
  RankTemplate t;
  start_ready(t);
  auto r = t.fork(sh("echo oops >&2; exit 3"));
  ASSERT_TRUE(r) << t.last_error();
  Supervisor sup;
  size_t i = sup.adopt(r->pid, std::move(r->pidfd), std::move(r->out), std::move(r->err));
  auto status = sup.wait(i, 10s);
  ASSERT_TRUE(status);
  EXPECT_EQ(status->code, 3);
  EXPECT_EQ(read_all(sup.child(i).stderr_pipe()), "oops\n");
}

TEST(RankTemplate, BadCwdIsRefusedAndTheTemplateStaysUsable) {
  RankTemplate t;
  start_ready(t);
  EXPECT_FALSE(t.fork(sh("true", {}, "/nonexistent/dir")));
  EXPECT_NE(t.last_error().find("chdir failed"), std::string::npos) << t.last_error();
  EXPECT_EQ(t.status().state, RankTemplate::State::kReady);
  auto r = t.fork(sh("exit 0"));
  ASSERT_TRUE(r) << t.last_error();
  Supervisor sup;
  size_t i = sup.adopt(r->pid, std::move(r->pidfd), std::move(r->out), std::move(r->err));
  EXPECT_EQ(sup.wait(i, 10s)->code, 0);
}

TEST(RankTemplate, DeadTemplateIsReportedAndNotUsed) {
  RankTemplate t;
  start_ready(t);
  ::kill(t.status().pid, SIGKILL);
  for (int k = 0; k < 500 && t.status().state == RankTemplate::State::kReady; ++k)
    std::this_thread::sleep_for(10ms);
  auto st = t.status();
  EXPECT_EQ(st.state, RankTemplate::State::kDead);
  EXPECT_NE(st.detail.find("killed by SIGKILL"), std::string::npos) << st.detail;
  EXPECT_FALSE(t.fork(sh("true")));
  // A new one replaces it.
  start_ready(t);
  auto r = t.fork(sh("exit 0"));
  ASSERT_TRUE(r) << t.last_error();
  Supervisor sup;
  size_t i = sup.adopt(r->pid, std::move(r->pidfd), std::move(r->out), std::move(r->err));
  EXPECT_EQ(sup.wait(i, 10s)->code, 0);
}

TEST(RankTemplate, MultiThreadedTemplateIsNeverForked) {
  RankTemplate t;
  start_ready(t, {"DDIP_TEST_EXTRA_THREAD=1"});
  EXPECT_FALSE(t.fork(sh("true")));
  EXPECT_NE(t.last_error().find("2 threads"), std::string::npos) << t.last_error();
  // Refused without a child: the template is discarded.
  EXPECT_EQ(t.status().state, RankTemplate::State::kDead);
}

TEST(RankTemplate, ClosingTheHandleKillsTemplateAndRanks) {
  pid_t template_pid, rank_pid;
  Supervisor sup;  // outlives the template: its ranks must die by PR_SET_PDEATHSIG alone
  size_t i;
  {
    RankTemplate t;
    start_ready(t);
    template_pid = t.status().pid;
    auto r = t.fork(sh("exec sleep 30"));
    ASSERT_TRUE(r) << t.last_error();
    rank_pid = r->pid;
    i = sup.adopt(r->pid, std::move(r->pidfd), std::move(r->out), std::move(r->err));
  }
  auto status = sup.wait(i, 10s);
  ASSERT_TRUE(status) << "rank " << rank_pid << " outlived its template's owner thread";
  EXPECT_EQ(status->signal, SIGKILL);
  EXPECT_FALSE(stat_of(template_pid) && stat_of(template_pid)->state != 'Z');
}

TEST(RankTemplate, CoordinatorForksWorkersFromIt) {
  RankTemplate t;
  start_ready(t);
  CoordinatorOptions o;
  o.workers.push_back(sh("echo \"slot $SLOT\"", {"SLOT=0"}));
  o.workers.push_back(sh("echo \"slot $SLOT\"", {"SLOT=1"}));
  o.rank_template = &t;
  Coordinator c(std::move(o));
  EXPECT_EQ(t.forks(), 2u);
  std::string seen[2];
  int exited = 0;
  while (exited < 2) {
    auto e = c.next_event(10s);
    ASSERT_TRUE(e);
    if (e->kind == Event::kOutput) seen[e->slot] += e->text;
    if (e->kind == Event::kExited) ++exited;
  }
  EXPECT_EQ(seen[0], "slot 0\n");
  EXPECT_EQ(seen[1], "slot 1\n");
}
