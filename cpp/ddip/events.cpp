#include "ddip/events.hpp"

#include <algorithm>

#include "ddip/output.hpp"

namespace ddip {

Event Event::output(int slot, int stream, std::string text) {
  Event e;
  e.kind = kOutput;
  e.slot = slot;
  e.stream = stream;
  e.text = std::move(text);
  return e;
}

Event Event::of_frame(int slot, Frame f) {
  Event e;
  e.kind = f.truncated ? kTruncated : kFrame;
  e.slot = slot;
  e.frame = std::move(f);
  return e;
}

EventQueue::EventQueue(size_t slots, size_t max_unread_output,
                       std::function<void(const Pushed&)> on_push)
    : max_unread_(max_unread_output),
      on_push_(std::move(on_push)),
      unread_(slots, 0),
      dropped_(slots, 0),
      dropping_(slots, false) {}

namespace {

// The workers whose reply (or end) `e` is: for EventQueue::ready_at.
size_t replies_in(const Event& e) {
  switch (e.kind) {
    case Event::kFrame:
      return e.frame.kind == kDone ? std::max<size_t>(1, e.slots.size()) : 0;
    case Event::kTruncated:
    case Event::kExited:
    case Event::kLost:
      return 1;
    default:
      return 0;
  }
}

}  // namespace

Event EventQueue::note(size_t slot, const std::string& what) {
  return Event::output(static_cast<int>(slot), RankOutput::kStderr, "\n[ddip: " + what + "]\n");
}

void EventQueue::push(Event e) {
  Pushed pushed;
  {
    std::lock_guard lock(mu_);
    if (events_.empty()) first_at_ = std::chrono::steady_clock::now();  // a note may go first
    if (e.kind == Event::kOutput) {
      size_t slot = static_cast<size_t>(e.slot);
      size_t& unread = unread_[slot];
      size_t& dropped = dropped_[slot];
      if (dropping_[slot] || unread + e.text.size() > max_unread_) {
        dropping_[slot] = true;
        if (dropped == 0)
          events_.push_back(note(slot, "rank output is being dropped: more than " +
                                           std::to_string(max_unread_ >> 10) +
                                           " KiB of it waits unread in the notebook"));
        dropped += e.text.size();
        return;
      }
      if (dropped != 0) {
        events_.push_back(note(slot, std::to_string(dropped) + " bytes of rank output were dropped"));
        dropped = 0;
      }
      unread += e.text.size();
      // Output the reader has not taken yet joins the same rank's and stream's output queued
      // just before it: a reader that fell behind (a rank flooding the notebook) takes it in
      // a few large pieces rather than one per line, and catches up.
      if (!events_.empty()) {
        Event& last = events_.back();
        if (last.kind == Event::kOutput && last.slot == e.slot && last.stream == e.stream &&
            last.text.size() + e.text.size() <= kJoinedOutput) {
          last.text += e.text;
          return;  // the reader, woken for `last`, has not taken it yet
        }
      }
    }
    pushed.replies = replies_in(e);
    pushed.plain_reply =
        e.kind == Event::kFrame && e.frame.kind == kDone && (!e.frame.fds || e.frame.fds->empty());
    pushed.seq = e.frame.seq;
    replies_ += pushed.replies;
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
  if (on_push_) on_push_(pushed);
}

std::optional<Event> EventQueue::pop(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  // A zero timeout only looks: a timed wait, even one already expired, costs the timer slack.
  if (timeout.count() > 0)
    cv_.wait_for(lock, timeout, [this] { return !events_.empty() || closed_; });
  if (events_.empty()) return std::nullopt;
  Event e = std::move(events_.front());
  events_.pop_front();
  replies_ -= replies_in(e);
  if (e.kind == Event::kOutput) taken(e);
  return e;
}

size_t EventQueue::pop_all(std::vector<Event>& out) {
  std::lock_guard lock(mu_);
  size_t n = events_.size();
  for (auto& e : events_) {
    if (e.kind == Event::kOutput) taken(e);
    out.push_back(std::move(e));
  }
  events_.clear();
  replies_ = 0;
  return n;
}

bool EventQueue::empty() const {
  std::lock_guard lock(mu_);
  return events_.empty();
}

std::optional<std::chrono::steady_clock::time_point> EventQueue::ready_at(
    size_t replies, std::chrono::steady_clock::duration window) const {
  std::lock_guard lock(mu_);
  return ready_locked(replies, window);
}

std::optional<std::chrono::steady_clock::time_point> EventQueue::ready_locked(
    size_t replies, std::chrono::steady_clock::duration window) const {
  if (events_.empty()) return std::nullopt;
  return replies_ >= replies ? first_at_ : first_at_ + window;
}

bool EventQueue::wait_ready(size_t replies, std::chrono::steady_clock::duration window,
                            std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock lock(mu_);
  while (!closed_) {
    auto until = deadline;
    if (auto at = ready_locked(replies, window)) {
      if (*at <= std::chrono::steady_clock::now()) break;
      until = std::min(until, *at);
    }
    if (cv_.wait_until(lock, until) == std::cv_status::timeout && until == deadline) break;
  }
  return !events_.empty();
}

// The reader took `e` (an output event): room again, and whatever comes next may be queued.
void EventQueue::taken(const Event& e) {
  size_t slot = static_cast<size_t>(e.slot);
  unread_[slot] -= std::min(unread_[slot], e.text.size());  // notes were never counted
  dropping_[slot] = false;
}

void EventQueue::close() {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

bool EventQueue::closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

bool EventQueue::wait_closed(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mu_);
  if (timeout.count() < 0)
    cv_.wait(lock, [this] { return closed_; });
  else if (timeout.count() > 0)
    cv_.wait_for(lock, timeout, [this] { return closed_; });
  return closed_;
}

size_t EventQueue::dropped_output(int slot) const {
  std::lock_guard lock(mu_);
  return dropped_.at(static_cast<size_t>(slot));
}

}  // namespace ddip
