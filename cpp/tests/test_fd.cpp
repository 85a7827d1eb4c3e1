#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <system_error>

#include "ddip/fd.hpp"

using namespace ddip;

TEST(Fd, ClosesOnDestructionAndMoves) {
  Pipe p = make_pipe();
  int raw = p.read.get();
  {
    Fd moved = std::move(p.read);
    EXPECT_FALSE(p.read);
    EXPECT_EQ(moved.get(), raw);
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);  // closed
}

TEST(Fd, PipeIsCloseOnExecAndOptionallyNonBlocking) {
  Pipe p = make_pipe(true);
  EXPECT_TRUE(::fcntl(p.read.get(), F_GETFD) & FD_CLOEXEC);
  EXPECT_TRUE(::fcntl(p.read.get(), F_GETFL) & O_NONBLOCK);
  EXPECT_FALSE(::fcntl(p.write.get(), F_GETFL) & O_NONBLOCK);
  char c;
  EXPECT_EQ(::read(p.read.get(), &c, 1), -1);
  EXPECT_EQ(errno, EAGAIN);
}

TEST(Fd, CheckThrowsWithCallDoingAndErrno) {
  try {
    check(::close(-1), "close", "closing a bad fd");
    FAIL() << "no exception";
  } catch (const std::system_error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("close failed while closing a bad fd"), std::string::npos) << what;
    EXPECT_EQ(e.code().value(), EBADF);
  }
}

TEST(Fd, PollTimeoutRoundsUpSoAWaitNeverEndsBeforeItsDeadline) {
  auto now = std::chrono::steady_clock::now();
  // Truncated, 300 us would be poll(0): a waiter would spin through its last millisecond.
  EXPECT_EQ(poll_timeout_ms(now + std::chrono::microseconds(300)), 1);
  EXPECT_GE(poll_timeout_ms(now + std::chrono::milliseconds(5)), 4);
  EXPECT_LE(poll_timeout_ms(now + std::chrono::milliseconds(5)), 5);
  EXPECT_EQ(poll_timeout_ms(now - std::chrono::seconds(1)), 0);
  EXPECT_EQ(poll_timeout_ms(now + std::chrono::hours(2)), 60'000);
}
