// The link protocol: what the kernel's HostLinks (links.hpp) and a host's HostAgent (remote.hpp)
// say to each other. The ticket a launcher hands the agent, the frame kinds that travel only on
// a link, and their payloads. Both ends include this header and nothing of each other's, so
// either side can change how it works without the other's header in its build.
//
// Payloads are little-endian fixed-width integers and length-prefixed strings; a payload that
// ends early or announces more than it holds is corrupt (std::runtime_error): from an
// authenticated peer that is a bug, and the link is dropped.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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
};

// A frame's rank for what concerns the host, not one worker: its heartbeat and ack.
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
  std::string encode() const;
  // Throws std::invalid_argument for anything else.
  static LinkTicket decode(const std::string& line);
};

}  // namespace ddip
