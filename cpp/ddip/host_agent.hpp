// The far end of a link to another host. A launcher (ssh, srun, a user's template) starts a
// HostAgent there; it reads the link's address and key from its stdin, connects back to the
// kernel's Coordinator over TCP, authenticates both ways (auth.hpp), and then supervises that
// host's workers with a Coordinator of its own: output captured at the fd level, exits with
// their status and stderr tail, heartbeats, signals and stack dumps all relayed as frames.
//
// When the link drops or goes silent, the agent stops its workers (their whole process groups)
// and exits: no worker outlives the notebook's group on any host.
//
// A later kSpawn on the link names workers that exited, to be started again in their slots (a
// heal that replaces a dead rank): the same spec or the one it carries, forked from the host's
// template when it can, else cold; one that can't be started is reported exited (kExit) with
// why. So a standing agent keeps its link while all its workers are dead, until the kernel
// closes it; a one-shot one (`ddip run`) ends when its last worker does.
//
// A standing agent (the kernel's AgentKeeper, keeper.hpp) serves one group per ticket line on
// its stdin, which stays open to the kernel: after a group that ended cleanly it waits for the
// next ticket; end of file there (the kernel died or let the host go) stops everything under it.
// It keeps a rank template of its host's own (rank_template.hpp) across groups, started with the
// first ticket that asks for warm ranks, and forks those groups' workers from it. When it can't
// (the template could not start, failed, stopped, or the workers can't be its forks), it says why
// to the kernel (kHostNote) at each group's start there, and the notebook shows it naming the
// host: the agent's own stderr is read by nobody once it runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddip/channel.hpp"
#include "ddip/link_protocol.hpp"
#include "ddip/supervisor.hpp"

namespace ddip {

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
  // How long a group that wants warm ranks waits for a template still importing.
  std::chrono::milliseconds template_wait{60000};
  // An agent waiting for a ticket that hears nothing on its stdin this long (the kernel's keeper
  // writes an empty line every 5 s) takes the kernel for gone: its host was cut off between
  // groups, and its launcher's connection may not report that for hours (TCP keepalive).
  std::chrono::milliseconds idle_timeout{30000};
};

class RankTemplate;

class HostAgent {
 public:
  explicit HostAgent(AgentOptions options);
  ~HostAgent();
  // Connects, serves the link and returns once this host's workers are all gone: 0 when the
  // kernel ended the group, 1 when the link failed (why() says what happened). Throws when it
  // can't connect or authenticate.
  int run();
  // `python -m ddip.remote`: reads ticket lines from `input` (its stdin) and serves them. A
  // one-shot ticket: `input` is pointed at /dev/null (the key is read), one group, its code. A
  // standing one: groups one after another until end of file on `input` (0), or a group that
  // did not end cleanly (run()'s code). `template_spec`: this host's rank template, started for
  // the first ticket that asks for warm ranks (none: always cold).
  int serve(int input, std::optional<SpawnSpec> template_spec);
  const std::string& why() const { return why_; }
  // The host's rank template (null until a ticket asked for one).
  RankTemplate* rank_template() const { return template_.get(); }

 private:
  AgentOptions options_;
  std::string why_;
  int lifeline_ = -1;    // a standing agent's stdin, watched during a group for end of file
  std::string input_;    // read from it beyond the current ticket
  bool let_go_ = false;  // end of file on it
  bool clean_ = false;   // the last group ended with every worker reported and the link intact
  std::optional<SpawnSpec> template_spec_;
  std::unique_ptr<RankTemplate> template_;
  std::string template_unstartable_;  // why template_spec_ could not start: every group is cold
  // What the kernel should tell the user about this host, said since a group's link last took
  // it: each line goes on that link as a kHostNote.
  std::vector<std::string> notes_;
  void note(std::string text);
  // After forks from `tmpl` (when not null): a note when some were refused (those started cold).
  void after_forks(RankTemplate* tmpl, uint64_t refusals_before);
  std::string preloads() const;
  // The template to fork `workers` from, or null (cold). `may_wait`: a template still importing
  // is waited for when the ticket says so (a group's start; never a worker started again, which
  // would leave the link unserved meanwhile).
  RankTemplate* warm_template(const std::vector<SpawnSpec>& workers, bool may_wait = true);
  // One group's link to the kernel and this host's workers, relayed on one thread.
  class Relay;
};

// Why `rank` can't be a fork of a rank template started by `tmpl` (it runs another program, or
// Python reads a start-up variable of its differently), or "" when it can. The one rule for the
// kernel's template (ddip.template) and a host's.
std::string unforkable(const SpawnSpec& tmpl, const SpawnSpec& rank);

}  // namespace ddip
