#include "ddip/streams.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "helpers.hpp"

using namespace ddip;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// One rank's streams on a loop, its pipes' write ends kept here, and what was emitted in order
// ("out:TEXT", "err:TEXT", "frame:SEQ", "exit:TEXT").
struct Rank {
  EventLoop loop;
  std::vector<std::string> seen;
  RankStreams streams{loop, 1, 20ms, [this](Event e) { seen.push_back(describe(e)); }};
  Pipe out = make_pipe(true), err = make_pipe(true);

  Rank() { streams.attach(0, std::move(out.read), std::move(err.read)); }

  static std::string describe(const Event& e) {
    switch (e.kind) {
      case Event::kOutput:
        return (e.stream == 1 ? "out:" : "err:") + e.text;
      case Event::kExited:
        return "exit:" + e.text;
      default:
        return "frame:" + std::to_string(e.frame.seq);
    }
  }
  static Event frame(uint16_t kind, uint64_t seq) {
    return Event::of_frame(0, Frame::make(kind, 0, seq));
  }
  // Loop rounds until `n` events were emitted (or 10 s).
  void run_until(size_t n) {
    auto deadline = Clock::now() + 10s;
    while (seen.size() < n && Clock::now() < deadline) {
      loop.run_once(Clock::now() + 10ms);
      streams.flush_due(Clock::now());
    }
  }
};

}  // namespace

TEST(RankStreams, LinesFromThePipesAreEmittedAsTheyArrive) {
  Rank r;
  test::write_fd(r.out.write.get(), "one\ntwo\n");
  r.run_until(1);
  test::write_fd(r.err.write.get(), "oops\n");
  r.run_until(2);
  EXPECT_EQ(r.seen, (std::vector<std::string>{"out:one\ntwo\n", "err:oops\n"}));
}

TEST(RankStreams, APartialLineWaitsForTheDelayThenGoesAnyway) {
  Rank r;
  test::write_fd(r.out.write.get(), "50%");
  r.loop.run_once(Clock::now() + 1s);  // read: held back as a partial line
  EXPECT_TRUE(r.seen.empty());
  auto due = r.streams.next_due();
  ASSERT_TRUE(due);
  EXPECT_LE(*due, Clock::now() + 20ms);
  r.streams.flush_due(*due - 1ms);  // not yet
  EXPECT_TRUE(r.seen.empty());
  r.streams.flush_due(*due);
  EXPECT_EQ(r.seen, (std::vector<std::string>{"out:50%"}));
  EXPECT_FALSE(r.streams.next_due());
}

TEST(RankStreams, AReplyComesAfterEverythingPrintedBeforeIt) {
  Rank r;
  // Written, never read by the loop: the reply itself makes the streams read it first.
  test::write_fd(r.out.write.get(), "printed\nno newline");
  test::write_fd(r.err.write.get(), "warned\n");
  r.streams.after_output(0, Rank::frame(kDone, 7));
  // Both pipes are read first; the partial line is flushed after them, still before the reply.
  EXPECT_EQ(r.seen, (std::vector<std::string>{"out:printed\n", "err:warned\n", "out:no newline",
                                              "frame:7"}));
}

TEST(RankStreams, ADisplayKeepsItsPlaceAmongPrints) {
  Rank r;
  test::write_fd(r.out.write.get(),
                 "before\n" + std::string(kDisplayMarker) + "after\n");
  r.run_until(1);
  r.loop.run_once(Clock::now() + 20ms);
  // "after" is held until the display it follows has arrived.
  EXPECT_EQ(r.seen, (std::vector<std::string>{"out:before\n"}));
  r.streams.display(0, Rank::frame(kDisplay, 3));
  EXPECT_EQ(r.seen, (std::vector<std::string>{"out:before\n", "frame:3", "out:after\n"}));
}

TEST(RankStreams, ADisplayWhoseMarkerWasNotReadYetIsReadFirst) {
  Rank r;
  test::write_fd(r.out.write.get(), "before\n" + std::string(kDisplayMarker));
  r.streams.display(0, Rank::frame(kDisplay, 4));
  EXPECT_EQ(r.seen, (std::vector<std::string>{"out:before\n", "frame:4"}));
}

TEST(RankStreams, AnExitComesAfterAllOutputWithTheLastLinesOfStderr) {
  Rank r;
  test::write_fd(r.out.write.get(), "bye\n");
  test::write_fd(r.err.write.get(), "Traceback\nValueError: no\n");
  r.out.write.reset();
  r.err.write.reset();
  Event e;
  e.kind = Event::kExited;
  r.streams.exited(0, std::move(e));
  ASSERT_EQ(r.seen.size(), 3u);
  EXPECT_EQ(r.seen[0], "out:bye\n");
  EXPECT_EQ(r.seen[1], "err:Traceback\nValueError: no\n");
  EXPECT_EQ(r.seen[2], "exit:Traceback\nValueError: no");
}

TEST(RankStreams, OutputFromALinkGoesInOrderAndKeepsItsStream) {
  Rank r;
  r.streams.output(0, 2, "remote err\n");
  r.streams.output(0, 1, "remote out\n");
  r.streams.output(0, 99, "unknown stream: stdout\n");
  EXPECT_EQ(r.seen, (std::vector<std::string>{"err:remote err\n", "out:remote out\n",
                                              "out:unknown stream: stdout\n"}));
}
