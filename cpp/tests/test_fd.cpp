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
