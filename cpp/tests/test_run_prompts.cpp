// Ranks' debugger prompts under `ddip run` (cpp/tools/run_prompts.hpp), over real pipes: one rank
// at a time, in the order they stopped, each keeping its turn until its debugger leaves; the line
// read next goes to the one shown; lines typed ahead wait for the next prompt; end of input, a
// rank that ends, and no input at all let the ranks go on.
#include <gtest/gtest.h>
#include <unistd.h>

#include "helpers.hpp"
#include "run_prompts.hpp"

using namespace ddip::run;
namespace proto = ddip::run::protocol;
using ddip::Fd;
using ddip::test::read_ready;
using ddip::test::write_fd;

namespace {

struct Answered {
  size_t unit;
  int rank;
  std::optional<std::string> line;
  bool operator==(const Answered&) const = default;
};

// A Prompts whose terminal is a pipe the test reads, and whose input is a pipe the test writes.
struct Desk {
  ddip::Pipe out = ddip::make_pipe(true), err = ddip::make_pipe(true), in = ddip::make_pipe();
  RunLoop loop;
  Terminal terminal{std::chrono::milliseconds::zero(), out.write.get(), err.write.get()};
  std::vector<Answered> answers;
  Prompts prompts;

  explicit Desk(Prompts::Show show = Prompts::Show::kText, bool open = true)
      : prompts(loop, terminal, show, [this](size_t u, int rank, std::optional<std::string> line) {
          answers.push_back({u, rank, std::move(line)});
        }) {
    if (open) prompts.open(std::move(in.read));
  }
  std::string shown() { return read_ready(out.read.get()); }
  void type(const std::string& text) { write_fd(in.write.get(), text); }
  void until_answers(size_t n) {
    loop.run_until([&] { return answers.size() >= n; });
  }
};

proto::Prompt at(int rank, std::string output = "") { return {rank, std::move(output), "ipdb> "}; }
// Its debugger has left its prompt (`c`), with its last words.
proto::Prompt left(int rank, std::string output = "") { return {rank, std::move(output), ""}; }

}  // namespace

TEST(RunPrompts, TheWaitingRanksOutputAndPromptAreShownAndTheNextLineGoesToIt) {
  Desk d;
  d.prompts.waiting(0, at(1, "> train.py(3)<module>()\n-> y = x + 1\n"));
  EXPECT_EQ(d.shown(), "[1] > train.py(3)<module>()\n[1] -> y = x + 1\n[1] ipdb> ");
  d.type("p x\n");
  d.until_answers(1);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{0, 1, "p x"}}));
  EXPECT_EQ(d.prompts.count(), 0u);
}

TEST(RunPrompts, RanksTakeTurnsInTheOrderTheyStoppedEachUntilItsDebuggerLeaves) {
  Desk d;
  d.prompts.waiting(3, at(3));
  d.prompts.waiting(1, at(1, "rank 1 here\n"));
  EXPECT_EQ(d.shown(), "[3] ipdb> ") << "one prompt at a time";
  d.type("p x\n");
  d.until_answers(1);
  d.prompts.waiting(3, at(3, "41\n"));  // its next prompt: still its turn, ahead of rank 1
  EXPECT_EQ(d.shown(), "p x\n[3] 41\n[3] ipdb> ") << "a line from a pipe is shown after its prompt";
  d.type("c\n");
  d.until_answers(2);
  EXPECT_EQ(d.shown(), "c\n") << "rank 1 waits until rank 3's debugger has left";
  d.prompts.waiting(3, left(3, "bye\n"));
  EXPECT_EQ(d.shown(), "[3] bye\n[1] rank 1 here\n[1] ipdb> ");
  d.type("p y\n");
  d.until_answers(3);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{3, 3, "p x"}, {3, 3, "c"}, {1, 1, "p y"}}));
}

TEST(RunPrompts, LinesTypedAheadWaitForTheNextPrompt) {
  Desk d;
  d.prompts.waiting(0, at(0));
  d.type("p a\r\nc\n");  // two lines in one read, the first with a terminal's "\r\n"
  d.until_answers(1);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{0, 0, "p a"}}));
  d.prompts.waiting(0, left(0));
  d.prompts.waiting(2, at(2));  // the second line answers it at once
  EXPECT_EQ(d.answers, (std::vector<Answered>{{0, 0, "p a"}, {2, 2, "c"}}));
}

TEST(RunPrompts, WithoutInputEveryPromptIsAnsweredByNobodyAtOnceItsOutputShown) {
  Desk d(Prompts::Show::kText, /*open=*/false);
  d.prompts.waiting(0, at(1, "> f.py(2)\n"));
  EXPECT_EQ(d.answers, (std::vector<Answered>{{0, 1, std::nullopt}}));
  EXPECT_EQ(d.shown(), "[1] > f.py(2)\n") << "no prompt nobody can answer";
}

TEST(RunPrompts, EndOfInputLetsTheWaitingRankAndLaterOnesGoOn) {
  Desk d;
  d.prompts.waiting(0, at(0));
  d.prompts.waiting(1, at(1));
  d.in.write.reset();
  d.until_answers(1);
  d.prompts.waiting(0, left(0));  // its debugger went on without an answer
  EXPECT_EQ(d.answers, (std::vector<Answered>{{0, 0, std::nullopt}, {1, 1, std::nullopt}}));
  d.prompts.waiting(1, left(1));
  d.prompts.waiting(2, at(2));
  EXPECT_EQ(d.answers.back(), (Answered{2, 2, std::nullopt}));
}

TEST(RunPrompts, ARankThatEndsWhileWaitingGivesTheNextOneItsTurn) {
  Desk d;
  d.prompts.waiting(0, at(0));
  d.prompts.waiting(1, at(1));
  d.prompts.waiting(0, at(2));  // unit 0 twice: a host's launcher with two ranks waiting
  d.shown();
  d.prompts.ended(0);
  EXPECT_EQ(d.shown(), "\n[1] ipdb> ") << "the left prompt's line ends; the next is shown";
  EXPECT_EQ(d.prompts.count(), 1u);
  d.type("c\n");
  d.until_answers(1);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{1, 1, "c"}}));
  EXPECT_EQ(d.prompts.count(), 0u);
}

TEST(RunPrompts, AProgramGetsEachPromptAsARecordLineAfterTheOutput) {
  Desk d(Prompts::Show::kRecords);
  d.prompts.waiting(4, at(5, "-> x = 1\n"));
  std::string shown = d.shown();
  EXPECT_EQ(shown, "[5] -> x = 1\n" + proto::encode(proto::Report{proto::Prompt{5, "", "ipdb> "}}));
  d.type("c\n");
  d.until_answers(1);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{4, 5, "c"}}));
}

TEST(RunPrompts, OutputWrittenWhileAPromptIsShownGoesOnItsOwnLineAndThePromptComesBack) {
  Desk d;
  d.prompts.waiting(0, at(1));
  d.terminal.write(1, "[0] step 5\n");
  d.terminal.write(2, "[0] warning\n");
  EXPECT_EQ(d.shown(), "[1] ipdb> \n[0] step 5\n[1] ipdb> \n[1] ipdb> ");
  EXPECT_EQ(read_ready(d.err.read.get()), "[0] warning\n");
  d.type("c\n");
  d.until_answers(1);
  d.terminal.write(1, "[0] step 6\n");
  EXPECT_EQ(d.shown(), "c\n[0] step 6\n") << "answered: no prompt any more";
}

TEST(RunPrompts, ALineLongerThanAPromptTakesIsNotSent) {
  Desk d;
  d.prompts.waiting(0, at(0));
  d.shown();
  d.type(std::string(proto::kMaxAnswer + 1, 'x') + "\np ok\n");
  d.until_answers(1);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{0, 0, "p ok"}}));
  EXPECT_NE(read_ready(d.err.read.get()).find("is longer than a prompt takes (16384); it was not sent"),
            std::string::npos);
}

TEST(RunPrompts, ARankThatLeavesWithoutAnAnswerNoLongerShowsItsPrompt) {
  Desk d;
  d.prompts.waiting(0, at(1));
  d.prompts.waiting(2, at(2));
  d.shown();
  d.prompts.waiting(0, left(1));  // Ctrl-C at its prompt: its debugger left by KeyboardInterrupt
  EXPECT_EQ(d.shown(), "\n[2] ipdb> ");
  d.terminal.write(2, "[1] KeyboardInterrupt\n");
  d.type("c\n");
  d.until_answers(1);
  EXPECT_EQ(d.answers, (std::vector<Answered>{{2, 2, "c"}})) << "rank 1 was never answered";
}

TEST(RunPrompts, ItSaysWhenAPromptWaitsForItsLineAndWhenNoneDoes) {
  Desk d;
  std::vector<bool> asking;
  d.prompts.on_asking([&](bool on) { asking.push_back(on); });
  d.prompts.waiting(0, at(0));
  d.prompts.waiting(1, at(1));
  EXPECT_EQ(asking, (std::vector<bool>{true}));
  d.type("c\n");
  d.until_answers(1);
  EXPECT_EQ(asking, (std::vector<bool>{true, false})) << "rank 0 runs on: the job's time again";
  d.prompts.waiting(0, left(0));
  EXPECT_EQ(asking, (std::vector<bool>{true, false, true}));  // rank 1's turn
  d.prompts.ended(1);
  EXPECT_EQ(asking, (std::vector<bool>{true, false, true, false}));
}
