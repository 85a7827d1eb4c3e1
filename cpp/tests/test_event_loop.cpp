#include "ddip/event_loop.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace ddip;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ddip::test::read_ready;

TEST(EventLoop, CallsAnFdsHandlerWithWhatIsReady) {
  EventLoop loop;
  Pipe p = make_pipe(true);
  std::string got;
  uint32_t seen = 0;
  loop.watch(p.read.get(), EPOLLIN, [&](uint32_t ev) {
    seen = ev;
    got += read_ready(p.read.get());
  });
  test::write_fd(p.write.get(), "hello");
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(got, "hello");
  EXPECT_TRUE(seen & EPOLLIN);
  EXPECT_TRUE(loop.watching(p.read.get()));
}

TEST(EventLoop, ModifyChangesWhatAnFdIsWatchedFor) {
  EventLoop loop;
  Pipe p = make_pipe(true);
  int calls = 0;
  loop.watch(p.write.get(), 0, [&](uint32_t ev) { calls += (ev & EPOLLOUT) ? 1 : 100; });
  loop.run_once(Clock::now() + 20ms);  // a pipe's write end is writable, but nobody asked
  EXPECT_EQ(calls, 0);
  loop.modify(p.write.get(), EPOLLOUT);
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(calls, 1);
}

TEST(EventLoop, AHandlerThatUnwatchesAnotherFdOfTheSameBatchStopsItsDelivery) {
  EventLoop loop;
  Pipe a = make_pipe(true), b = make_pipe(true);
  int a_calls = 0, b_calls = 0;
  // Whichever runs first unwatches the other: exactly one handler runs.
  loop.watch(a.read.get(), EPOLLIN, [&](uint32_t) {
    ++a_calls;
    loop.unwatch(b.read.get());
  });
  loop.watch(b.read.get(), EPOLLIN, [&](uint32_t) {
    ++b_calls;
    loop.unwatch(a.read.get());
  });
  test::write_fd(a.write.get(), "x");
  test::write_fd(b.write.get(), "y");
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(a_calls + b_calls, 1);
}

TEST(EventLoop, AHandlerMayUnwatchItselfAndItsFdCanBeWatchedAgain) {
  EventLoop loop;
  Pipe p = make_pipe(true);
  std::string first, second;
  loop.watch(p.read.get(), EPOLLIN, [&, fd = p.read.get()](uint32_t) {
    first += read_ready(fd);
    loop.unwatch(fd);  // destroys this very handler's owner; the call must finish safely
  });
  test::write_fd(p.write.get(), "one");
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(first, "one");
  EXPECT_FALSE(loop.watching(p.read.get()));
  loop.watch(p.read.get(), EPOLLIN, [&](uint32_t) { second += read_ready(p.read.get()); });
  test::write_fd(p.write.get(), "two");
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(first, "one");
  EXPECT_EQ(second, "two");
}

TEST(EventLoop, WatchingAnFdTwiceOrABadFdThrows) {
  EventLoop loop;
  Pipe p = make_pipe(true);
  loop.watch(p.read.get(), EPOLLIN, [](uint32_t) {});
  EXPECT_THROW(loop.watch(p.read.get(), EPOLLIN, [](uint32_t) {}), std::logic_error);
  EXPECT_THROW(loop.watch(-1, EPOLLIN, [](uint32_t) {}), std::system_error);
  EXPECT_THROW(loop.modify(12345, EPOLLIN), std::logic_error);
}

TEST(EventLoop, TryWatchRefusesWhatEpollCannotWatchAndWatchesTheRest) {
  EventLoop loop;
  char path[] = "/tmp/ddip-test-event-loop-XXXXXX";
  Fd file(::mkstemp(path));
  ASSERT_TRUE(file);
  ::unlink(path);
  Fd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(null);
  for (int fd : {file.get(), null.get()}) {
    EXPECT_FALSE(loop.try_watch(fd, EPOLLIN, [](uint32_t) {}));
    EXPECT_FALSE(loop.watching(fd));
    EXPECT_THROW(loop.watch(fd, EPOLLIN, [](uint32_t) {}), std::system_error);
  }
  EXPECT_THROW(loop.try_watch(-1, EPOLLIN, [](uint32_t) {}), std::system_error);  // not EPERM
  Pipe p = make_pipe(true);
  std::string got;
  EXPECT_TRUE(loop.try_watch(p.read.get(), EPOLLIN, [&](uint32_t) { got += read_ready(p.read.get()); }));
  test::write_fd(p.write.get(), "ok");
  loop.run_once(Clock::now() + 1s);
  EXPECT_EQ(got, "ok");
}

TEST(EventLoop, TimersRunInOrderWhenDueAndNotBefore) {
  EventLoop loop;
  std::vector<int> ran;
  auto t0 = Clock::now();
  loop.at(t0 + 60ms, [&] { ran.push_back(2); });
  loop.at(t0 + 20ms, [&] { ran.push_back(1); });
  auto cancelled = loop.at(t0 + 40ms, [&] { ran.push_back(99); });
  loop.cancel(cancelled);
  loop.cancel(cancelled);  // twice: a no-op
  while (ran.size() < 2) loop.run_once();  // no deadline: the timers bound the wait
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));
  EXPECT_GE(Clock::now() - t0, 60ms);
}

TEST(EventLoop, ATimerThatRearmsForNowRunsOncePerRound) {
  EventLoop loop;
  int runs = 0;
  std::function<void()> again = [&] {
    ++runs;
    loop.at(Clock::now(), again);
  };
  loop.at(Clock::now(), again);
  loop.run_once(Clock::now());
  EXPECT_EQ(runs, 1);
  loop.run_once(Clock::now());
  EXPECT_EQ(runs, 2);
}

TEST(EventLoop, PostWakesTheLoopFromAnotherThreadAndRunsThere) {
  EventLoop loop;
  std::thread::id ran_on;
  std::atomic<bool> done{false};
  std::thread poster([&] {
    std::this_thread::sleep_for(20ms);  // the loop is waiting with no deadline by then
    loop.post([&] {
      ran_on = std::this_thread::get_id();
      done = true;
    });
  });
  auto t0 = Clock::now();
  while (!done) loop.run_once(Clock::now() + 10s);
  poster.join();
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_LT(Clock::now() - t0, 5s);  // woken by the post, not by the deadline
}

TEST(EventLoop, ACommandThatThrowsDoesNotStopTheOthers) {
  EventLoop loop;
  int ran = 0;
  loop.post([] { throw std::runtime_error("gone"); });
  loop.post([&] { ++ran; });
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(ran, 1);
}

TEST(EventLoop, AHandlersExceptionReachesTheOwner) {
  EventLoop loop;
  Pipe p = make_pipe(true);
  loop.watch(p.read.get(), EPOLLIN, [](uint32_t) { throw std::runtime_error("broken fd"); });
  test::write_fd(p.write.get(), "x");
  EXPECT_THROW(loop.run_once(Clock::now() + 5s), std::runtime_error);
}

TEST(EventLoop, AfterCloseQueuedCommandsStillRunAndNewPostsThrowItsMessage) {
  EventLoop loop("the group's runtime has stopped");
  int ran = 0;
  loop.post([&] { ++ran; });
  loop.close();
  EXPECT_TRUE(loop.closed());
  try {
    loop.post([&] { ran += 100; });
    FAIL() << "post after close did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the group's runtime has stopped");
  }
  loop.run_once(Clock::now() + 5s);
  EXPECT_EQ(ran, 1);
}

TEST(EventLoop, DiscardDropsQueuedCommandsUnrun) {
  EventLoop loop;
  auto promise = std::make_shared<std::promise<void>>();
  auto future = promise->get_future();
  loop.post([promise] { promise->set_value(); });
  promise.reset();
  loop.close();
  loop.discard();
  loop.run_once(Clock::now() + 20ms);
  // The command was destroyed without running: its promise is broken, not kept.
  EXPECT_THROW(future.get(), std::future_error);
}
