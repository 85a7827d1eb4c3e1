// AgentKeeper with /bin/sh launchers playing standing agents: each reads ticket lines on its
// stdin and appends them to a file (what a HostAgent would serve), and exits at end of file.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ddip/keeper.hpp"
#include "helpers.hpp"

using namespace ddip;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

template <typename F>
bool eventually(F&& f, std::chrono::milliseconds limit = 10s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return f();
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Dir {
  fs::path path;
  Dir() {
    path = fs::temp_directory_path() /
           ("ddip-test-keeper-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
  static inline int counter = 0;
};

// An "agent" that appends each ticket to DIR/tickets, says so on stderr, and exits on EOF.
SpawnSpec agent(const Dir& d, std::vector<std::string> env = {}) {
  return test::sh("echo started >&2; while read line; do echo \"$line\" >> " +
                      (d.path / "tickets").string() + "; echo \"got $line\" >&2; done; exit 3",
                  std::move(env));
}

}  // namespace

TEST(AgentKeeper, ALaterGroupGetsTheSameAgentAndItsNextTicket) {
  Dir d;
  AgentKeeper keeper(2000ms);
  pid_t first;
  {
    auto lease = keeper.lease(agent(d), [] {});
    EXPECT_FALSE(lease->reused());
    first = lease->pid();
    lease->send("ticket-1\n");
    ASSERT_TRUE(eventually([&] { return slurp(d.path / "tickets") == "ticket-1\n"; }));
    EXPECT_TRUE(eventually([&] { return lease->tail() == "started\ngot ticket-1"; }))
        << lease->tail();
  }
  // Returned: still running, idle, and the next lease of the same command gets it.
  EXPECT_TRUE(alive(first));
  EXPECT_EQ(keeper.launchers(), std::vector<pid_t>{first});
  auto again = keeper.lease(agent(d), [] {});
  EXPECT_TRUE(again->reused());
  EXPECT_EQ(again->pid(), first);
  EXPECT_EQ(again->tail(), "");  // what it printed for the earlier group is not this one's
  again->send("ticket-2\n");
  ASSERT_TRUE(eventually([&] { return slurp(d.path / "tickets") == "ticket-1\nticket-2\n"; }));
  // A second group at the same time on the same host gets an agent of its own.
  auto other = keeper.lease(agent(d), [] {});
  EXPECT_FALSE(other->reused());
  EXPECT_NE(other->pid(), first);
}

TEST(AgentKeeper, ARetiredLeaseEndsItsAgentAndReportsItsExitAndLastLines) {
  Dir d;
  AgentKeeper keeper(2000ms);
  std::atomic<int> exits{0};
  auto lease = keeper.lease(agent(d), [&] { ++exits; });
  pid_t pid = lease->pid();
  lease->send("only\n");
  ASSERT_TRUE(eventually([&] { return slurp(d.path / "tickets") == "only\n"; }));
  EXPECT_FALSE(lease->exit_status());
  lease->retire();  // end of file on its stdin
  ASSERT_TRUE(eventually([&] { return exits.load() == 1; }));
  ASSERT_TRUE(lease->exit_status());
  EXPECT_EQ(lease->exit_status()->describe(), "exit code 3");
  EXPECT_EQ(lease->tail(), "started\ngot only");
  EXPECT_FALSE(alive(pid));
  lease.reset();
  EXPECT_TRUE(keeper.launchers().empty());
  // Never handed out again: the next lease starts a new one.
  auto next = keeper.lease(agent(d), [] {});
  EXPECT_FALSE(next->reused());
}

TEST(AgentKeeper, ALauncherThatFailsReportsItsExitToItsGroup) {
  AgentKeeper keeper(2000ms);
  std::atomic<int> exits{0};
  auto lease =
      keeper.lease(test::sh("echo 'ssh: connect to host far port 22: Connection refused' >&2; "
                            "exit 255"),
                   [&] { ++exits; });
  ASSERT_TRUE(eventually([&] { return exits.load() == 1; }));
  EXPECT_EQ(lease->exit_status()->describe(), "exit code 255");
  EXPECT_EQ(lease->tail(), "ssh: connect to host far port 22: Connection refused");
  EXPECT_THROW(keeper.lease(SpawnSpec{{"/nonexistent/launcher"}, {}, "", true}, [] {}),
               std::system_error);
}

TEST(AgentKeeper, AnotherEnvironmentLetsTheIdleAgentGoForANewOne) {
  Dir d;
  AgentKeeper keeper(2000ms);
  pid_t first = keeper.lease(agent(d, {"X=1"}), [] {})->pid();
  auto lease = keeper.lease(agent(d, {"X=2"}), [] {});
  EXPECT_FALSE(lease->reused());
  EXPECT_TRUE(eventually([&] { return !alive(first); }));
  EXPECT_EQ(keeper.launchers(), std::vector<pid_t>{lease->pid()});
}

TEST(AgentKeeper, ReleaseLetsIdleAgentsGoNowAndBusyOnesWhenTheirGroupEnds) {
  Dir d;
  AgentKeeper keeper(2000ms);
  auto a = keeper.lease(agent(d), [] {});
  auto b = keeper.lease(agent(d), [] {});
  pid_t idle = a->pid(), busy = b->pid();
  a.reset();  // idle
  EXPECT_EQ(keeper.release(5000ms), 1u);
  EXPECT_FALSE(alive(idle));
  EXPECT_TRUE(alive(busy));
  EXPECT_FALSE(b->retired());
  b.reset();  // its group ended: let go now
  EXPECT_TRUE(eventually([&] { return !alive(busy) && keeper.launchers().empty(); }));
}

TEST(AgentKeeper, AnAgentThatIgnoresEndOfFileIsKilledAfterTheGrace) {
  AgentKeeper keeper(300ms);
  auto lease = keeper.lease(test::sh("trap '' TERM; exec sleep 60 < /dev/null"), [] {});
  pid_t pid = lease->pid();
  lease->retire();
  ASSERT_TRUE(eventually([&] { return lease->exit_status().has_value(); }));
  EXPECT_EQ(lease->exit_status()->describe(), "killed by SIGKILL");
  EXPECT_FALSE(alive(pid));
}

TEST(AgentKeeper, ItsEndLetsEveryAgentGo) {
  Dir d;
  std::vector<pid_t> pids;
  {
    AgentKeeper keeper(500ms);
    pids.push_back(keeper.lease(agent(d), [] {})->pid());
    pids.push_back(keeper.lease(test::sh("exec sleep 60 < /dev/null"), [] {})->pid());
  }
  for (pid_t p : pids) EXPECT_FALSE(alive(p));
}
