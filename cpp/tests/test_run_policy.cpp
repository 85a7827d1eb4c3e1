// `ddip run`'s failure policy (cpp/tools/run_policy.hpp) as a state machine: what it does to the
// processes (a recording Crew) and what it decides, with time given by the test.
#include <gtest/gtest.h>

#include <csignal>

#include "run_policy.hpp"

using namespace ddip::run;
using std::chrono::milliseconds;

namespace {

const Clock::time_point t0 = Clock::now();

struct RecordingCrew : Crew {
  std::vector<std::string> did;
  std::vector<RootCause> upstream;
  void terminate() override { did.push_back("terminate"); }
  void kill() override { did.push_back("kill"); }
  void forward(int sig) override { did.push_back("forward " + ddip::signal_name(sig)); }
  void report_upstream(const RootCause& cause) override { upstream.push_back(cause); }
  void collect() override {
    did.push_back("collect");
    if (nobody_to_ask) policy->collected(t0);
  }
  // collect() finds no rank to ask: collected() at once, from inside collect().
  bool nobody_to_ask = false;
  FailurePolicy* policy = nullptr;
};

RootCause rank_failed(int rank, int code, int64_t when_ns = 0, bool reported = false) {
  RootCause c;
  c.unit = static_cast<size_t>(rank);
  c.rank = rank;
  c.who = "rank " + std::to_string(rank);
  c.what = "exit code " + std::to_string(code);
  c.code = code;
  c.exit_code = code;
  c.when_ns = when_ns;
  c.reported = reported;
  return c;
}

const milliseconds kGrace(5000);

}  // namespace

TEST(RunPolicy, FirstFailureIsTheRootCauseAndStopsEveryone) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  EXPECT_EQ(p.next_deadline(false), std::nullopt);
  p.failed(rank_failed(1, 3), t0 + milliseconds(100));
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
  EXPECT_TRUE(p.stopping());
  ASSERT_TRUE(p.root());
  EXPECT_EQ(p.root()->rank, 1);
  EXPECT_GT(p.root()->when_ns, 0) << "stamped when seen";
  // The ranks being stopped fail too: not causes, and not stopped twice.
  p.failed(rank_failed(2, 143), t0 + milliseconds(200));
  p.stop(t0 + milliseconds(300));
  EXPECT_EQ(p.root()->rank, 1);
  EXPECT_EQ(crew.did.size(), 1u);
  // SIGKILL after the grace, counted from the failure; not before.
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(100) + kGrace);
  p.tick(t0 + milliseconds(5099), false);
  EXPECT_EQ(crew.did.size(), 1u);
  p.tick(t0 + milliseconds(5100), false);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate", "kill"}));
  EXPECT_EQ(p.next_deadline(false), std::nullopt);
  EXPECT_EQ(p.outcome().exit_code(), 3);
  EXPECT_FALSE(p.outcome().grace_ran_out);
  EXPECT_TRUE(crew.upstream.empty()) << "not a host's ddip run";
}

TEST(RunPolicy, NothingToKillOnceEveryRankHasExited) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  p.failed(rank_failed(0, 1), t0);
  EXPECT_EQ(p.next_deadline(true), std::nullopt);
  p.tick(t0 + kGrace, true);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
}

TEST(RunPolicy, TheEarliestReportedFailureWinsAcrossHosts) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  p.failed(rank_failed(0, 4, 2000), t0);        // here: its peer on another host had died
  p.failed(rank_failed(1, 3, 1000, true), t0);  // that host's report, late but earlier
  EXPECT_EQ(p.root()->rank, 1);
  p.failed(rank_failed(2, 5, 1500, true), t0);  // later than the root cause: ignored
  p.failed(rank_failed(3, 6, 500, false), t0);  // not a report: a rank here being stopped
  EXPECT_EQ(p.root()->rank, 1);
  EXPECT_EQ(p.outcome().exit_code(), 3);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
}

TEST(RunPolicy, AForwardedSignalEscalatesToSigkillAfterTheGrace) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  EXPECT_EQ(p.signalled(SIGINT, t0 + milliseconds(10)), FailurePolicy::Signalled::kForwarded);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"forward SIGINT"}));
  EXPECT_FALSE(p.stopping()) << "a rank failing of it is still a root cause";
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(10) + kGrace);
  p.tick(t0 + milliseconds(5009), false);
  EXPECT_EQ(crew.did.size(), 1u);
  p.tick(t0 + milliseconds(5010), false);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"forward SIGINT", "kill"}));
  EXPECT_TRUE(p.outcome().grace_ran_out);
  // The ranks killed now are stopped by ddip run, not failures.
  p.failed(rank_failed(0, 0), t0 + milliseconds(5020));
  EXPECT_FALSE(p.root());
  EXPECT_EQ(p.outcome().exit_code(), 128 + SIGINT);
}

TEST(RunPolicy, RanksThatActOnTheSignalInTimeAreNotKilled) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  p.signalled(SIGTERM, t0);
  EXPECT_EQ(p.next_deadline(true), std::nullopt);
  p.tick(t0 + kGrace, true);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"forward SIGTERM"}));
  EXPECT_FALSE(p.outcome().grace_ran_out);
  EXPECT_EQ(p.outcome().exit_code(), 128 + SIGTERM);
}

TEST(RunPolicy, AFailureAfterASignalKeepsThatSignalsGraceAndSendsNoSigterm) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  p.signalled(SIGINT, t0);
  p.failed(rank_failed(1, 130), t0 + milliseconds(2000));  // its KeyboardInterrupt handler failed
  EXPECT_EQ(crew.did, (std::vector<std::string>{"forward SIGINT"}));
  EXPECT_EQ(p.root()->rank, 1);
  EXPECT_EQ(p.next_deadline(false), t0 + kGrace) << "not extended by the failure";
  p.tick(t0 + kGrace, false);
  EXPECT_EQ(crew.did.back(), "kill");
  EXPECT_FALSE(p.outcome().grace_ran_out) << "the root cause explains the end";
  EXPECT_EQ(p.outcome().exit_code(), 130);
}

TEST(RunPolicy, ASecondSignalKillsAtOnce) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  p.signalled(SIGINT, t0);
  EXPECT_EQ(p.signalled(SIGINT, t0 + milliseconds(1)), FailurePolicy::Signalled::kKilling);
  EXPECT_EQ(p.signalled(SIGINT, t0 + milliseconds(2)), FailurePolicy::Signalled::kKillingAgain);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"forward SIGINT", "kill", "kill"}));
  EXPECT_EQ(p.next_deadline(false), std::nullopt);
  // Killed by the user's second Ctrl-C: the first rank to die of it is the root cause (137).
  RootCause killed = rank_failed(0, 0);
  killed.signal = SIGKILL;
  killed.code = 137;
  p.failed(killed, t0 + milliseconds(3));
  EXPECT_EQ(p.outcome().exit_code(), 137);
}

TEST(RunPolicy, TimeoutStopsEveryRank) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.timeout_s = 1.5;
  FailurePolicy p(crew, o, t0);
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(1500));
  p.tick(t0 + milliseconds(1499), false);
  EXPECT_TRUE(crew.did.empty());
  p.tick(t0 + milliseconds(1500), false);
  EXPECT_TRUE(p.outcome().timed_out);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(1500) + kGrace);
  p.tick(t0 + milliseconds(6500), false);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate", "kill"}));
  EXPECT_EQ(p.outcome().exit_code(), 124);
}

TEST(RunPolicy, TheTimeoutAsksTheRanksWhereTheyAreBeforeItStopsThem) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.timeout_s = 1.5;
  o.collect = true;
  FailurePolicy p(crew, o, t0);
  p.tick(t0 + milliseconds(1500), false);
  EXPECT_TRUE(p.outcome().timed_out);
  EXPECT_TRUE(p.collecting());
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect"})) << "asked, not stopped yet";
  EXPECT_EQ(p.next_deadline(false), std::nullopt) << "the asking keeps its own deadline";
  p.tick(t0 + milliseconds(9000), false);
  EXPECT_EQ(crew.did.size(), 1u);
  p.collected(t0 + milliseconds(4500));
  EXPECT_FALSE(p.collecting());
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect", "terminate"}));
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(4500) + kGrace) << "the grace starts now";
  p.collected(t0 + milliseconds(4600));  // once only
  EXPECT_EQ(crew.did.size(), 2u);
  EXPECT_EQ(p.outcome().exit_code(), 124);
}

TEST(RunPolicy, WithNobodyToAskTheTimeoutStopsAtOnce) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.timeout_s = 1;
  o.collect = true;
  FailurePolicy p(crew, o, t0);
  crew.policy = &p;
  crew.nobody_to_ask = true;
  p.tick(t0 + milliseconds(1000), false);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect", "terminate"}));
  EXPECT_FALSE(p.collecting());
}

TEST(RunPolicy, CtrlCAsksTheRanksFirstThenForwardsIt) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.collect = true;
  FailurePolicy p(crew, o, t0);
  EXPECT_EQ(p.signalled(SIGINT, t0), FailurePolicy::Signalled::kForwarded);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect"}));
  EXPECT_EQ(p.outcome().first_signal, SIGINT);
  p.collected(t0 + milliseconds(3000));
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect", "forward SIGINT"}));
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(3000) + kGrace);
}

TEST(RunPolicy, ASecondCtrlCWhileTheRanksAreAskedKillsAndForwardsNothing) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.collect = true;
  FailurePolicy p(crew, o, t0);
  p.signalled(SIGINT, t0);
  EXPECT_EQ(p.signalled(SIGINT, t0 + milliseconds(500)), FailurePolicy::Signalled::kKilling);
  p.collected(t0 + milliseconds(600));
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect", "kill"}));
}

TEST(RunPolicy, SigtermAndAStopAreActedOnWithoutAsking) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.collect = true;
  o.timeout_s = 2;
  FailurePolicy p(crew, o, t0);
  p.signalled(SIGTERM, t0);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"forward SIGTERM"}));
  RecordingCrew crew2;
  FailurePolicy q(crew2, o, t0);
  q.failed(rank_failed(1, 3), t0);
  q.tick(t0 + milliseconds(2000), false);  // stopping already: the timeout asks nobody
  EXPECT_EQ(crew2.did, (std::vector<std::string>{"terminate"}));
}

TEST(RunPolicy, AFailureWhileTheRanksAreAskedStopsThemAtOnce) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.collect = true;
  o.timeout_s = 1;
  FailurePolicy p(crew, o, t0);
  p.tick(t0 + milliseconds(1000), false);
  p.failed(rank_failed(0, 1), t0 + milliseconds(1200));
  EXPECT_EQ(crew.did, (std::vector<std::string>{"collect", "terminate"}));
  p.collected(t0 + milliseconds(2000));
  EXPECT_EQ(crew.did.size(), 2u) << "stopped once";
}

TEST(RunPolicy, TheTimeoutStandsStillWhileAPromptWaits) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.timeout_s = 1.5;
  FailurePolicy p(crew, o, t0);
  p.paused(true, t0 + milliseconds(1000));  // 1 s of the job's time, then a prompt
  EXPECT_EQ(p.next_deadline(false), std::nullopt);
  p.tick(t0 + milliseconds(60000), false);
  EXPECT_TRUE(crew.did.empty()) << "a minute at the prompt is not the job's";
  p.paused(true, t0 + milliseconds(70000));  // still the same pause
  p.paused(false, t0 + milliseconds(100000));
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(100500));  // the 0.5 s left
  p.tick(t0 + milliseconds(100499), false);
  EXPECT_TRUE(crew.did.empty());
  p.tick(t0 + milliseconds(100500), false);
  EXPECT_TRUE(p.outcome().timed_out);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
}

TEST(RunPolicy, AHostsLauncherFailingIsNoCauseAfterAForwardedSignal) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  p.signalled(SIGINT, t0);
  RootCause host;
  host.rank = -1;
  host.who = "host node2";
  host.code = 130;
  p.launcher_failed(host, t0);
  EXPECT_FALSE(p.root());
  RecordingCrew crew2;
  FailurePolicy q(crew2, {}, t0);
  host.code = 255;
  q.launcher_failed(host, t0);
  ASSERT_TRUE(q.root());
  EXPECT_EQ(q.root()->who, "host node2");
  EXPECT_EQ(q.outcome().exit_code(), 255);
}

TEST(RunPolicy, OnAHostItReportsTheFirstFailureUpstreamAtOnce) {
  RecordingCrew crew;
  FailurePolicy::Options o;
  o.node = true;
  FailurePolicy p(crew, o, t0);
  p.failed(rank_failed(5, 7, 42), t0);
  p.failed(rank_failed(6, 143), t0);
  ASSERT_EQ(crew.upstream.size(), 1u);
  EXPECT_EQ(crew.upstream[0].rank, 5);
  EXPECT_EQ(crew.upstream[0].when_ns, 42);
}

TEST(RunPolicy, ALostLinkStopsTheRanksAndSaysWhy) {
  RecordingCrew crew;
  FailurePolicy p(crew, {kGrace, 0, true}, t0);
  p.link_lost("it heard nothing for 30 s", t0);
  p.link_lost("its output could not be sent back", t0);  // the first reason stays
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
  EXPECT_EQ(p.outcome().lost, "it heard nothing for 30 s");
  EXPECT_EQ(p.outcome().exit_code(), 1);
}

TEST(RunPolicy, TheChannelClosingWhileStoppingIsNoLoss) {
  RecordingCrew crew;
  FailurePolicy p(crew, {kGrace, 0, true}, t0);
  p.stop(t0);  // Stop from the starting side; its end of file follows
  p.link_closed("its launcher's stdin closed", t0);
  EXPECT_EQ(p.outcome().lost, "");
  EXPECT_EQ(p.outcome().exit_code(), 0);
  RecordingCrew crew2;
  FailurePolicy q(crew2, {kGrace, 0, true}, t0);
  q.link_closed("its launcher's stdin closed", t0);  // out of the blue: the starting side is gone
  EXPECT_EQ(crew2.did, (std::vector<std::string>{"terminate"}));
  EXPECT_EQ(q.outcome().lost, "its launcher's stdin closed");
  EXPECT_EQ(q.outcome().exit_code(), 1);
}

TEST(RunPolicy, KillFromTheStartingSideStopsAndKills) {
  RecordingCrew crew;
  FailurePolicy p(crew, {kGrace, 0, true}, t0);
  p.told_kill(t0);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate", "kill"}));
  p.told_signal(SIGTERM, t0);
  EXPECT_EQ(p.outcome().first_signal, SIGTERM);
  EXPECT_EQ(p.outcome().exit_code(), 128 + SIGTERM);
}

TEST(RunPolicy, ATerminateAbortLetsTheOthersEndOnTheirOwnForTheGrace) {
  RecordingCrew crew;
  FailurePolicy p(crew, {}, t0);
  RootCause c = rank_failed(1, 134);
  c.exit_code = 0;
  c.signal = SIGABRT;
  c.what = "killed by SIGABRT";
  c.tail = {"terminate called without an active exception"};
  p.failed(c, t0 + milliseconds(100));
  EXPECT_TRUE(crew.did.empty()) << "the others may be in their own exit: their ends are evidence";
  EXPECT_FALSE(p.stopping());
  EXPECT_EQ(p.outcome().exit_code(), 134);
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(100) + kGrace);
  EXPECT_EQ(p.next_deadline(true), std::nullopt) << "nothing to wait for once all have ended";
  p.failed(rank_failed(0, 1), t0 + milliseconds(200));
  EXPECT_EQ(p.root()->rank, 1) << "a later failure is no root cause";
  // Still running after the grace: stopped as after any failure, and killed a grace later.
  p.tick(t0 + milliseconds(5099), false);
  EXPECT_TRUE(crew.did.empty());
  p.tick(t0 + milliseconds(5100), false);
  EXPECT_EQ(crew.did, (std::vector<std::string>{"terminate"}));
  EXPECT_TRUE(p.stopping());
  EXPECT_EQ(p.next_deadline(false), t0 + milliseconds(5100) + kGrace);
}
