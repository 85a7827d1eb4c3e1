// The control channel between two `ddip run`s (cpp/tools/run_channel.hpp), over real pipes: a
// host's end (Upstream) hears messages, end of file, garbage and silence; the starting side's
// (Downstream) tells hosts, pings them, and kills launchers that can't hear Kill.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

#include "helpers.hpp"
#include "run_channel.hpp"

using namespace ddip::run;
namespace proto = ddip::run::protocol;
using ddip::Fd;
using std::chrono::milliseconds;
using ddip::test::read_ready;

namespace {

struct Heard {
  std::vector<proto::Control> messages;
  std::vector<std::string> closed, lost;
  Upstream::Hooks hooks() {
    return {[this](const proto::Control& m) { messages.push_back(m); },
            [this](std::string why) { closed.push_back(why); },
            [this](std::string why) { lost.push_back(why); }};
  }
};

}  // namespace

TEST(RunChannel, PingEveryAndSeconds) {
  EXPECT_EQ(ping_every(milliseconds(30000)), milliseconds(5000));
  EXPECT_EQ(ping_every(milliseconds(6000)), milliseconds(1000));
  EXPECT_EQ(ping_every(milliseconds(300)), milliseconds(100));
  EXPECT_EQ(seconds_text(milliseconds(30000)), "30");
  EXPECT_EQ(seconds_text(milliseconds(500)), "0.5");
}

TEST(RunChannel, UpstreamHearsMessagesThenEndOfFile) {
  RunLoop loop;
  Terminal terminal;
  Heard heard;
  Upstream up(loop, terminal, milliseconds(30000), heard.hooks());
  auto p = ddip::make_pipe();
  ASSERT_EQ(up.open(std::move(p.read)), "");
  ddip::test::write_fd(p.write.get(), proto::encode(proto::Control{proto::Signal{SIGINT}}) +
                                          proto::encode(proto::Control{proto::Ping{}}) +
                                          proto::encode(proto::Control{proto::Stop{}}));
  loop.run_until([&] { return heard.messages.size() == 3; });
  EXPECT_EQ(heard.messages, (std::vector<proto::Control>{proto::Signal{SIGINT}, proto::Ping{}, proto::Stop{}}));
  p.write.reset();
  loop.run_until([&] { return !heard.closed.empty(); });
  EXPECT_NE(heard.closed[0].find("its launcher's stdin closed"), std::string::npos);
  EXPECT_TRUE(heard.lost.empty());
}

TEST(RunChannel, UpstreamTakesGarbageForALostLink) {
  RunLoop loop;
  Terminal terminal;
  Heard heard;
  Upstream up(loop, terminal, milliseconds(30000), heard.hooks());
  auto p = ddip::make_pipe();
  ASSERT_EQ(up.open(std::move(p.read)), "");
  ddip::test::write_fd(p.write.get(), proto::encode(proto::Control{proto::Kill{}}) + "\x1e" "ddip halt\n" +
                                          proto::encode(proto::Control{proto::Stop{}}));
  loop.run_until([&] { return !heard.lost.empty(); });
  EXPECT_EQ(heard.messages, (std::vector<proto::Control>{proto::Kill{}}));  // nothing after the garbage
  EXPECT_EQ(heard.lost[0].rfind("the ddip run that started it sent a malformed ddip record \"\\x1eddip halt\": unknown kind", 0), 0u)
      << heard.lost[0];
}

TEST(RunChannel, UpstreamTakesSilenceForALostLinkOnce) {
  RunLoop loop;
  Terminal terminal;
  Heard heard;
  Upstream up(loop, terminal, milliseconds(200), heard.hooks());
  auto p = ddip::make_pipe();
  const auto start = Clock::now();
  ASSERT_EQ(up.open(std::move(p.read)), "");
  loop.run_until([&] { return !heard.lost.empty(); });
  EXPECT_GE(Clock::now() - start, milliseconds(200));
  EXPECT_EQ(heard.lost, (std::vector<std::string>{"it heard nothing from the ddip run that started it for 0.2 s"}));
  // Said once: the loop has no deadline of the channel's left (it would return at once).
  bool later = false;
  loop.deadline([&]() -> std::optional<Clock::time_point> {
    if (later) return std::nullopt;
    return start + milliseconds(600);
  }, [&](Clock::time_point) { later = true; });
  loop.run_until([&] { return later; });
  EXPECT_EQ(heard.lost.size(), 1u);
}

TEST(RunChannel, UpstreamWithoutStdinSaysSo) {
  RunLoop loop;
  Terminal terminal;
  Heard heard;
  Upstream up(loop, terminal, milliseconds(30000), heard.hooks());
  char path[] = "/tmp/ddip-test-run-channel-XXXXXX";
  Fd file(::mkstemp(path));
  ::unlink(path);
  EXPECT_EQ(up.open(std::move(file)),
            "its launcher gives it no stdin to listen to (docker and kubectl exec need -i)");
}

TEST(RunChannel, UpstreamSendsReportsOnItsStderr) {
  RunLoop loop;
  auto err = ddip::make_pipe(true);
  Terminal terminal(milliseconds(1000), -1, err.write.get());
  Heard heard;
  Upstream up(loop, terminal, milliseconds(30000), heard.hooks());
  proto::Report done = proto::NodeDone{{{2, "exit code 0"}}};
  up.send(done);
  EXPECT_EQ(read_ready(err.read.get()), proto::encode(done));
}

TEST(RunChannel, DownstreamTellsPingsAndKillsLaunchers) {
  ::signal(SIGPIPE, SIG_IGN);
  RunLoop loop;
  std::vector<size_t> killed;
  // Link timeout 0.6 s: a ping every 0.1 s; the launchers' SIGKILL 0.1 s after Kill.
  Downstream down(loop, milliseconds(600), [&](size_t u) { killed.push_back(u); }, milliseconds(100));
  auto a = ddip::make_pipe(true), b = ddip::make_pipe(true);
  down.add(3, std::move(a.write));
  down.add(4, std::move(b.write));
  down.tell(proto::Stop{});
  EXPECT_EQ(read_ready(a.read.get()), proto::encode(proto::Control{proto::Stop{}}));
  EXPECT_EQ(read_ready(b.read.get()), proto::encode(proto::Control{proto::Stop{}}));
  down.ended(3);  // host of unit 3: its launcher exited
  down.tell(proto::Signal{SIGTERM});
  EXPECT_EQ(read_ready(b.read.get()), proto::encode(proto::Control{proto::Signal{SIGTERM}}));
  std::string pinged;
  loop.run_until([&] {
    pinged += read_ready(b.read.get());
    return pinged.size() >= 2 * proto::encode(proto::Control{proto::Ping{}}).size();
  });
  EXPECT_EQ(pinged, proto::encode(proto::Control{proto::Ping{}}) + proto::encode(proto::Control{proto::Ping{}}));
  const auto kill_sent = Clock::now();
  down.kill();
  EXPECT_EQ(read_ready(b.read.get()), proto::encode(proto::Control{proto::Kill{}}));
  loop.run_until([&] { return !killed.empty(); });
  EXPECT_GE(Clock::now() - kill_sent, milliseconds(100));
  EXPECT_EQ(killed, (std::vector<size_t>{4}));  // not the one that had exited
  // A host that can't take a message (its reader gone) is told no more.
  b.read.reset();
  down.tell(proto::Stop{});
  down.tell(proto::Stop{});
}

TEST(RunChannel, DownstreamShipsFilesWithoutBlockingAndMessagesQueueBehind) {
  ::signal(SIGPIPE, SIG_IGN);
  RunLoop loop;
  Downstream down(loop, milliseconds(30000), [](size_t) {});
  auto a = ddip::make_pipe(true);
  down.add(0, std::move(a.write));
  std::string files(1 << 20, '\0');  // far more than a pipe holds
  for (size_t i = 0; i < files.size(); ++i) files[i] = static_cast<char>(i * 7 + i / 4096);
  down.ship(0, files);  // returns at once: the rest goes as the reader takes it
  down.tell(proto::Stop{});
  const std::string want = files + proto::encode(proto::Control{proto::Stop{}});
  std::string got;
  loop.run_until([&] {
    got += read_ready(a.read.get());
    return got.size() >= want.size();
  });
  EXPECT_TRUE(got == want) << "the files, then the message told meanwhile, in order";
  // A host whose reader is gone while files are queued is told no more.
  down.ship(0, files);
  a.read.reset();
  loop.run_once(Clock::now() + milliseconds(50));
  down.tell(proto::Stop{});
}
