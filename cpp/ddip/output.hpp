// Per-rank output assembly. Text is released at line ends: '\n', and also '\r', so a progress
// bar's in-place updates reach the notebook as they happen instead of one line at the end.
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <set>
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

// Repeats collapse, with the ranks named: a line that several ranks print alike is handed on
// once, with all their ranks, for the notebook (ddip.repeats) and `ddip run` alike. Output is live
// and comes a piece at a time, so nothing can wait for whole outputs. The rule (why: ranks
// running the same code print their n-th lines at about the same time): a rank's n-th line of a
// stream joins round n of that stream; a round goes once every expected rank gave its n-th line
// (to it, or to an earlier round n) or is done(), or `window` seconds after its first line came,
// or at release(everything). Rounds go in order, each as its distinct lines, one Piece per set of
// ranks, in rank order; nothing is dropped. A line that comes after its round went starts the
// round again. Text that is no whole line (a '\r' progress bar, a line without its end for
// `window`) goes as it is, after the rounds before it. Times are seconds on the monotonic clock
// (Python's time.monotonic()); the caller keeps time with next_due(): the class has no thread.
// How long a line waits for the same line of the other ranks: short enough to read as live.
inline constexpr double kRepeatWindowS = 0.2;

class Repeats {
 public:
  struct Piece {
    std::vector<int> ranks;  // one, or every rank that wrote `text`, sorted
    int stream;              // RankOutput::Stream: 1 stdout, 2 stderr
    std::string text;
  };
  Repeats(std::vector<int> ranks, double window);
  std::vector<Piece> feed(int rank, int stream, std::string_view text, double now);
  // `rank` will write no more: rounds stop waiting for it.
  std::vector<Piece> done(int rank, double now);
  // Rounds (and unended lines) whose time is up; `everything`: all that is held.
  std::vector<Piece> release(double now, bool everything = false);
  // When release() next has something to hand on, or none while nothing is held.
  std::optional<double> next_due() const;

 private:
  struct Round {
    double since = 0;
    std::vector<std::pair<std::string, std::vector<int>>> lines;  // in the order first written
  };
  struct Partial {
    std::string text;
    double since = 0;
  };
  using Key = std::pair<int, int>;  // (rank, stream)
  void add(const Key& key, std::string line, double now);
  void raw(const Key& key, std::string text, double now, std::vector<Piece>& out);
  void release_stream(int stream, double now, bool everything, std::vector<Piece>& out);
  void release_into(double now, bool everything, std::vector<Piece>& out);

  std::set<int> expected_, done_;
  double window_;
  std::map<int, std::map<long, Round>> rounds_;  // stream -> line index -> its round
  std::map<Key, long> count_;                     // lines so far: the next line's round
  std::map<Key, Partial> partial_;                // text not ended yet
  std::set<Key> raw_;                             // whose current line went on as it is
};

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
