#include "run_channel.hpp"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>
#include <system_error>

namespace ddip::run {

milliseconds ping_every(milliseconds link_timeout) {
  return std::min(milliseconds(5000), std::max(milliseconds(100), link_timeout / 6));
}

std::string seconds_text(milliseconds d) {
  std::ostringstream out;
  out << d.count() / 1000.0;
  return out.str();
}

std::string SealedLines::seal(std::string_view line) {
  std::string_view body = line;
  if (!body.empty() && body.back() == '\n') body.remove_suffix(1);
  std::string out(body);
  out += ' ';
  out += to_hex(send_.sign("line", body));
  out += '\n';
  return out;
}

std::string SealedLines::open(std::string_view line) {
  std::string_view body = line;
  if (!body.empty() && body.back() == '\n') body.remove_suffix(1);
  size_t sp = body.rfind(' ');
  if (sp == std::string_view::npos)
    throw protocol::ProtocolError("line without its seal on a link with a shared key");
  std::string mac;
  try {
    mac = from_hex(body.substr(sp + 1));
    recv_.verify("line", body.substr(0, sp), mac);
  } catch (const std::exception&) {
    throw protocol::ProtocolError(
        "line whose seal is wrong: it was not sent with the job's key, or was changed, replayed "
        "or dropped on the way");
  }
  return std::string(body.substr(0, sp)) + "\n";
}

bool JoinLink::fill() {
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fd_.get(), buf, sizeof buf);
    if (n > 0) {
      pending_.append(buf, static_cast<size_t>(n));
      if (static_cast<size_t>(n) < sizeof buf) return true;
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    throw std::system_error(errno, std::generic_category(), "reading from " + peer_);
  }
}

std::optional<std::string> JoinLink::next_line() {
  size_t nl = pending_.find('\n');
  if (nl == std::string::npos) {
    if (pending_.size() > protocol::kMaxControlLine)
      throw protocol::ProtocolError("line from " + peer_ + " without its end within " +
                                    std::to_string(protocol::kMaxControlLine) + " bytes");
    return std::nullopt;
  }
  std::string line = pending_.substr(0, nl + 1);
  pending_.erase(0, nl + 1);
  if (seal_) return seal_->open(line);
  return line;
}

std::string JoinLink::read_line(Clock::time_point deadline) {
  while (true) {
    if (auto line = next_line()) return *line;
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) throw std::runtime_error("nothing from " + peer_ + " in time");
    pollfd p{fd_.get(), POLLIN, 0};
    int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, 1000)));
    if (rc < 0 && errno != EINTR)
      throw std::system_error(errno, std::generic_category(), "waiting for " + peer_);
    if (rc > 0 && !fill()) throw std::runtime_error(peer_ + " closed the connection");
  }
}

bool JoinLink::send(std::string_view line, milliseconds limit) {
  if (!fd_) return false;
  return write_all(fd_.get(), seal_ ? seal_->seal(line) : std::string(line), limit);
}

Upstream::Upstream(RunLoop& loop, Terminal& terminal, milliseconds link_timeout, Hooks hooks)
    : loop_(loop), terminal_(terminal), link_timeout_(link_timeout), hooks_(std::move(hooks)) {
  heard_at_ = Clock::now();
  loop_.deadline(
      [this]() -> std::optional<Clock::time_point> {
        if ((!fd_ && !link_) || silent_) return std::nullopt;
        return heard_at_ + link_timeout_;
      },
      [this](Clock::time_point) {
        silent_ = true;
        hooks_.on_lost("it heard nothing from " + who_ + " for " + seconds_text(link_timeout_) +
                       " s");
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

void Upstream::open(JoinLink& link, std::string who) {
  link_ = &link;
  joined_ = true;
  who_ = std::move(who);
  loop_.watch(link.fd(), EPOLLIN, [this](uint32_t) { on_link_readable(); });
  heard_at_ = Clock::now();
  // What arrived with the attempt's start is read now: epoll says only what comes after.
  on_link_readable();
}

void Upstream::close() {
  if (link_) {
    loop_.unwatch(link_->fd());
    link_ = nullptr;
    silent_ = true;
    return;
  }
  loop_.unwatch(fd_.get());
  fd_.reset();
}

void Upstream::on_link_readable() {
  if (!link_) return;
  bool open = true;
  std::string failed;
  try {
    open = link_->fill();
  } catch (const std::system_error& e) {
    failed = e.what();
  }
  try {
    while (link_) {
      auto line = link_->next_line();
      if (!line) break;
      heard_at_ = Clock::now();
      in_.feed(*line);
      while (auto m = in_.next()) hooks_.on_message(*m);
    }
  } catch (const protocol::ProtocolError& e) {
    close();
    hooks_.on_lost(who_ + " sent a " + std::string(e.what()));
    return;
  }
  if (!link_) return;
  if (!failed.empty()) {
    close();
    hooks_.on_lost("its link to " + who_ + " failed: " + failed);
  } else if (!open) {
    close();
    hooks_.on_closed("its link to " + who_ + " closed: that ddip run is gone");
  }
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

void Upstream::send(const protocol::Report& report) {
  if (joined_) {
    if (link_) link_->send(protocol::encode(report), link_timeout_);
    return;
  }
  terminal_.write(2, protocol::encode(report));
}

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
  hosts_.push_back({unit, std::move(stdin_pipe), true, {}, nullptr});
}

void Downstream::add(size_t unit, JoinLink& link) {
  hosts_.push_back({unit, Fd(), true, {}, &link});
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
  h.link = nullptr;
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
  if (h.link && h.running) {
    if (!h.link->send(line, link_timeout_)) drop(h);
    return;
  }
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

void NodeReports::add(size_t unit, JoinLink& link) {
  links_.emplace_back(unit, &link);
  loop_.watch(link.fd(), EPOLLIN, [this, unit](uint32_t) { on_readable(unit); });
}

void NodeReports::done(size_t unit) {
  for (auto& [u, link] : links_)
    if (u == unit && link) {
      loop_.unwatch(link->fd());
      link = nullptr;
    }
}

void NodeReports::on_readable(size_t unit) {
  JoinLink* link = nullptr;
  for (auto& [u, l] : links_)
    if (u == unit) link = l;
  if (!link) return;
  bool open = true;
  std::string failed;
  try {
    open = link->fill();
  } catch (const std::system_error& e) {
    failed = e.what();
  }
  try {
    while (auto line = link->next_line()) {
      hooks_.on_record(unit, *line);
      for (auto& [u, l] : links_)
        if (u == unit && !l) return;  // it said it was done
    }
  } catch (const protocol::ProtocolError& e) {
    failed = std::string("it sent a ") + e.what();
  }
  if (failed.empty() && open) return;
  done(unit);
  hooks_.on_gone(unit, failed.empty() ? "its link closed" : failed);
}

}  // namespace ddip::run
