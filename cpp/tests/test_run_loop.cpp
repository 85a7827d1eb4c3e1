// `ddip run`'s event loop (cpp/tools/run_loop.hpp): handlers for readable fds, deadlines, and
// unwatching in the middle of a round.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <system_error>

#include "helpers.hpp"
#include "run_loop.hpp"

using namespace ddip::run;
using ddip::Fd;
using std::chrono::milliseconds;

namespace {

std::string read_some(int fd) {
  char buf[256];
  ssize_t n = ::read(fd, buf, sizeof buf);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

}  // namespace

TEST(RunLoop, CallsTheHandlerOfAReadableFd) {
  EventLoop loop;
  auto p = ddip::make_pipe(true);
  std::string got;
  uint64_t id = loop.watch(p.read.get(), [&] { got += read_some(p.read.get()); });
  ddip::test::write_fd(p.write.get(), "hello");
  loop.run_until([&] { return got == "hello"; });
  EXPECT_EQ(got, "hello");
  // Unwatched: more data is not read.
  loop.unwatch(id);
  ddip::test::write_fd(p.write.get(), "more");
  bool fired = false;
  const auto until = Clock::now() + milliseconds(20);
  loop.deadline([&]() -> std::optional<Clock::time_point> {
    if (fired) return std::nullopt;
    return until;
  }, [&](Clock::time_point) { fired = true; });
  loop.run_until([&] { return fired; });
  EXPECT_EQ(got, "hello");
}

TEST(RunLoop, DeadlinesRunOnceDueInTheOrderAdded) {
  EventLoop loop;
  const auto start = Clock::now();
  std::vector<std::pair<std::string, Clock::time_point>> fired;
  std::optional<Clock::time_point> a = start + milliseconds(60), b = start + milliseconds(30);
  loop.deadline([&] { return a; }, [&](Clock::time_point now) { fired.push_back({"a", now}); a.reset(); });
  loop.deadline([&] { return b; }, [&](Clock::time_point now) { fired.push_back({"b", now}); b.reset(); });
  loop.run_until([&] { return fired.size() == 2; });
  ASSERT_EQ(fired.size(), 2u);
  EXPECT_EQ(fired[0].first, "b");
  EXPECT_GE(fired[0].second, start + milliseconds(30));
  EXPECT_EQ(fired[1].first, "a");
  EXPECT_GE(fired[1].second, start + milliseconds(60));
}

TEST(RunLoop, AHandlerMayUnwatchAnotherFdOfTheSameRound) {
  EventLoop loop;
  auto p1 = ddip::make_pipe(true), p2 = ddip::make_pipe(true);
  ddip::test::write_fd(p1.write.get(), "1");
  ddip::test::write_fd(p2.write.get(), "2");  // both readable before the loop waits
  int calls = 0;
  uint64_t id1 = 0, id2 = 0;
  id1 = loop.watch(p1.read.get(), [&] {
    ++calls;
    loop.unwatch(id2);
    loop.unwatch(id1);  // itself too: the handler is not destroyed under it
  });
  id2 = loop.watch(p2.read.get(), [&] {
    ++calls;
    loop.unwatch(id1);
    loop.unwatch(id2);
  });
  loop.run_until([&] { return calls > 0; });
  // Whichever ran first unwatched the other: its pending event of this round is dropped.
  EXPECT_EQ(calls, 1);
}

TEST(RunLoop, TryWatchRefusesWhatEpollCannotWatch) {
  EventLoop loop;
  char path[] = "/tmp/ddip-test-run-loop-XXXXXX";
  Fd file(::mkstemp(path));
  ASSERT_TRUE(file);
  ::unlink(path);
  EXPECT_EQ(loop.try_watch(file.get(), [] {}), std::nullopt);
  EXPECT_THROW(loop.watch(file.get(), [] {}), std::system_error);
}
