#include "run_channel.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>

namespace ddip::run {

milliseconds ping_every(milliseconds link_timeout) {
  return std::min(milliseconds(5000), std::max(milliseconds(100), link_timeout / 6));
}

std::string seconds_text(milliseconds d) {
  std::ostringstream out;
  out << d.count() / 1000.0;
  return out.str();
}

Upstream::Upstream(RunLoop& loop, Terminal& terminal, milliseconds link_timeout, Hooks hooks)
    : loop_(loop), terminal_(terminal), link_timeout_(link_timeout), hooks_(std::move(hooks)) {
  heard_at_ = Clock::now();
  loop_.deadline(
      [this]() -> std::optional<Clock::time_point> {
        if (!fd_ || silent_) return std::nullopt;
        return heard_at_ + link_timeout_;
      },
      [this](Clock::time_point) {
        silent_ = true;
        hooks_.on_lost("it heard nothing from the ddip run that started it for " +
                       seconds_text(link_timeout_) + " s");
      });
}

std::string Upstream::open(Fd fd) {
  set_nonblocking(fd.get());
  if (!loop_.try_watch(fd.get(), EPOLLIN, [this](uint32_t) { on_readable(); }))
    return "its launcher gives it no stdin to listen to (docker and kubectl exec need -i)";
  fd_ = std::move(fd);
  heard_at_ = Clock::now();
  return "";
}

void Upstream::close() {
  loop_.unwatch(fd_.get());
  fd_.reset();
}

void Upstream::on_readable() {
  char buf[256];
  ssize_t n = ::read(fd_.get(), buf, sizeof buf);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) {
    close();
    hooks_.on_closed(
        "its launcher's stdin closed: the ddip run that started it is gone, or the launcher "
        "gives it no stdin (docker and kubectl exec need -i)");
    return;
  }
  heard_at_ = Clock::now();
  in_.feed(std::string_view(buf, static_cast<size_t>(n)));
  try {
    while (auto m = in_.next()) hooks_.on_message(*m);
  } catch (const protocol::ProtocolError& e) {
    // Nothing more from this channel can be trusted: stop as if it had closed (the grace
    // period's SIGKILL needs no Kill from it).
    close();
    hooks_.on_lost("the ddip run that started it sent a " + std::string(e.what()));
  }
}

void Upstream::send(const protocol::Report& report) { terminal_.write(2, protocol::encode(report)); }

Downstream::Downstream(RunLoop& loop, milliseconds link_timeout,
                       std::function<void(size_t unit)> kill_launcher, milliseconds kill_after)
    : loop_(loop),
      link_timeout_(link_timeout),
      kill_after_(kill_after),
      kill_launcher_(std::move(kill_launcher)) {
  next_ping_ = Clock::now() + ping_every(link_timeout_);
  loop.deadline(
      [this]() -> std::optional<Clock::time_point> {
        if (!any_running()) return std::nullopt;
        return next_ping_;
      },
      [this](Clock::time_point now) {  // "still here", to each host's ddip run
        tell(protocol::Ping{});
        next_ping_ = now + ping_every(link_timeout_);
      });
  loop.deadline([this] { return kill_launchers_at_; },
                [this](Clock::time_point) {
                  kill_launchers_at_.reset();
                  for (const auto& h : hosts_)
                    if (h.running) kill_launcher_(h.unit);
                });
}

void Downstream::add(size_t unit, Fd stdin_pipe) {
  hosts_.push_back({unit, std::move(stdin_pipe), true, {}});
}

void Downstream::ship(size_t unit, std::string bytes) {
  for (auto& h : hosts_)
    if (h.unit == unit && h.in && !bytes.empty()) {
      set_nonblocking(h.in.get());
      h.queued += bytes;
      flush(h);
    }
}

void Downstream::flush(Host& h) {
  size_t done = 0;
  while (done < h.queued.size()) {
    ssize_t n = ::write(h.in.get(), h.queued.data() + done, h.queued.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EAGAIN) {
      h.queued.erase(0, done);
      if (!loop_.watching(h.in.get())) {
        size_t unit = h.unit;
        loop_.watch(h.in.get(), EPOLLOUT, [this, unit](uint32_t) {
          for (auto& x : hosts_)
            if (x.unit == unit && x.in) flush(x);
        });
      }
      return;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return drop(h);  // its launcher is gone: its exit says the rest
    }
  }
  h.queued.clear();
  if (loop_.watching(h.in.get())) loop_.unwatch(h.in.get());
}

void Downstream::drop(Host& h) {
  if (h.in && loop_.watching(h.in.get())) loop_.unwatch(h.in.get());
  h.in.reset();
  h.queued.clear();
}

void Downstream::ended(size_t unit) {
  for (auto& h : hosts_)
    if (h.unit == unit) {
      h.running = false;
      drop(h);
    }
}

bool Downstream::any_running() const {
  return std::any_of(hosts_.begin(), hosts_.end(), [](const Host& h) { return h.running; });
}

void Downstream::tell(const protocol::Control& message) {
  const std::string line = protocol::encode(message);
  for (auto& h : hosts_) tell(h, line);
}

void Downstream::tell(size_t unit, const protocol::Control& message) {
  const std::string line = protocol::encode(message);
  for (auto& h : hosts_)
    if (h.unit == unit) tell(h, line);
}

void Downstream::tell(Host& h, const std::string& line) {
  if (!h.in || !h.running) return;
  if (!h.queued.empty()) {
    h.queued += line;  // behind the files still being shipped
    return;
  }
  if (!write_all(h.in.get(), line)) drop(h);
}

void Downstream::kill() {
  tell(protocol::Kill{});
  if (!kill_armed_) {
    kill_armed_ = true;
    kill_launchers_at_ = Clock::now() + kill_after_;
  }
}

}  // namespace ddip::run
