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
  EXPECT_THROW(LinkTicket::decode("hello"), std::invalid_argument);
}
