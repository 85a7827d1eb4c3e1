#include "run_loop.hpp"

namespace ddip::run {

void RunLoop::deadline(Next next, Due due) {
  deadlines_.push_back({std::move(next), std::move(due)});
}

void RunLoop::run_until(const std::function<bool()>& done) {
  while (!done()) {
    std::optional<Clock::time_point> next;
    for (size_t i = 0; i < deadlines_.size(); ++i)
      if (auto t = deadlines_[i].next(); t && (!next || *t < *next)) next = t;
    run_once(next);
    auto now = Clock::now();
    for (size_t i = 0; i < deadlines_.size(); ++i)
      if (auto t = deadlines_[i].next(); t && now >= *t) deadlines_[i].due(now);
  }
}

}  // namespace ddip::run
