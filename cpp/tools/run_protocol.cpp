#include "run_protocol.hpp"

#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace ddip::run::protocol {
namespace {

std::string escape(std::string_view text) {
  if (text.empty()) return "\\e";
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case ' ': out += "\\s"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      default: out += c;
    }
  }
  return out;
}

// Quotes (part of) a bad line in an error message, its control characters made visible.
std::string quoted(std::string_view line) {
  constexpr size_t kShown = 120;
  std::string out = "\"";
  for (char c : line.substr(0, kShown)) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      static const char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[(c >> 4) & 0xf];
      out += hex[c & 0xf];
    } else {
      out += c;
    }
  }
  out += line.size() > kShown ? "\"..." : "\"";
  return out;
}

// The fields of one record, read in order; every error names the field and quotes the line.
class Fields {
 public:
  Fields(std::string_view line, std::string_view direction) {
    std::string_view body = line;
    if (body.size() >= 2 && body.substr(body.size() - 2) == "\r\n")
      body.remove_suffix(2);
    else if (!body.empty() && body.back() == '\n')
      body.remove_suffix(1);
    line_ = body;  // quoted in errors without its line end
    if (!is_record(body))
      fail("a " + std::string(direction) + " record must start with \\x1e\"ddip \"");
    body.remove_prefix(kPrefix.size());
    if (body.find_first_of("\r\n") != std::string_view::npos)
      fail("a record is one line, but this one has a line end inside");
    size_t start = 0;
    while (true) {
      size_t sp = body.find(' ', start);
      fields_.push_back(body.substr(start, sp == std::string_view::npos ? sp : sp - start));
      if (sp == std::string_view::npos) break;
      start = sp + 1;
    }
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw ProtocolError("malformed ddip record " + quoted(line_) + ": " + why);
  }

  std::string_view kind() const { return fields_[0]; }
  size_t left() const { return fields_.size() - next_; }

  std::string_view raw(const char* name) {
    if (next_ >= fields_.size()) fail(std::string("it ends before its ") + name);
    std::string_view f = fields_[next_++];
    if (f.empty()) fail(std::string("its ") + name + " is empty (two spaces in a row?)");
    return f;
  }

  template <typename Int>
  Int number(const char* name, Int lo, Int hi) {
    std::string_view f = raw(name);
    Int value{};
    auto [end, ec] = std::from_chars(f.data(), f.data() + f.size(), value);
    if (ec != std::errc() || end != f.data() + f.size())
      fail(std::string("its ") + name + " \"" + std::string(f) + "\" is not a number");
    if (value < lo || value > hi)
      fail(std::string("its ") + name + " " + std::to_string(value) + " is outside " +
           std::to_string(lo) + ".." + std::to_string(hi));
    return value;
  }

  std::string text(const char* name) {
    std::string_view f = raw(name);
    if (f == "\\e") return {};
    std::string out;
    out.reserve(f.size());
    for (size_t i = 0; i < f.size(); ++i) {
      if (f[i] != '\\') {
        out += f[i];
        continue;
      }
      char e = i + 1 < f.size() ? f[++i] : '\0';
      switch (e) {
        case '\\': out += '\\'; break;
        case 's': out += ' '; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        default:
          fail(std::string("its ") + name + " has an unknown escape \"\\" +
               (e ? std::string(1, e) : std::string()) + "\"");
      }
    }
    return out;
  }

  void end() const {
    if (next_ != fields_.size())
      fail("it has " + std::to_string(fields_.size() - next_) + " field(s) more than a \"" +
           std::string(kind()) + "\" record");
  }

  [[noreturn]] void unknown(std::string_view expected) const {
    fail("unknown kind \"" + std::string(kind()) + "\" (expected " + std::string(expected) +
         "); is the ddip program on both hosts the same version? (--ddip)");
  }

  void skip_kind() { next_ = 1; }

 private:
  std::string_view line_;
  std::vector<std::string_view> fields_;
  size_t next_ = 0;
};

constexpr int kMaxRank = std::numeric_limits<int>::max();
constexpr int64_t kMaxTime = std::numeric_limits<int64_t>::max();
// More lines than any report sends (RankOutput keeps 20): a bound on what a record may ask for.
constexpr size_t kMaxLines = 1000;

struct ControlEncoder {
  std::string operator()(const Ping&) const { return "ping"; }
  std::string operator()(const Signal& m) const { return "signal " + std::to_string(m.number); }
  std::string operator()(const Stop&) const { return "stop"; }
  std::string operator()(const Kill&) const { return "kill"; }
  std::string operator()(const Answer& m) const {
    return "answer " + std::to_string(m.rank) + " " + (m.end ? "1 " : "0 ") + escape(m.line);
  }
  std::string operator()(const Collect&) const { return "collect"; }
};

struct ReportEncoder {
  std::string operator()(const RankFailed& m) const {
    std::string out = "failed " + std::to_string(m.rank) + " " + std::to_string(m.exit_code) +
                      " " + std::to_string(m.signal) + " " + std::to_string(m.when_ns) + " " +
                      escape(m.what) + " " + escape(m.error) + " " + std::to_string(m.tail.size());
    // append(), not " " + escape(): GCC 12's -Wrestrict misfires on the latter at -O3.
    for (const auto& l : m.tail) out.append(" ").append(escape(l));
    return out;
  }
  std::string operator()(const NodeDone& m) const {
    std::string out = "done " + std::to_string(m.ranks.size());
    for (const auto& r : m.ranks)
      out.append(" ").append(std::to_string(r.rank)).append(" ").append(escape(r.what));
    return out;
  }
  std::string operator()(const Prompt& m) const {
    return "prompt " + std::to_string(m.rank) + " " + escape(m.output) + " " + escape(m.prompt);
  }
  std::string operator()(const RankState& m) const {
    return "state " + std::to_string(m.rank) + " " + escape(m.snapshot) + " " + escape(m.stack);
  }
  std::string operator()(const Signalled& m) const {
    return "signalled " + std::to_string(m.number);
  }
};

// Seconds as text that reads back exactly enough (a timeout, to the millisecond).
std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", s);
  return buf;
}

struct JoinEncoder {
  std::string operator()(const Welcome& m) const {
    return std::string("welcome ") + (m.keyed ? "1 " : "0 ") + escape(m.challenge);
  }
  std::string operator()(const Hello& m) const { return "hello " + escape(m.response); }
  std::string operator()(const Accept& m) const { return "accept " + escape(m.proof); }
  std::string operator()(const Join& m) const {
    return "join " + escape(m.run_id) + " " + std::to_string(m.node_rank) + " " +
           std::to_string(m.nproc) + " " + seconds(m.timeout_s) + " " + escape(m.name);
  }
  std::string operator()(const Refuse& m) const { return "refuse " + escape(m.why); }
  std::string operator()(const Start& m) const {
    return "start " + std::to_string(m.restart) + " " + std::to_string(m.max_restarts) + " " +
           std::to_string(m.rank_offset) + " " + std::to_string(m.world_size) + " " +
           std::to_string(m.node_rank) + " " + std::to_string(m.nnodes) + " " +
           escape(m.master_addr) + " " + std::to_string(m.master_port) + " " + escape(m.run_id) +
           (m.prompts ? " 1" : " 0");
  }
  std::string operator()(const End& m) const {
    std::string out = std::string("end ") + (m.restart ? "1 " : "0 ") +
                      std::to_string(m.exit_code) + (m.failed ? " 1 " : " 0 ") +
                      std::to_string(m.rank) + " " + escape(m.who) + " " + escape(m.what) + " " +
                      escape(m.error) + (m.timed_out ? " 1 " : " 0 ") + seconds(m.timeout_s) + " " +
                      std::to_string(m.first_signal) + (m.grace_ran_out ? " 1 " : " 0 ") +
                      std::to_string(m.tail.size());
    for (const auto& l : m.tail) out.append(" ").append(escape(l));
    return out;
  }
};

}  // namespace

std::string encode(const Control& message) {
  return std::string(kPrefix) + std::visit(ControlEncoder{}, message) + "\n";
}

std::string encode(const Report& message) {
  return std::string(kPrefix) + std::visit(ReportEncoder{}, message) + "\n";
}

Control decode_control(std::string_view line) {
  Fields f(line, "control");
  std::string_view kind = f.kind();
  f.skip_kind();
  Control out;
  if (kind == "ping") {
    out = Ping{};
  } else if (kind == "signal") {
    out = Signal{f.number<int>("signal number", 1, NSIG - 1)};
  } else if (kind == "stop") {
    out = Stop{};
  } else if (kind == "kill") {
    out = Kill{};
  } else if (kind == "answer") {
    Answer a;
    a.rank = f.number<int>("rank", 0, kMaxRank);
    a.end = f.number<int>("end", 0, 1) == 1;
    a.line = f.text("line");
    if (a.line.find('\n') != std::string::npos) f.fail("its line has a line end inside");
    out = std::move(a);
  } else if (kind == "collect") {
    out = Collect{};
  } else {
    f.unknown("ping, signal, stop, kill, answer or collect");
  }
  f.end();
  return out;
}

std::optional<Control> ControlReader::next() {
  size_t nl = pending_.find('\n');
  if (nl == std::string::npos) {
    if (pending_.size() > kMaxControlLine)
      throw ProtocolError("malformed ddip record " + quoted(pending_) + ": no line end within " +
                          std::to_string(kMaxControlLine) + " bytes");
    return std::nullopt;
  }
  std::string line = pending_.substr(0, nl + 1);
  pending_.erase(0, nl + 1);
  return decode_control(line);
}

std::string encode(const FileHeader& h) {
  return std::string(kPrefix) + "file " + escape(h.path) + " " + std::to_string(h.size) + " " +
         std::to_string(h.mode) + "\n";
}

FileHeader decode_file_header(std::string_view line) {
  Fields f(line, "file");
  if (f.kind() != "file") f.unknown("file");
  f.skip_kind();
  FileHeader h;
  h.path = f.text("path");
  if (h.path.empty()) f.fail("its path is empty");
  h.size = f.number<uint64_t>("size", 0, kMaxShipBytes);
  h.mode = f.number<uint32_t>("mode", 0, 0777);
  f.end();
  return h;
}

Report decode_report(std::string_view line) {
  Fields f(line, "report");
  std::string_view kind = f.kind();
  f.skip_kind();
  if (kind == "failed") {
    RankFailed m;
    m.rank = f.number<int>("rank", 0, kMaxRank);
    m.exit_code = f.number<int>("exit code", 0, 255);
    m.signal = f.number<int>("signal", 0, NSIG - 1);
    m.when_ns = f.number<int64_t>("time", 0, kMaxTime);
    m.what = f.text("description");
    m.error = f.text("error file");
    if (m.exit_code == 0 && m.signal == 0)
      f.fail("a failed rank needs a non-zero exit code or a signal");
    size_t n = f.number<size_t>("line count", 0, kMaxLines);
    if (f.left() != n)
      f.fail("it says " + std::to_string(n) + " line(s) of stderr follow, but " +
             std::to_string(f.left()) + " do");
    for (size_t i = 0; i < n; ++i) m.tail.push_back(f.text("stderr line"));
    f.end();
    return m;
  }
  if (kind == "done") {
    NodeDone m;
    size_t n = f.number<size_t>("rank count", 0, static_cast<size_t>(kMaxRank));
    if (f.left() != 2 * n)
      f.fail("it says " + std::to_string(n) + " rank(s) follow, which takes " +
             std::to_string(2 * n) + " fields, but " + std::to_string(f.left()) + " do");
    for (size_t i = 0; i < n; ++i) {
      RankEnd r;
      r.rank = f.number<int>("rank", 0, kMaxRank);
      r.what = f.text("rank's end");
      m.ranks.push_back(std::move(r));
    }
    f.end();
    return m;
  }
  if (kind == "prompt") {
    Prompt m;
    m.rank = f.number<int>("rank", 0, kMaxRank);
    m.output = f.text("debugger output");
    m.prompt = f.text("prompt");
    f.end();
    return m;
  }
  if (kind == "state") {
    RankState m;
    m.rank = f.number<int>("rank", 0, kMaxRank);
    m.snapshot = f.text("snapshot");
    m.stack = f.text("stack");
    f.end();
    return m;
  }
  if (kind == "signalled") {
    Signalled m{f.number<int>("signal number", 1, NSIG - 1)};
    f.end();
    return m;
  }
  f.unknown("failed, done, prompt, state or signalled");
}

std::string encode(const JoinRecord& record) {
  return std::string(kPrefix) + std::visit(JoinEncoder{}, record) + "\n";
}

namespace {
double seconds_field(Fields& f, const char* name) {
  std::string text = f.text(name);
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v >= 0) || v > 1e9)
    f.fail(std::string("its ") + name + " \"" + text + "\" is not a number of seconds");
  return v;
}
bool flag(Fields& f, const char* name) { return f.number<int>(name, 0, 1) == 1; }
}  // namespace

JoinRecord decode_join(std::string_view line) {
  Fields f(line, "join");
  std::string_view kind = f.kind();
  f.skip_kind();
  JoinRecord out;
  if (kind == "welcome") {
    Welcome m;
    m.keyed = flag(f, "keyed");
    m.challenge = f.text("challenge");
    out = m;
  } else if (kind == "hello") {
    out = Hello{f.text("response")};
  } else if (kind == "accept") {
    out = Accept{f.text("proof")};
  } else if (kind == "join") {
    Join m;
    m.run_id = f.text("run id");
    m.node_rank = f.number<int>("node rank", -1, kMaxRank);
    m.nproc = f.number<int>("rank count", 1, kMaxRank);
    m.timeout_s = seconds_field(f, "timeout");
    m.name = f.text("name");
    out = m;
  } else if (kind == "refuse") {
    out = Refuse{f.text("reason")};
  } else if (kind == "start") {
    Start m;
    m.restart = f.number<int>("restart count", 0, kMaxRank);
    m.max_restarts = f.number<int>("max restarts", 0, kMaxRank);
    m.rank_offset = f.number<int>("rank offset", 0, kMaxRank);
    m.world_size = f.number<int>("world size", 1, kMaxRank);
    m.node_rank = f.number<int>("node rank", 0, kMaxRank);
    m.nnodes = f.number<int>("node count", 1, kMaxRank);
    m.master_addr = f.text("master address");
    m.master_port = f.number<int>("master port", 1, 65535);
    m.run_id = f.text("run id");
    m.prompts = flag(f, "prompts");
    if (m.node_rank >= m.nnodes || m.rank_offset >= m.world_size)
      f.fail("its node rank or rank offset is outside the job");
    out = m;
  } else if (kind == "end") {
    End m;
    m.restart = flag(f, "restart");
    m.exit_code = f.number<int>("exit code", 0, 255);
    m.failed = flag(f, "failed");
    m.rank = f.number<int>("rank", -1, kMaxRank);
    m.who = f.text("who");
    m.what = f.text("what");
    m.error = f.text("error file");
    m.timed_out = flag(f, "timed out");
    m.timeout_s = seconds_field(f, "timeout");
    m.first_signal = f.number<int>("signal", 0, NSIG - 1);
    m.grace_ran_out = flag(f, "grace ran out");
    size_t n = f.number<size_t>("line count", 0, kMaxLines);
    if (f.left() != n)
      f.fail("it says " + std::to_string(n) + " line(s) of stderr follow, but " +
             std::to_string(f.left()) + " do");
    for (size_t i = 0; i < n; ++i) m.tail.push_back(f.text("stderr line"));
    out = m;
  } else {
    f.unknown("welcome, hello, accept, join, refuse, start or end");
  }
  f.end();
  return out;
}

}  // namespace ddip::run::protocol
