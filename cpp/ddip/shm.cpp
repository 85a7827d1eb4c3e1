#include "ddip/shm.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace ddip {
namespace {

// A memfd of `size` bytes, sealed against resizing: a rank that shrank it would make every other
// mapping of it fault (SIGBUS) on the lost pages.
Fd sealed_memfd(size_t size) {
  Fd fd(check(::memfd_create("ddip-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING), "memfd_create",
              "creating a shared-memory segment"));
  check(::ftruncate(fd.get(), static_cast<off_t>(size)), "ftruncate",
        "sizing a shared-memory segment");
  check(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), "fcntl(F_ADD_SEALS)",
        "sealing a shared-memory segment's size");
  return fd;
}

size_t segment_size(size_t n) { return std::max(SegmentPool::kMinSegment, std::bit_ceil(n)); }

}  // namespace

Segment::Segment(size_t size) : size_(size) {
  fd_ = sealed_memfd(size);
  addr_ = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (addr_ == MAP_FAILED) {
    addr_ = nullptr;
    throw_errno("mmap", "mapping a shared-memory segment");
  }
}

Segment::Segment(Fd fd, size_t size) : fd_(std::move(fd)), size_(size) {}

Segment::Segment(Segment&& o) noexcept
    : fd_(std::move(o.fd_)),
      addr_(std::exchange(o.addr_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    if (addr_) ::munmap(addr_, size_);
    fd_ = std::move(o.fd_);
    addr_ = std::exchange(o.addr_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

Fd Segment::release() {
  if (addr_) ::munmap(addr_, size_);
  addr_ = nullptr;
  size_ = 0;
  return std::move(fd_);
}

Segment::~Segment() {
  if (addr_) ::munmap(addr_, size_);
}

std::optional<Segment> SegmentPool::take_free(size_t size) {
  std::lock_guard lock(mu_);
  auto it = free_.find(size);
  if (it == free_.end()) {
    ++created_;  // the caller makes one
    return std::nullopt;
  }
  Segment seg = std::move(it->second.segment);
  free_bytes_ -= size;
  free_.erase(it);
  return seg;
}

uint64_t SegmentPool::put(const void* data, size_t n) {
  // Sizes are rounded up to a power of two so that freed segments fit later requests.
  size_t want = segment_size(n);
  std::optional<Segment> seg = take_free(want);  // mapped: a pool that puts never adopts
  if (!seg) seg.emplace(want);
  if (n > 0) std::memcpy(seg->data(), data, n);  // the one copy, outside the lock
  std::lock_guard lock(mu_);
  uint64_t id = next_id_++;
  used_.emplace(id, Entry{std::move(*seg), 1, n});
  return id;
}

void SegmentPool::retain(uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = used_.find(id);
  if (it == used_.end()) throw std::out_of_range("no shared-memory segment " + std::to_string(id));
  ++it->second.refs;
}

void SegmentPool::release(uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = used_.find(id);
  if (it == used_.end()) return;
  if (--it->second.refs > 0) return;
  Segment seg = std::move(it->second.segment);
  used_.erase(it);
  keep_free(std::move(seg));
}

void SegmentPool::keep_free(Segment seg) {
  if (free_bytes_ + seg.size() > keep_free_) return;  // freed here
  free_bytes_ += seg.size();
  size_t size = seg.size();
  free_.emplace(size, Unused{std::move(seg), std::chrono::steady_clock::now()});
}

Fd SegmentPool::take_buffer(size_t n) {
  size_t want = segment_size(n);
  std::optional<Segment> seg = take_free(want);
  if (!seg) return sealed_memfd(want);
  return seg->release();  // its mapping here, if any, goes outside the lock; its pages stay
}

void SegmentPool::adopt(uint64_t id, Fd fd, size_t length) {
  struct stat st {};
  check(::fstat(fd.get(), &st), "fstat", "keeping a received buffer");
  Segment seg(std::move(fd), static_cast<size_t>(st.st_size));
  std::lock_guard lock(mu_);
  auto it = used_.find(id);
  if (it == used_.end()) {
    used_.emplace(id, Entry{std::move(seg), 1, length});
    return;
  }
  ++it->second.refs;
  keep_free(std::move(seg));
}

bool SegmentPool::contains(uint64_t id) const {
  std::lock_guard lock(mu_);
  return used_.count(id) > 0;
}

size_t SegmentPool::trim(std::chrono::steady_clock::duration max_idle,
                         std::chrono::steady_clock::time_point now) {
  std::vector<Segment> doomed;  // unmapped after the lock is dropped: munmap of GiBs takes a while
  {
    std::lock_guard lock(mu_);
    for (auto it = free_.begin(); it != free_.end();) {
      if (now - it->second.since < max_idle) {
        ++it;
        continue;
      }
      free_bytes_ -= it->second.segment.size();
      doomed.push_back(std::move(it->second.segment));
      it = free_.erase(it);
    }
  }
  size_t bytes = 0;
  for (auto& seg : doomed) bytes += seg.size();
  return bytes;
}

Fd SegmentPool::dup_fd(uint64_t id) const {
  std::lock_guard lock(mu_);
  auto it = used_.find(id);
  if (it == used_.end()) throw std::out_of_range("no shared-memory segment " + std::to_string(id));
  return Fd(check(::fcntl(it->second.segment.fd(), F_DUPFD_CLOEXEC, 0), "fcntl(F_DUPFD_CLOEXEC)",
                  "duplicating a segment's fd"));
}

size_t SegmentPool::length(uint64_t id) const {
  std::lock_guard lock(mu_);
  auto it = used_.find(id);
  if (it == used_.end()) throw std::out_of_range("no shared-memory segment " + std::to_string(id));
  return it->second.length;
}

size_t SegmentPool::in_use() const {
  std::lock_guard lock(mu_);
  return used_.size();
}

size_t SegmentPool::free_bytes() const {
  std::lock_guard lock(mu_);
  return free_bytes_;
}

size_t SegmentPool::created() const {
  std::lock_guard lock(mu_);
  return created_;
}

}  // namespace ddip
