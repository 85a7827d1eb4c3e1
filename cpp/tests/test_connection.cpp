#include "ddip/connection.hpp"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace ddip;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

struct Ended {
  Connection::End how;
  std::string why;
};

// Runs the loop until `done` or 10 s.
template <typename Pred>
void run_until(EventLoop& loop, Pred done) {
  auto deadline = Clock::now() + 10s;
  while (!done() && Clock::now() < deadline) loop.run_once(Clock::now() + 100ms);
}

}  // namespace

TEST(Connection, DeliversEveryFrameInOrderThenTheEndWhenThePeerCloses) {
  EventLoop loop;
  auto [ours, theirs] = channel_pair();
  std::vector<uint64_t> seqs;
  std::optional<Ended> ended;
  Connection c(loop, std::move(ours), [&](Frame f) { seqs.push_back(f.seq); },
               [&](Connection::End how, const std::string& why) {
                 EXPECT_EQ(seqs.size(), 3u);  // the end comes after every frame
                 ended = Ended{how, why};
               });
  for (uint64_t i = 1; i <= 3; ++i) theirs.send(Frame::make(7, 0, i, "payload"));
  { Channel gone = std::move(theirs); }  // closes the peer
  run_until(loop, [&] { return ended.has_value(); });
  EXPECT_EQ(seqs, (std::vector<uint64_t>{1, 2, 3}));
  ASSERT_TRUE(ended);
  EXPECT_EQ(ended->how, Connection::End::kClosed);
  EXPECT_EQ(ended->why, "the connection closed");
  EXPECT_FALSE(loop.watching(c.fd()));
}

TEST(Connection, WritesWhatTheSocketCannotTakeNowOnceItIsWritable) {
  EventLoop loop;
  auto [ours, theirs] = channel_pair();
  Connection c(loop, std::move(ours), [](Frame) {}, [](Connection::End, const std::string&) {});
  // Far more than a socket buffer: the rest waits for EPOLLOUT while the peer reads.
  std::string big(8 << 20, 'x');
  big[12345] = 'y';
  c.send(Frame::make(1, 0, 1, big));
  c.send(Frame::make(2, 0, 2, "after"));
  EXPECT_TRUE(c.channel().wants_write());
  std::vector<Frame> got;
  set_nonblocking(theirs.fd());
  run_until(loop, [&] {
    while (theirs.read_some() == Channel::ReadResult::kProgress) {
    }
    while (auto f = theirs.next()) got.push_back(std::move(*f));
    return got.size() == 2;
  });
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].data(), big);
  EXPECT_EQ(got[1].data(), "after");
  EXPECT_FALSE(c.channel().wants_write());
}

TEST(Connection, ACorruptFrameEndsItAsUntrusted) {
  EventLoop loop;
  auto [ours, theirs] = channel_pair();
  std::optional<Ended> ended;
  Connection c(loop, std::move(ours), [](Frame) { FAIL() << "a corrupt frame was delivered"; },
               [&](Connection::End how, const std::string& why) { ended = Ended{how, why}; });
  test::write_fd(theirs.fd(), std::string(24, '\xff'));  // an impossible header
  run_until(loop, [&] { return ended.has_value(); });
  ASSERT_TRUE(ended);
  EXPECT_EQ(ended->how, Connection::End::kCorrupt);
  EXPECT_NE(ended->why.find("corrupt frame header"), std::string::npos) << ended->why;
}

TEST(Connection, ItsOwnerMayDestroyItFromAFrameCallback) {
  EventLoop loop;
  auto [ours, theirs] = channel_pair();
  std::optional<Connection> c;
  int frames = 0;
  bool ended = false;
  c.emplace(
      loop, std::move(ours),
      [&](Frame) {
        ++frames;
        c.reset();  // the first frame makes its owner drop the connection
      },
      [&](Connection::End, const std::string&) { ended = true; });
  int fd = c->fd();
  theirs.send(Frame::make(1, 0, 1));
  theirs.send(Frame::make(1, 0, 2));
  run_until(loop, [&] { return !c.has_value(); });
  loop.run_once(Clock::now() + 50ms);  // the second frame's readiness finds nothing watched
  EXPECT_EQ(frames, 1);
  EXPECT_FALSE(ended);
  EXPECT_FALSE(loop.watching(fd));
}

TEST(Connection, AFailedWriteEndsItOnce) {
  EventLoop loop;
  auto [ours, theirs] = channel_pair();
  std::vector<Ended> ends;
  Connection c(loop, std::move(ours), [](Frame) {},
               [&](Connection::End how, const std::string& why) { ends.push_back({how, why}); });
  ::shutdown(c.fd(), SHUT_WR);  // our own writes now fail with EPIPE
  c.send(Frame::make(1, 0, 1, "lost"));
  c.send(Frame::make(1, 0, 2, "ignored: it ended"));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].how, Connection::End::kFailed);
  EXPECT_NE(ends[0].why.find("could not write to it"), std::string::npos) << ends[0].why;
}
