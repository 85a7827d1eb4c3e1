// The link protocol: what the kernel's HostLinks (links.hpp) and a host's HostAgent
// (host_agent.hpp) say to each other. The ticket a launcher hands the agent, the frame kinds that
// travel only on a link, and their payloads. Both ends include this header and nothing of each
// other's, so either side can change how it works without the other's header in its build.
//
// Payloads are little-endian fixed-width integers and length-prefixed strings; a payload that
// ends early or announces more than it holds is corrupt (std::runtime_error): from an
// authenticated peer that is a bug, and the link is dropped.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/supervisor.hpp"

namespace ddip {

// Frame kinds only on links to other hosts, beside the runtime's own (FrameKind, channel.hpp).
enum LinkFrameKind : uint16_t {
  kSpawn = 12,    // kernel -> host: the workers to start there (payload: encode_spawn)
  kSignal = 13,   // kernel -> host: signal a worker (payload: encode_signal)
  kOutput = 14,   // host -> kernel: a worker's output (seq: the stream, 1 or 2; payload: text)
  kExit = 15,     // host -> kernel: a worker exited (payload: encode_exit)
  kSegment = 16,  // kernel -> host: a buffer its workers' frames refer to (seq: its id; one fd)
  kForget = 17,   // kernel -> host: no later frame refers to segment `seq`; drop it
  // kernel -> host: one frame for several of its workers (payload: encode_fan_out; seq: the
  // frame's; its segment refs: the frame's), which the agent writes to each of them
  kFanOut = 21,
  // host -> kernel: replies (kDone) of several of its workers to request `seq`, gathered by its
  // agent, each distinct payload once with the workers that sent it (payload: encode_replies)
  kReplies = 22,
  // host -> kernel: what the notebook's user should hear about this host (payload: one line of
  // text), e.g. why its ranks start cold; the kernel shows it naming the host
  kHostNote = 23,
};

// A frame's rank for what concerns the host, not one worker: its heartbeat and ack, its notes.
inline constexpr int32_t kHostRank = -1;

// kSpawn's payload: the workers a host starts, by their slot in the kernel's group. Their env
// holds what the kernel adds; the rest is the host's own environment.
std::string encode_spawn(const std::vector<std::pair<int, SpawnSpec>>& workers);
std::vector<std::pair<int, SpawnSpec>> decode_spawn(const std::string& payload);
// kExit's payload.
std::string encode_exit(const ExitStatus& status, const std::string& stderr_tail);
std::pair<ExitStatus, std::string> decode_exit(const std::string& payload);
// kSignal's payload.
std::string encode_signal(int sig, bool whole_group);
std::pair<int, bool> decode_signal(const std::string& payload);
// A host's heartbeat ack (kHeartbeatAck for kHostRank): the slots its agent vouches for. One
// heartbeat and one ack per host and second, whatever its rank count.
std::string encode_slots(const std::vector<int>& slots);
std::vector<int> decode_slots(const std::string& payload);

// kFanOut's payload: the frame's kind and payload once, and the workers (by slot) it is for.
struct FanOut {
  uint16_t kind = 0;
  std::vector<int> slots;
  std::string payload;
};
std::string encode_fan_out(uint16_t kind, const std::vector<int>& slots,
                           const std::string& payload);
FanOut decode_fan_out(const std::string& payload);

// kReplies' payload: each distinct reply once, with the workers that sent it byte for byte.
struct GatheredReply {
  std::vector<int> slots;
  std::string payload;
};
std::string encode_replies(const std::vector<GatheredReply>& replies);
std::vector<GatheredReply> decode_replies(const std::string& payload);

// A host agent's gathering of its workers' replies to one fanned-out request into kReplies
// frames, byte-equal payloads collapsed into one entry. A gather is due when every worker it
// expects has replied (or left), or `window` after the oldest reply it holds: Group.run waits for
// every rank anyway, and a rank that hangs then holds the others' replies back by that window,
// never hides them from the panel and the hang picture. A reply it does not expect (no gather
// for its request or its worker) is not held: its frame goes on by itself.
class ReplyGather {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kWindow{100};  // the kernel's default
  explicit ReplyGather(std::chrono::milliseconds window = kWindow) : window_(window) {}
  // Request `seq` went to `slots` (more than one; workers that can still reply).
  void expect(uint64_t seq, const std::vector<int>& slots);
  // `slot`'s reply to `seq`: true when held for a gather; false: send it on its own.
  bool add(int slot, uint64_t seq, const std::shared_ptr<const std::string>& payload,
           Clock::time_point now);
  // `slot` left (it exited): no reply will come from it.
  void gone(int slot);
  // Whether a reply of `slot`'s is held: it goes before anything else of that worker's (its
  // output after its reply, its exit).
  bool holds(int slot) const;
  // kReplies frames for the gathers that are due (`all`: every held reply now), oldest first.
  std::vector<Frame> take(Clock::time_point now, bool all = false);
  // When the next gather falls due by its window, if any holds a reply.
  std::optional<Clock::time_point> next_due() const;

 private:
  struct Gather {
    std::set<int> waiting;  // expected, neither replied nor gone
    std::vector<std::pair<int, std::shared_ptr<const std::string>>> held;
    Clock::time_point first{};
  };
  std::chrono::milliseconds window_;
  std::map<uint64_t, Gather> gathers_;
  std::map<int, uint64_t> expected_;  // worker -> the request it is expected to reply to
  static Frame frame(uint64_t seq, Gather& g);
};

// What a launcher writes to the agent's stdin: one line, never on a command line or in an
// environment where a process listing could show it.
struct LinkTicket {
  std::string address;  // the kernel's listener
  uint16_t port = 0;
  uint32_t host = 0;  // this host's index in the group
  std::string key;    // raw bytes
  // The kernel's heartbeat timeout: the agent gives up on a kernel silent this long (0: the
  // agent's own default).
  uint32_t timeout_ms = 0;
  // The agent stays for further tickets on the same stdin (end of file there ends it).
  bool standing = false;
  // Fork the workers from the host's rank template: 0 no (cold), 1 when it is ready, 2 waiting
  // for it while it imports (the ranks will use what it preloads).
  uint32_t warm = 0;
  // How long the agent holds its workers' replies to a request for the rest of them
  // (ReplyGather; 0: ReplyGather::kWindow).
  uint32_t reply_window_ms = 0;
  std::string encode() const;
  // Throws std::invalid_argument for anything else.
  static LinkTicket decode(const std::string& line);
};

}  // namespace ddip
