#include "ddip/streams.hpp"

#include <poll.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>

namespace ddip {

using Clock = std::chrono::steady_clock;

RankStreams::RankStreams(EventLoop& loop, size_t slots, std::chrono::milliseconds delay, Emit emit)
    : loop_(loop), delay_(delay), emit_(std::move(emit)), streams_(slots) {}

RankStreams::~RankStreams() {
  for (auto& s : streams_)
    for (Fd* fd : {&s.out, &s.err})
      if (*fd) loop_.unwatch(fd->get());
}

void RankStreams::attach(size_t slot, Fd out, Fd err) {
  Stream& s = streams_.at(slot);
  // A slot whose worker is started again (Coordinator::respawn): what the exited one left open
  // (a child of its own still holding a pipe) is let go, and its last lines are not the new one's.
  for (Fd* fd : {&s.out, &s.err})
    if (*fd) {
      loop_.unwatch(fd->get());
      fd->reset();
    }
  s.output = RankOutput();
  s.out = std::move(out);
  s.err = std::move(err);
  if (s.out)
    loop_.watch(s.out.get(), EPOLLIN,
                [this, slot](uint32_t) { read(slot, RankOutput::kStdout, false); });
  if (s.err)
    loop_.watch(s.err.get(), EPOLLIN,
                [this, slot](uint32_t) { read(slot, RankOutput::kStderr, false); });
}

void RankStreams::read(size_t slot, int stream, bool to_eof) {
  Stream& s = streams_[slot];
  Fd& fd = stream == RankOutput::kStdout ? s.out : s.err;
  if (!fd) return;
  char buf[65536];
  auto end = read_available(fd.get(), buf, sizeof buf, [&](std::string_view got) {
    auto pieces = s.output.feed(static_cast<RankOutput::Stream>(stream), got);
    s.last_output = Clock::now();
    for (auto& piece : pieces) {
      text(slot, stream, std::move(piece.text));
      if (piece.marker) s.held.emplace_back();
    }
    return got.size() == sizeof buf || to_eof;  // a short read: all there is for now
  });
  if (end == ReadEnd::kEnded) {  // EOF or error: the worker (and anything it started) closed it
    loop_.unwatch(fd.get());
    fd.reset();
  }
}

void RankStreams::drain(size_t slot, bool to_eof) {
  Stream& s = streams_[slot];
  if (!to_eof) {
    // One look at both pipes first: most replies come with nothing left in them (two reads
    // that find them empty cost twice that).
    pollfd fds[2];
    nfds_t n = 0;
    for (Fd* fd : {&s.out, &s.err})
      if (*fd) fds[n++] = {fd->get(), POLLIN, 0};
    if (n == 0 || ::poll(fds, n, 0) == 0) return;
  }
  read(slot, RankOutput::kStdout, to_eof);
  read(slot, RankOutput::kStderr, to_eof);
}

void RankStreams::read_now(const std::vector<size_t>& slots) {
  std::vector<pollfd> fds;
  std::vector<std::pair<size_t, int>> whose;
  for (size_t slot : slots) {
    Stream& s = streams_[slot];
    if (s.out)
      fds.push_back({s.out.get(), POLLIN, 0}), whose.emplace_back(slot, RankOutput::kStdout);
    if (s.err)
      fds.push_back({s.err.get(), POLLIN, 0}), whose.emplace_back(slot, RankOutput::kStderr);
  }
  if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents) read(whose[i].first, whose[i].second, false);
}

void RankStreams::flush_partial(size_t slot, bool force) {
  Stream& s = streams_[slot];
  for (auto stream : {RankOutput::kStdout, RankOutput::kStderr})
    text(slot, stream, s.output.flush(stream, force));
}

void RankStreams::output(size_t slot, int stream, std::string t) {
  text(slot, stream == RankOutput::kStderr ? RankOutput::kStderr : RankOutput::kStdout,
       std::move(t));
}

void RankStreams::text(size_t slot, int stream, std::string t) {
  if (t.empty()) return;
  Stream& s = streams_[slot];
  Event e = Event::output(static_cast<int>(slot), stream, std::move(t));
  if (stream == RankOutput::kStdout && !s.held.empty())
    s.held.back().push_back(std::move(e));
  else
    emit_(std::move(e));
}

void RankStreams::release_held(size_t slot, bool all) {
  Stream& s = streams_[slot];
  while (!s.held.empty()) {
    std::vector<Event> batch = std::move(s.held.front());
    s.held.pop_front();
    for (auto& e : batch) emit_(std::move(e));
    if (!all) break;
  }
}

// Everything the rank printed is in its pipes before it sends a reply (or exits): read it all.
void RankStreams::catch_up(size_t slot, bool to_eof) {
  drain(slot, to_eof);
  flush_partial(slot, true);
  release_held(slot, true);
}

void RankStreams::after_output(size_t slot, Event e) {
  catch_up(slot, false);
  emit_(std::move(e));
}

void RankStreams::display(size_t slot, Event e) {
  // The rank wrote the marker before sending the frame, so after a drain it has been read.
  if (streams_[slot].held.empty()) drain(slot, false);
  emit_(std::move(e));
  release_held(slot, false);
}

void RankStreams::exited(size_t slot, Event e) {
  catch_up(slot, true);
  if (e.text.empty()) e.text = streams_[slot].output.stderr_tail();
  emit_(std::move(e));
}

void RankStreams::flush_due(Clock::time_point now) {
  for (size_t i = 0; i < streams_.size(); ++i) {
    Stream& s = streams_[i];
    if (!s.output.has_pending() || now - s.last_output < delay_) continue;
    flush_partial(i, false);
    // Kept back (half a UTF-8 character): one more delay for the rest, then it goes anyway.
    if (s.output.has_pending()) s.last_output = now;
  }
}

std::optional<Clock::time_point> RankStreams::next_due() const {
  std::optional<Clock::time_point> due;
  for (auto& s : streams_)
    if (s.output.has_pending()) {
      auto t = s.last_output + delay_;
      if (!due || t < *due) due = t;
    }
  return due;
}

}  // namespace ddip
