// The records two `ddip run`s exchange (cpp/tools/run_protocol.hpp): every message survives a
// round trip whatever its text holds, and anything else is rejected with an error that says why.
#include <gtest/gtest.h>

#include <csignal>

#include "run_protocol.hpp"

using namespace ddip::run::protocol;

namespace {

std::string error_of_report(std::string_view line) {
  try {
    decode_report(line);
  } catch (const ProtocolError& e) {
    return e.what();
  }
  return "";
}

std::string error_of_control(std::string_view line) {
  try {
    decode_control(line);
  } catch (const ProtocolError& e) {
    return e.what();
  }
  return "";
}

// Text a rank may well print: spaces at both ends, escapes' own characters, a progress bar's
// '\r', the record prefix itself, a tab, non-ASCII, invalid UTF-8.
const std::vector<std::string> kAwkward = {
    "",  " ", "  two  spaces  ", "a\\sb", "\\e", "\\", "50%\r100%", "line\nbreak", "\r\n",
    "\x1e" "ddip failed 1 2 3", "tab\there", "Grüße ✓", std::string("\xff\xfe bytes"), "x y\\",
};

}  // namespace

TEST(RunProtocol, ControlMessagesRoundTrip) {
  for (const Control& m : {Control{Ping{}}, Control{Signal{SIGINT}}, Control{Signal{SIGTERM}},
                           Control{Stop{}}, Control{Kill{}}, Control{Answer{3, false, "p x"}},
                           Control{Answer{0, true, ""}}, Control{Collect{}}}) {
    std::string line = encode(m);
    EXPECT_TRUE(is_record(line));
    EXPECT_EQ(line.find('\n'), line.size() - 1) << "one line";
    EXPECT_EQ(decode_control(line), m) << line;
  }
  EXPECT_EQ(encode(Control{Signal{SIGTERM}}), "\x1e" "ddip signal 15\n");
  EXPECT_EQ(encode(Control{Answer{2, false, "p x"}}), "\x1e" "ddip answer 2 0 p\\sx\n");
  for (const auto& text : kAwkward) {
    if (text.find('\n') != std::string::npos) continue;  // a typed line has no line end inside
    Answer a{7, false, text};
    EXPECT_EQ(decode_control(encode(Control{a})), Control{a}) << text;
  }
}

TEST(RunProtocol, PromptRoundTripsAnyText) {
  for (const auto& text : kAwkward) {
    Prompt m{5, text + "\n-> x = 1\n", text};
    std::string line = encode(Report{m});
    EXPECT_EQ(line.find_first_of("\r\n"), line.size() - 1) << "one line, whatever the text held";
    EXPECT_EQ(std::get<Prompt>(decode_report(line)), m) << text;
  }
  // As ddip.rank.run_debug writes it.
  EXPECT_EQ(std::get<Prompt>(decode_report("\x1e" "ddip prompt 1 >\\sf.py(3)\\n ipdb>\\s\n")),
            (Prompt{1, "> f.py(3)\n", "ipdb> "}));
}

TEST(RunProtocol, RankStateRoundTripsAnyText) {
  for (const auto& text : kAwkward) {
    RankState m{3, R"({"rank": 3, "entries": [{"op": "all_reduce"}], "x": ")" + text + "\"}",
                "  File \"train.py\", line 7, in <module>\n    " + text + "\n"};
    std::string line = encode(Report{m});
    EXPECT_EQ(line.find_first_of("\r\n"), line.size() - 1) << "one line, whatever the text held";
    EXPECT_EQ(std::get<RankState>(decode_report(line)), m) << text;
  }
  // A host's word for a rank that can't answer: no snapshot, no stack.
  EXPECT_EQ(encode(Report{RankState{2, "", ""}}), "\x1e" "ddip state 2 \\e \\e\n");
  // As ddip.rank.run_hook writes it (json.dumps, traceback.format_stack).
  EXPECT_EQ(std::get<RankState>(decode_report(
                "\x1e" "ddip state 1 {\"off\":\\s\"torch.distributed\\sis\\snot\\sinitialized\"} "
                "\\s\\sFile\\s\"t.py\",\\sline\\s3,\\sin\\s<module>\\n\n")),
            (RankState{1, R"({"off": "torch.distributed is not initialized"})",
                       "  File \"t.py\", line 3, in <module>\n"}));
}

TEST(RunProtocol, RankFailedRoundTripsAnyText) {
  RankFailed m;
  m.rank = 1023;
  m.exit_code = 7;
  m.when_ns = 1732430000123456789;
  m.what = "exit code 7";
  m.error = R"({"message": {"message": "ValueError: a b", "extraInfo": {"py_callstack": "T\n"}}})";
  m.tail = kAwkward;
  std::string line = encode(Report{m});
  EXPECT_TRUE(is_record(line));
  EXPECT_EQ(line.find_first_of("\r\n"), line.size() - 1) << "one line, whatever the text held";
  EXPECT_EQ(std::get<RankFailed>(decode_report(line)), m);

  RankFailed killed;
  killed.rank = 0;
  killed.signal = SIGSEGV;
  killed.what = "killed by SIGSEGV";
  EXPECT_EQ(std::get<RankFailed>(decode_report(encode(Report{killed}))), killed);  // no tail
  for (const auto& text : kAwkward) {
    RankFailed one = m;
    one.what = text;
    one.error = text;
    one.tail = {text};
    EXPECT_EQ(std::get<RankFailed>(decode_report(encode(Report{one}))), one) << text;
  }
}

TEST(RunProtocol, NodeDoneRoundTrips) {
  NodeDone m;
  for (int r = 4; r < 8; ++r) m.ranks.push_back({r, r == 5 ? "exit code 1" : "killed by SIGTERM (stopped by ddip run)"});
  m.ranks.push_back({8, ""});
  EXPECT_EQ(std::get<NodeDone>(decode_report(encode(Report{m}))), m);
  EXPECT_EQ(std::get<NodeDone>(decode_report(encode(Report{NodeDone{}}))), NodeDone{});
}

TEST(RunProtocol, LineEndsAreOptionalOnDecode) {
  std::string line = encode(Control{Stop{}});
  line.pop_back();
  EXPECT_EQ(decode_control(line), Control{Stop{}});
  EXPECT_EQ(decode_control(line + "\r\n"), Control{Stop{}});  // through a terminal-ish pipe
}

TEST(RunProtocol, TextIsNotARecord) {
  EXPECT_FALSE(is_record("[3] ddip failed 1 2"));
  EXPECT_FALSE(is_record("ddip run on node2: its launcher's stdin closed"));
  EXPECT_FALSE(is_record("\x1e" "ddi"));
  EXPECT_NE(error_of_control("stop\n").find("must start with \\x1e\"ddip \""), std::string::npos);
}

TEST(RunProtocol, MalformedControlIsRejectedSayingWhy) {
  const std::string p(kPrefix);
  struct Case {
    std::string line, why;
  } cases[] = {
      {p + "signal\n", "ends before its signal number"},
      {p + "signal x\n", "signal number \"x\" is not a number"},
      {p + "signal 15x\n", "signal number \"15x\" is not a number"},
      {p + "signal -2\n", "signal number -2 is outside 1.."},
      {p + "signal 0\n", "signal number 0 is outside 1.."},
      {p + "signal 99999999999\n", "is not a number"},
      {p + "signal 15 9\n", "1 field(s) more than a \"signal\" record"},
      {p + "stop now\n", "1 field(s) more than a \"stop\" record"},
      {p + "ping \n", "1 field(s) more"},
      {p + "signal  15\n", "signal number is empty (two spaces in a row?)"},
      {p + "halt\n", "unknown kind \"halt\" (expected ping, signal, stop, kill, answer or collect); is the ddip program on both hosts the same version? (--ddip)"},
      {p + "\n", "unknown kind \"\""},
      {p + "failed 1 2 0 5 x 0\n", "unknown kind \"failed\""},  // a report on the control channel
      {p + "stop\rkill\n", "has a line end inside"},
  };
  for (const auto& c : cases) {
    std::string e = error_of_control(c.line);
    EXPECT_NE(e.find(c.why), std::string::npos) << c.line << " -> " << e;
    EXPECT_EQ(e.rfind("malformed ddip record \"\\x1eddip ", 0), 0u) << "quotes the line: " << e;
  }
}

TEST(RunProtocol, MalformedReportsAreRejectedSayingWhy) {
  const std::string p(kPrefix);
  struct Case {
    std::string line, why;
  } cases[] = {
      {p + "failed\n", "ends before its rank"},
      {p + "failed 3 7 0 12\n", "ends before its description"},
      {p + "failed 3 7 0 12 exit\\scode\\s7\n", "ends before its error file"},
      {p + "failed 3 7 0 12 exit\\scode\\s7 \\e\n", "ends before its line count"},
      {p + "failed -1 7 0 12 x \\e 0\n", "rank -1 is outside 0.."},
      {p + "failed 3 256 0 12 x \\e 0\n", "exit code 256 is outside 0..255"},
      {p + "failed 3 0 65 12 x \\e 0\n", "signal 65 is outside 0.."},
      {p + "failed 3 0 0 12 x \\e 0\n", "needs a non-zero exit code or a signal"},
      {p + "failed 3 7 0 -5 x \\e 0\n", "time -5 is outside 0.."},
      {p + "failed 3 7 0 1e9 x \\e 0\n", "time \"1e9\" is not a number"},
      {p + "failed 3 7 0 12 x \\e 2 a\n", "says 2 line(s) of stderr follow, but 1 do"},
      {p + "failed 3 7 0 12 x \\e 1 a b\n", "says 1 line(s) of stderr follow, but 2 do"},
      {p + "failed 3 7 0 12 x \\e 1001\n", "line count 1001 is outside 0..1000"},
      {p + "failed 3 7 0 12 bad\\q \\e 0\n", "description has an unknown escape \"\\q\""},
      {p + "failed 3 7 0 12 x bad\\q 0\n", "error file has an unknown escape \"\\q\""},
      {p + "failed 3 7 0 12 x \\e 1 trailing\\\n", "stderr line has an unknown escape \"\\\""},
      {p + "done 2 0 ok\n", "says 2 rank(s) follow, which takes 4 fields, but 2 do"},
      {p + "done 1 zero ok\n", "rank \"zero\" is not a number"},
      {p + "done x\n", "rank count \"x\" is not a number"},
      {p + "tail some stderr\n", "unknown kind \"tail\" (expected failed, done, prompt, state or signalled)"},
      {p + "status 1 exit\n", "unknown kind \"status\""},
      {p + "state 1 {}\n", "it ends before its stack"},
      {p + "state one {} x\n", "rank \"one\" is not a number"},
      {p + "state 1 {} x y\n", "1 field(s) more than a \"state\" record"},
      {p + "ping\n", "unknown kind \"ping\""},  // a control message in a report's place
  };
  for (const auto& c : cases) {
    std::string e = error_of_report(c.line);
    EXPECT_NE(e.find(c.why), std::string::npos) << c.line << " -> " << e;
  }
}

TEST(RunProtocol, ErrorsQuoteTheLineReadably) {
  std::string line = std::string(kPrefix) + "failed 1 2 0 3 " + std::string(300, 'x') + "\x01 9\n";
  std::string e = error_of_report(line);
  // Control characters are shown as \xNN; a long line is cut, and says so.
  EXPECT_EQ(e.rfind("malformed ddip record \"\\x1eddip failed 1 2 0 3 xxx", 0), 0u) << e;
  EXPECT_NE(e.find("\"...: "), std::string::npos) << e;
  EXPECT_EQ(e.find('\x01'), std::string::npos);
}

TEST(RunProtocol, ControlReaderTakesMessagesAsTheyArrive) {
  ControlReader in;
  std::string bytes = encode(Control{Ping{}}) + encode(Control{Signal{SIGINT}}) + encode(Control{Kill{}});
  std::vector<Control> got;
  for (char c : bytes) {  // one byte at a time: a record split anywhere by the pipe
    in.feed(std::string_view(&c, 1));
    while (auto m = in.next()) got.push_back(*m);
  }
  EXPECT_EQ(got, (std::vector<Control>{Ping{}, Signal{SIGINT}, Kill{}}));
  EXPECT_FALSE(in.next().has_value());
}

TEST(RunProtocol, ControlReaderRejectsGarbage) {
  ControlReader in;
  in.feed(std::string(kMaxControlLine, 'x'));
  EXPECT_FALSE(in.next().has_value());  // a long line may still end
  in.feed("x");
  try {
    in.next();
    FAIL() << "a line without an end past the limit was accepted";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(("no line end within " + std::to_string(kMaxControlLine) + " bytes")), std::string::npos) << e.what();
  }
  ControlReader bad;
  bad.feed(encode(Control{Stop{}}) + "hello\n");
  EXPECT_EQ(bad.next(), Control{Stop{}});
  EXPECT_THROW(bad.next(), ProtocolError);
}
