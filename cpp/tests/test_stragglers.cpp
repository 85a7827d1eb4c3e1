#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddip/stragglers.hpp"

using ddip::Stragglers;

namespace {

constexpr long long kMs = 1'000'000;
constexpr long long kStart = 1'795'000'000'000'000'000;  // a wall-clock time, as the recorder's

// One "entered" record as python/ddip/rank/collectives.py's snapshot() writes it.
struct In {
  long long seq;
  long long ns;
  std::string pg = "0";
  long long gen = 0;
  std::string op = "all_reduce";

  std::string json() const {
    return R"([")" + pg + R"(", )" + std::to_string(gen) + ", " + std::to_string(seq) + R"(, ")" +
           op + R"(", )" + std::to_string(ns) + "]";
  }
};

std::string snapshot(
    int rank, const std::vector<In>& entered,
    const std::string& groups = R"({"0": {"ranks": [0, 1, 2, 3], "issued": null}})") {
  std::string list;
  for (const In& e : entered) list += (list.empty() ? "" : ", ") + e.json();
  return R"({"rank": )" + std::to_string(rank) +
         R"(, "world": 4, "now_ns": 0, "entries": [], "groups": )" + groups + R"(, "entered": [)" +
         list + "]}";
}

// `world` ranks that run `steps` collectives of the default group, a step every `period_ms`;
// delay(rank, step) says how late into the step each rank enters its collective.
template <class Delay>
std::map<int, std::string> steps(int world, int steps, long long period_ms, Delay delay) {
  std::string ranks;
  for (int r = 0; r < world; ++r) ranks += (r ? ", " : "") + std::to_string(r);
  std::string groups =
      R"({"0": {"ranks": [)" + ranks + R"(], "issued": )" + std::to_string(steps) + "}}";
  std::map<int, std::string> out;
  for (int r = 0; r < world; ++r) {
    std::vector<In> entered;
    for (int s = 0; s < steps; ++s)
      entered.push_back(In{s + 1, kStart + s * period_ms * kMs + delay(r, s) * kMs});
    out[r] = snapshot(r, entered, groups);
  }
  return out;
}

}  // namespace

TEST(Stragglers, NamesTheRankTheOthersWaitFor) {
  // Ranks 0-2 enter each step's all_reduce at once; rank 3 200 ms later; a step is 250 ms.
  Stragglers s(steps(4, 10, 250, [](int r, int) { return r == 3 ? 200 : 0; }), 50);
  ASSERT_EQ(s.straggler(), 3);
  EXPECT_EQ(s.window(), 10);
  EXPECT_NEAR(s.held_s().at(3), 10 * 3 * 0.2, 1e-9);  // 10 steps, 3 ranks waiting 200 ms each
  EXPECT_EQ(s.held_s().at(0), 0);
  EXPECT_EQ(s.last_in().at(3), 10);
  EXPECT_EQ(s.last_in().at(0), 0);
  // From the first entry of step 1 to rank 3's entry into step 10.
  EXPECT_NEAR(s.span_s(), 9 * 0.25 + 0.2, 1e-9);
  EXPECT_EQ(s.start_ns(), kStart);
  EXPECT_NEAR(s.share().at(3), 10 * 0.2 / (9 * 0.25 + 0.2), 1e-9);  // 82%
  EXPECT_EQ(s.headline(),
            "rank 3 is the straggler: the others waited for it 82% of the time of the last 10 "
            "collectives (2.00 s of 2.45 s each, on average)");
  EXPECT_EQ(s.describe(), s.headline() +
                              "\n  rank 0: the others waited 0.00 s for it (0% of their time); it "
                              "entered 0 of 10 collectives last"
                              "\n  rank 1: the others waited 0.00 s for it (0% of their time); it "
                              "entered 0 of 10 collectives last"
                              "\n  rank 2: the others waited 0.00 s for it (0% of their time); it "
                              "entered 0 of 10 collectives last"
                              "\n  rank 3: the others waited 6.00 s for it (82% of their time); "
                              "it entered 10 of 10 collectives last");
}

TEST(Stragglers, TimelineSaysWhoEachCollectiveWaitedFor) {
  // Rank 1 is 30 ms late into step 1, rank 0 10 ms late into step 2.
  Stragglers s(
      steps(2, 2, 100,
            [](int r, int step) { return step == 0 ? (r == 1 ? 30 : 0) : (r == 0 ? 10 : 0); }),
      5);
  ASSERT_EQ(s.timeline().size(), 2u);
  EXPECT_EQ(s.timeline()[0].last, 1);
  EXPECT_EQ(s.timeline()[0].seq, 1);
  EXPECT_EQ(s.timeline()[0].op, "all_reduce");
  EXPECT_EQ(s.timeline()[0].pg, "0");
  EXPECT_NEAR(s.timeline()[0].at_s, 0.030, 1e-9);
  EXPECT_NEAR(s.timeline()[0].wait_s, 0.030, 1e-9);
  EXPECT_EQ(s.timeline()[1].last, 0);
  EXPECT_NEAR(s.timeline()[1].at_s, 0.110, 1e-9);
  EXPECT_NEAR(s.timeline()[1].wait_s, 0.010, 1e-9);
  EXPECT_NEAR(s.held_s().at(1), 0.030, 1e-9);
  EXPECT_NEAR(s.held_s().at(0), 0.010, 1e-9);
  // 30 ms of 110 ms, three times rank 0's 10 ms; but two collectives are one slow start, maybe.
  EXPECT_EQ(s.straggler(), std::nullopt);
  EXPECT_EQ(s.headline(),
            "no straggler named: it takes 3 collectives to tell one, and the window holds 2 "
            "collectives (the most: rank 1, 27% of the others' time)");
}

TEST(Stragglers, NamesARankOverThreeCollectivesOrMore) {
  auto late = [](int r, int) { return r == 1 ? 30 : 0; };
  EXPECT_EQ(Stragglers(steps(2, 2, 100, late), 50).straggler(), std::nullopt);
  EXPECT_EQ(Stragglers(steps(2, 3, 100, late), 50).straggler(), 1);
  EXPECT_EQ(Stragglers(steps(2, 3, 100, late), 2).straggler(), std::nullopt);
}

TEST(Stragglers, OverlappingCollectivesCountARanksTimeOnce) {
  // Asynchronous all_reduces (DDP's buckets): rank 0 issues #1 at 0 and #2 at 10 ms, then waits;
  // rank 1 issues them at 100 and 110 ms. Rank 0 waited from 0 to 110 ms: 110 ms, not 200.
  std::string groups = R"({"0": {"ranks": [0, 1], "issued": 2}})";
  Stragglers s({{0, snapshot(0, {In{1, kStart}, In{2, kStart + 10 * kMs}}, groups)},
                {1, snapshot(1, {In{1, kStart + 100 * kMs}, In{2, kStart + 110 * kMs}}, groups)}},
               50);
  ASSERT_EQ(s.window(), 2);
  EXPECT_NEAR(s.timeline()[0].wait_s, 0.100, 1e-9);
  EXPECT_NEAR(s.timeline()[1].wait_s, 0.010, 1e-9);
  EXPECT_NEAR(s.held_s().at(1), 0.110, 1e-9);
  EXPECT_NEAR(s.share().at(1), 1.0, 1e-9);  // never more than all of the others' time
}

TEST(Stragglers, WaitIsSummedOverEveryRankThatWaited) {
  // Rank 0 enters at 0, rank 1 at 40 ms, rank 2 at 100 ms: 100 + 60 ms of waiting for rank 2.
  std::map<int, long long> at = {{0, 0}, {1, 40}, {2, 100}};
  Stragglers s(steps(3, 1, 1000, [&](int r, int) { return at[r]; }), 50);
  EXPECT_NEAR(s.held_s().at(2), 0.160, 1e-9);
  EXPECT_EQ(s.held_s().at(1), 0);
  EXPECT_NEAR(s.span_s(), 0.100, 1e-9);
  EXPECT_NEAR(s.share().at(2), 0.160 / (2 * 0.100), 1e-9);  // of 2 others' 100 ms each
}

TEST(Stragglers, NamesNoneWhereRanksTakeTurnsBeingLast) {
  // Each rank in turn is 200 ms late: the others wait as long for every rank.
  Stragglers s(steps(4, 8, 250, [](int r, int step) { return step % 4 == r ? 200 : 0; }), 50);
  EXPECT_EQ(s.straggler(), std::nullopt);
  EXPECT_NEAR(s.held_s().at(0), s.held_s().at(3), 1e-9);
  EXPECT_EQ(s.headline().rfind("no straggler in the last 8 collectives: no rank held the others up "
                               "for 10% of their time and twice as long as any other (the most: "
                               "rank 0, ",
                               0),
            0u)
      << s.headline();
}

TEST(Stragglers, NamesNoneWhoseLeadIsUnderTwice) {
  // Rank 2 holds the others up for 150 ms a step, rank 1 for 100 ms: both are slow, 1.5 x apart.
  Stragglers s(
      steps(3, 6, 500,
            [](int r, int step) { return r == (step % 2 ? 1 : 2) ? (step % 2 ? 100 : 150) : 0; }),
      50);
  EXPECT_GT(s.share().at(2), Stragglers::kMinShare);
  EXPECT_EQ(s.straggler(), std::nullopt);
}

TEST(Stragglers, NamesNoneBelowTheMinimumShare) {
  // Rank 3 is always last, by 5 ms of 100 ms steps: jitter, not a straggler.
  Stragglers s(steps(4, 20, 100, [](int r, int) { return r == 3 ? 5 : 0; }), 50);
  EXPECT_EQ(s.last_in().at(3), 20);
  EXPECT_LT(s.share().at(3), Stragglers::kMinShare);
  EXPECT_EQ(s.straggler(), std::nullopt);
  EXPECT_NE(s.headline().find("(the most: rank 3, 5%)"), std::string::npos) << s.headline();
}

TEST(Stragglers, LooksAtTheLastCollectivesOnly) {
  // Rank 1 lags in the first 10 steps, rank 2 in the next 10.
  auto snapshots =
      steps(3, 20, 100, [](int r, int step) { return r == (step < 10 ? 1 : 2) ? 50 : 0; });
  Stragglers recent(snapshots, 10);
  EXPECT_EQ(recent.window(), 10);
  EXPECT_EQ(recent.straggler(), 2);
  EXPECT_EQ(recent.held_s().at(1), 0);
  EXPECT_EQ(recent.timeline().front().seq, 11);
  Stragglers all(snapshots, 20);
  EXPECT_EQ(all.window(), 20);
  EXPECT_EQ(all.straggler(), std::nullopt);  // as long for each
  EXPECT_NEAR(all.held_s().at(1), all.held_s().at(2), 1e-9);
  Stragglers more(snapshots, 100);
  EXPECT_EQ(more.window(), 20);
  EXPECT_EQ(more.last(), 100);
}

TEST(Stragglers, CountsOnlyCollectivesEveryMemberEntered) {
  // The one in flight (rank 1 has not entered #3) and one the ring buffer dropped on rank 0 (#1).
  std::string groups = R"({"0": {"ranks": [0, 1], "issued": 3}})";
  Stragglers s({{0, snapshot(0, {In{2, kStart + 100 * kMs}, In{3, kStart + 200 * kMs}}, groups)},
                {1, snapshot(1, {In{1, kStart}, In{2, kStart + 150 * kMs}}, groups)}},
               50);
  ASSERT_EQ(s.window(), 1);
  EXPECT_EQ(s.timeline()[0].seq, 2);
  EXPECT_EQ(s.timeline()[0].last, 1);
  EXPECT_NEAR(s.held_s().at(1), 0.050, 1e-9);
}

TEST(Stragglers, SubgroupCollectivesCountTheirMembersOnly) {
  // Ranks 0 and 1 also share group "1", where rank 1 is 80 ms late; ranks 2 and 3 do not wait.
  std::string groups =
      R"({"0": {"ranks": [0, 1, 2, 3], "issued": 1}, "1": {"ranks": [0, 1], "issued": 1}})";
  std::string world_only = R"({"0": {"ranks": [0, 1, 2, 3], "issued": 1}})";
  In world{1, kStart};
  Stragglers s({{0, snapshot(0, {world, In{1, kStart + 100 * kMs, "1"}}, groups)},
                {1, snapshot(1, {world, In{1, kStart + 180 * kMs, "1"}}, groups)},
                {2, snapshot(2, {world}, world_only)},
                {3, snapshot(3, {world}, world_only)}},
               50);
  ASSERT_EQ(s.window(), 2);
  EXPECT_EQ(s.timeline()[1].pg, "1");
  EXPECT_EQ(s.timeline()[1].last, 1);
  EXPECT_NEAR(s.held_s().at(1), 0.080, 1e-9);  // rank 0's wait only
  EXPECT_NEAR(s.span_s(), 0.180, 1e-9);
  EXPECT_NEAR(s.share().at(1), 0.080 / (3 * 0.180), 1e-9);
}

TEST(Stragglers, MatchesOnlyTheCurrentGenerationOfAGroup) {
  // After a heal: rank 0 survived (its old group, id 0, ran 5 collectives where rank 1 lagged;
  // the rebuilt one, id 1, ran 2); rank 1 is a new process whose group is its first (id 0).
  std::string groups = R"({"0": {"ranks": [0, 1], "issued": 2}})";
  std::vector<In> survivor;
  for (int i = 1; i <= 5; ++i) survivor.push_back(In{i, kStart + i * 100 * kMs, "0", 0});
  survivor.push_back(In{1, kStart + 1000 * kMs, "0", 1});
  survivor.push_back(In{2, kStart + 1100 * kMs, "0", 1});
  std::vector<In> fresh = {In{1, kStart + 1030 * kMs, "0", 0}, In{2, kStart + 1100 * kMs, "0", 0}};
  Stragglers s({{0, snapshot(0, survivor, groups)}, {1, snapshot(1, fresh, groups)}}, 50);
  ASSERT_EQ(s.window(), 2);
  EXPECT_NEAR(s.held_s().at(1), 0.030, 1e-9);
  // A group rebuilt that has issued nothing yet: the records are all the old group's.
  std::string rebuilt = R"({"0": {"ranks": [0, 1], "issued": 0}})";
  Stragglers none({{0, snapshot(0, {In{1, kStart}}, rebuilt)},
                   {1, snapshot(1, {In{1, kStart + 50 * kMs}}, rebuilt)}},
                  50);
  EXPECT_EQ(none.window(), 0);
  // A group destroyed (the rank lists other groups only) is history too.
  Stragglers gone({{0, snapshot(0, {In{1, kStart, "7"}})}, {1, snapshot(1, {In{1, kStart, "7"}})}},
                  50);
  EXPECT_EQ(gone.window(), 0);
}

TEST(Stragglers, RanksThatCannotBeReadAreNamedWithWhy) {
  auto snapshots = steps(2, 3, 100, [](int r, int) { return r == 1 ? 60 : 0; });
  snapshots[2] = R"({"off": "dead: killed by SIGKILL"})";
  snapshots[3] = R"({"outside": "uninitialized", "where": null})";
  snapshots[4] = "not json";
  snapshots[5] = R"({"rank": 5, "world": 6, "entries": []})";
  snapshots[6] = R"({"rank": 6, "groups": {}, "entered": [["0", 0]]})";
  Stragglers s(snapshots, 50);
  EXPECT_EQ(s.ranks(), (std::vector<int>{0, 1}));
  EXPECT_EQ(s.straggler(), 1);
  ASSERT_EQ(s.unread().size(), 5u);
  EXPECT_EQ(s.unread().at(2), "dead: killed by SIGKILL");
  EXPECT_EQ(s.unread().at(3), "torch.distributed is not initialized there");
  EXPECT_EQ(s.unread().at(4).rfind("its snapshot could not be read: ", 0), 0u);
  EXPECT_EQ(s.unread().at(5),
            "its snapshot has no entry times (a rank running another version of ddip)");
  EXPECT_NE(s.unread().at(6).find("not [pg, gen, seq, op, ns]"), std::string::npos);
  EXPECT_NE(s.describe().find("\n  rank 2: not read (dead: killed by SIGKILL)"), std::string::npos);
}

TEST(Stragglers, SaysWhyNothingIsNamedWithoutCollectives) {
  Stragglers off({{0, R"j({"off": "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"})j"}},
                 50);
  EXPECT_EQ(off.headline(),
            "no straggler named: no rank's collectives could be read (rank 0: torch's flight "
            "recorder is off (TORCH_FR_BUFFER_SIZE=0))");
  Stragglers idle({{0, snapshot(0, {})}, {1, snapshot(1, {})}}, 50);
  EXPECT_EQ(idle.window(), 0);
  EXPECT_EQ(idle.straggler(), std::nullopt);
  EXPECT_EQ(idle.headline(),
            "no straggler named: the flight recorder holds no collective that every rank of its "
            "group has entered");
  EXPECT_EQ(idle.describe(), idle.headline());
}

TEST(Stragglers, RefusesAWindowOfNoCollectives) {
  EXPECT_THROW(Stragglers({}, 0), std::invalid_argument);
  EXPECT_THROW(Stragglers({}, -3), std::invalid_argument);
}
