// `ddip run`'s event loop (cpp/tools/run_loop.hpp): run_until over the runtime's event loop, and
// deadlines polled after every wake-up. Watching fds itself is ddip::EventLoop's (test_event_loop).
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "helpers.hpp"
#include "run_loop.hpp"

using namespace ddip::run;
using std::chrono::milliseconds;

namespace {

std::string read_some(int fd) {
  char buf[256];
  ssize_t n = ::read(fd, buf, sizeof buf);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

}  // namespace

TEST(RunLoop, RunsFdHandlersUntilDoneAndADeadlineEndsAWaitWithNoFd) {
  RunLoop loop;
  auto p = ddip::make_pipe(true);
  std::string got;
  loop.watch(p.read.get(), EPOLLIN, [&](uint32_t) { got += read_some(p.read.get()); });
  ddip::test::write_fd(p.write.get(), "hello");
  loop.run_until([&] { return got == "hello"; });
  EXPECT_EQ(got, "hello");
  // Unwatched: more data is not read, and only the deadline wakes the loop.
  loop.unwatch(p.read.get());
  ddip::test::write_fd(p.write.get(), "more");
  bool fired = false;
  const auto until = Clock::now() + milliseconds(20);
  loop.deadline([&]() -> std::optional<Clock::time_point> {
    if (fired) return std::nullopt;
    return until;
  }, [&](Clock::time_point) { fired = true; });
  loop.run_until([&] { return fired; });
  EXPECT_EQ(got, "hello");
  EXPECT_GE(Clock::now(), until);
}

TEST(RunLoop, DeadlinesRunOnceDueInTheOrderAdded) {
  RunLoop loop;
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

TEST(RunLoop, ADeadlineSetByAnFdHandlerIsAskedForBeforeTheNextWait) {
  // A unit's deadline follows its state (a heartbeat heard): no re-arming, the loop asks again.
  RunLoop loop;
  auto p = ddip::make_pipe(true);
  std::optional<Clock::time_point> when;
  std::optional<Clock::time_point> fired_at;
  loop.watch(p.read.get(), EPOLLIN, [&](uint32_t) {
    read_some(p.read.get());
    when = Clock::now() + milliseconds(30);
  });
  loop.deadline([&] { return when; }, [&](Clock::time_point now) {
    fired_at = now;
    when.reset();
  });
  ddip::test::write_fd(p.write.get(), "x");
  const auto start = Clock::now();
  loop.run_until([&] { return fired_at.has_value(); });
  ASSERT_TRUE(fired_at);
  EXPECT_GE(*fired_at, start + milliseconds(30));
  EXPECT_LT(*fired_at, start + milliseconds(5000));  // woken by the deadline, not left waiting
}
