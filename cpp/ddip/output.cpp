#include "ddip/output.hpp"

#include <algorithm>

namespace ddip {

std::string LineAssembler::feed(std::string_view data) {
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

std::string LineAssembler::flush() {
  std::string out = std::move(pending_);
  pending_.clear();
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

std::string RankOutput::flush(Stream s) {
  std::string text;
  if (s == kStdout) {
    out_.feed(marker_carry_);  // not a marker after all: it's text
    marker_carry_.clear();
    text = out_.flush();
  } else {
    text = err_.flush();
    remember(text);
  }
  return text;
}

void RankOutput::remember(std::string_view text) {
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find_first_of("\r\n", start);
    if (end == std::string_view::npos) {
      tail_partial_.append(text.substr(start));
      return;
    }
    tail_partial_.append(text.substr(start, end - start));
    // A '\r' rewrites the line in place: keep only what is finally shown.
    if (text[end] == '\n') {
      tail_.push_back(std::move(tail_partial_));
      if (tail_.size() > kTailLines) tail_.pop_front();
    }
    tail_partial_.clear();
    start = end + 1;
  }
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

}  // namespace ddip
