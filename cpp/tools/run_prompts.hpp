// Ranks waiting at a debugger prompt (breakpoint(), ddip.rank.run_debug), answered from ddip
// run's own stdin: one rank at a time, in the order they stopped. The waiting rank's debugger
// output and its prompt are shown labelled ("[1] ipdb> "), and the next line read goes to that
// rank only. A rank keeps its turn, prompt after prompt, until its debugger leaves (a Prompt
// without a prompt: `c`) or it ends; only then is the next rank's prompt shown. ddip run's stdin
// is read only while a prompt is shown, so a line typed ahead waits in the terminal (or pipe) for
// the next prompt, and a ddip run in a shell's background is not stopped for reading its
// terminal until a rank asks.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <string>

#include "ddip/fd.hpp"
#include "run_loop.hpp"
#include "run_output.hpp"
#include "run_protocol.hpp"

namespace ddip::run {

class Prompts {
 public:
  // How a prompt is shown: as text for a person ("[1] ipdb> ", no line end), or as a Prompt
  // record on its own line of stdout (without the output, which goes before it as text), for a
  // program that answers (%%diprun).
  enum class Show { kText, kRecords };
  // `answer(unit, rank, line)`: send `line` to that rank's stdin; nullopt: nobody can answer
  // (ddip run's stdin has ended, or was never readable), so its stdin closes.
  using Answer = std::function<void(size_t unit, int rank, std::optional<std::string> line)>;

  Prompts(RunLoop& loop, Terminal& terminal, Show show, Answer answer)
      : loop_(loop), terminal_(terminal), show_(show), answer_(std::move(answer)) {}
  ~Prompts();

  // Answers come from `in` (ddip run's stdin, duplicated). Until then, and once it has ended,
  // a prompt's output is shown and it is answered with nullopt at once.
  void open(Fd in);
  // Rank `p.rank`, of unit `u` (a rank, or the launcher of its host), waits at a prompt, or (an
  // empty prompt) has left its debugger.
  void waiting(size_t u, protocol::Prompt p);
  // Unit `u` has ended: none of its ranks waits any more.
  void ended(size_t u);
  // How many ranks wait (the one shown included).
  size_t count() const { return queue_.size(); }
  // `asking(true)` when a prompt is shown and waits for its line, `asking(false)` when none does
  // any more (ddip run's --timeout stands still meanwhile).
  void on_asking(std::function<void(bool)> asking) { asking_ = std::move(asking); }

 private:
  struct Waiter {
    size_t unit;
    protocol::Prompt prompt;
    bool is(const std::optional<std::pair<size_t, int>>& who) const {
      return who && who->first == unit && who->second == prompt.rank;
    }
  };
  void show_next();
  void on_readable();
  void answer_lines();
  void answer_front(std::optional<std::string> line);
  void close_input();
  void watch(bool on);
  void set_shown(bool on);

  RunLoop& loop_;
  Terminal& terminal_;
  Show show_;
  Answer answer_;
  Fd in_;
  bool tty_ = false;
  std::deque<Waiter> queue_;  // front: the one shown, when shown_
  bool shown_ = false;
  std::optional<std::pair<size_t, int>> turn_;  // (unit, rank) whose turn it is
  std::string typed_;  // read, not yet a whole line
  std::function<void(bool)> asking_;
};

}  // namespace ddip::run
