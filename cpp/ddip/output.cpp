#include "ddip/output.hpp"

#include <algorithm>

namespace ddip {
namespace detail {

// How many bytes at the end of `s` start a UTF-8 character that is not complete yet.
size_t incomplete_utf8_tail(std::string_view s) {
  for (size_t back = 1; back <= 4 && back <= s.size(); ++back) {
    auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: the lead is further back
    size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return back < len ? back : 0;
  }
  return 0;  // only continuation bytes: invalid, nothing to wait for
}

}  // namespace detail

std::string rank_ranges(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(ranks[i]);
    if (j >= i + 2) {
      out.append("-").append(std::to_string(ranks[j]));
    } else if (j == i + 1) {
      out.append(",").append(std::to_string(ranks[j]));
    }
    i = j + 1;
  }
  return out;
}

std::string LineAssembler::feed(std::string_view data) {
  if (!data.empty()) kept_ = false;
  size_t cut = data.find_last_of("\r\n");
  if (cut == std::string_view::npos) {
    pending_.append(data);
    return {};
  }
  std::string out = std::move(pending_);
  out.append(data.substr(0, cut + 1));
  pending_.assign(data.substr(cut + 1));
  return out;
}

std::string LineAssembler::flush(bool force) {
  size_t keep = force || kept_ ? 0 : detail::incomplete_utf8_tail(pending_);
  std::string out = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  kept_ = keep > 0;
  return out;
}

std::vector<OutputPiece> RankOutput::feed(Stream s, std::string_view data) {
  std::vector<OutputPiece> pieces;
  if (s == kStderr) {
    std::string text = err_.feed(data);
    remember(text);
    if (!text.empty()) pieces.push_back({std::move(text), false});
    return pieces;
  }
  std::string buf = std::move(marker_carry_);
  marker_carry_.clear();
  buf.append(data);
  std::string_view rest(buf);
  while (true) {
    size_t at = rest.find(kDisplayMarker);
    if (at == std::string_view::npos) break;
    std::string text = out_.feed(rest.substr(0, at));
    text += out_.flush();
    pieces.push_back({std::move(text), true});
    rest.remove_prefix(at + kDisplayMarker.size());
  }
  // Hold back a tail that could be the first bytes of a marker split across reads.
  size_t keep = 0;
  for (size_t k = std::min(rest.size(), kDisplayMarker.size() - 1); k > 0; --k) {
    if (rest.substr(rest.size() - k) == kDisplayMarker.substr(0, k)) {
      keep = k;
      break;
    }
  }
  marker_carry_.assign(rest.substr(rest.size() - keep));
  std::string text = out_.feed(rest.substr(0, rest.size() - keep));
  if (!text.empty()) pieces.push_back({std::move(text), false});
  return pieces;
}

std::string RankOutput::flush(Stream s, bool force) {
  std::string text;
  if (s == kStdout) {
    std::string carry = std::move(marker_carry_);  // not a marker after all: it's text
    marker_carry_.clear();
    text = out_.feed(carry);
    text += out_.flush(force);
  } else {
    text = err_.flush(force);
    remember(text);
  }
  return text;
}

void RankOutput::remember(std::string_view text) {
  for_each_line(text, [this](std::string_view body, std::string_view end) {
    tail_partial_.append(body);
    if (end.empty()) return;
    // A '\r' rewrites the line in place: keep only what is finally shown.
    if (end != "\r") {
      tail_.push_back(std::move(tail_partial_));
      if (tail_.size() > kTailLines) tail_.pop_front();
    }
    tail_partial_.clear();
  });
}

std::string RankOutput::stderr_tail() const {
  std::string out;
  for (const auto& line : tail_) {
    if (!out.empty()) out += '\n';
    out += line;
  }
  if (!tail_partial_.empty()) {
    if (!out.empty()) out += '\n';
    out += tail_partial_;
  }
  return out;
}

Repeats::Repeats(std::vector<int> ranks, double window)
    : expected_(ranks.begin(), ranks.end()), window_(window) {}

std::vector<Repeats::Piece> Repeats::feed(int rank, int stream, std::string_view text, double now) {
  std::vector<Piece> out;
  Key key{rank, stream};
  double since = now;  // when the unended text held so far began
  std::string held;
  if (auto it = partial_.find(key); it != partial_.end()) {
    held = std::move(it->second.text);
    since = it->second.since;
    partial_.erase(it);
  }
  held.append(text);
  for_each_line(held, [&](std::string_view body, std::string_view end) {
    if (end.empty()) {  // waits for its end from when it began
      partial_[key] = Partial{std::string(body), since};
      return;
    }
    since = now;
    std::string line = std::string(body) + std::string(end);
    if (end == "\r" || raw_.count(key)) {
      raw(key, std::move(line), now, out);
    } else {
      add(key, std::move(line), now);
    }
  });
  release_into(now, false, out);
  return out;
}

std::vector<Repeats::Piece> Repeats::done(int rank, double now) {
  done_.insert(rank);
  return release(now);
}

std::vector<Repeats::Piece> Repeats::release(double now, bool everything) {
  std::vector<Piece> out;
  release_into(now, everything, out);
  return out;
}

std::optional<double> Repeats::next_due() const {
  std::optional<double> first;
  auto take = [&](double since) { first = first ? std::min(*first, since) : since; };
  for (const auto& [stream, rounds] : rounds_)
    for (const auto& [n, round] : rounds) take(round.since);
  for (const auto& [key, p] : partial_) take(p.since);
  if (first) *first += window_;
  return first;
}

void Repeats::add(const Key& key, std::string line, double now) {
  long n = count_[key]++;
  auto [it, fresh] = rounds_[key.second].try_emplace(n);
  Round& round = it->second;
  if (fresh) round.since = now;
  for (auto& [text, ranks] : round.lines) {
    if (text == line) {
      ranks.push_back(key.first);
      return;
    }
  }
  round.lines.emplace_back(std::move(line), std::vector<int>{key.first});
}

void Repeats::raw(const Key& key, std::string text, double now, std::vector<Piece>& out) {
  release_stream(key.second, now, true, out);  // this rank's lines before it go first
  bool ended = text.back() == '\n';
  out.push_back(Piece{{key.first}, key.second, std::move(text)});
  if (ended) {
    raw_.erase(key);
    ++count_[key];
  } else {
    raw_.insert(key);  // the rest of this line follows it as it is
  }
}

void Repeats::release_into(double now, bool everything, std::vector<Piece>& out) {
  for (auto& [stream, rounds] : rounds_) release_stream(stream, now, everything, out);
  for (auto it = partial_.begin(); it != partial_.end();) {
    if (everything || now >= it->second.since + window_) {
      Key key = it->first;
      std::string text = std::move(it->second.text);
      it = partial_.erase(it);
      raw(key, std::move(text), now, out);
    } else {
      ++it;
    }
  }
}

void Repeats::release_stream(int stream, double now, bool everything, std::vector<Piece>& out) {
  auto& rounds = rounds_[stream];
  while (!rounds.empty()) {
    auto& [n, round] = *rounds.begin();
    bool complete = true;  // every expected rank gave its n-th line (here or before), or is done
    for (int r : expected_) complete = complete && (count_[{r, stream}] > n || done_.count(r));
    if (!(everything || complete || now >= round.since + window_))
      break;  // later rounds wait for this one: each rank's lines keep their order
    auto lines = std::move(round.lines);
    rounds.erase(rounds.begin());
    for (auto& [text, ranks] : lines) std::sort(ranks.begin(), ranks.end());
    std::sort(lines.begin(), lines.end(),
              [](const auto& a, const auto& b) { return a.second.front() < b.second.front(); });
    for (auto& [text, ranks] : lines)
      out.push_back(Piece{std::move(ranks), stream, std::move(text)});
  }
}

}  // namespace ddip
