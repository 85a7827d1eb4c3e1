// Per-rank output assembly. Text is released at line ends: '\n', and also '\r', so a progress
// bar's in-place updates reach the notebook as they happen instead of one line at the end.
#pragma once

#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace ddip {

// Calls fn(body, end) for each piece of `text`: `end` is "\n", "\r\n", "\r" (a redrawn progress
// bar), or empty for text after the last line end. The C++ side's one line splitter (the Python
// package's is ddip.labels.pieces).
template <class Fn>
void for_each_line(std::string_view text, Fn&& fn) {
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find_first_of("\r\n", start);
    if (end == std::string_view::npos) {
      fn(text.substr(start), std::string_view{});
      return;
    }
    size_t after = end + 1;
    if (text[end] == '\r' && after < text.size() && text[after] == '\n') ++after;
    fn(text.substr(start, end - start), text.substr(end, after - end));
    start = after;
  }
}

class LineAssembler {
 public:
  // Appends `data`; returns everything up to and including the last '\n' or '\r'.
  std::string feed(std::string_view data);
  // Returns (and forgets) the partial line held back. Unless `force`, an incomplete UTF-8
  // character at its end stays, for the rest of it to arrive: a piece never ends mid-character.
  // Bytes already kept back by the previous flush, with nothing fed since, go anyway, so
  // invalid UTF-8 is delayed, never lost.
  std::string flush(bool force = true);
  bool has_pending() const { return !pending_.empty(); }

 private:
  std::string pending_;
  bool kept_ = false;  // pending_ is what the previous flush kept back
};

// Ranks named as a reader takes them in at 128 ranks: sorted, each run of three or more as a
// range, "0-126" or "0,2,4-7" (a pair stays "0,1": shorter than no range at all). The one
// spelling of a rank set, for the notebook (bound as _core.rank_ranges) and `ddip run` alike.
std::string rank_ranges(std::vector<int> ranks);

// Written by a worker to its stdout just before it sends a display frame: it marks where in the
// text that rich output belongs, since the frame and the pipe travel separately.
inline constexpr std::string_view kDisplayMarker = "\x1b_ddip-display\x1b\\";

struct OutputPiece {
  std::string text;
  bool marker = false;  // a display frame belongs right after `text`
};

// stdout and stderr of one rank, plus the last lines of stderr for failure reports.
class RankOutput {
 public:
  static constexpr size_t kTailLines = 20;
  enum Stream { kStdout = 1, kStderr = 2 };

  // Text released by `data`. On stdout, each display marker ends a piece (with the partial line
  // before it flushed), so the caller can put the display there.
  std::vector<OutputPiece> feed(Stream s, std::string_view data);
  // The partial line of `s`; see LineAssembler::flush for `force`.
  std::string flush(Stream s, bool force = true);
  bool has_pending() const {
    return out_.has_pending() || err_.has_pending() || !marker_carry_.empty();
  }
  // The last kTailLines complete lines written to stderr, joined with '\n'.
  std::string stderr_tail() const;

 private:
  LineAssembler out_, err_;
  std::string marker_carry_;  // the end of a read that may be the start of a marker
  std::deque<std::string> tail_;
  std::string tail_partial_;
  void remember(std::string_view text);
};

}  // namespace ddip
