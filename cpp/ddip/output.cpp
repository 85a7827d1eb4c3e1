#include "ddip/output.hpp"

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

std::string RankOutput::feed(Stream s, std::string_view data) {
  std::string text = (s == kStdout ? out_ : err_).feed(data);
  if (s == kStderr) remember(text);
  return text;
}

std::string RankOutput::flush(Stream s) {
  std::string text = (s == kStdout ? out_ : err_).flush();
  if (s == kStderr) remember(text);
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
