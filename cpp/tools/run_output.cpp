#include "run_output.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>
#include <system_error>

#include "run_protocol.hpp"

namespace ddip::run {

namespace {
constexpr size_t kReadChunk = 64 * 1024;
}

bool write_all(int fd, std::string_view data, milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (errno == EAGAIN) {
      int wait_ms = -1;
      if (limit > milliseconds::zero()) {
        auto left = std::chrono::ceil<milliseconds>(until - Clock::now()).count();
        if (left <= 0) return false;
        wait_ms = static_cast<int>(left);
      }
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, wait_ms);
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

std::string label(std::string_view text, const std::string& tag, bool& after_cr) {
  std::string out;
  out.reserve(text.size() + tag.size() * 4);
  for_each_line(text, [&](std::string_view body, std::string_view end) {
    if (!body.empty() || (!end.empty() && end != "\r" && !after_cr)) out += tag;
    out.append(body);
    out.append(end);
    after_cr = end == "\r";
  });
  if (!out.empty() && out.back() != '\n' && out.back() != '\r') {
    out += '\n';
    after_cr = false;
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

bool Terminal::write(int stream, std::string_view text) {
  if (prompt_.empty() || text.empty()) return put(stream, text);
  put(1, "\n");
  bool ok = put(stream, text);
  if (text.back() == '\n') put(1, prompt_);
  else put(1, "\n" + prompt_);
  return ok;
}

void Terminal::prompt(std::string text) {
  prompt_ = std::move(text);
  put(1, prompt_);
}

void Terminal::answered(bool newline) {
  if (newline && !prompt_.empty()) put(1, "\n");
  prompt_.clear();
}

bool Terminal::put(int stream, std::string_view text) {
  if (!ok_[stream]) return false;
  if (!write_all(fd_[stream], text, limit_)) ok_[stream] = false;
  return ok_[stream];
}

std::string make_job_log_dir(const std::string& log_dir, const std::string& run_id) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  if (ec) throw std::system_error(ec, "creating --log-dir " + log_dir);
  // torch's tempfile.mkdtemp(prefix=run_id + "_"): eight of these characters.
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyz0123456789_";
  std::random_device random;
  for (int tries = 0;; ++tries) {
    std::string dir = log_dir + "/" + run_id + "_";
    for (int i = 0; i < 8; ++i) dir += kChars[random() % (sizeof kChars - 1)];
    if (::mkdir(dir.c_str(), 0700) == 0) return dir;
    if (errno != EEXIST || tries > 100) check(-1, "mkdir", "creating " + dir);
  }
}

std::string make_temporary_log_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/torchelastic_XXXXXX";
  check(::mkdtemp(dir.data()) ? 0 : -1, "mkdtemp", "creating " + dir);
  return dir;
}

size_t LabelledStreams::add_rank(int rank, bool shown, RankStreams streams) {
  Unit& un = units_.emplace_back();
  un.first_rank = rank;
  un.shown = shown;
  un.streams = streams;
  // append(): GCC 12's -Wrestrict misfires on "[" + std::to_string(rank) at -O3.
  un.tag.append("[").append(std::to_string(rank)).append("] ");
  return units_.size() - 1;
}

size_t LabelledStreams::add_host() {
  Unit& un = units_.emplace_back();
  un.host = true;
  return units_.size() - 1;
}

void LabelledStreams::open_logs() {
  for (auto& un : units_) {
    if (un.host || un.streams.dir.empty()) continue;  // a host's ddip run keeps its ranks' logs
    const std::string& dir = un.streams.dir;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw std::system_error(ec, "creating " + dir);
    for (int s : {1, 2}) {
      if (!(un.streams.to_file & s)) continue;
      std::string path = dir + (s == 1 ? "/stdout.log" : "/stderr.log");
      un.log[s] = Fd(check(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                           "open", "creating " + path));
    }
  }
}

void LabelledStreams::collapse_repeats(double window) {
  std::vector<int> shown;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].host || !units_[u].shown) continue;  // a host's ddip run collapses its own
    shown.push_back(units_[u].first_rank);
    unit_of_rank_[units_[u].first_rank] = u;
  }
  if (shown.size() < 2) return;
  repeats_.emplace(std::move(shown), window);
  loop_.deadline(
      [this]() -> std::optional<Clock::time_point> {
        auto due = repeats_->next_due();
        if (!due) return std::nullopt;
        return Clock::time_point(
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*due)));
      },
      [this](Clock::time_point now) { put(repeats_->release(seconds(now))); });
}

double LabelledStreams::seconds(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

void LabelledStreams::attach(size_t u, Fd out, Fd err) {
  Unit& un = units_.at(u);
  un.pipe[1] = std::move(out);
  un.pipe[2] = std::move(err);
  for (auto s : {RankOutput::kStdout, RankOutput::kStderr})
    loop_.watch(un.pipe[s].get(), EPOLLIN, [this, u, s](uint32_t) { read(u, s); });
}

bool LabelledStreams::any_open() const {
  for (const auto& un : units_)
    if (un.pipe[1] || un.pipe[2]) return true;
  return false;
}

void LabelledStreams::read(size_t u, RankOutput::Stream s) {
  Unit& un = units_[u];
  Fd& fd = un.pipe[s];
  if (!fd) return;
  char buf[kReadChunk];
  ssize_t n = ::read(fd.get(), buf, sizeof buf);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return;
    n = 0;  // EIO and the like: nothing more will come from it
  }
  if (n == 0) {
    loop_.unwatch(fd.get());
    fd.reset();
    deliver(u, s, un.output.flush(s));
    if (repeats_ && !un.host && !un.pipe[1] && !un.pipe[2])  // it writes no more
      put(repeats_->done(un.first_rank, seconds(Clock::now())));
    return;
  }
  std::string_view data(buf, static_cast<size_t>(n));
  if (un.log[s] && !write_all(un.log[s].get(), data)) {
    std::cerr << me_ << ": writing rank " << un.first_rank << "'s log failed ("
              << std::strerror(errno) << "); its output goes on to the terminal only\n";
    un.log[s].reset();
  }
  for (auto& piece : un.output.feed(s, data)) deliver(u, s, piece.text);
}

// Everything the exited unit wrote is in its pipes already; take it before reporting.
void LabelledStreams::drain(size_t u) {
  for (auto s : {RankOutput::kStdout, RankOutput::kStderr}) read_ready(u, s);
}

void LabelledStreams::drain(size_t u, RankOutput::Stream s) {
  read_ready(u, s);
  // Before its prompt, the lines held for repeats go (theirs among them), not after it.
  if (repeats_) put(repeats_->release(seconds(Clock::now()), true));
}

void LabelledStreams::read_ready(size_t u, RankOutput::Stream s) {
  Unit& un = units_[u];
  for (int i = 0; i < 4096 && un.pipe[s]; ++i) {
    pollfd p{un.pipe[s].get(), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) break;
    read(u, s);
  }
}

void LabelledStreams::flush(size_t u) {
  for (auto s : {RankOutput::kStdout, RankOutput::kStderr}) deliver(u, s, units_[u].output.flush(s));
}

void LabelledStreams::flush_open() {
  for (size_t u = 0; u < units_.size(); ++u)
    for (auto s : {RankOutput::kStdout, RankOutput::kStderr})
      if (units_[u].pipe[s]) deliver(u, s, units_[u].output.flush(s));
  if (repeats_) put(repeats_->release(seconds(Clock::now()), true));
}

void LabelledStreams::deliver(size_t u, RankOutput::Stream s, const std::string& text) {
  if (s != RankOutput::kStderr)
    emit(u, s, text);
  else if (units_[u].host)
    host_text(u, text);
  else
    rank_text(u, text);
}

// A rank's stderr, with the record its debugger writes before each prompt (ddip.rank.run_debug):
// at the end of a line, after text the rank left without a line end ("loss: " and then the
// breakpoint), which is shown as a line of its own.
void LabelledStreams::rank_text(size_t u, const std::string& text) {
  if (text.find(protocol::kPrefix) == std::string::npos) return emit(u, RankOutput::kStderr, text);
  std::string shown;
  for_each_line(text, [&](std::string_view body, std::string_view end) {
    std::string_view line(body.data(), body.size() + end.size());
    size_t at = line.find(protocol::kPrefix);
    if (at == std::string_view::npos) {
      shown.append(line);
      return;
    }
    if (at > 0) shown.append(line.substr(0, at)).append("\n");
    emit(u, RankOutput::kStderr, shown);
    shown.clear();
    hooks_.on_record(u, line.substr(at));
  });
  emit(u, RankOutput::kStderr, shown);
}

// A host's stderr arrives in whole lines (RankOutput assembles them), its ddip run's records
// among its ranks' lines.
void LabelledStreams::host_text(size_t u, const std::string& text) {
  std::string shown;
  // A line ends at '\n', or at '\r' (a redrawn progress bar): a record can follow either.
  for_each_line(text, [&](std::string_view body, std::string_view end) {
    std::string_view line(body.data(), body.size() + end.size());
    if (protocol::is_record(line)) {
      hooks_.on_record(u, line);
    } else {
      shown.append(line);
      // ssh's and the host's own messages (not the ranks', which are labelled) explain a failed
      // launcher.
      if (!body.empty() && body[0] != '[') note(u, std::string(body));
    }
  });
  emit(u, RankOutput::kStderr, shown);
}

void LabelledStreams::emit(size_t u, RankOutput::Stream s, std::string_view text) {
  Unit& un = units_[u];
  if (text.empty() || !terminal_.ok(s)) return;
  std::string labelled;
  if (!un.host) {  // a host's lines are labelled and filtered there already
    if (!un.shown || !(un.streams.to_console & s)) return;
    if (repeats_) return put(repeats_->feed(un.first_rank, s, text, seconds(Clock::now())));
    labelled = label(text, un.tag, un.after_cr[s]);
    text = labelled;
  }
  if (!terminal_.write(s, text) && hooks_.on_write_failed) hooks_.on_write_failed();
}

// What repeats_ hands on: a line of one rank labelled as ever, one of several "[0-7] ".
void LabelledStreams::put(const std::vector<ddip::Repeats::Piece>& pieces) {
  for (const auto& p : pieces) {
    std::string text;
    if (p.ranks.size() == 1) {
      Unit& un = units_[unit_of_rank_.at(p.ranks.front())];
      text = label(p.text, un.tag, un.after_cr[p.stream]);
    } else {
      bool after_cr = false;
      std::string tag;  // append(): GCC 12's -Wrestrict misfires on "[" + ... at -O3
      tag.append("[").append(rank_ranges(p.ranks)).append("] ");
      text = label(p.text, tag, after_cr);
    }
    if (!terminal_.ok(p.stream)) continue;
    if (!terminal_.write(p.stream, text) && hooks_.on_write_failed) hooks_.on_write_failed();
  }
}

std::vector<std::string> LabelledStreams::stderr_tail(size_t u) const {
  std::vector<std::string> tail;
  // Without the records of its debugger's prompts, which it never showed.
  for (auto& line : lines_of(units_[u].output.stderr_tail())) {
    size_t at = line.find(protocol::kPrefix);
    if (at == std::string::npos)
      tail.push_back(std::move(line));
    else if (at > 0)
      tail.push_back(line.substr(0, at));
  }
  return tail;
}

std::vector<std::string> LabelledStreams::launcher_tail(size_t u) const {
  return {units_[u].tail.begin(), units_[u].tail.end()};
}

void LabelledStreams::note(size_t u, std::string line) {
  auto& tail = units_[u].tail;
  tail.push_back(std::move(line));
  if (tail.size() > RankOutput::kTailLines) tail.pop_front();
}

}  // namespace ddip::run
