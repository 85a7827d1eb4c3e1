// Waiting from Python: in short slices with the GIL released, checking for signals between
// slices, so Ctrl-C (the kernel's interrupt) is never blocked by a wait in C++.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <optional>

namespace ddip_python {

inline constexpr std::chrono::milliseconds kSlice{50};
// For a wait that a signal cuts short itself (it returns, and the signal's Python handler runs at
// once): the slice only bounds how late a handler runs for a signal that another thread took.
inline constexpr std::chrono::milliseconds kInterruptibleSlice{1000};

// Calls wait(slice) until it yields a value or `timeout_ms` passes (negative: forever).
template <typename T, typename Wait>
std::optional<T> wait_in_slices(double timeout_ms, Wait&& wait,
                                std::chrono::milliseconds slice_length = kSlice) {
  using namespace std::chrono;
  auto deadline =
      steady_clock::now() + duration_cast<steady_clock::duration>(
                                duration<double, std::milli>(timeout_ms < 0 ? 0 : timeout_ms));
  while (true) {
    auto slice = slice_length;
    if (timeout_ms >= 0) {
      auto left = duration_cast<milliseconds>(deadline - steady_clock::now());
      if (left < slice) slice = std::max(left, milliseconds(0));
    }
    std::optional<T> got;
    {
      nanobind::gil_scoped_release release;
      got = wait(slice);
    }
    if (got) return got;
    if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
    if (timeout_ms >= 0 && steady_clock::now() >= deadline) return std::nullopt;
  }
}

}  // namespace ddip_python
