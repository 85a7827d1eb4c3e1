// Shared-memory segments for the data plane: large buffers are written once into a memfd segment
// and passed to every rank by fd, instead of being copied through the socket per rank.
//
// A fresh memfd costs ~9x a memcpy (its pages are allocated and zeroed); a segment reused from
// the pool costs ~1x. Segments are reused only once every rank that received one has said its
// objects are gone (a release), as iceoryx's mempools do: a rank maps a segment privately, and
// Linux shows later writes to the file through pages a private mapping has not copied yet.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "ddip/fd.hpp"

namespace ddip {

class Segment {
 public:
  // A memfd of `size` bytes, mapped shared and writable here, sealed against resizing: a rank
  // that shrank it would make every other mapping of it fault (SIGBUS) on the lost pages.
  explicit Segment(size_t size);
  // A memfd made elsewhere (`size`: its size), not mapped here: a buffer received from another
  // host, which this process only hands on.
  Segment(Fd fd, size_t size);
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  Segment(Segment&& o) noexcept;
  Segment& operator=(Segment&& o) noexcept;
  ~Segment();

  int fd() const { return fd_.get(); }
  char* data() const { return static_cast<char*>(addr_); }  // null when not mapped here
  // The memfd, unmapped here: the segment is empty after.
  Fd release();
  size_t size() const { return size_; }

 private:
  Fd fd_;
  void* addr_ = nullptr;
  size_t size_ = 0;
};

class SegmentPool {
 public:
  static constexpr size_t kMinSegment = size_t(1) << 20;

  // Keeps at most `keep_free_bytes` of unused segments for reuse; beyond that they are freed.
  explicit SegmentPool(size_t keep_free_bytes = size_t(4) << 30) : keep_free_(keep_free_bytes) {}

  // Copies `n` bytes into a segment (reused when one is free) and returns its id, holding one
  // reference for the caller. Thread-safe.
  uint64_t put(const void* data, size_t n);
  // One more reference (a frame that carries the segment to a rank).
  void retain(uint64_t id);
  // One reference fewer; at zero the segment returns to the pool. Unknown ids are ignored.
  void release(uint64_t id);
  // A memfd of at least `n` bytes to receive a buffer into: a free segment's (taken out of the
  // pool), or a fresh one. It returns to the pool only through adopt(). Thread-safe.
  Fd take_buffer(size_t n);
  // Keeps the memfd `fd` (from take_buffer, filled in) as segment `id`, an id the sender chose,
  // holding one reference for the caller; a second adopt() of an id still in use only adds a
  // reference (the buffer is the same). A pool takes ids either from put() or from adopt(), never
  // both: a host agent adopts the kernel's ids, so that its workers' releases name them.
  void adopt(uint64_t id, Fd fd, size_t length);
  bool contains(uint64_t id) const;
  // A new fd for the segment, for sending (the frame owns and closes it).
  Fd dup_fd(uint64_t id) const;
  // The bytes put() stored in it (the segment itself may be larger): what a TCP link sends.
  size_t length(uint64_t id) const;
  // Frees the unused segments that have been unused for longer than `max_idle` (all of them for
  // 0); returns the bytes freed. The pool only speeds up pushes that follow each other.
  size_t trim(std::chrono::steady_clock::duration max_idle,
              std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

  size_t in_use() const;      // segments with references
  size_t free_bytes() const;  // bytes kept for reuse
  size_t created() const;     // segments ever created (reuse keeps this down)

 private:
  struct Entry {
    Segment segment;
    int refs = 0;
    size_t length = 0;
  };
  mutable std::mutex mu_;
  size_t keep_free_;
  uint64_t next_id_ = 1;
  struct Unused {
    Segment segment;
    std::chrono::steady_clock::time_point since;
  };
  void keep_free(Segment seg);  // with mu_ held: kept for reuse, or freed beyond the limit
  // A free segment of exactly `size` bytes, out of the pool; none: the caller makes one (counted).
  std::optional<Segment> take_free(size_t size);
  std::unordered_map<uint64_t, Entry> used_;
  std::multimap<size_t, Unused> free_;  // by size
  size_t free_bytes_ = 0;
  size_t created_ = 0;
};

}  // namespace ddip
