#include "run_prompts.hpp"

#include <unistd.h>

#include <cerrno>

namespace ddip::run {

namespace {
// "[rank] ". append(): GCC 12's -Wrestrict misfires on "[" + std::to_string(rank) at -O3.
std::string tag_of(int rank) {
  std::string tag;
  tag.append("[").append(std::to_string(rank)).append("] ");
  return tag;
}
}  // namespace

Prompts::~Prompts() { watch(false); }

void Prompts::open(Fd in) {
  tty_ = ::isatty(in.get()) == 1;
  set_nonblocking(in.get());
  in_ = std::move(in);
  show_next();
}

void Prompts::watch(bool on) {
  if (!in_) return;
  if (on && !loop_.watching(in_.get()))
    loop_.watch(in_.get(), EPOLLIN, [this](uint32_t) { on_readable(); });
  else if (!on && loop_.watching(in_.get()))
    loop_.unwatch(in_.get());
}

void Prompts::set_shown(bool on) {
  if (on == shown_) return;
  shown_ = on;
  if (asking_) asking_(on);
}

void Prompts::waiting(size_t u, protocol::Prompt p) {
  Waiter w{u, std::move(p)};
  if (w.prompt.prompt.empty()) {  // its debugger has left: its last words, and the next one's turn
    // Left without an answer (Ctrl-C at its prompt): its prompt is no longer shown.
    if (shown_ && queue_.front().unit == u && queue_.front().prompt.rank == w.prompt.rank) {
      queue_.pop_front();
      set_shown(false);
      terminal_.answered(true);
    }
    bool after_cr = false;
    terminal_.write(1, label(w.prompt.output, tag_of(w.prompt.rank), after_cr));
    if (w.is(turn_)) turn_.reset();
  } else if (w.is(turn_) && !shown_) {
    queue_.push_front(std::move(w));  // still its turn
  } else {
    queue_.push_back(std::move(w));
  }
  show_next();
}

void Prompts::ended(size_t u) {
  bool shown_gone = shown_ && queue_.front().unit == u;
  std::erase_if(queue_, [u](const Waiter& w) { return w.unit == u; });
  if (turn_ && turn_->first == u) turn_.reset();
  if (shown_gone) {
    set_shown(false);
    terminal_.answered(true);
  }
  show_next();
}

void Prompts::show_next() {
  while (!shown_ && !queue_.empty() && (!turn_ || queue_.front().is(turn_))) {
    Waiter& w = queue_.front();
    turn_ = {w.unit, w.prompt.rank};
    const std::string tag = tag_of(w.prompt.rank);
    bool after_cr = false;
    terminal_.write(1, label(w.prompt.output, tag, after_cr));
    if (!in_) {  // nobody to ask: its stdin closes, and the rank goes on (it says so)
      answer_front(std::nullopt);
      continue;
    }
    set_shown(true);
    if (show_ == Show::kText)
      terminal_.prompt(tag + w.prompt.prompt);
    else
      terminal_.write(1, protocol::encode(
                             protocol::Report{protocol::Prompt{w.prompt.rank, "", w.prompt.prompt}}));
    answer_lines();  // a line typed ahead answers at once
  }
  watch(shown_);
}

void Prompts::answer_front(std::optional<std::string> line) {
  Waiter w = std::move(queue_.front());
  queue_.pop_front();
  set_shown(false);
  answer_(w.unit, w.prompt.rank, std::move(line));
}

void Prompts::answer_lines() {
  size_t nl;
  while (shown_ && (nl = typed_.find('\n')) != std::string::npos) {
    std::string line = typed_.substr(0, nl);
    typed_.erase(0, nl + 1);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    terminal_.answered(false);
    if (line.size() > protocol::kMaxAnswer) {
      terminal_.write(2, "ddip run: a line of " + std::to_string(line.size()) +
                             " bytes is longer than a prompt takes (" +
                             std::to_string(protocol::kMaxAnswer) + "); it was not sent\n");
      if (show_ == Show::kText)
        terminal_.prompt(tag_of(queue_.front().prompt.rank) + queue_.front().prompt.prompt);
      continue;
    }
    // A terminal echoed the line itself; from a pipe, it is shown after its prompt.
    if (!tty_ && show_ == Show::kText) terminal_.write(1, line + "\n");
    answer_front(std::move(line));
  }
  watch(shown_);
}

void Prompts::on_readable() {
  char buf[4096];
  ssize_t n = ::read(in_.get(), buf, sizeof buf);
  if (n > 0) {
    typed_.append(buf, static_cast<size_t>(n));
    answer_lines();
    return;
  }
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n == 0 && tty_ && typed_.empty()) {
    // Ctrl-D at a terminal's prompt: pdb's own end of input, for this rank; the terminal reads
    // on after it.
    terminal_.answered(true);
    typed_ = "EOF\n";
    answer_lines();
    return;
  }
  close_input();
}

// End of file (or an error: EIO for a terminal that is gone): every rank that waits, and every
// one that will, goes on without an answer.
void Prompts::close_input() {
  watch(false);
  in_.reset();
  typed_.clear();
  if (shown_) {
    terminal_.answered(true);
    answer_front(std::nullopt);
  }
  show_next();
}

}  // namespace ddip::run
