#include "ddip/link_protocol.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "ddip/auth.hpp"

namespace ddip {
namespace detail {
namespace {

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

std::string encode_slots(const std::vector<int>& slots) {
  detail::Writer w;
  w.u32(static_cast<uint32_t>(slots.size()));
  for (int s : slots) w.i32(s);
  return w.take();
}

std::vector<int> decode_slots(const std::string& payload) {
  detail::Reader r(payload);
  uint32_t n = r.u32();
  if (n > payload.size() / sizeof(int32_t)) throw std::runtime_error("corrupt link message");
  std::vector<int> slots;
  for (uint32_t i = 0; i < n; ++i) slots.push_back(r.i32());
  return slots;
}

std::string encode_fan_out(uint16_t kind, const std::vector<int>& slots,
                           const std::string& payload) {
  detail::Writer w;
  w.u32(kind);
  w.u32(static_cast<uint32_t>(slots.size()));
  for (int s : slots) w.i32(s);
  w.str(payload);
  return w.take();
}

FanOut decode_fan_out(const std::string& payload) {
  detail::Reader r(payload);
  FanOut out;
  uint32_t kind = r.u32();
  if (kind > 0xffff) throw std::runtime_error("corrupt link message");
  out.kind = static_cast<uint16_t>(kind);
  uint32_t n = r.u32();
  if (n > payload.size() / sizeof(int32_t)) throw std::runtime_error("corrupt link message");
  for (uint32_t i = 0; i < n; ++i) out.slots.push_back(r.i32());
  out.payload = r.str();
  return out;
}

std::string encode_replies(const std::vector<GatheredReply>& replies) {
  detail::Writer w;
  w.u32(static_cast<uint32_t>(replies.size()));
  for (const auto& reply : replies) {
    w.u32(static_cast<uint32_t>(reply.slots.size()));
    for (int s : reply.slots) w.i32(s);
    w.str(reply.payload);
  }
  return w.take();
}

std::vector<GatheredReply> decode_replies(const std::string& payload) {
  detail::Reader r(payload);
  uint32_t n = r.u32();
  if (n > payload.size() / sizeof(int32_t)) throw std::runtime_error("corrupt link message");
  std::vector<GatheredReply> out(n);
  for (auto& reply : out) {
    uint32_t k = r.u32();
    if (k == 0 || k > payload.size() / sizeof(int32_t))
      throw std::runtime_error("corrupt link message");
    for (uint32_t i = 0; i < k; ++i) reply.slots.push_back(r.i32());
    reply.payload = r.str();
  }
  return out;
}

void ReplyGather::expect(uint64_t seq, const std::vector<int>& slots) {
  Gather& g = gathers_[seq];
  for (int s : slots) {
    // A worker expected for an older request that never replied (it was interrupted and the
    // kernel moved on) replies to this one now.
    if (auto it = expected_.find(s); it != expected_.end() && it->second != seq) {
      auto old = gathers_.find(it->second);
      if (old != gathers_.end()) old->second.waiting.erase(s);
    }
    expected_[s] = seq;
    g.waiting.insert(s);
  }
}

bool ReplyGather::add(int slot, uint64_t seq, const std::shared_ptr<const std::string>& payload,
                      Clock::time_point now) {
  auto e = expected_.find(slot);
  if (e == expected_.end() || e->second != seq) return false;
  auto it = gathers_.find(seq);
  if (it == gathers_.end()) return false;
  expected_.erase(e);
  Gather& g = it->second;
  g.waiting.erase(slot);
  if (g.held.empty()) g.first = now;
  g.held.emplace_back(slot, payload ? payload : std::make_shared<const std::string>());
  return true;
}

void ReplyGather::gone(int slot) {
  auto e = expected_.find(slot);
  if (e == expected_.end()) return;
  auto it = gathers_.find(e->second);
  if (it != gathers_.end()) it->second.waiting.erase(slot);
  expected_.erase(e);
}

bool ReplyGather::holds(int slot) const {
  for (const auto& [seq, g] : gathers_)
    for (const auto& [s, payload] : g.held)
      if (s == slot) return true;
  return false;
}

Frame ReplyGather::frame(uint64_t seq, Gather& g) {
  // Byte-equal payloads (every rank's None after `pass`) become one entry: the kernel unpickles
  // each distinct reply once. Entries in the order their first reply came.
  std::vector<GatheredReply> replies;
  for (auto& [slot, payload] : g.held) {
    auto same = std::find_if(replies.begin(), replies.end(),
                             [&](const GatheredReply& r) { return r.payload == *payload; });
    if (same != replies.end()) {
      same->slots.push_back(slot);
      continue;
    }
    replies.push_back(GatheredReply{{slot}, *payload});
  }
  g.held.clear();
  return Frame::make(kReplies, kHostRank, seq, encode_replies(replies));
}

std::vector<Frame> ReplyGather::take(Clock::time_point now, bool all) {
  std::vector<Frame> out;
  for (auto it = gathers_.begin(); it != gathers_.end();) {
    Gather& g = it->second;
    bool complete = g.waiting.empty();
    if (!g.held.empty() && (all || complete || now >= g.first + window_))
      out.push_back(frame(it->first, g));
    it = complete && g.held.empty() ? gathers_.erase(it) : std::next(it);
  }
  return out;
}

std::optional<ReplyGather::Clock::time_point> ReplyGather::next_due() const {
  std::optional<Clock::time_point> due;
  for (const auto& [seq, g] : gathers_)
    if (!g.held.empty() && (!due || g.first + window_ < *due)) due = g.first + window_;
  return due;
}

std::string LinkTicket::encode() const {
  return "ddip-link " + address + " " + std::to_string(port) + " " + std::to_string(host) + " " +
         to_hex(key) + " " + std::to_string(timeout_ms) + " " + (standing ? "1" : "0") + " " +
         std::to_string(warm) + " " + std::to_string(reply_window_ms) + "\n";
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
  int standing = 0, warm = 0;
  if (in >> standing >> warm) {
    t.standing = standing == 1;
    t.warm = warm >= 0 && warm <= 2 ? static_cast<uint32_t>(warm) : 0;
  }
  long long window = 0;
  if (in >> window && window > 0 && window <= 0xffffffffLL)
    t.reply_window_ms = static_cast<uint32_t>(window);
  if (t.key.size() < 16) throw std::invalid_argument("the link key is too short");
  return t;
}

}  // namespace ddip
