#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "ddip/shm.hpp"

using namespace ddip;

TEST(Segment, IsASharedMemfdOfTheGivenSize) {
  Segment s(4096);
  std::memcpy(s.data(), "abc", 3);
  struct stat st{};
  ASSERT_EQ(::fstat(s.fd(), &st), 0);
  EXPECT_EQ(st.st_size, 4096);
  // Another mapping of the fd sees the bytes (what a rank does after receiving it).
  void* other = ::mmap(nullptr, 4096, PROT_READ, MAP_PRIVATE, s.fd(), 0);
  ASSERT_NE(other, MAP_FAILED);
  EXPECT_EQ(std::memcmp(other, "abc", 3), 0);
  ::munmap(other, 4096);
}

TEST(SegmentPool, PutCopiesAndDupFdSharesTheBytes) {
  SegmentPool pool;
  std::string data(3 << 20, 'x');
  data[12345] = 'y';
  uint64_t id = pool.put(data.data(), data.size());
  Fd fd = pool.dup_fd(id);
  struct stat st{};
  ASSERT_EQ(::fstat(fd.get(), &st), 0);
  EXPECT_EQ(st.st_size, 4 << 20);  // rounded up to a power of two
  char* p = static_cast<char*>(::mmap(nullptr, data.size(), PROT_READ, MAP_PRIVATE, fd.get(), 0));
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(std::string(p, data.size()), data);
  ::munmap(p, data.size());
}

TEST(SegmentPool, ASegmentIsReusedOnlyAfterEveryReferenceIsReleased) {
  SegmentPool pool;
  std::string a(1 << 20, 'a');
  uint64_t first = pool.put(a.data(), a.size());
  pool.retain(first);  // sent to two ranks: 3 references with the caller's
  pool.retain(first);
  pool.release(first);  // the caller's
  pool.release(first);  // rank 0
  EXPECT_EQ(pool.in_use(), 1u);
  uint64_t second = pool.put(a.data(), a.size());  // rank 1 still holds the first
  EXPECT_EQ(pool.created(), 2u);
  pool.release(first);  // rank 1
  EXPECT_EQ(pool.free_bytes(), size_t(1) << 20);
  pool.release(second);
  uint64_t third = pool.put(a.data(), 100);  // same size class: reused, nothing created
  EXPECT_EQ(pool.created(), 2u);
  EXPECT_NE(third, first);
  pool.release(third);
  pool.release(999);  // unknown ids are ignored (a rank can't corrupt the pool)
}

// A host agent's pool: buffers received from another host are kept under the sender's ids, and
// the next buffer is received into the pages of one every holder let go of.
TEST(SegmentPool, AnAdoptedBufferReturnsToThePoolAndIsReceivedIntoAgain) {
  auto inode = [](int fd) {
    struct stat st {};
    EXPECT_EQ(::fstat(fd, &st), 0);
    return st.st_ino;
  };
  SegmentPool pool;
  Fd first = pool.take_buffer(3 << 20);
  struct stat st {};
  ASSERT_EQ(::fstat(first.get(), &st), 0);
  EXPECT_EQ(st.st_size, 4 << 20) << "sized as put() sizes a segment, so that later ones fit";
  ASSERT_EQ(::pwrite(first.get(), "pushed", 6, 0), 6);
  ino_t ino = inode(first.get());
  pool.adopt(41, std::move(first), 3 << 20);  // the sender's id; its reference is ours
  EXPECT_TRUE(pool.contains(41));
  EXPECT_EQ(pool.length(41), size_t(3) << 20);
  Fd worker = pool.dup_fd(41);
  char buf[6];
  ASSERT_EQ(::pread(worker.get(), buf, 6, 0), 6);
  EXPECT_EQ(std::string(buf, 6), "pushed");
  pool.retain(41);   // a worker holds it
  pool.release(41);  // the sender forgot it
  Fd second = pool.take_buffer(3 << 20);
  EXPECT_NE(inode(second.get()), ino) << "a worker still holds the first: not reused";
  pool.release(41);  // the worker's release
  EXPECT_FALSE(pool.contains(41));
  EXPECT_EQ(pool.created(), 2u);
  Fd third = pool.take_buffer(4 << 20);
  EXPECT_EQ(inode(third.get()), ino) << "received into the first's pages";
  EXPECT_EQ(pool.created(), 2u);
  EXPECT_EQ(pool.free_bytes(), 0u);
  // The same id sent again while still in use (the sender shipped it twice): one more reference,
  // the second buffer kept for reuse.
  pool.adopt(42, std::move(second), 10);
  pool.adopt(42, std::move(third), 10);
  EXPECT_EQ(pool.free_bytes(), size_t(4) << 20);
  pool.release(42);
  EXPECT_TRUE(pool.contains(42));
  pool.release(42);
  EXPECT_FALSE(pool.contains(42));
}

TEST(SegmentPool, KeepsAtMostTheConfiguredFreeBytes) {
  SegmentPool pool(SegmentPool::kMinSegment);
  std::string a(10, 'a');
  uint64_t x = pool.put(a.data(), a.size());
  uint64_t y = pool.put(a.data(), a.size());
  pool.release(x);
  pool.release(y);  // over the limit: freed, not kept
  EXPECT_EQ(pool.free_bytes(), SegmentPool::kMinSegment);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(Segment, SizeIsSealed) {
  // A rank that truncated a segment would make the notebook's and other ranks' mappings fault.
  Segment s(1 << 20);
  int seals = ::fcntl(s.fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_EQ(::ftruncate(s.fd(), 4096), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(s.fd(), 2 << 20), -1);
  EXPECT_EQ(::pwrite(s.fd(), "x", 1, 4 << 20), -1);  // writing past the end would grow it
}

TEST(SegmentPool, TrimFreesOnlySegmentsUnusedForLongEnough) {
  using namespace std::chrono_literals;
  SegmentPool pool;
  std::string data(1 << 20, 'x');
  uint64_t old_id = pool.put(data.data(), data.size());
  pool.release(old_id);
  auto later = std::chrono::steady_clock::now() + 10s;
  uint64_t busy = pool.put(std::string(2 << 20, 'y').data(), 2 << 20);  // in use: never trimmed
  EXPECT_EQ(pool.free_bytes(), size_t(1) << 20);
  EXPECT_EQ(pool.trim(1h, later), 0u);
  EXPECT_EQ(pool.free_bytes(), size_t(1) << 20);
  EXPECT_EQ(pool.trim(5s, later), size_t(1) << 20);
  EXPECT_EQ(pool.free_bytes(), 0u);
  EXPECT_EQ(pool.in_use(), 1u);
  pool.release(busy);
  EXPECT_EQ(pool.trim(0s), size_t(2) << 20);  // 0: every unused segment
  EXPECT_EQ(pool.free_bytes(), 0u);
}
