#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "ddip/collectives.hpp"

using ddip::CollectivePicture;

namespace {

using Lines = std::vector<std::string>;
using Ranks = std::set<int>;

constexpr long long kSecond = 1'000'000'000;

// One flight-recorder entry as python/ddip/rank/collectives.py's snapshot() writes it.
struct E {
  long long seq;
  std::string op = "all_reduce";
  std::string sizes = "[[1024]]";
  std::string dtypes = R"(["Float"])";
  bool done = true;
  long long created_ns = 0;
  std::string pg = "0";
  bool p2p = false;
  long long gen = 0;

  std::string json() const {
    return R"({"seq": )" + std::to_string(seq) + R"(, "gen": )" + std::to_string(gen) +
           R"(, "p2p": )" + (p2p ? "true" : "false") +
           R"(, "pg": ")" + pg + R"(", "op": ")" + op + R"(", "sizes": )" + sizes +
           R"(, "dtypes": )" + dtypes + R"(, "done": )" + (done ? "true" : "false") +
           R"(, "created_ns": )" + std::to_string(created_ns) + "}";
  }
};

E pending(long long seq, long long created_ns = 0) {
  E e{seq};
  e.done = false;
  e.created_ns = created_ns;
  return e;
}

std::string snapshot(int rank, const std::vector<E>& entries, long long now_ns = 12 * kSecond,
                     const std::string& groups = "{}") {
  std::string list;
  for (const E& e : entries) list += (list.empty() ? "" : ", ") + e.json();
  return R"({"rank": )" + std::to_string(rank) + R"(, "world": 2, "now_ns": )" +
         std::to_string(now_ns) + R"(, "groups": )" + groups + R"(, "entries": [)" + list + "]}";
}

const std::string kTitle = "collectives (torch's flight recorder):";

}  // namespace

TEST(CollectivePicture, NamesTheRankThatSkippedTheCollectiveTheOthersWaitIn) {
  CollectivePicture p({{0, snapshot(0, {E{1}, pending(2)})}, {1, snapshot(1, {E{1}})}});
  EXPECT_TRUE(p.known());
  EXPECT_EQ(p.waiting(), Ranks({0}));
  EXPECT_EQ(p.missing(), Ranks({1}));
  EXPECT_EQ(p.mismatched(), Ranks());
  EXPECT_DOUBLE_EQ(p.waited_s().at(0), 12.0);
  EXPECT_EQ(p.waiting_in(), (std::map<int, std::string>{{0, "all_reduce #2 (float32[1024])"}}));
  EXPECT_EQ(p.missing_from(), (std::map<int, std::string>{{1, "all_reduce #2 (float32[1024])"}}));
  EXPECT_EQ(
      p.describe(),
      kTitle +
          "\n  rank 0: waiting 12.0 s in all_reduce #2 (float32[1024]); last completed: "
          "all_reduce #1"
          "\n  rank 1: in no collective; last completed: all_reduce #1"
          "\n=> rank 1 has not entered all_reduce #2 (float32[1024]), which rank 0 has waited "
          "in for 12.0 s; its last collective was all_reduce #1");
}

TEST(CollectivePicture, GroupsAbsentRanksByTheirLastCollective) {
  const std::string groups = R"({"0": [0, 1, 2, 3, 4]})";
  CollectivePicture p({{0, snapshot(0, {E{2}, pending(3, 2 * kSecond)}, 12 * kSecond, groups)},
                       {1, snapshot(1, {E{2}, pending(3, 4 * kSecond)}, 12 * kSecond, groups)},
                       {2, snapshot(2, {E{1}, E{2}}, 12 * kSecond, groups)},
                       {3, snapshot(3, {E{1}}, 12 * kSecond, groups)},
                       {4, snapshot(4, {}, 12 * kSecond, groups)}});
  EXPECT_EQ(p.waiting(), Ranks({0, 1}));
  EXPECT_EQ(p.missing(), Ranks({2, 3, 4}));
  // The longest wait is the one named; each rank's own is on its line.
  EXPECT_EQ(p.findings(),
            Lines({"rank 2 has not entered all_reduce #3 (float32[1024]), which ranks 0, 1 have "
                   "waited in for 10.0 s; its last collective was all_reduce #2",
                   "rank 3 has not entered all_reduce #3 (float32[1024]), which ranks 0, 1 have "
                   "waited in for 10.0 s; its last collective was all_reduce #1",
                   "rank 4 has not entered all_reduce #3 (float32[1024]), which ranks 0, 1 have "
                   "waited in for 10.0 s; it has run no collective in this group"}));
  EXPECT_EQ(
      p.rank_lines()[1],
      "rank 1: waiting 8.0 s in all_reduce #3 (float32[1024]); last completed: all_reduce #2");
  EXPECT_EQ(p.rank_lines()[4], "rank 4: in no collective");
}

TEST(CollectivePicture, RanksThatStoppedTogetherShareALine) {
  CollectivePicture p(
      {{0, snapshot(0, {E{1}, pending(2)})}, {1, snapshot(1, {E{1}})}, {2, snapshot(2, {E{1}})}});
  EXPECT_EQ(p.findings(),
            Lines({"ranks 1, 2 have not entered all_reduce #2 (float32[1024]), which rank 0 has "
                   "waited in for 12.0 s; their last collective was all_reduce #1"}));
}

TEST(CollectivePicture, AShapeMismatchNamesBothRanksAndWhatEachGave) {
  E mine = pending(2), theirs = pending(2);
  theirs.sizes = "[[512]]";
  CollectivePicture p({{0, snapshot(0, {E{1}, mine})}, {1, snapshot(1, {E{1}, theirs})}});
  EXPECT_EQ(p.mismatched(), Ranks({0, 1}));
  EXPECT_EQ(p.missing(), Ranks());
  EXPECT_EQ(p.waiting(), Ranks({0, 1}));
  EXPECT_EQ(p.findings(), Lines({"ranks disagree about collective #2: rank 0: all_reduce "
                                 "float32[1024]; rank 1: all_reduce float32[512]"}));
}

TEST(CollectivePicture, AnOpMismatchAndADtypeMismatch) {
  E bcast = pending(2);
  bcast.op = "broadcast";
  bcast.sizes = "[[512]]";
  CollectivePicture op({{0, snapshot(0, {pending(2)})}, {1, snapshot(1, {bcast})}});
  EXPECT_EQ(op.findings(), Lines({"ranks disagree about collective #2: rank 0: all_reduce "
                                  "float32[1024]; rank 1: broadcast float32[512]"}));
  E longs = pending(1);
  longs.dtypes = R"(["Long", "BFloat16"])";
  longs.sizes = "[[2, 3], []]";
  E floats = longs;
  floats.dtypes = R"(["Double", "Half"])";
  CollectivePicture dtype({{0, snapshot(0, {longs})}, {1, snapshot(1, {floats})}});
  EXPECT_EQ(
      dtype.findings(),
      Lines({"ranks disagree about collective #1: rank 0: all_reduce int64[2, 3], bfloat16[]; "
             "rank 1: all_reduce float64[2, 3], float16[]"}));
}

TEST(CollectivePicture, EveryRankWaitingInTheSameCollectiveIsAStall) {
  CollectivePicture p({{0, snapshot(0, {E{1}, pending(2, 8'500'000'000)})},
                       {1, snapshot(1, {E{1}, pending(2, 9 * kSecond)})}});
  EXPECT_EQ(p.waiting(), Ranks({0, 1}));
  EXPECT_EQ(p.missing(), Ranks());
  EXPECT_EQ(p.findings(), Lines({"every rank is in all_reduce #2 (float32[1024]) and it has not "
                                 "completed after 3.5 s (a peer outside these ranks, or the "
                                 "network)"}));
}

TEST(CollectivePicture, EachProcessGroupIsReadOnItsOwn) {
  // Ranks 0 and 1 form group "pairs"; rank 2 is not in it and is not named as missing from it.
  const std::string groups = R"({"0": [0, 1, 2], "pairs": [0, 1]})";
  E pair_pending = pending(1, 7 * kSecond);
  pair_pending.pg = "pairs";
  CollectivePicture p({{0, snapshot(0, {E{1}, pair_pending}, 12 * kSecond, groups)},
                       {1, snapshot(1, {E{1}}, 12 * kSecond, groups)},
                       {2, snapshot(2, {E{1}, pending(2, 10 * kSecond)}, 12 * kSecond, groups)}});
  EXPECT_EQ(p.missing(), Ranks({0, 1}));
  EXPECT_EQ(p.waiting(), Ranks({0, 2}));
  EXPECT_EQ(p.findings(),
            Lines({"ranks 0, 1 have not entered all_reduce #2 (float32[1024]), which rank 2 has "
                   "waited in for 2.0 s; their last collective was all_reduce #1",
                   "rank 1 has not entered all_reduce #1 (float32[1024]) of group 'pairs', which "
                   "rank 0 has waited in for 5.0 s; it has run no collective in this group"}));
  // Rank 0 waits in one group and is missing from the other.
  EXPECT_EQ(p.waiting_in().at(0), "all_reduce #1 (float32[1024]) of group 'pairs'");
  EXPECT_EQ(p.missing_from().at(0), "all_reduce #2 (float32[1024])");
  EXPECT_EQ(p.missing_from().at(1), "all_reduce #1 (float32[1024]) of group 'pairs'");
  EXPECT_EQ(p.rank_lines()[0],
            "rank 0: waiting 5.0 s in all_reduce #1 (float32[1024]) of group 'pairs'; last "
            "completed: all_reduce #1");
}

TEST(CollectivePicture, PointToPointIsNotACollective) {
  E send = pending(1);
  send.op = "send";
  send.p2p = true;
  E recv{1};
  recv.op = "recv";
  recv.p2p = true;
  CollectivePicture p({{0, snapshot(0, {E{1}, send})}, {1, snapshot(1, {E{1}, recv})}});
  EXPECT_TRUE(p.known());
  EXPECT_EQ(p.findings(), Lines());
  EXPECT_EQ(p.waiting(), Ranks());
  EXPECT_EQ(p.rank_lines(), Lines({"rank 0: in no collective; last completed: all_reduce #1",
                                   "rank 1: in no collective; last completed: all_reduce #1"}));
}

TEST(CollectivePicture, RanksWithoutARecorderSayWhyAndAreNoMembers) {
  CollectivePicture none({{0, R"({"off": "torch.distributed is not initialized"})"},
                          {1, R"({"off": "torch.distributed is not initialized"})"}});
  EXPECT_FALSE(none.known());
  EXPECT_EQ(none.describe(), "");
  EXPECT_EQ(none.findings(), Lines());
  EXPECT_EQ(none.rank_lines(), Lines({"rank 0: torch.distributed is not initialized",
                                      "rank 1: torch.distributed is not initialized"}));
  // A dead rank is no member: the one left waits for it, and the dead rank is named, not taken
  // for a stall of every rank.
  CollectivePicture dead({{0, snapshot(0, {E{1}, pending(2)})},
                          {1, R"j({"off": "dead: killed by signal 9 (SIGKILL)"})j"}});
  EXPECT_EQ(dead.missing(), Ranks());
  EXPECT_EQ(dead.rank_lines()[1], "rank 1: dead: killed by signal 9 (SIGKILL)");
  EXPECT_EQ(dead.findings(), Lines({"rank 0 has waited 12.0 s in all_reduce #2 (float32[1024]); "
                                    "the group's other rank could not say where it is: rank 1 "
                                    "(dead: killed by signal 9 (SIGKILL))"}));
}

TEST(CollectivePicture, RanksThatGaveNoAnswerAreNamedNotTakenForAStall) {
  // ddip run asks, and rank 2 of 3 never answers: the world (default group) says it belongs.
  CollectivePicture world({{0, snapshot(0, {E{1}, pending(2)})},
                           {1, snapshot(1, {E{1}, pending(2)})}});
  EXPECT_EQ(world.waiting(), Ranks({0, 1}));
  EXPECT_EQ(world.findings(), Lines({"every rank is in all_reduce #2 (float32[1024]) and it has not "
                                     "completed after 12.0 s (a peer outside these ranks, or the "
                                     "network)"}));
  std::string three = snapshot(0, {E{1}, pending(2)});
  three.replace(three.find("\"world\": 2"), 10, "\"world\": 3");
  CollectivePicture silent({{0, three}, {1, snapshot(1, {E{1}, pending(2)})}});
  EXPECT_EQ(silent.findings(), Lines({"ranks 0, 1 have waited 12.0 s in all_reduce #2 "
                                      "(float32[1024]); the group's other rank could not say where "
                                      "it is: rank 2 (no answer)"}));
  // A named group's ranks come from its config, whatever the world.
  E sub = pending(1);
  sub.pg = "7";
  CollectivePicture group({{0, snapshot(0, {sub}, 12 * kSecond, R"({"7": [0, 2, 3]})")}});
  EXPECT_EQ(group.findings(),
            Lines({"rank 0 has waited 12.0 s in all_reduce #1 (float32[1024]) of group '7'; the "
                   "group's other ranks could not say where they are: rank 2 (no answer), rank 3 "
                   "(no answer)"}));
}

TEST(CollectivePicture, AnUnreadableSnapshotIsThatRanksOffWithTheParsersReason) {
  CollectivePicture p({{0, snapshot(0, {E{1}, pending(2)})},
                       {1, "{not json"},
                       {2, "[1, 2]"},
                       {3, R"({"now_ns": 5, "entries": [{"seq": "two"}]})"},
                       {4, ""}});
  auto lines = p.rank_lines();
  ASSERT_EQ(lines.size(), 5u);
  const std::string unreadable = ": its snapshot could not be read: ";
  EXPECT_EQ(lines[1].rfind("rank 1" + unreadable + "[json.exception.parse_error.", 0), 0u)
      << lines[1];
  EXPECT_EQ(lines[2], "rank 2" + unreadable + "it is array, not an object");
  EXPECT_EQ(lines[3].rfind("rank 3" + unreadable + "[json.exception.type_error.", 0), 0u)
      << lines[3];
  EXPECT_NE(lines[3].find("string"), std::string::npos) << lines[3];
  EXPECT_EQ(lines[4].rfind("rank 4" + unreadable + "[json.exception.parse_error.", 0), 0u)
      << lines[4];
  // The readable rank is still read.
  EXPECT_EQ(p.waiting(), Ranks({0}));
}

TEST(CollectivePicture, AGroupRebuiltByAHealNumbersFromOneAgain) {
  // After a heal, #1 again, done on both: the current generation of the group (the older one's
  // records are left out: RecordsFromBeforeARebuildAreHistory). Nothing is pending.
  CollectivePicture p({{0, snapshot(0, {E{1}})}, {1, snapshot(1, {E{1}})}});
  EXPECT_EQ(p.findings(), Lines());
  EXPECT_EQ(p.waiting(), Ranks());
  EXPECT_EQ(p.rank_lines(), Lines({"rank 0: in no collective; last completed: all_reduce #1",
                                   "rank 1: in no collective; last completed: all_reduce #1"}));
}

TEST(CollectivePicture, TheLowestPendingCollectiveIsTheOneRead) {
  // Rank 1 has gone on to #3 (an async op it did not wait for) while rank 0 is still in #2.
  CollectivePicture p({{0, snapshot(0, {E{1}, pending(2, 2 * kSecond)})},
                       {1, snapshot(1, {E{1}, pending(2, 3 * kSecond), pending(3)})}});
  EXPECT_EQ(p.waiting(), Ranks({0, 1}));
  EXPECT_EQ(p.findings(), Lines({"every rank is in all_reduce #2 (float32[1024]) and it has not "
                                 "completed after 10.0 s (a peer outside these ranks, or the "
                                 "network)"}));
}

TEST(CollectivePicture, AClockBehindTheEntryCountsNoWait) {
  CollectivePicture p(
      {{0, snapshot(0, {pending(1, 20 * kSecond)}, 12 * kSecond)}, {1, snapshot(1, {})}});
  EXPECT_EQ(p.waited_s().at(0), 0.0);
  EXPECT_EQ(p.rank_lines()[0], "rank 0: waiting 0.0 s in all_reduce #1 (float32[1024])");
}

namespace {

// The groups a rank has now, as snapshot() lists them: the default group "0" of ranks 0 and 1,
// which has issued `issued` collectives.
std::string world_group(int issued) {
  return R"({"0": {"ranks": [0, 1], "issued": )" + std::to_string(issued) + "}}";
}

E of_generation(E e, long long gen) {
  e.gen = gen;
  return e;
}

}  // namespace

TEST(CollectivePicture, TheGroupsFirstCollectiveNamesTheRankWithNoRecordYet) {
  // Rank 1 has run no collective at all: its group list still makes it a member, missing from #1.
  CollectivePicture p(
      {{0, snapshot(0, {pending(1, 3 * kSecond)}, 12 * kSecond, world_group(1))},
       {1, snapshot(1, {}, 12 * kSecond, world_group(0))}});
  EXPECT_EQ(p.missing(), Ranks({1}));
  EXPECT_EQ(p.waiting(), Ranks({0}));
  EXPECT_EQ(p.rank_lines(), Lines({"rank 0: waiting 9.0 s in all_reduce #1 (float32[1024])",
                                   "rank 1: in no collective"}));
  EXPECT_EQ(p.findings(), Lines({"rank 1 has not entered all_reduce #1 (float32[1024]), which rank "
                                 "0 has waited in for 9.0 s; it has run no collective in this "
                                 "group"}));
}

TEST(CollectivePicture, RecordsFromBeforeARebuildAreHistory) {
  // Each heal made the default group anew (recorder ids 0, 1, 2); rank 1 has run nothing in the
  // current one, so its records of #1 are an older group's, not a disagreement about #1.
  E old_small = of_generation(E{1}, 0);
  old_small.sizes = "[[4]]";
  for (int heals = 1; heals <= 3; ++heals) {
    std::vector<E> mine = {old_small}, theirs = {old_small};
    for (int g = 1; g < heals; ++g) {
      mine.push_back(of_generation(E{1}, g));
      theirs.push_back(of_generation(E{1}, g));
    }
    mine.push_back(of_generation(pending(1, 2 * kSecond), heals));
    CollectivePicture p({{0, snapshot(0, mine, 12 * kSecond, world_group(1))},
                         {1, snapshot(1, theirs, 12 * kSecond, world_group(0))}});
    EXPECT_EQ(p.mismatched(), Ranks()) << heals;
    EXPECT_EQ(p.findings(),
              Lines({"rank 1 has not entered all_reduce #1 (float32[1024]), which rank 0 has "
                     "waited in for 10.0 s; it has run no collective in this group"}))
        << heals;
    EXPECT_EQ(p.rank_lines()[1], "rank 1: in no collective") << heals;
  }
  // A group the rank no longer has (destroyed) is history too, and so is a generation whose
  // numbers run past what the live group has issued.
  E sub = pending(1);
  sub.pg = "5";
  CollectivePicture gone({{0, snapshot(0, {sub, E{1}}, 12 * kSecond, world_group(1))}});
  EXPECT_EQ(gone.waiting(), Ranks());
  EXPECT_EQ(gone.rank_lines(), Lines({"rank 0: in no collective; last completed: all_reduce #1"}));
  CollectivePicture ahead({{0, snapshot(0, {E{1}, pending(2)}, 12 * kSecond, world_group(0))}});
  EXPECT_FALSE(ahead.known());
}

TEST(CollectivePicture, ARankThatLeftTorchDistributedIsMissingFromTheCollective) {
  CollectivePicture p(
      {{0, snapshot(0, {E{1}, pending(2, 7 * kSecond)}, 12 * kSecond, world_group(2))},
       {1, R"({"outside": "left"})"}});
  EXPECT_EQ(p.missing(), Ranks({1}));
  EXPECT_EQ(p.rank_lines()[1], "rank 1: has left torch.distributed (destroy_process_group)");
  EXPECT_EQ(p.findings(), Lines({"rank 1 has not entered all_reduce #2 (float32[1024]), which rank "
                                 "0 has waited in for 5.0 s; it has left torch.distributed "
                                 "(destroy_process_group)"}));
  // A rank outside the group's ranks is not named.
  CollectivePicture other({{0, snapshot(0, {pending(1)}, 12 * kSecond, world_group(1))},
                           {2, R"({"outside": "uninitialized"})"}});
  EXPECT_EQ(other.missing(), Ranks());
  EXPECT_EQ(other.rank_lines()[1], "rank 2: torch.distributed is not initialized");
}

TEST(CollectivePicture, ADeadRanksLastWordsFollowTheSurvivorsRecord) {
  // gloo aborts the rank that receives more than it expects (a rank-dependent shape): the
  // survivor's record says what it gave, the dead rank's stderr what gloo found.
  CollectivePicture p(
      {{0, snapshot(0, {E{1, "all_reduce", "[[1024]]", R"(["Float"])", true, kSecond}},
                    12 * kSecond, world_group(1))},
       {1, R"({"off": "dead: killed by SIGABRT", "last_words": ["earlier output", )"
           R"("terminate called after throwing an instance of 'gloo::EnforceNotMet'", )"
           R"("  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. )"
           R"(1024 vs 512.", ""]})"}});
  EXPECT_EQ(p.findings(),
            Lines({"rank 1 died (killed by SIGABRT); rank 0's last collective: all_reduce #1 "
                   "(float32[1024]); rank 1's last words: terminate called after throwing an "
                   "instance of 'gloo::EnforceNotMet' what():  [enforce fail at pair.cc:456] "
                   "op.preamble.length <= op.nbytes. 1024 vs 512."}));
  // Not when the survivor's last collective came before the request the rank died in.
  CollectivePicture earlier(
      {{0, snapshot(0, {E{1, "all_reduce", "[[1024]]", R"(["Float"])", true, kSecond}},
                    12 * kSecond, world_group(1))},
       {1, R"({"off": "dead: exit code 3", "since_ns": 5000000000, "last_words": ["bye"]})"}});
  EXPECT_EQ(earlier.findings(), Lines());
  // Where the survivor still waits for it, the dead rank's words follow the waiting line.
  CollectivePicture waiting(
      {{0, snapshot(0, {pending(1, 12 * kSecond)}, 12 * kSecond, world_group(1))},
       {1, R"({"off": "dead: exit code 3", "last_words": ["bye"]})"}});
  EXPECT_EQ(waiting.findings(),
            Lines({"rank 0 has waited 0.0 s in all_reduce #1 (float32[1024]); the group's other "
                   "rank could not say where it is: rank 1 (dead: exit code 3)",
                   "rank 1 died (exit code 3); rank 0's last collective: all_reduce #1 "
                   "(float32[1024]); rank 1's last words: bye"}));
}

TEST(CollectivePicture, ARankNotWhereTheOthersWaitIsLocated) {
  std::string asleep = snapshot(1, {E{1}}, 12 * kSecond, world_group(1));
  asleep.insert(asleep.size() - 1,
                R"(, "where": {"file": "<ipython-input-3-ab12>", "line": 7, "function": )"
                R"("<module>", "call": "time.sleep"})");
  std::string waiting = snapshot(0, {E{1}, pending(2, 10 * kSecond)}, 12 * kSecond, world_group(2));
  waiting.insert(waiting.size() - 1,
                 R"(, "where": {"file": "<ipython-input-3-ab12>", "line": 3, "function": )"
                 R"("<module>", "call": "dist.all_reduce"})");
  CollectivePicture p({{0, waiting}, {1, asleep}});
  EXPECT_EQ(p.rank_lines(),
            Lines({"rank 0: waiting 2.0 s in all_reduce #2 (float32[1024]); last completed: "
                   "all_reduce #1",
                   "rank 1: in no collective; last completed: all_reduce #1; at cell line 7, in "
                   "time.sleep"}));
  EXPECT_EQ(p.findings(), Lines({"rank 1 has not entered all_reduce #2 (float32[1024]), which rank "
                                 "0 has waited in for 2.0 s; its last collective was all_reduce "
                                 "#1; it is at cell line 7, in time.sleep"}));
  // In a script: its file's name and line, and the function where no call is known.
  std::string script = snapshot(1, {E{1}}, 12 * kSecond, world_group(1));
  script.insert(script.size() - 1,
                R"(, "where": {"file": "/home/u/train.py", "line": 42, "function": "step"})");
  EXPECT_EQ(CollectivePicture({{1, script}}).rank_lines()[0],
            "rank 1: in no collective; last completed: all_reduce #1; in step() at train.py:42");
}
