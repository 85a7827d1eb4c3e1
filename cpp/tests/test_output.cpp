#include "ddip/output.hpp"

#include <gtest/gtest.h>

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

TEST(RankOutput, StreamsAreIndependent) {
  RankOutput o;
  EXPECT_EQ(o.feed(RankOutput::kStdout, "out"), "");
  EXPECT_EQ(o.feed(RankOutput::kStderr, "err\n"), "err\n");
  EXPECT_EQ(o.feed(RankOutput::kStdout, "!\n"), "out!\n");
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
