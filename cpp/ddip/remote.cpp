#include "ddip/remote.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "ddip/auth.hpp"
#include "ddip/channel.hpp"
#include "ddip/coordinator.hpp"
#include "ddip/plan.hpp"
#include "ddip/tcp.hpp"

extern char** environ;

namespace ddip {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

class Writer {
 public:
  void u32(uint32_t v) { out_.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void i32(int32_t v) { out_.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void strs(const std::vector<std::string>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (const auto& s : v) str(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads what Writer wrote; any overrun is corruption (from an authenticated peer: a bug).
class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  uint32_t u32() {
    uint32_t v;
    copy(&v, sizeof v);
    return v;
  }
  int32_t i32() {
    int32_t v;
    copy(&v, sizeof v);
    return v;
  }
  std::string str() {
    uint32_t n = u32();
    need(n);
    std::string s = in_.substr(at_, n);
    at_ += n;
    return s;
  }
  std::vector<std::string> strs() {
    uint32_t n = u32();
    std::vector<std::string> v;
    for (uint32_t i = 0; i < n; ++i) v.push_back(str());
    return v;
  }

 private:
  const std::string& in_;
  size_t at_ = 0;
  void need(size_t n) const {
    if (n > in_.size() - at_) throw std::runtime_error("corrupt link message");
  }
  void copy(void* dst, size_t n) {
    need(n);
    std::memcpy(dst, in_.data() + at_, n);
    at_ += n;
  }
};

// The host's own environment, with the kernel's additions in place of its own values.
std::vector<std::string> merged_environment(const std::vector<std::string>& additions) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv;
  }
  for (const auto& kv : additions) {
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv;
  }
  std::vector<std::string> out;
  for (auto& [k, kv] : env) out.push_back(std::move(kv));
  return out;
}

}  // namespace
}  // namespace detail

std::string encode_spawn(const std::vector<std::pair<int, SpawnSpec>>& workers) {
  detail::Writer w;
  w.u32(static_cast<uint32_t>(workers.size()));
  for (const auto& [slot, spec] : workers) {
    w.i32(slot);
    w.strs(spec.argv);
    w.strs(spec.env);
    w.str(spec.cwd);
  }
  return w.take();
}

std::vector<std::pair<int, SpawnSpec>> decode_spawn(const std::string& payload) {
  detail::Reader r(payload);
  uint32_t n = r.u32();
  std::vector<std::pair<int, SpawnSpec>> out;
  for (uint32_t i = 0; i < n; ++i) {
    int slot = r.i32();
    SpawnSpec s;
    s.argv = r.strs();
    s.env = r.strs();
    s.cwd = r.str();
    out.emplace_back(slot, std::move(s));
  }
  return out;
}

std::string encode_exit(const ExitStatus& status, const std::string& stderr_tail) {
  detail::Writer w;
  w.i32(status.code);
  w.i32(status.signal);
  w.i32(status.unknown ? 1 : 0);
  w.str(stderr_tail);
  return w.take();
}

std::pair<ExitStatus, std::string> decode_exit(const std::string& payload) {
  detail::Reader r(payload);
  ExitStatus s;
  s.code = r.i32();
  s.signal = r.i32();
  s.unknown = r.i32() != 0;
  std::string tail = r.str();
  return {s, std::move(tail)};
}

std::string encode_signal(int sig, bool whole_group) {
  detail::Writer w;
  w.i32(sig);
  w.i32(whole_group ? 1 : 0);
  return w.take();
}

std::pair<int, bool> decode_signal(const std::string& payload) {
  detail::Reader r(payload);
  int sig = r.i32();
  bool whole = r.i32() != 0;
  return {sig, whole};
}

std::string LinkTicket::encode() const {
  return "ddip-link " + address + " " + std::to_string(port) + " " + std::to_string(host) + " " +
         to_hex(key) + " " + std::to_string(timeout_ms) + "\n";
}

LinkTicket LinkTicket::decode(const std::string& line) {
  std::istringstream in(line);
  std::string magic, hex;
  long long port = -1, host = -1;
  LinkTicket t;
  if (!(in >> magic >> t.address >> port >> host >> hex) || magic != "ddip-link" || port <= 0 ||
      port > 65535 || host < 0 || host > 0xffffffffLL)
    throw std::invalid_argument(
        "expected 'ddip-link ADDRESS PORT HOST KEY' on stdin (this is started by ddip's "
        "launchers, not by hand)");
  t.port = static_cast<uint16_t>(port);
  t.host = static_cast<uint32_t>(host);
  t.key = from_hex(hex);
  long long timeout = 0;
  if (in >> timeout && timeout > 0 && timeout <= 0xffffffffLL)
    t.timeout_ms = static_cast<uint32_t>(timeout);
  if (t.key.size() < 16) throw std::invalid_argument("the link key is too short");
  return t;
}

int HostAgent::run() {
  using detail::Clock;
  if (options_.ticket.timeout_ms > 0)
    options_.kernel_timeout = std::chrono::milliseconds(options_.ticket.timeout_ms);
  const LinkTicket& t = options_.ticket;
  auto deadline = Clock::now() + options_.connect_timeout;
  Fd sock = connect_tcp(t.address, t.port, options_.connect_timeout);
  HostHandshake hs(t.key, t.host);
  write_all(sock.get(),
            hs.respond(read_exact(sock.get(), KernelHandshake::kChallengeBytes, deadline)),
            deadline);
  // Throws AuthError when whoever answered does not know the key: not our kernel.
  LinkKeys keys = hs.verify(read_exact(sock.get(), KernelHandshake::kProofBytes, deadline));
  // A kernel that stops reading (its host gone) must not block us forever in a write.
  timeval tv{};
  tv.tv_sec = options_.kernel_timeout.count() / 1000;
  tv.tv_usec = (options_.kernel_timeout.count() % 1000) * 1000;
  check(::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv),
        "setsockopt(SO_SNDTIMEO)", "bounding writes to the kernel");
  int fd = sock.get();
  std::mutex why_mu;
  auto say_why = [&](std::string text) {
    std::lock_guard lock(why_mu);
    if (why_.empty()) why_ = std::move(text);
  };
  Channel link(std::move(sock));
  link.seal(std::move(keys));
  std::mutex send_mu;
  // False when the link is broken (or stuck for kernel_timeout).
  auto send = [&](Frame f) {
    std::lock_guard lock(send_mu);
    try {
      link.queue(std::move(f));
      return link.flush();
    } catch (const std::exception&) {
      return false;
    }
  };
  // Reads the next frame, waiting at most kernel_timeout; nullopt with why_ set when the link
  // is gone.
  auto next = [&]() -> std::optional<Frame> {
    while (true) {
      if (auto f = link.next()) return f;
      pollfd p{fd, POLLIN, 0};
      int rc = ::poll(&p, 1, static_cast<int>(options_.kernel_timeout.count()));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) {
        say_why("no frame from the kernel for " + std::to_string(options_.kernel_timeout.count()) +
                " ms");
        return std::nullopt;
      }
      try {
        if (rc < 0 || link.read_some() == Channel::ReadResult::kEof) {
          say_why("the kernel closed the connection");
          return std::nullopt;
        }
      } catch (const std::exception& e) {
        say_why(std::string("the link failed: ") + e.what());
        return std::nullopt;
      }
    }
  };

  auto first = next();
  if (!first) return 1;
  if (first->kind != kSpawn) {
    say_why("the kernel's first frame was not the list of workers");
    return 1;
  }
  auto spawn = decode_spawn(first->data());
  CoordinatorOptions co;
  std::vector<int> global;
  std::map<int, int> local;
  for (auto& [slot, spec] : spawn) {
    spec.env = detail::merged_environment(spec.env);
    plan::add_thread_default(spec.env);  // this host's cores: the kernel can't count them
    // The notebook's directory, where this host shares it; else the agent's own (the home).
    if (!spec.cwd.empty() && ::access(spec.cwd.c_str(), X_OK) != 0) spec.cwd.clear();
    local[slot] = static_cast<int>(co.workers.size());
    global.push_back(slot);
    co.workers.push_back(std::move(spec));
  }
  co.heartbeat_timeout = std::chrono::milliseconds(0);  // the kernel judges, from our acks
  std::optional<Coordinator> coord;
  try {
    coord.emplace(std::move(co));
  } catch (const std::exception& e) {
    // Nothing was left running; every worker of this host is reported with why.
    for (int slot : global)
      send(Frame::make(kExit, slot, 0,
                       encode_exit(ExitStatus{127, 0, false},
                                   std::string("could not start the worker: ") + e.what())));
    say_why(e.what());
    return 1;
  }

  std::atomic<bool> link_lost{false};
  std::thread reader([&] {
    while (true) {
      auto f = next();
      if (!f) break;
      auto it = local.find(f->rank);
      if (it == local.end()) continue;  // not one of ours: nothing to do with it
      int l = it->second;
      try {
        if (f->kind == kHeartbeat) {
          // Vouch for a worker only while it answers its own heartbeats here.
          long long age = coord->heartbeat_age_ms(l);
          if (age >= 0 && age <= options_.worker_stale.count() &&
              !send(Frame::make(kHeartbeatAck, f->rank, f->seq))) {
            say_why("could not write to the kernel");
            break;
          }
        } else if (f->kind == kSignal) {
          auto [sig, whole] = decode_signal(f->data());
          coord->signal(l, sig, whole);
        } else if (f->kind != kSpawn) {
          coord->send(l, std::move(*f));
        }
      } catch (const std::exception&) {
        // The worker is gone (its exit is on its way to the kernel) or the group is stopping.
      }
    }
    link_lost = true;
    ::shutdown(fd, SHUT_RDWR);  // wakes a writer stuck on a dead link
  });

  std::vector<bool> exited(global.size(), false);
  size_t alive = global.size();
  while (alive > 0 && !link_lost) {
    auto e = coord->next_event(std::chrono::milliseconds(100));
    if (!e) {
      if (!coord->running()) break;
      continue;
    }
    bool ok = true;
    int slot = e->slot >= 0 ? global[e->slot] : -1;
    switch (e->kind) {
      case Event::kOutput:
        ok = send(Frame::make(kOutput, slot, static_cast<uint64_t>(e->stream), std::move(e->text)));
        break;
      case Event::kFrame:
      case Event::kTruncated:
        e->frame.rank = slot;
        ok = send(std::move(e->frame));
        break;
      case Event::kExited:
        exited[e->slot] = true;
        --alive;
        ok = send(Frame::make(kExit, slot, 0, encode_exit(e->status, e->text)));
        break;
      case Event::kFailed:
        for (size_t i = 0; i < global.size(); ++i)
          if (!exited[i])
            send(Frame::make(kExit, global[i], 0, encode_exit(ExitStatus{0, 0, true}, e->text)));
        alive = 0;
        break;
      default:
        break;  // connections and heartbeats of our own workers are ours to judge
    }
    if (!ok) {
      link_lost = true;
      say_why("could not write to the kernel");
    }
  }
  // Gone with the link: every worker's process group, at once.
  coord->close(link_lost ? std::chrono::milliseconds(0) : std::chrono::milliseconds(2000));
  ::shutdown(fd, SHUT_RDWR);
  reader.join();
  return link_lost && alive > 0 ? 1 : 0;
}

}  // namespace ddip
