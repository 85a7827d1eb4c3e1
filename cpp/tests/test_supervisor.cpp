#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <string>
#include <system_error>
#include <thread>

#include "ddip/supervisor.hpp"

using namespace ddip;
using namespace std::chrono_literals;

namespace {

SpawnSpec sh(const std::string& script, std::vector<std::string> env = {}) {
  env.push_back("PATH=/usr/bin:/bin");
  return SpawnSpec{{"/bin/sh", "-c", script}, env, "", true};
}

std::string read_all(Fd& fd) {
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n > 0) {
      out.append(buf, n);
    } else if (n < 0 && errno == EAGAIN) {
      std::this_thread::sleep_for(1ms);  // poll a non-blocking pipe until its writer closes
    } else {
      return out;
    }
  }
}

std::string read_line(Fd& fd) {
  std::string line;
  char c;
  while (true) {
    ssize_t n = ::read(fd.get(), &c, 1);
    if (n == 1 && c == '\n') return line;
    if (n == 1) line += c;
    if (n == 0) return line;
    if (n < 0) std::this_thread::sleep_for(1ms);
  }
}

// Alive and not a zombie (an orphaned zombie waits for whoever is pid 1 here to reap it).
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

}  // namespace

TEST(Supervisor, ReportsExitCode) {
  Supervisor s;
  size_t i = s.spawn(sh("exit 3"));
  auto st = s.wait(i, 10s);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->code, 3);
  EXPECT_EQ(st->signal, 0);
  EXPECT_EQ(st->describe(), "exit code 3");
}

TEST(Supervisor, ReportsSignalWithShellCode) {
  Supervisor s;
  size_t i = s.spawn(sh("exec sleep 100"));
  EXPECT_TRUE(s.running(i));
  s.signal(i, SIGKILL);
  auto st = s.wait(i, 10s);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->signal, SIGKILL);
  EXPECT_EQ(st->shell_code(), 137);
  EXPECT_EQ(st->describe(), "killed by SIGKILL");
}

TEST(Supervisor, PassesEnvironmentAndCapturesBothStreams) {
  Supervisor s;
  size_t i = s.spawn(sh("echo rank=$RANK; echo oops >&2", {"RANK=7"}));
  std::string out = read_all(s.child(i).stdout_pipe());
  std::string err = read_all(s.child(i).stderr_pipe());
  EXPECT_EQ(out, "rank=7\n");
  EXPECT_EQ(err, "oops\n");
  EXPECT_EQ(s.wait(i, 10s)->code, 0);
}

TEST(Supervisor, EachChildLeadsItsOwnProcessGroup) {
  Supervisor s;
  size_t i = s.spawn(sh("exec sleep 100"));
  EXPECT_EQ(::getpgid(s.child(i).pid()), s.child(i).pid());
  EXPECT_NE(::getpgid(s.child(i).pid()), ::getpgrp());
}

TEST(Supervisor, ExecFailureThrowsWithTheReason) {
  Supervisor s;
  try {
    s.spawn(SpawnSpec{{"/nonexistent/ddip-worker"}, {}, "", true});
    FAIL() << "spawn should throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/ddip-worker"), std::string::npos);
  }
  EXPECT_EQ(s.size(), 0u);
}

TEST(Supervisor, StopEscalatesToSigkillAfterTheGrace) {
  Supervisor s;
  size_t stubborn = s.spawn(sh("trap '' TERM; echo ready; while :; do sleep 1; done"));
  size_t polite = s.spawn(sh("exec sleep 100"));
  EXPECT_EQ(read_line(s.child(stubborn).stdout_pipe()), "ready");
  s.stop_all(200ms);
  EXPECT_EQ(s.child(polite).status()->signal, SIGTERM);
  EXPECT_EQ(s.child(stubborn).status()->signal, SIGKILL);
}

TEST(Supervisor, SignalReachesTheWholeGroupAndDeathCleansIt) {
  Supervisor s;
  // The shell starts a grandchild in the same group and reports its pid.
  size_t i = s.spawn(sh("sleep 100 & echo $!; wait"));
  pid_t grandchild = std::stoi(read_line(s.child(i).stdout_pipe()));
  EXPECT_TRUE(alive(grandchild));
  s.signal(i, SIGKILL, /*whole_group=*/false);
  s.wait(i, 10s);
  // Reaping the leader also killed what it left in its group.
  for (int k = 0; k < 1000 && alive(grandchild); ++k) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(alive(grandchild));
}

TEST(Supervisor, ChildDiesWithTheThreadThatSpawnedIt) {
  // PR_SET_PDEATHSIG fires when the spawning *thread* ends; the Coordinator spawns from its IO
  // thread, which lives exactly as long as the group.
  Supervisor s;
  std::thread t([&] { s.spawn(sh("exec sleep 100")); });
  t.join();
  auto st = s.wait(0, 10s);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->signal, SIGKILL);
}

TEST(Supervisor, DestructorLeavesNoChildRunning) {
  pid_t pid;
  {
    Supervisor s;
    pid = s.child(s.spawn(sh("exec sleep 100"))).pid();
  }
  EXPECT_FALSE(alive(pid));
}
