// The link protocol's payloads and ticket (link_protocol.hpp): each round-trips, and one that
// ends early or claims more than it holds is refused, never read past its end.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ddip/auth.hpp"
#include "ddip/link_protocol.hpp"

using namespace ddip;

TEST(LinkProtocol, SlotListsRoundTripAndACorruptOneIsRefused) {
  EXPECT_EQ(decode_slots(encode_slots({})), std::vector<int>{});
  EXPECT_EQ(decode_slots(encode_slots({3, 1, 7})), (std::vector<int>{3, 1, 7}));
  std::string lying = encode_slots({1}).substr(0, 4) + std::string(4, '\0');
  lying[0] = 100;  // claims 100 slots, carries one
  EXPECT_THROW(decode_slots(lying), std::runtime_error);
}

TEST(LinkProtocol, SpawnListsRoundTrip) {
  SpawnSpec a;
  a.argv = {"python", "-c", "pass"};
  a.env = {"RANK=3", "EMPTY="};
  a.cwd = "/work";
  SpawnSpec b;
  b.argv = {"x"};
  auto back = decode_spawn(encode_spawn({{3, a}, {5, b}}));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].first, 3);
  EXPECT_EQ(back[0].second.argv, a.argv);
  EXPECT_EQ(back[0].second.env, a.env);
  EXPECT_EQ(back[0].second.cwd, "/work");
  EXPECT_EQ(back[1].first, 5);
  EXPECT_EQ(back[1].second.argv, b.argv);
  EXPECT_TRUE(back[1].second.env.empty());
  std::string cut = encode_spawn({{3, a}});
  cut.resize(cut.size() - 1);
  EXPECT_THROW(decode_spawn(cut), std::runtime_error);
}

TEST(LinkProtocol, ExitsAndSignalsRoundTrip) {
  auto [status, tail] = decode_exit(encode_exit(ExitStatus{0, 9, false}, "last\nlines"));
  EXPECT_EQ(status.code, 0);
  EXPECT_EQ(status.signal, 9);
  EXPECT_FALSE(status.unknown);
  EXPECT_EQ(tail, "last\nlines");
  EXPECT_TRUE(decode_exit(encode_exit(ExitStatus{0, 0, true}, "")).first.unknown);
  EXPECT_THROW(decode_exit("abc"), std::runtime_error);
  EXPECT_EQ(decode_signal(encode_signal(2, true)), std::make_pair(2, true));
  EXPECT_EQ(decode_signal(encode_signal(15, false)), std::make_pair(15, false));
}

TEST(LinkProtocol, TicketsRoundTrip) {
  LinkTicket t{"10.0.0.1", 4242, 3, random_bytes(32)};
  LinkTicket back = LinkTicket::decode(t.encode());
  EXPECT_EQ(back.address, "10.0.0.1");
  EXPECT_EQ(back.port, 4242);
  EXPECT_EQ(back.host, 3u);
  EXPECT_EQ(back.key, t.key);
  EXPECT_FALSE(back.standing);
  EXPECT_EQ(back.warm, 0u);
  t.standing = true;
  t.warm = 2;
  back = LinkTicket::decode(t.encode());
  EXPECT_TRUE(back.standing);
  EXPECT_EQ(back.warm, 2u);
  EXPECT_EQ(back.reply_window_ms, 0u);
  t.reply_window_ms = 250;
  EXPECT_EQ(LinkTicket::decode(t.encode()).reply_window_ms, 250u);
  EXPECT_THROW(LinkTicket::decode("hello"), std::invalid_argument);
}

TEST(LinkProtocol, FanOutsAndGatheredRepliesRoundTrip) {
  FanOut f = decode_fan_out(encode_fan_out(kRequest, {4, 5, 6}, std::string("a\0b", 3)));
  EXPECT_EQ(f.kind, kRequest);
  EXPECT_EQ(f.slots, (std::vector<int>{4, 5, 6}));
  EXPECT_EQ(f.payload, std::string("a\0b", 3));
  std::string cut = encode_fan_out(kRequest, {4, 5}, "payload");
  cut.resize(cut.size() - 2);
  EXPECT_THROW(decode_fan_out(cut), std::runtime_error);
  auto back = decode_replies(encode_replies({{{1, 3}, "same"}, {{2}, "other"}}));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].slots, (std::vector<int>{1, 3}));
  EXPECT_EQ(back[0].payload, "same");
  EXPECT_EQ(back[1].slots, (std::vector<int>{2}));
  EXPECT_EQ(back[1].payload, "other");
  std::string lying = encode_replies({{{1}, "x"}});
  lying[0] = 100;  // claims 100 entries, carries one
  EXPECT_THROW(decode_replies(lying), std::runtime_error);
  EXPECT_THROW(decode_replies(encode_replies({{{}, "no worker"}})), std::runtime_error);
}

namespace {

using Clock = ReplyGather::Clock;

std::shared_ptr<const std::string> bytes(const std::string& s) {
  return std::make_shared<const std::string>(s);
}

// Each frame's entries as (slots, payload).
std::vector<std::pair<std::vector<int>, std::string>> entries(const Frame& f) {
  EXPECT_EQ(f.kind, kReplies);
  EXPECT_EQ(f.rank, kHostRank);
  std::vector<std::pair<std::vector<int>, std::string>> out;
  for (auto& r : decode_replies(f.data())) out.emplace_back(r.slots, r.payload);
  return out;
}

}  // namespace

TEST(ReplyGather, AlikeRepliesBecomeOneEntryOnceEveryWorkerReplied) {
  ReplyGather g;
  auto t = Clock::now();
  g.expect(9, {1, 2, 3, 4});
  EXPECT_TRUE(g.add(2, 9, bytes("None"), t));
  EXPECT_TRUE(g.add(1, 9, bytes("None"), t));
  EXPECT_TRUE(g.add(4, 9, bytes("4"), t));
  EXPECT_TRUE(g.take(t).empty()) << "worker 3 has not replied, and the window is open";
  EXPECT_TRUE(g.holds(1));
  EXPECT_FALSE(g.holds(3));
  EXPECT_TRUE(g.add(3, 9, bytes("None"), t));
  auto frames = g.take(t);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(frames[0].seq, 9u);
  using E = std::vector<std::pair<std::vector<int>, std::string>>;
  EXPECT_EQ(entries(frames[0]), (E{{{2, 1, 3}, "None"}, {{4}, "4"}}));
  EXPECT_FALSE(g.holds(1));
  EXPECT_TRUE(g.take(t).empty());
  EXPECT_FALSE(g.next_due());
  EXPECT_FALSE(g.add(1, 9, bytes("None"), t)) << "a second reply of the request is not held";
}

TEST(ReplyGather, AWorkerThatHangsHoldsTheOthersBackForTheWindowOnly) {
  ReplyGather g;
  auto t = Clock::now();
  g.expect(3, {1, 2, 3});
  EXPECT_TRUE(g.add(1, 3, bytes("a"), t));
  EXPECT_TRUE(g.add(2, 3, bytes("a"), t + std::chrono::milliseconds(10)));
  ASSERT_TRUE(g.next_due());
  EXPECT_EQ(*g.next_due(), t + ReplyGather::kWindow);
  EXPECT_TRUE(g.take(t + ReplyGather::kWindow - std::chrono::milliseconds(1)).empty());
  auto frames = g.take(t + ReplyGather::kWindow);
  ASSERT_EQ(frames.size(), 1u);
  using E = std::vector<std::pair<std::vector<int>, std::string>>;
  EXPECT_EQ(entries(frames[0]), (E{{{1, 2}, "a"}}));
  // The late one, when it comes, completes the request: it goes at once.
  auto late = t + std::chrono::seconds(5);
  EXPECT_TRUE(g.add(3, 3, bytes("a"), late));
  frames = g.take(late);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(entries(frames[0]), (E{{{3}, "a"}}));
}

TEST(ReplyGather, AWorkerThatLeftIsNotWaitedForAndUnexpectedRepliesAreNotHeld) {
  ReplyGather g;
  auto t = Clock::now();
  EXPECT_FALSE(g.add(1, 4, bytes("x"), t)) << "no request was fanned out";
  g.expect(4, {1, 2});
  EXPECT_FALSE(g.add(1, 5, bytes("x"), t)) << "another request's";
  EXPECT_FALSE(g.add(7, 4, bytes("x"), t)) << "a worker it was not sent to";
  EXPECT_TRUE(g.add(1, 4, bytes("x"), t));
  g.gone(2);
  auto frames = g.take(t);
  ASSERT_EQ(frames.size(), 1u);
  // take(all): whatever is held, before a worker's later output or exit.
  g.expect(6, {1, 2});
  EXPECT_TRUE(g.add(2, 6, bytes("y"), t));
  EXPECT_TRUE(g.take(t).empty());
  frames = g.take(t, true);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_FALSE(g.holds(2));
}

TEST(ReplyGather, ANewRequestToAWorkerReleasesItFromAnOlderOnesWait) {
  ReplyGather g;
  auto t = Clock::now();
  g.expect(1, {1, 2});
  EXPECT_TRUE(g.add(1, 1, bytes("x"), t));
  g.expect(2, {2, 3});  // worker 2 never replied to request 1 (the kernel moved on)
  auto frames = g.take(t);
  ASSERT_EQ(frames.size(), 1u) << "request 1 waits for nobody now";
  EXPECT_EQ(frames[0].seq, 1u);
  EXPECT_FALSE(g.add(2, 1, bytes("x"), t));
  EXPECT_TRUE(g.add(2, 2, bytes("y"), t));
}
