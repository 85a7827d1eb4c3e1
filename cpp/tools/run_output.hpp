// What the processes `ddip run` supervises write: read from their pipes, kept in log files
// (--log-dir), labelled "[rank] " line by line and written whole to ddip run's own stdout and
// stderr. A host's launcher (another host's ddip run) sends lines labelled there already, and
// its stderr carries that ddip run's records (run_protocol.hpp), which are handed on, not shown.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddip/fd.hpp"
#include "ddip/output.hpp"
#include "run_loop.hpp"

namespace ddip::run {

using std::chrono::milliseconds;

// Writes everything, waiting when `fd` is non-blocking and full, for at most `limit` in all (0:
// no limit). False when the reader is gone (EPIPE), the file can't take more (ENOSPC, EIO) or the
// limit passed: the caller stops writing there.
bool write_all(int fd, std::string_view data, milliseconds limit = milliseconds::zero());

// "[rank] " at the start of every line. A line ends at '\n', or at '\r' when text follows (a
// progress bar redrawn in place keeps its label; "\r\n" gets one label). `after_cr` carries
// whether the stream's previous text ended with '\r' across calls.
std::string label(std::string_view text, const std::string& tag, bool& after_cr);

// `text` split at '\n', without them.
std::vector<std::string> lines_of(const std::string& text);

// ddip run's own stdout (1) and stderr (2). A stream that failed once is written no more: the
// ranks run on (their logs keep their output) without a terminal or a reader.
class Terminal {
 public:
  // `limit`: how long one write may wait for a full pipe (0: as long as it takes). On another
  // host, output goes back through the launcher and must not wait for good on a dead link.
  // `out`, `err`: the files behind streams 1 and 2 (tests give pipes).
  explicit Terminal(milliseconds limit = milliseconds::zero(), int out = 1, int err = 2)
      : limit_(limit), fd_{-1, out, err} {}
  // False if `stream` could not take `text`, now or before. Text written while a prompt is shown
  // goes on a line of its own, and the prompt is shown again after it.
  bool write(int stream, std::string_view text);
  bool ok(int stream) const { return ok_[stream]; }
  // Shows `text` on stdout without a line end: a debugger's prompt, until answered().
  void prompt(std::string text);
  // The prompt was answered (the line typed ended its line) or left: `newline` ends its line.
  void answered(bool newline);

 private:
  bool put(int stream, std::string_view text);
  milliseconds limit_;
  std::string prompt_;  // shown, not yet answered
  int fd_[3];
  bool ok_[3] = {true, true, true};
};

// Where a rank's two streams go besides being read: torchrun's -r/--redirects and -t/--tee, as
// the launch plan decides them (run_plan.cpp). Bit 1 is stdout, bit 2 stderr, as torch's Std.
struct RankStreams {
  int to_console = 3;  // shown on the terminal (when the rank is shown at all)
  int to_file = 0;     // kept in its log files, stdout.log and stderr.log in `dir`
  // Its directory in torchrun's layout, <job>/attempt_<n>/<local rank> (made by open_logs even
  // when it keeps no file, as torchrun's); "": none.
  std::string dir;
};

// --log-dir's directory for one launch, torchrun's: DIR/<run id>_<8 random characters>, made
// (DIR too) once, whatever the attempt. Throws std::system_error.
std::string make_job_log_dir(const std::string& log_dir, const std::string& run_id);
// torchrun's without --log-dir when -r or -t asks for files: a new $TMPDIR/torchelastic_XXXXXX,
// kept after the launch.
std::string make_temporary_log_dir();

// Every supervised process's output, one unit each: a rank, or another host's launcher.
class LabelledStreams {
 public:
  struct Hooks {
    // A record from a host's ddip run, or from a rank (a Prompt): one line of its stderr, line
    // end included.
    std::function<void(size_t unit, std::string_view line)> on_record;
    // The terminal could not take a write (on another host: the link back is gone).
    std::function<void()> on_write_failed;
  };
  // `me`: "ddip run" or "ddip run on HOST", for messages.
  LabelledStreams(RunLoop& loop, Terminal& terminal, std::string me, Hooks hooks)
      : loop_(loop), terminal_(terminal), me_(std::move(me)), hooks_(std::move(hooks)) {}

  // A unit for a rank (`shown`: it reaches the terminal, --tee) or a host's launcher; returns
  // its index, the same as the Supervisor's.
  size_t add_rank(int rank, bool shown, RankStreams streams = {});
  size_t add_host();
  // Every rank's log directory (its RankStreams), with stdout.log and stderr.log for the streams
  // it keeps. Throws.
  void open_logs();
  // From now on, a line that several shown ranks print alike is written once, "[0-7] text", by
  // the runtime's rule (ddip::Repeats: the notebook's too); `window`: how long a line waits for
  // the others'. Call once the ranks are added.
  void collapse_repeats(double window);
  // Takes unit `u`'s pipes and reads them as they fill.
  void attach(size_t u, Fd out, Fd err);
  // Reads what unit `u` (exited) left in its pipes.
  void drain(size_t u);
  // Reads what unit `u` has written to `s` so far (a rank's prints before its prompt), and
  // writes every line held for repeats.
  void drain(size_t u, RankOutput::Stream s);
  // Releases unit `u`'s partial lines: a host's, once its ddip run has ended.
  void flush(size_t u);
  // At the end: every partial line of a pipe still open (a descendant holds it).
  void flush_open();
  bool any_open() const;

  // A rank's last lines of stderr (but its prompt records).
  std::vector<std::string> stderr_tail(size_t u) const;
  // A host launcher's last lines of its own (ssh's errors, the host's ddip run's messages;
  // not its ranks', which are labelled), and notes added about it.
  std::vector<std::string> launcher_tail(size_t u) const;
  void note(size_t u, std::string line);

 private:
  struct Unit {
    bool host = false;
    int first_rank = 0;
    bool shown = true;
    RankStreams streams;
    std::string tag;
    RankOutput output;
    Fd pipe[3];  // [1] stdout, [2] stderr
    Fd log[3];
    bool after_cr[3] = {false, false, false};
    std::deque<std::string> tail;  // host units: launcher_tail()
  };
  void read(size_t u, RankOutput::Stream s);
  void deliver(size_t u, RankOutput::Stream s, const std::string& text);
  void host_text(size_t u, const std::string& text);
  void rank_text(size_t u, const std::string& text);
  void emit(size_t u, RankOutput::Stream s, std::string_view text);
  void read_ready(size_t u, RankOutput::Stream s);  // what its pipe holds now
  void put(const std::vector<ddip::Repeats::Piece>& pieces);
  static double seconds(Clock::time_point t);

  RunLoop& loop_;
  Terminal& terminal_;
  std::string me_;
  Hooks hooks_;
  std::deque<Unit> units_;  // a deque: units never move once added
  std::optional<ddip::Repeats> repeats_;  // collapse_repeats()
  std::map<int, size_t> unit_of_rank_;    // the shown ranks' units, for repeats_' pieces
};

}  // namespace ddip::run
