#include <gtest/gtest.h>

#include "ddip/output.hpp"

using namespace ddip;

TEST(LineAssembler, ReleasesCompleteLinesAndHoldsThePartOne) {
  LineAssembler a;
  EXPECT_EQ(a.feed("hel"), "");
  EXPECT_TRUE(a.has_pending());
  EXPECT_EQ(a.feed("lo\nwor"), "hello\n");
  EXPECT_EQ(a.feed("ld\n"), "world\n");
  EXPECT_FALSE(a.has_pending());
}

TEST(LineAssembler, KeepsCarriageReturnUpdatesSeparate) {
  LineAssembler a;
  EXPECT_EQ(a.feed(" 10%\r"), " 10%\r");
  EXPECT_EQ(a.feed(" 50%\r 90"), " 50%\r");
  EXPECT_EQ(a.feed("%\r100%\n"), " 90%\r100%\n");
}

TEST(LineAssembler, FlushReturnsThePartialLineOnce) {
  LineAssembler a;
  a.feed("no newline");
  EXPECT_EQ(a.flush(), "no newline");
  EXPECT_EQ(a.flush(), "");
}

namespace {

std::string text_of(const std::vector<OutputPiece>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += p.text + (p.marker ? "|D|" : "");
  return out;
}

}  // namespace

TEST(RankOutput, StreamsAreIndependent) {
  RankOutput o;
  EXPECT_EQ(text_of(o.feed(RankOutput::kStdout, "out")), "");
  EXPECT_EQ(text_of(o.feed(RankOutput::kStderr, "err\n")), "err\n");
  EXPECT_EQ(text_of(o.feed(RankOutput::kStdout, "!\n")), "out!\n");
}

TEST(RankOutput, DisplayMarkersSplitTheTextAndFlushThePartialLine) {
  RankOutput o;
  std::string m(kDisplayMarker);
  EXPECT_EQ(text_of(o.feed(RankOutput::kStdout, "before\npart" + m + "after\n")),
            "before\npart|D|after\n");
}

TEST(RankOutput, AMarkerSplitAcrossReadsIsStillFound) {
  std::string m(kDisplayMarker);
  for (size_t cut = 1; cut < m.size(); ++cut) {
    RankOutput o;
    std::string got = text_of(o.feed(RankOutput::kStdout, "a\n" + m.substr(0, cut)));
    got += text_of(o.feed(RankOutput::kStdout, m.substr(cut) + "b\n"));
    EXPECT_EQ(got, "a\n|D|b\n") << "cut at " << cut;
  }
}

TEST(RankOutput, ALookalikeThatIsNotAMarkerIsText) {
  RankOutput o;
  std::string start(kDisplayMarker.substr(0, 3));
  EXPECT_EQ(text_of(o.feed(RankOutput::kStdout, "x" + start)), "");
  EXPECT_TRUE(o.has_pending());
  EXPECT_EQ(o.flush(RankOutput::kStdout), "x" + start);
}

TEST(RankOutput, StderrTailKeepsTheLastLinesAsFinallyShown) {
  RankOutput o;
  for (int i = 0; i < 30; ++i) o.feed(RankOutput::kStderr, "line " + std::to_string(i) + "\n");
  o.feed(RankOutput::kStderr, "progress 1\rprogress 2\n");
  o.feed(RankOutput::kStdout, "stdout is not in the tail\n");
  o.feed(RankOutput::kStderr, "Killed");
  o.flush(RankOutput::kStderr);
  std::string tail = o.stderr_tail();
  EXPECT_EQ(tail.find("line 9\n"), std::string::npos);
  EXPECT_NE(tail.find("line 29\nprogress 2\nKilled"), std::string::npos) << tail;
  EXPECT_EQ(tail.find("progress 1"), std::string::npos);
  EXPECT_EQ(tail.find("stdout"), std::string::npos);
}

TEST(LineAssembler, APartialFlushNeverSplitsAUtf8Character) {
  LineAssembler a;
  a.feed("caf\xC3");  // 'é' is C3 A9; the pipe read ended between its bytes
  EXPECT_EQ(a.flush(false), "caf");
  EXPECT_TRUE(a.has_pending());
  a.feed("\xA9 ok");
  EXPECT_EQ(a.flush(false), "\xC3\xA9 ok");
  a.feed("\xE2\x82");  // two of the three bytes of '€'
  EXPECT_EQ(a.flush(false), "");
  EXPECT_EQ(a.feed("\xAC\n"), "\xE2\x82\xAC\n");
  a.feed("\xF0\x9F\x98");  // three of the four bytes of an emoji
  EXPECT_EQ(a.flush(false), "");
  a.feed("\x80");
  EXPECT_EQ(a.flush(false), "\xF0\x9F\x98\x80");
}

TEST(LineAssembler, InvalidBytesAreDelayedNotLost) {
  LineAssembler a;
  a.feed("x\xC3");  // a lead byte whose continuation never comes
  EXPECT_EQ(a.flush(false), "x");
  EXPECT_EQ(a.flush(false), "\xC3");  // nothing new since: it goes now
  EXPECT_FALSE(a.has_pending());
  a.feed("\xA9\xA9");  // stray continuation bytes: nothing to wait for
  EXPECT_EQ(a.flush(false), "\xA9\xA9");
  a.feed("y\xE2");
  EXPECT_EQ(a.flush(true), "y\xE2");  // forced (a request's end, an exit): everything
}

TEST(RankOutput, PartialFlushKeepsUtf8WholeOnBothStreams) {
  RankOutput o;
  o.feed(RankOutput::kStdout, "\xC3");
  o.feed(RankOutput::kStderr, "\xC3");
  EXPECT_EQ(o.flush(RankOutput::kStdout, false), "");
  EXPECT_EQ(o.flush(RankOutput::kStderr, false), "");
  o.feed(RankOutput::kStdout, "\xA9");
  o.feed(RankOutput::kStderr, "\xA9");
  EXPECT_EQ(o.flush(RankOutput::kStdout, false), "\xC3\xA9");
  EXPECT_EQ(o.flush(RankOutput::kStderr, false), "\xC3\xA9");
  EXPECT_EQ(o.stderr_tail(), "\xC3\xA9");
}

TEST(ForEachLine, SplitsAtEveryLineEndAndKeepsWhichOne) {
  std::vector<std::pair<std::string, std::string>> got;
  for_each_line("a\nbar 1\rbar 2\r\n\nwin\r\ntail",
                [&](std::string_view body, std::string_view end) { got.emplace_back(body, end); });
  std::vector<std::pair<std::string, std::string>> want{
      {"a", "\n"}, {"bar 1", "\r"}, {"bar 2", "\r\n"}, {"", "\n"}, {"win", "\r\n"}, {"tail", ""}};
  EXPECT_EQ(got, want);
  got.clear();
  for_each_line("", [&](std::string_view body, std::string_view end) { got.emplace_back(body, end); });
  EXPECT_TRUE(got.empty());
}

TEST(RankOutput, AStderrLineEndedByCrLfKeepsItsText) {
  RankOutput o;
  o.feed(RankOutput::kStderr, "Traceback\r\nValueError: bad\r\n");
  EXPECT_EQ(o.stderr_tail(), "Traceback\nValueError: bad");
}

TEST(RankRanges, RunsOfThreeOrMoreBecomeRanges) {
  std::vector<int> all(127);
  for (int r = 0; r < 127; ++r) all[static_cast<size_t>(r)] = r;
  EXPECT_EQ(rank_ranges(all), "0-126");
  EXPECT_EQ(rank_ranges({7, 0, 2, 4, 5, 6}), "0,2,4-7");
  EXPECT_EQ(rank_ranges({3}), "3");
  EXPECT_EQ(rank_ranges({1, 0}), "0,1");
  EXPECT_EQ(rank_ranges({0, 1, 3, 4, 5, 9, 10}), "0,1,3-5,9,10");
  EXPECT_EQ(rank_ranges({2, 2, 3}), "2,3");  // a rank named twice is one rank
  EXPECT_EQ(rank_ranges({}), "");
}

namespace {
using Pieces = std::vector<Repeats::Piece>;
std::vector<std::string> shown(const Pieces& pieces) {
  std::vector<std::string> out;
  for (const auto& p : pieces)
    out.push_back(rank_ranges(p.ranks) + ":" + std::to_string(p.stream) + ":" + p.text);
  return out;
}
}  // namespace

TEST(Repeats, ALineEveryRankPrintsGoesOnceAndLinesThatDifferKeepRankOrder) {
  Repeats rep({0, 1, 2, 3, 4, 5, 6, 7}, 60);
  Pieces got;
  for (int r : {3, 0, 7, 1, 2, 4, 6, 5}) {  // arrival order is not rank order
    for (auto* p : {"loss 0.31\n", r == 5 ? "odd one out\n" : "same\n"}) {
      auto out = rep.feed(r, 1, p, 0.0);
      got.insert(got.end(), out.begin(), out.end());
    }
  }
  EXPECT_EQ(shown(got), (std::vector<std::string>{"0-7:1:loss 0.31\n", "0-4,6,7:1:same\n",
                                                  "5:1:odd one out\n"}));
  EXPECT_FALSE(rep.next_due());
}

TEST(Repeats, ALineThePeersNeverPrintGoesAfterTheWindowAndStragglersCollapseAmongThemselves) {
  Repeats rep({0, 1, 2, 3}, 0.2);
  EXPECT_TRUE(rep.feed(0, 1, "only rank 0\n", 10.0).empty());
  EXPECT_EQ(*rep.next_due(), 10.2);
  EXPECT_TRUE(rep.release(10.1).empty());
  EXPECT_EQ(shown(rep.release(10.2)), (std::vector<std::string>{"0:1:only rank 0\n"}));
  // The round again, for the others: rank 0 gave its line already and is not waited for.
  for (int r : {1, 2}) EXPECT_TRUE(rep.feed(r, 1, "only rank 0\n", 11.0).empty());
  EXPECT_EQ(shown(rep.done(3, 11.0)), (std::vector<std::string>{"1,2:1:only rank 0\n"}));
}

TEST(Repeats, BarsAndUnendedLinesGoAsTheyAreAfterTheLinesBeforeThem) {
  Repeats rep({0, 1}, 60);
  EXPECT_TRUE(rep.feed(0, 1, "epoch 1\n", 0).empty());
  EXPECT_EQ(shown(rep.feed(0, 1, "10%\r100%", 0)),
            (std::vector<std::string>{"0:1:epoch 1\n", "0:1:10%\r"}));
  EXPECT_EQ(shown(rep.feed(0, 1, "\n", 0)), (std::vector<std::string>{"0:1:100%\n"}));
  EXPECT_TRUE(rep.feed(1, 2, "loss: ", 0).empty());
  EXPECT_EQ(shown(rep.release(0, true)), (std::vector<std::string>{"1:2:loss: "}));
}
