// One `ddip run` per node forming one job, as one torchrun per node does (srun, a Kubeflow pod,
// SkyPilot, a master and a worker started by hand): the rendezvous that decides who is in and
// where each node's ranks sit, and the links that then carry each attempt's control channel
// (run_channel.hpp, run_protocol.hpp) between the job's host and every other node.
//
// The job's host is node 0, and serves the rendezvous on a TCP port: with the static backend
// (--nnodes N --node-rank K --master-addr A --master-port P) the node given --node-rank 0, at
// P; with c10d (--rdzv-endpoint H:P), as torch's c10d backend picks its store's server, the node
// on the endpoint's host that binds P first. Every other node connects to it and joins (Join);
// the host answers with each attempt's place in the job (Start), and its outcome (End).
//
// Who can join: anyone who can reach the port and names the job's run id, which is no secret (a
// Slurm job id, a pod's name). With a shared key (--key-file, DDIP_RUN_KEY) on every node, a node
// joins only after a challenge-response proves both sides know it (ddip/auth.hpp), and every line
// on the link carries the key's MAC (SealedLines).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ddip/tcp.hpp"
#include "run_channel.hpp"
#include "run_protocol.hpp"
#include "run_report.hpp"

namespace ddip::run {

// What a node's ddip run brings to the rendezvous: from its command line (or PET_* variables).
struct JoinOptions {
  std::string backend = "static";  // "static", "c10d"
  std::string host;                // the master's address, or the rendezvous endpoint's host
  // --local-addr: the job's host's address for MASTER_ADDR when it is not `host` (torch's
  // agents name theirs in the rendezvous the same way); "": `host`.
  std::string local_addr;
  uint16_t port = 29400;
  int nnodes_min = 1, nnodes_max = 1;
  int node_rank = -1;    // static: this node's place; -1 given on arrival (c10d)
  std::string run_id;    // the job's --rdzv-id: every node must name the same
  int nproc = 1;         // this node's ranks
  std::string name;      // this node's host name, for messages
  double timeout_s = 0;  // its --timeout (0: none); the job stops at the earliest node's
  int max_restarts = 0;  // the host's counts for the job
  bool prompts = false;  // someone at the host's terminal can answer the ranks' prompts
  std::string key;       // the shared key's bytes; "": links are not authenticated
  std::chrono::milliseconds join_timeout{600000};  // rdzv-conf join_timeout, as torch's
  std::chrono::milliseconds last_call{30000};      // rdzv-conf last_call_timeout
  std::chrono::milliseconds link_timeout{30000};   // --link-timeout
};

// The rendezvous failed: too few nodes came in time, the host refused this node, the link broke.
// what() says why and what to do.
struct JoinError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "host:port", "[v6]:port" or "host" (then `default_port`) -> host and port. Throws
// std::invalid_argument naming what is wrong.
std::pair<std::string, uint16_t> split_endpoint(const std::string& endpoint, uint16_t default_port);

// rdzv-conf's timeouts: `key` in seconds (an integer or not), else `fallback`. Throws
// std::invalid_argument for a value that is not a positive number.
std::chrono::milliseconds conf_seconds(const std::map<std::string, std::string>& conf,
                                       const std::string& key, std::chrono::milliseconds fallback);

// The earliest of the nodes' --timeout (0: none given anywhere): the job stops at it.
double earliest_timeout(double own, const std::vector<double>& others);

// Whether a failed attempt is followed by another: a rank (or a node) failed, not a signal or a
// timeout, and fewer than --max-restarts restarts have been made (torch elastic's agent).
bool restarts_after(const Outcome& outcome, int restart, int max_restarts);

// The job's host's account of an attempt for every other node (`local_units`: the host's own
// rank units, whose root cause is named with `host_name`), and a node's reading of it, for
// summary() with its own ranks' ends.
protocol::End end_record(const Outcome& outcome, bool restart, size_t local_units,
                         const std::string& host_name);
Outcome outcome_of(const protocol::End& end, const std::vector<UnitEnd>& units);

// Whether `host` names this machine: its name, localhost, a loopback address or an address one
// of its interfaces has (torch's _matches_machine_hostname).
bool is_this_machine(const std::string& host);

// The rendezvous's listening socket when this node hosts the job, else nullptr: static, node
// rank 0 (throws JoinError when the port can't be had); c10d, the endpoint names this machine and
// its port is free here (taken: another node here hosts it, and this one joins).
std::unique_ptr<TcpListener> host_rendezvous(const JoinOptions& opts);

// A node's shared key: the file --key-file names (its bytes, without a last line end), else
// DDIP_RUN_KEY's value, else "". Throws JoinError for a file that can't be read, or a key shorter
// than kMinKeyBytes (the links' HMAC keys are no stronger than it).
inline constexpr size_t kMinKeyBytes = 16;
std::string shared_key(const std::string& key_file);

// Node 0: hosts the rendezvous, and the links to every other node.
class JobHost {
 public:
  JobHost(JoinOptions opts, std::unique_ptr<TcpListener> listener);

  struct Node {
    std::unique_ptr<JoinLink> link;
    protocol::Join join;
    int node_rank = 0, first_rank = 0;
  };
  // Forms the next attempt and tells every node its Start; returns this node's. It waits for
  // nnodes_min nodes (with this one) and then the last call, or for nnodes_max; a restart keeps
  // the nodes still linked and admits those that came meanwhile. Throws JoinError when too few
  // nodes are in by the join timeout.
  protocol::Start gather(int restart, int master_port);
  // The other nodes of the attempt, in node rank order.
  std::vector<Node>& nodes() { return nodes_; }
  // Tells every node how the attempt ended; nodes whose link is gone are dropped.
  void end(const protocol::End& end);
  // A node that vanished during the attempt is dropped before the next.
  void drop(size_t i) { nodes_[i].link.reset(); }

 private:
  struct Pending;
  void accept_new(std::vector<Pending>& pending);
  // Reads what pending connection `p` sent; true when it is done with (joined or refused).
  bool on_pending(Pending& p);
  void admit(Pending& p);
  int admitted() const { return 1 + static_cast<int>(nodes_.size()); }
  bool complete(Clock::time_point now) const;
  JoinOptions opts_;
  std::unique_ptr<TcpListener> listener_;
  std::vector<Node> nodes_;
  std::optional<Clock::time_point> min_reached_;
};

// Any other node: joins the job its host holds.
class JobMember {
 public:
  explicit JobMember(JoinOptions opts) : opts_(std::move(opts)) {}
  // Connects to the host (waiting for it to listen, up to the join timeout), authenticates,
  // joins, and waits for the first attempt. Throws JoinError.
  protocol::Start join();
  JoinLink& link() { return *link_; }
  // After an attempt: the host's account of it. Throws JoinError when the link is gone.
  protocol::End end();
  // The next attempt's Start, after an End that said restart.
  protocol::Start next_start();

 private:
  // The next join record, skipping what the host told an attempt that has ended here (pings,
  // its stop); `pings_extend`: each of them moves the deadline to a link timeout from then.
  protocol::JoinRecord next(Clock::time_point deadline, const char* waiting_for,
                            bool pings_extend = false);
  JoinOptions opts_;
  std::unique_ptr<JoinLink> link_;
};

}  // namespace ddip::run
