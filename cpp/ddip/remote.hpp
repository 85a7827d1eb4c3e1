// The far end of a link to another host. A launcher (ssh, srun, a user's template) starts a
// HostAgent there; it reads the link's address and key from its stdin, connects back to the
// kernel's Coordinator over TCP, authenticates both ways (auth.hpp), and then supervises that
// host's workers with a Coordinator of its own: output captured at the fd level, exits with
// their status and stderr tail, heartbeats, signals and stack dumps all relayed as frames.
//
// When the link drops or goes silent, the agent stops its workers (their whole process groups)
// and exits: no worker outlives the notebook's group on any host.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/supervisor.hpp"

namespace ddip {

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
  std::string encode() const;
  // Throws std::invalid_argument for anything else.
  static LinkTicket decode(const std::string& line);
};

// The agent's authenticated link to the kernel named by the ticket. Tried again with a growing
// pause until `connect_timeout` when the connection fails or the kernel's listener refuses it
// (strangers holding its port busy); throws std::runtime_error with the last cause, AuthError at
// once for a kernel that does not know the key. user_timeout > 0: TCP_USER_TIMEOUT of the link.
Channel connect_to_kernel(const LinkTicket& ticket, std::chrono::milliseconds connect_timeout,
                          std::chrono::milliseconds user_timeout);

struct AgentOptions {
  LinkTicket ticket;
  std::chrono::milliseconds connect_timeout{15000};
  // No frame from the kernel for this long (it heartbeats every second) means it is gone.
  std::chrono::milliseconds kernel_timeout{10000};
  // A worker whose own heartbeat is older than this is not vouched for to the kernel, which
  // then reports it unresponsive after its own timeout.
  std::chrono::milliseconds worker_stale{2500};
};

class HostAgent {
 public:
  explicit HostAgent(AgentOptions options) : options_(std::move(options)) {}
  // Connects, serves the link and returns once this host's workers are all gone: 0 when the
  // kernel ended the group, 1 when the link failed (why() says what happened). Throws when it
  // can't connect or authenticate.
  int run();
  const std::string& why() const { return why_; }

 private:
  AgentOptions options_;
  std::string why_;
};

}  // namespace ddip
