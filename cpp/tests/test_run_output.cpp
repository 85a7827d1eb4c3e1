// The ranks' output in `ddip run` (cpp/tools/run_output.hpp): labels, --tee, log files, a host's
// records picked out of its stderr, and a terminal that goes away. Real pipes stand in for the
// ranks' and the terminal's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "helpers.hpp"
#include "run_output.hpp"
#include "run_protocol.hpp"

using namespace ddip::run;
using ddip::Fd;
using ddip::test::read_ready;

namespace {

std::string file_text(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string labelled(std::initializer_list<std::string_view> pieces) {
  bool after_cr = false;
  std::string out;
  for (auto p : pieces) out += label(p, "[3] ", after_cr);
  return out;
}

// A unit's pipes: the test writes, LabelledStreams reads.
struct FakeProcess {
  ddip::Pipe out = ddip::make_pipe(true), err = ddip::make_pipe(true);
};

}  // namespace

TEST(RunOutput, LabelsEveryLine) {
  EXPECT_EQ(labelled({"a\nb\n"}), "[3] a\n[3] b\n");
  EXPECT_EQ(labelled({"\n"}), "[3] \n");                       // an empty line is a line
  EXPECT_EQ(labelled({"no end"}), "[3] no end\n");             // a last line gets its end
  EXPECT_EQ(labelled({"10%\r", "50%\r", "done\n"}), "[3] 10%\r[3] 50%\r[3] done\n");
  EXPECT_EQ(labelled({"100%\r", "\n"}), "[3] 100%\r\n");        // "\r\n": one label
  EXPECT_EQ(labelled({"x\r\ny\n"}), "[3] x\r\n[3] y\n");
}

TEST(RunOutput, LinesOf) {
  EXPECT_EQ(lines_of("a\nb"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(lines_of("a\n\nb\n"), (std::vector<std::string>{"a", "", "b"}));
  EXPECT_TRUE(lines_of("").empty());
}

TEST(RunOutput, RanksHostsTeeAndLogs) {
  RunLoop loop;
  auto term_out = ddip::make_pipe(true), term_err = ddip::make_pipe(true);
  Terminal terminal(std::chrono::milliseconds::zero(), term_out.write.get(), term_err.write.get());
  std::vector<std::pair<size_t, std::string>> records;
  LabelledStreams streams(loop, terminal, "ddip run",
                      {[&](size_t u, std::string_view line) { records.emplace_back(u, line); }, nullptr});
  // Rank 1 is not shown (--show), rank 2's stdout goes to its log only (-r 2:1).
  auto logs = std::filesystem::temp_directory_path() /
              ("ddip-test-run-output-" + std::to_string(::getpid()));
  std::filesystem::remove_all(logs);
  const std::string job = make_job_log_dir(logs.string(), "myjob");
  // torchrun's layout: <dir>/<run id>_<8 random characters>/attempt_<n>/<local rank>/.
  ASSERT_EQ(job.rfind((logs / "myjob_").string(), 0), 0u) << job;
  EXPECT_EQ(job.size(), (logs / "myjob_").string().size() + 8);
  EXPECT_NE(make_job_log_dir(logs.string(), "myjob"), job);
  const auto dir = std::filesystem::path(job) / "attempt_2";
  auto at = [&](int r) { return (dir / std::to_string(r)).string(); };
  size_t r0 = streams.add_rank(0, true, {3, 3, at(0)});
  size_t r1 = streams.add_rank(1, false, {3, 3, at(1)});
  size_t r2 = streams.add_rank(2, true, {2, 1, at(2)}), h = streams.add_host();
  streams.open_logs();
  FakeProcess p0, p1, p2, ph;
  streams.attach(r0, std::move(p0.out.read), std::move(p0.err.read));
  streams.attach(r1, std::move(p1.out.read), std::move(p1.err.read));
  streams.attach(r2, std::move(p2.out.read), std::move(p2.err.read));
  streams.attach(h, std::move(ph.out.read), std::move(ph.err.read));

  ddip::test::write_fd(p0.out.write.get(), "hello\npart");
  ddip::test::write_fd(p0.err.write.get(), "oops 1\noops 2\n");
  ddip::test::write_fd(p1.out.write.get(), "hidden by --show\n");
  ddip::test::write_fd(p2.out.write.get(), "redirected\n");
  ddip::test::write_fd(ph.out.write.get(), "[4] from node2\n");
  std::string record = ddip::run::protocol::encode(ddip::run::protocol::Report{ddip::run::protocol::NodeDone{{{4, "exit code 0"}}}});
  ddip::test::write_fd(ph.err.write.get(), "ssh: warning\n[4] its stderr\r" + record + "[4] after\n");
  for (auto* p : {&p0, &p1, &p2, &ph}) {
    p->out.write.reset();
    p->err.write.reset();
  }
  loop.run_until([&] { return !streams.any_open(); });

  // Units interleave line by line in the order their pipes are read; rank 0's partial line is
  // released at its end of file, with a line end.
  auto out = lines_of(read_ready(term_out.read.get()));
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, (std::vector<std::string>{"[0] hello", "[0] part", "[4] from node2"}));
  // Each unit's text arrived in one read, so each is written whole, in either order.
  const std::string err = read_ready(term_err.read.get()), mine = "[0] oops 1\n[0] oops 2\n",
                    hosts = "ssh: warning\n[4] its stderr\r[4] after\n";
  EXPECT_TRUE(err == mine + hosts || err == hosts + mine) << err;
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0], std::make_pair(h, record));
  EXPECT_EQ(streams.stderr_tail(r0), (std::vector<std::string>{"oops 1", "oops 2"}));
  // The launcher's own words, not its ranks' labelled lines.
  EXPECT_EQ(streams.launcher_tail(h), (std::vector<std::string>{"ssh: warning"}));
  streams.note(h, "host node2 sent a malformed record");
  EXPECT_EQ(streams.launcher_tail(h).back(), "host node2 sent a malformed record");
  // Logs hold what each rank wrote, unlabelled, shown or not; a host keeps its own.
  EXPECT_EQ(file_text(dir / "0" / "stdout.log"), "hello\npart");
  EXPECT_EQ(file_text(dir / "0" / "stderr.log"), "oops 1\noops 2\n");
  EXPECT_EQ(file_text(dir / "1" / "stdout.log"), "hidden by --show\n");
  EXPECT_EQ(file_text(dir / "2" / "stdout.log"), "redirected\n");
  EXPECT_FALSE(std::filesystem::exists(dir / "2" / "stderr.log"));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 3);
  std::filesystem::remove_all(logs);
}

TEST(RunOutput, ATerminalThatGoesAwayIsSaidOnceAndWrittenNoMore) {
  ::signal(SIGPIPE, SIG_IGN);
  RunLoop loop;
  auto term_out = ddip::make_pipe(true), term_err = ddip::make_pipe(true);
  term_out.read.reset();  // nobody reads ddip run's stdout any more
  Terminal terminal(std::chrono::milliseconds::zero(), term_out.write.get(), term_err.write.get());
  int failed = 0;
  LabelledStreams streams(loop, terminal, "ddip run",
                          {[](size_t, std::string_view) {}, [&] { ++failed; }});
  size_t r0 = streams.add_rank(0, true);
  FakeProcess p;
  streams.attach(r0, std::move(p.out.read), std::move(p.err.read));
  ddip::test::write_fd(p.out.write.get(), "one\n");
  loop.run_until([&] { return failed > 0; });
  ddip::test::write_fd(p.out.write.get(), "two\n");
  ddip::test::write_fd(p.err.write.get(), "still shown\n");
  p.out.write.reset();
  p.err.write.reset();
  loop.run_until([&] { return !streams.any_open(); });
  EXPECT_EQ(failed, 1);
  EXPECT_FALSE(terminal.ok(1));
  EXPECT_TRUE(terminal.ok(2));
  EXPECT_EQ(read_ready(term_err.read.get()), "[0] still shown\n");
}

TEST(RunOutput, ARanksPromptRecordIsHandedOnEvenAfterTextWithoutALineEnd) {
  RunLoop loop;
  auto term_out = ddip::make_pipe(true), term_err = ddip::make_pipe(true);
  Terminal terminal(std::chrono::milliseconds::zero(), term_out.write.get(), term_err.write.get());
  std::vector<std::pair<size_t, std::string>> records;
  LabelledStreams streams(loop, terminal, "ddip run",
                          {[&](size_t u, std::string_view line) { records.emplace_back(u, line); },
                           nullptr});
  size_t r = streams.add_rank(2, true);
  FakeProcess p;
  streams.attach(r, std::move(p.out.read), std::move(p.err.read));
  namespace proto = ddip::run::protocol;
  std::string prompt = proto::encode(proto::Report{proto::Prompt{2, "-> x = 1\n", "ipdb> "}});
  std::string left = proto::encode(proto::Report{proto::Prompt{2, "", ""}});
  ddip::test::write_fd(p.err.write.get(), "warn\nloss: " + prompt + left + "after\n");
  p.out.write.reset();
  p.err.write.reset();
  loop.run_until([&] { return !streams.any_open(); });
  EXPECT_EQ(records, (std::vector<std::pair<size_t, std::string>>{{r, prompt}, {r, left}}));
  EXPECT_EQ(read_ready(term_err.read.get()), "[2] warn\n[2] loss: \n[2] after\n");
  // A failure report's tail shows what the rank showed.
  EXPECT_EQ(streams.stderr_tail(r), (std::vector<std::string>{"warn", "loss: ", "after"}));
}

TEST(RunOutput, LinesSeveralRanksPrintAlikeGoOnceLabelledWithTheirRanks) {
  RunLoop loop;
  auto term_out = ddip::make_pipe(true), term_err = ddip::make_pipe(true);
  Terminal terminal(std::chrono::milliseconds::zero(), term_out.write.get(), term_err.write.get());
  LabelledStreams streams(loop, terminal, "ddip run", {[](size_t, std::string_view) {}, nullptr});
  std::vector<FakeProcess> p(4);
  std::vector<size_t> units;
  for (int r = 0; r < 4; ++r) units.push_back(streams.add_rank(r, true));
  streams.collapse_repeats(60);  // complete rounds go at once: none waits for the window
  for (int r = 0; r < 4; ++r)
    streams.attach(units[r], std::move(p[r].out.read), std::move(p[r].err.read));
  for (int r : {2, 0, 3, 1}) {
    ddip::test::write_fd(p[r].out.write.get(),
                         r == 3 ? "loss 0.31\nodd one out\n" : "loss 0.31\nsame\n");
    ddip::test::write_fd(p[r].err.write.get(), "warning from " + std::to_string(r) + "\n");
    p[r].out.write.reset();
    p[r].err.write.reset();
  }
  loop.run_until([&] { return !streams.any_open(); });
  streams.flush_open();
  EXPECT_EQ(read_ready(term_out.read.get()), "[0-3] loss 0.31\n[0-2] same\n[3] odd one out\n");
  // Lines that differ: each rank's own, in rank order, none dropped.
  EXPECT_EQ(read_ready(term_err.read.get()),
            "[0] warning from 0\n[1] warning from 1\n[2] warning from 2\n[3] warning from 3\n");
}
