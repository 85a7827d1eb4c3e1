// What `ddip run` says at its end (cpp/tools/run_report.hpp), word for word: docs/run.md shows
// these summaries, and tests/test_run.py and test_multihost.py match them in real runs.
#include <gtest/gtest.h>

#include <csignal>

#include "run_report.hpp"

using namespace ddip::run;

namespace {

UnitEnd rank(int r, std::optional<ddip::ExitStatus> status, bool stopped = false) {
  UnitEnd e;
  e.first_rank = r;
  e.status = status;
  e.stopped = stopped;
  return e;
}

UnitEnd host(const std::string& name, int first, int n, std::optional<ddip::ExitStatus> status,
             std::vector<ddip::run::protocol::RankEnd> ranks = {}) {
  UnitEnd e;
  e.host = true;
  e.name = name;
  e.first_rank = first;
  e.nranks = n;
  e.status = status;
  e.ranks = std::move(ranks);
  return e;
}

ddip::ExitStatus exited(int code) { return {code, 0, false}; }
ddip::ExitStatus killed(int sig) { return {0, sig, false}; }

}  // namespace

TEST(RunReport, RankEnds) {
  EXPECT_EQ(rank_end(std::nullopt, false), "still running");
  EXPECT_EQ(rank_end(exited(0), false), "exit code 0");
  EXPECT_EQ(rank_end(killed(SIGTERM), true), "killed by SIGTERM (stopped by ddip run)");
}

TEST(RunReport, ARanksFailure) {
  Outcome o;
  RootCause c;
  c.unit = 1;
  c.rank = 1;
  c.who = "rank 1";
  c.what = "exit code 3";
  c.code = 3;
  c.tail = {"Traceback (most recent call last):", "ValueError: bad batch"};
  o.root = c;
  std::vector<UnitEnd> units = {rank(0, killed(SIGTERM), true), rank(1, exited(3)), rank(2, std::nullopt)};
  EXPECT_EQ(summary(o, units),
            "ddip run: rank 1 failed first: exit code 3\n"
            "last lines of its stderr:\n"
            "  | Traceback (most recent call last):\n"
            "  | ValueError: bad batch\n"
            "other ranks:\n"
            "  rank 0: killed by SIGTERM (stopped by ddip run)\n"
            "  rank 2: still running\n"
            "ddip run: exit code 3\n");
  EXPECT_EQ(o.exit_code(), 3);
}

TEST(RunReport, AFailureOnAnotherHostAfterASignal) {
  Outcome o;
  o.first_signal = SIGINT;
  RootCause c;
  c.unit = 1;
  c.rank = 3;
  c.who = "rank 3 (on node2)";
  c.what = "exit code 1";
  c.code = 1;
  c.reported = true;
  o.root = c;
  std::vector<UnitEnd> units = {
      rank(0, exited(0)),
      host("node2", 1, 3, exited(1), {{1, "exit code 0"}, {2, "killed by SIGKILL (stopped by ddip run)"}, {3, "exit code 1"}}),
      host("node3", 4, 2, killed(SIGKILL)),  // ended without telling its ranks' ends
      host("node4", 6, 1, std::nullopt)};
  EXPECT_EQ(summary(o, units),
            "ddip run: rank 3 (on node2) failed first: exit code 1 (after ddip run forwarded SIGINT)\n"
            "other ranks:\n"
            "  rank 0: exit code 0\n"
            "  rank 1 (on node2): exit code 0\n"
            "  rank 2 (on node2): killed by SIGKILL (stopped by ddip run)\n"
            "  ranks 4-5 (on node3): unknown; its launcher ended with killed by SIGKILL\n"
            "  rank 6 (on node4): still running\n"
            "ddip run: exit code 1\n");
}

TEST(RunReport, AHostThatFailedBeforeItsRanks) {
  Outcome o;
  RootCause c;
  c.unit = 1;
  c.who = "host node7";
  c.what = "its launcher (or ddip run there) ended with exit code 255 before any of its ranks reported a failure";
  c.code = 255;
  c.tail = {"ssh: connect to host node7 port 22: No route to host"};
  o.root = c;
  std::vector<UnitEnd> units = {rank(0, killed(SIGTERM), true), host("node7", 1, 2, exited(255))};
  EXPECT_EQ(summary(o, units),
            "ddip run: host node7 failed first: its launcher (or ddip run there) ended with exit code 255 "
            "before any of its ranks reported a failure\n"
            "last lines of its stderr:\n"
            "  | ssh: connect to host node7 port 22: No route to host\n"
            "other ranks:\n"
            "  rank 0: killed by SIGTERM (stopped by ddip run)\n"
            "ddip run: exit code 255\n");
}

TEST(RunReport, TimeoutAndSignals) {
  std::vector<UnitEnd> units = {rank(0, killed(SIGTERM), true), rank(1, killed(SIGKILL), true)};
  Outcome t;
  t.timed_out = true;
  t.timeout_s = 1.5;
  EXPECT_EQ(summary(t, units),
            "ddip run: timed out after 1.5 s; ranks:\n"
            "  rank 0: killed by SIGTERM (stopped by ddip run)\n"
            "  rank 1: killed by SIGKILL (stopped by ddip run)\n"
            "ddip run: exit code 124\n");
  Outcome s;
  s.first_signal = SIGTERM;
  s.grace_ran_out = true;
  EXPECT_EQ(summary(s, units),
            "ddip run: forwarded SIGTERM to every rank, then SIGKILL to those still running after 5 s; ranks:\n"
            "  rank 0: killed by SIGTERM (stopped by ddip run)\n"
            "  rank 1: killed by SIGKILL (stopped by ddip run)\n"
            "ddip run: exit code 143\n");
  s.grace_ran_out = false;
  EXPECT_EQ(summary(s, {rank(0, exited(0))}),
            "ddip run: forwarded SIGTERM to every rank; ranks:\n"
            "  rank 0: exit code 0\n"
            "ddip run: exit code 143\n");
}

TEST(RunReport, NothingToSayWhenEveryRankExitedZero) {
  Outcome o;
  EXPECT_EQ(summary(o, {rank(0, exited(0)), rank(1, exited(0))}), "");
  EXPECT_EQ(o.exit_code(), 0);
  o.lost = "its launcher's stdin closed";
  EXPECT_EQ(o.exit_code(), 1);
}

TEST(RunReport, NodeDoneListsEveryRanksEnd) {
  auto done = node_done({rank(4, exited(0)), rank(5, killed(SIGTERM), true), rank(6, std::nullopt)});
  EXPECT_EQ(done, (protocol::NodeDone{{{4, "exit code 0"},
                                       {5, "killed by SIGTERM (stopped by ddip run)"},
                                       {6, "still running"}}}));
}
