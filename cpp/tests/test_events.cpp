#include <gtest/gtest.h>
#include <sys/mman.h>

#include <thread>
#include <tuple>
#include <vector>

#include "ddip/events.hpp"
#include "ddip/output.hpp"

using namespace ddip;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(Events, OfFrameTellsATruncatedFrameApart) {
  Frame f = Frame::make(kDone, 0, 3, "reply");
  EXPECT_EQ(Event::of_frame(2, f).kind, Event::kFrame);
  f.truncated = true;
  Event e = Event::of_frame(2, std::move(f));
  EXPECT_EQ(e.kind, Event::kTruncated);
  EXPECT_EQ(e.slot, 2);
  EXPECT_EQ(e.frame.seq, 3u);
  EXPECT_EQ(e.frame.data(), "reply");
}

TEST(EventQueue, PopsInOrderAndTimesOutWhenEmpty) {
  EventQueue q(2, 1 << 20);
  q.push(Event::output(0, 1, "a"));
  q.push(Event::output(1, 2, "b"));
  EXPECT_EQ(q.pop(0ms)->text, "a");
  EXPECT_EQ(q.pop(0ms)->text, "b");
  EXPECT_FALSE(q.pop(0ms));
  auto t0 = Clock::now();
  EXPECT_FALSE(q.pop(30ms));
  EXPECT_GE(Clock::now() - t0, 30ms);
}

TEST(EventQueue, APushFromAnotherThreadWakesAWaiter) {
  EventQueue q(1, 1 << 20);
  std::thread pusher([&] { q.push(Event::output(0, 1, "late")); });
  auto e = q.pop(10s);
  pusher.join();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->text, "late");
}

TEST(EventQueue, CallsOnPushForEveryEventQueuedSayingWhatItIs) {
  std::vector<Pushed> pushes;
  EventQueue q(1, 10, [&](const Pushed& p) { pushes.push_back(p); });
  q.push(Event::output(0, 1, "12345"));
  q.push(Event::of_frame(0, Frame::make(kDone, 0, 7, "reply")));
  Frame with_buffer = Frame::make(kDone, 0, 8, "reply");
  with_buffer.fds = std::make_shared<std::vector<Fd>>();
  with_buffer.fds->emplace_back(::memfd_create("buffer", MFD_CLOEXEC));
  q.push(Event::of_frame(0, std::move(with_buffer)));
  q.push(Event::of_frame(0, Frame::make(kDisplay, 0, 9, "shown")));
  Event exited;
  exited.kind = Event::kExited;
  q.push(std::move(exited));
  ASSERT_EQ(pushes.size(), 5u);
  auto said = [&](size_t i) {
    return std::tuple(pushes[i].replies, pushes[i].plain_reply, pushes[i].seq);
  };
  EXPECT_EQ(said(0), std::tuple(size_t(0), false, uint64_t(0)));  // output
  EXPECT_EQ(said(1), std::tuple(size_t(1), true, uint64_t(7)));   // a reply an agent may gather
  EXPECT_EQ(said(2), std::tuple(size_t(1), false, uint64_t(8)));  // one that carries a buffer
  EXPECT_EQ(said(3), std::tuple(size_t(0), false, uint64_t(9)));  // a display: no reply
  EXPECT_FALSE(pushes[4].plain_reply);                            // an exit: no reply will come
  EXPECT_EQ(pushes[4].replies, 1u);
}

TEST(EventQueue, UnreadOutputBeyondTheCapIsDroppedAndTheDropReported) {
  EventQueue q(2, 10);
  q.push(Event::output(0, 1, "123456"));
  q.push(Event::output(0, 1, "789012"));  // 12 bytes unread: over the cap of 10, dropped
  q.push(Event::output(0, 1, "345678"));
  q.push(Event::output(1, 1, "other"));   // another rank has a cap of its own
  EXPECT_EQ(q.dropped_output(0), 12u);
  EXPECT_EQ(q.dropped_output(1), 0u);
  EXPECT_EQ(q.pop(0ms)->text, "123456");
  auto note = q.pop(0ms);
  ASSERT_TRUE(note);
  EXPECT_EQ(note->stream, RankOutput::kStderr);
  EXPECT_NE(note->text.find("rank output is being dropped"), std::string::npos) << note->text;
  EXPECT_EQ(q.pop(0ms)->text, "other");
  // Read, so there is room again: the next output says how much was lost, then goes through.
  q.push(Event::output(0, 1, "again"));
  auto lost = q.pop(0ms);
  EXPECT_NE(lost->text.find("12 bytes of rank output were dropped"), std::string::npos)
      << lost->text;
  EXPECT_EQ(q.pop(0ms)->text, "again");
  EXPECT_EQ(q.dropped_output(0), 0u);
}

TEST(EventQueue, PopAllTakesEverythingQueuedAndFreesItsRoom) {
  EventQueue q(1, 10);
  q.push(Event::output(0, 1, "12345"));
  q.push(Event::output(0, 1, "67890"));
  std::vector<Event> got;
  EXPECT_EQ(q.pop_all(got), 1u);  // joined: the same rank's and stream's, not taken yet
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].text, "1234567890");
  EXPECT_EQ(q.pop_all(got), 0u);
  // Taken, so no longer unread: the cap has room again, nothing is dropped.
  q.push(Event::output(0, 1, "abcdefghij"));
  EXPECT_EQ(q.dropped_output(0), 0u);
  EXPECT_EQ(q.pop(0ms)->text, "abcdefghij");
}

TEST(EventQueue, QueuedOutputJoinsOnlyItsOwnRanksAndStreamsAndOnlyUpToAPiece) {
  EventQueue q(2, size_t(1) << 20);
  q.push(Event::output(0, 1, "a1\n"));
  q.push(Event::output(0, 1, "a2\n"));  // joins a1
  q.push(Event::output(0, 2, "e1\n"));  // another stream: its own
  q.push(Event::output(1, 1, "b1\n"));  // another rank: its own
  q.push(Event::output(0, 1, "a3\n"));  // not right after a2: its own, the order kept
  std::vector<Event> got;
  ASSERT_EQ(q.pop_all(got), 4u);
  EXPECT_EQ(got[0].text, "a1\na2\n");
  EXPECT_EQ(got[1].text, "e1\n");
  EXPECT_EQ(got[2].slot, 1);
  EXPECT_EQ(got[3].text, "a3\n");
  // A taken event is not added to; a piece grows to kJoinedOutput at most.
  q.push(Event::output(0, 1, "x"));
  ASSERT_EQ(q.pop(0ms)->text, "x");
  std::string line(1000, 'y');
  for (size_t i = 0; i < 2 * EventQueue::kJoinedOutput / line.size(); ++i)
    q.push(Event::output(0, 1, line));
  got.clear();
  q.pop_all(got);
  ASSERT_GE(got.size(), 2u);
  for (const Event& e : got) EXPECT_LE(e.text.size(), EventQueue::kJoinedOutput);
}

TEST(EventQueue, OnceDroppingEverySmallerPieceIsDroppedTooUntilTheReaderTakesSome) {
  EventQueue q(1, 10);
  q.push(Event::output(0, 1, "12345678"));
  q.push(Event::output(0, 1, "abcdef"));  // over the cap: dropped
  q.push(Event::output(0, 1, "xy"));      // would fit, but would leave a hole before it
  EXPECT_EQ(q.dropped_output(0), 8u);
  std::vector<Event> got;
  q.pop_all(got);
  ASSERT_EQ(got.size(), 2u);  // the text before the drop, and the note that dropping began
  EXPECT_EQ(got[0].text, "12345678");
  q.push(Event::output(0, 1, "after"));  // the reader took some: the tally, then the text
  got.clear();
  q.pop_all(got);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NE(got[0].text.find("8 bytes of rank output were dropped"), std::string::npos)
      << got[0].text;
  EXPECT_EQ(got[1].text, "after");
}

TEST(EventQueue, CloseWakesWaitersAndLeavesQueuedEventsToTake) {
  EventQueue q(1, 1 << 20);
  q.push(Event::output(0, 1, "last words"));
  EXPECT_FALSE(q.wait_closed(0ms));
  std::thread closer([&] { q.close(); });
  EXPECT_TRUE(q.wait_closed(-1ms));
  closer.join();
  EXPECT_TRUE(q.closed());
  EXPECT_EQ(q.pop(10s)->text, "last words");
  auto t0 = Clock::now();
  EXPECT_FALSE(q.pop(10s));  // closed and drained: at once
  EXPECT_LT(Clock::now() - t0, 5s);
}

// ready_at: a reader waiting for N replies takes what is queued once N are, or once the first
// event still queued has waited the window.
TEST(EventQueue, ReadyOnceEnoughRepliesAreQueuedOrTheFirstEventWaitedTheWindow) {
  EventQueue q(4, 1 << 20);
  EXPECT_FALSE(q.ready_at(0, 1h));
  auto before = Clock::now();
  q.push(Event::output(0, 1, "printed first\n"));
  auto first = *q.ready_at(3, 1h);  // output is no reply: the window from the first event
  EXPECT_GE(first, before + 1h);
  EXPECT_LE(first, Clock::now() + 1h);
  EXPECT_LE(*q.ready_at(0, 1h), Clock::now());  // a reader waiting for no reply: at once
  q.push(Event::of_frame(0, Frame::make(kDone, 0, 1, "")));
  EXPECT_EQ(*q.ready_at(3, 1h), first);
  q.push(Event::of_frame(1, Frame::make(kHello, 1, 0, "")));  // not a reply
  EXPECT_EQ(*q.ready_at(2, 1h), first);
  Event gone;
  gone.kind = Event::kExited;
  gone.slot = 2;
  q.push(gone);  // a worker that exited will not reply: it counts as one
  EXPECT_LE(*q.ready_at(2, 1h), Clock::now());
  EXPECT_EQ(*q.ready_at(3, 1h), first);
  // One reply that a host's agent gathered speaks for each of its workers.
  Event gathered = Event::of_frame(3, Frame::make(kDone, 3, 1, ""));
  gathered.slots = {3, 1};
  q.push(gathered);
  EXPECT_LE(*q.ready_at(4, 1h), Clock::now());
  // Taken one by one, the count follows; taken all, nothing is left to wait for.
  q.pop(0ms);  // the output
  q.pop(0ms);  // worker 0's reply
  EXPECT_LE(*q.ready_at(3, 1h), Clock::now());
  EXPECT_GT(*q.ready_at(4, 1h), Clock::now());
  std::vector<Event> all;
  q.pop_all(all);
  EXPECT_FALSE(q.ready_at(1, 1h));
  before = Clock::now();
  q.push(Event::output(0, 1, "later\n"));
  EXPECT_GE(*q.ready_at(1, 1h), before + 1h);
}

TEST(EventQueue, WaitReadyReturnsOnceTheRepliesAreInOrAtTheDeadline) {
  EventQueue q(2, 1 << 20);
  q.push(Event::output(0, 1, "first\n"));
  std::thread replier([&] {
    q.push(Event::of_frame(0, Frame::make(kDone, 0, 1, "")));
    q.push(Event::of_frame(1, Frame::make(kDone, 1, 1, "")));
  });
  EXPECT_TRUE(q.wait_ready(2, 1h, Clock::now() + 60s));  // the replies end it, not the deadline
  replier.join();
  std::vector<Event> all;
  EXPECT_EQ(q.pop_all(all), 3u);
  auto t0 = Clock::now();
  EXPECT_FALSE(q.wait_ready(1, 1h, t0 + 20ms));
  EXPECT_GE(Clock::now() - t0, 20ms);
  q.push(Event::output(0, 1, "alone\n"));
  EXPECT_TRUE(q.wait_ready(1, 1h, Clock::now() + 20ms));  // not enough replies: the deadline
}
