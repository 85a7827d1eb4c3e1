// What `ddip run` says at its end (cpp/tools/run_report.hpp), word for word: docs/run.md shows
// these summaries, and tests/test_run.py and test_multihost.py match them in real runs.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include "run_report.hpp"

using namespace ddip::run;

namespace {

UnitEnd rank(int r, std::optional<ddip::ExitStatus> status, bool stopped = false) {
  UnitEnd e;
  e.first_rank = r;
  e.status = status;
  e.stopped = stopped;
  if (stopped) e.at_stop.signal = SIGTERM;
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
  std::vector<UnitEnd> units = {rank(0, killed(SIGTERM), true), rank(1, exited(3)),
                                rank(2, std::nullopt)};
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
      host(
          "node2", 1, 3, exited(1),
          {{1, "exit code 0"}, {2, "killed by SIGKILL (stopped by ddip run)"}, {3, "exit code 1"}}),
      host("node3", 4, 2, killed(SIGKILL)),  // ended without telling its ranks' ends
      host("node4", 6, 1, std::nullopt)};
  EXPECT_EQ(
      summary(o, units),
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
  c.what =
      "its launcher (or ddip run there) ended with exit code 255 before any of its ranks reported "
      "a failure";
  c.code = 255;
  c.tail = {"ssh: connect to host node7 port 22: No route to host"};
  o.root = c;
  std::vector<UnitEnd> units = {rank(0, killed(SIGTERM), true), host("node7", 1, 2, exited(255))};
  EXPECT_EQ(summary(o, units),
            "ddip run: host node7 failed first: its launcher (or ddip run there) ended with exit "
            "code 255 "
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
            "ddip run: forwarded SIGTERM to every rank, then SIGKILL to those still running after "
            "5 s; ranks:\n"
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
  auto done =
      node_done({rank(4, exited(0)), rank(5, killed(SIGTERM), true), rank(6, std::nullopt)});
  EXPECT_EQ(done, (protocol::NodeDone{{{4, "exit code 0"},
                                       {5, "killed by SIGTERM (stopped by ddip run)"},
                                       {6, "still running"}}}));
}

namespace {

RootCause aborted(int r, std::vector<std::string> tail, int signal = SIGABRT, int exit_code = 0) {
  RootCause c;
  c.unit = static_cast<size_t>(r);
  c.rank = r;
  c.who = "rank " + std::to_string(r);
  c.what = signal ? "killed by SIGABRT" : "exit code " + std::to_string(exit_code);
  c.code = signal ? 128 + signal : exit_code;
  c.signal = signal;
  c.exit_code = exit_code;
  c.tail = std::move(tail);
  return c;
}

const char* const kTerminate = "terminate called without an active exception";

}  // namespace

TEST(RunReport, TerminateAbortIsSigabrtWithTheRuntimesLastWords) {
  EXPECT_TRUE(terminate_abort(aborted(1, {"RESULT 3", kTerminate})));
  EXPECT_TRUE(terminate_abort(aborted(1, {kTerminate, ""}))) << "a blank line after it";
  EXPECT_TRUE(terminate_abort(aborted(1, {kTerminate}, 0, 134))) << "SIGABRT through a shell";
  EXPECT_FALSE(terminate_abort(aborted(1, {kTerminate, "Fatal Python error: Aborted"})));
  EXPECT_FALSE(
      terminate_abort(aborted(1, {"terminate called after throwing an instance of 'c10::Error'"})));
  EXPECT_FALSE(terminate_abort(aborted(1, {kTerminate}, SIGSEGV)));
  EXPECT_FALSE(terminate_abort(aborted(1, {kTerminate}, 0, 1)));
  EXPECT_FALSE(terminate_abort(aborted(1, {})));
  RootCause host = aborted(1, {kTerminate});
  host.rank = -1;
  EXPECT_FALSE(terminate_abort(host)) << "a host's launcher is no rank";
}

TEST(RunReport, ARankThatDiedInTorchsExitAfterEveryOtherRankFinished) {
  Outcome o;
  o.root = aborted(1, {kTerminate});
  std::vector<UnitEnd> units = {rank(0, exited(0)), rank(1, killed(SIGABRT)), rank(2, exited(0))};
  EXPECT_EQ(summary(o, units),
            "ddip run: rank 1 failed first: killed by SIGABRT\n"
            "last lines of its stderr:\n"
            "  | terminate called without an active exception\n"
            "other ranks:\n"
            "  rank 0: exit code 0\n"
            "  rank 2: exit code 0\n"
            "ddip run: rank 1 died in torch's exit after its work was done: every other rank "
            "exited 0, and it aborted as Python shut down while one of torch's threads (gloo's, "
            "say) still held its tensors. End the script with "
            "torch.distributed.destroy_process_group() after its last collective (accelerate: "
            "accelerator.end_training()); see docs/run.md.\n"
            "ddip run: exit code 134\n");
  EXPECT_EQ(o.exit_code(), 134) << "still a failure";
  // Across hosts: the host's account of its ranks is the evidence.
  RootCause remote = aborted(2, {kTerminate});
  remote.unit = 1;
  remote.who = "rank 2 (on node2)";
  remote.reported = true;
  o.root = remote;
  EXPECT_NE(summary(o, {rank(0, exited(0)), host("node2", 1, 2, exited(134),
                                                 {{1, "exit code 0"}, {2, "killed by SIGABRT"}})})
                .find("rank 2 (on node2) died in torch's exit"),
            std::string::npos);
}

TEST(RunReport, NoClaimOfFinishedWorkWithoutEvidence) {
  const std::string claim = "died in torch's exit";
  Outcome o;
  o.root = aborted(1, {kTerminate});
  // A peer that failed, was stopped, or is still running: the abort may have been mid-run.
  EXPECT_EQ(summary(o, {rank(0, exited(1)), rank(1, killed(SIGABRT))}).find(claim),
            std::string::npos);
  EXPECT_EQ(summary(o, {rank(0, killed(SIGTERM), true), rank(1, killed(SIGABRT))}).find(claim),
            std::string::npos);
  EXPECT_EQ(summary(o, {rank(0, std::nullopt), rank(1, killed(SIGABRT))}).find(claim),
            std::string::npos);
  EXPECT_EQ(summary(o, {rank(0, killed(SIGABRT)), rank(1, killed(SIGABRT))}).find(claim),
            std::string::npos);
  // A host that did not say how its ranks ended.
  EXPECT_EQ(
      summary(o, {host("node2", 0, 1, killed(SIGKILL)), rank(1, killed(SIGABRT))}).find(claim),
      std::string::npos);
  // Another line after the runtime's: some other abort.
  o.root = aborted(1, {kTerminate, "Fatal Python error: Aborted"});
  EXPECT_EQ(summary(o, {rank(0, exited(0)), rank(1, killed(SIGABRT))}).find(claim),
            std::string::npos);
  // Timed out, or after a forwarded signal: not a run that ended on its own.
  o.root = aborted(1, {kTerminate});
  o.timed_out = true;
  EXPECT_EQ(summary(o, {rank(0, exited(0)), rank(1, killed(SIGABRT))}).find(claim),
            std::string::npos);
}

namespace {

UnitEnd stopped_rank(int r, ddip::ExitStatus status, AtStop at) {
  UnitEnd e = rank(r, status, true);
  e.at_stop = at;
  return e;
}

}  // namespace

TEST(RunReport, OnlyRanksThatDdipRunsStopEndedAreStoppedByIt) {
  const AtStop plain{SIGTERM, false, false}, handles{SIGTERM, false, true},
      exiting{SIGTERM, true, false}, kill_only{SIGKILL, false, false};
  // Ended as the signal ends a process: stopped.
  EXPECT_TRUE(ended_by_stop(stopped_rank(0, killed(SIGTERM), plain)));
  EXPECT_TRUE(ended_by_stop(stopped_rank(0, killed(SIGKILL), plain)))
      << "the SIGKILL after the grace";
  EXPECT_TRUE(ended_by_stop(stopped_rank(0, killed(SIGKILL), kill_only)));
  // Its own handler ended it (a checkpoint, then exit 1): stopped.
  EXPECT_TRUE(ended_by_stop(stopped_rank(0, exited(1), handles)));
  // SIGTERM would have killed it, yet it exited with a code: it was failing by itself (the
  // issue's `exit code 1 (stopped by ddip run)`: a rank in its own exit, not yet a zombie).
  EXPECT_FALSE(ended_by_stop(stopped_rank(0, exited(1), plain)));
  EXPECT_FALSE(ended_by_stop(stopped_rank(0, exited(0), plain)));
  EXPECT_FALSE(ended_by_stop(stopped_rank(0, exited(1), kill_only))) << "SIGKILL can't be handled";
  // Already exiting when the signal went: whatever it ends with is its own.
  EXPECT_FALSE(ended_by_stop(stopped_rank(0, exited(1), exiting)));
  EXPECT_FALSE(ended_by_stop(stopped_rank(0, killed(SIGABRT), exiting)));
  // Killed by something else than ddip run's signals.
  EXPECT_FALSE(ended_by_stop(stopped_rank(0, killed(SIGSEGV), plain)));
  EXPECT_FALSE(ended_by_stop(rank(0, exited(1)))) << "never signalled";

  // In the report: a peer that failed by itself in the same moment as the root cause says so;
  // the one ddip run stopped says that.
  Outcome o;
  RootCause c;
  c.unit = 0;
  c.rank = 0;
  c.who = "rank 0";
  c.what = "exit code 1";
  o.root = c;
  std::vector<UnitEnd> units = {rank(0, exited(1)), stopped_rank(1, exited(1), plain),
                                stopped_rank(2, killed(SIGTERM), plain)};
  EXPECT_EQ(other_ranks(units, o.root),
            "  rank 1: exit code 1\n"
            "  rank 2: killed by SIGTERM (stopped by ddip run)\n");
  EXPECT_EQ(node_done(units).ranks[1].what, "exit code 1");
}

namespace {

// A child that has done `setup` and then waits, told so through a pipe.
pid_t child_that(void (*setup)()) {
  int p[2];
  if (::pipe(p) != 0) return -1;
  pid_t pid = ::fork();
  if (pid == 0) {
    setup();
    char c = 'x';
    if (::write(p[1], &c, 1) != 1) ::_exit(2);
    for (;;) ::pause();
  }
  ::close(p[1]);
  char c = 0;
  EXPECT_EQ(::read(p[0], &c, 1), 1);
  ::close(p[0]);
  return pid;
}

void reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

}  // namespace

TEST(RunReport, StanceIsReadFromProc) {
  pid_t plain = child_that([] {});
  AtStop at = stance(plain, SIGTERM);
  EXPECT_EQ(at.signal, SIGTERM);
  EXPECT_FALSE(at.exiting);
  EXPECT_FALSE(at.handles);
  reap(plain);

  pid_t catches = child_that([] { ::signal(SIGTERM, [](int) {}); });
  EXPECT_TRUE(stance(catches, SIGTERM).handles);
  EXPECT_FALSE(stance(catches, SIGINT).handles) << "only the signal asked about";
  reap(catches);

  pid_t blocks = child_that([] {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGTERM);
    ::sigprocmask(SIG_BLOCK, &s, nullptr);
  });
  EXPECT_TRUE(stance(blocks, SIGTERM).handles);
  reap(blocks);

  // Exited, not yet reaped: exiting (the kernel's PF_EXITING is set from the start of its exit).
  pid_t gone = ::fork();
  if (gone == 0) ::_exit(1);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(gone), &info, WEXITED | WNOWAIT), 0);
  EXPECT_TRUE(stance(gone, SIGTERM).exiting);
  ::waitpid(gone, nullptr, 0);
}

TEST(RunReport, TheRootCausesErrorFileReplacesItsStderrTail) {
  Outcome o;
  RootCause c;
  c.unit = 1;
  c.rank = 1;
  c.who = "rank 1";
  c.what = "exit code 1";
  c.tail = {"[rank1]: ValueError: bad batch"};
  c.error = R"({"message": {"message": "ValueError: bad batch", "extraInfo": {"py_callstack": )"
            R"("Traceback (most recent call last):\n  File \"train.py\", line 9, in main\n)"
            R"(    raise ValueError(\"bad batch\")\nValueError: bad batch\n", )"
            R"("timestamp": "1700000000"}}})";
  o.root = c;
  std::vector<UnitEnd> units = {rank(0, killed(SIGTERM), true), rank(1, exited(1))};
  EXPECT_EQ(summary(o, units),
            "ddip run: rank 1 failed first: exit code 1\n"
            "its error file (TORCHELASTIC_ERROR_FILE, written by torch's @record) says: "
            "ValueError: bad batch\n"
            "  | Traceback (most recent call last):\n"
            "  |   File \"train.py\", line 9, in main\n"
            "  |     raise ValueError(\"bad batch\")\n"
            "  | ValueError: bad batch\n"
            "other ranks:\n"
            "  rank 0: killed by SIGTERM (stopped by ddip run)\n"
            "ddip run: exit code 1\n");
  // A file that is not torch's: the stderr tail, as without one.
  o.root->error = "{not json";
  EXPECT_NE(
      summary(o, units).find("last lines of its stderr:\n  | [rank1]: ValueError: bad batch\n"),
      std::string::npos);
}
