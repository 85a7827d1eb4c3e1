#include "run_join.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <system_error>
#include <thread>

#include "ddip/auth.hpp"
#include "ddip/plan.hpp"

namespace ddip::run {
namespace {

using std::chrono::milliseconds;

// A connection that has not joined within this long is closed: its peer is not a ddip run.
milliseconds handshake_time(const JoinOptions& o) {
  return std::min(o.link_timeout, milliseconds(10000));
}

std::string secs(milliseconds d) { return seconds_text(d); }

void tune(int fd, const JoinOptions& o) {
  set_nonblocking(fd);
  try {
    // A node whose host or network vanished fails the link within the link timeout: the host
    // pings every node, so unacknowledged data is always in flight.
    set_user_timeout(fd, o.link_timeout);
  } catch (const std::system_error&) {
  }
}

}  // namespace

std::pair<std::string, uint16_t> split_endpoint(const std::string& endpoint,
                                                uint16_t default_port) {
  std::string host = endpoint, port;
  if (!endpoint.empty() && endpoint.front() == '[') {
    size_t close = endpoint.find(']');
    if (close == std::string::npos)
      throw std::invalid_argument("'" + endpoint + "' opens '[' without closing it");
    host = endpoint.substr(1, close - 1);
    if (close + 1 < endpoint.size()) {
      if (endpoint[close + 1] != ':')
        throw std::invalid_argument("'" + endpoint + "': expected ':PORT' after ']'");
      port = endpoint.substr(close + 2);
    }
  } else if (std::count(endpoint.begin(), endpoint.end(), ':') == 1) {
    size_t colon = endpoint.find(':');
    host = endpoint.substr(0, colon);
    port = endpoint.substr(colon + 1);
  }
  if (host.empty()) throw std::invalid_argument("'" + endpoint + "' names no host; give HOST:PORT");
  if (port.empty()) return {host, default_port};
  int p = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || p > 65535)
      throw std::invalid_argument("'" + port + "' in '" + endpoint + "' is not a port number");
    p = p * 10 + (c - '0');
  }
  if (p < 1 || p > 65535)
    throw std::invalid_argument("port " + port + " in '" + endpoint + "' is outside 1-65535");
  return {host, static_cast<uint16_t>(p)};
}

milliseconds conf_seconds(const std::map<std::string, std::string>& conf, const std::string& key,
                          milliseconds fallback) {
  auto it = conf.find(key);
  if (it == conf.end()) return fallback;
  char* end = nullptr;
  double s = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end != '\0' || !(s > 0) || s > 1e7)
    throw std::invalid_argument("--rdzv-conf " + key + "=" + it->second +
                                ": give a positive number of seconds");
  return milliseconds(static_cast<int64_t>(s * 1000));
}

double earliest_timeout(double own, const std::vector<double>& others) {
  double t = own;
  for (double o : others)
    if (o > 0 && (t <= 0 || o < t)) t = o;
  return t;
}

bool restarts_after(const Outcome& o, int restart, int max_restarts) {
  return o.root && !o.first_signal && !o.timed_out && restart < max_restarts;
}

protocol::End end_record(const Outcome& o, bool restart, size_t local_units,
                         const std::string& host_name) {
  protocol::End e;
  e.restart = restart;
  e.exit_code = o.exit_code();
  e.timed_out = o.timed_out;
  e.timeout_s = o.timeout_s;
  e.first_signal = o.first_signal;
  e.grace_ran_out = o.grace_ran_out;
  if (o.root) {
    e.failed = true;
    e.rank = o.root->rank;
    e.who = o.root->who;
    if (o.root->unit < local_units) e.who += " (on node 0, " + host_name + ")";
    e.what = o.root->what;
    e.error = o.root->error;
    e.tail = o.root->tail;
  }
  return e;
}

Outcome outcome_of(const protocol::End& e, const std::vector<UnitEnd>& units) {
  Outcome o;
  o.timed_out = e.timed_out;
  o.timeout_s = e.timeout_s;
  o.first_signal = e.first_signal;
  o.grace_ran_out = e.grace_ran_out;
  if (e.failed) {
    RootCause c;
    c.unit = units.size();  // on another node: none of these
    for (size_t u = 0; u < units.size(); ++u)
      if (!units[u].host && units[u].first_rank == e.rank) c.unit = u;
    c.rank = e.rank;
    c.who = e.who;
    c.what = e.what;
    c.code = e.exit_code;
    c.error = e.error;
    c.tail = e.tail;
    c.reported = true;
    o.root = std::move(c);
  } else if (!e.timed_out && !e.first_signal && e.exit_code != 0) {
    o.lost = "the job failed";
  }
  return o;
}

bool is_this_machine(const std::string& host) {
  if (plan::is_this_host(host)) return true;
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) {
    // A name: what it resolves to.
    hints.ai_flags = 0;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  }
  std::vector<std::string> wanted;
  char buf[INET6_ADDRSTRLEN] = {};
  for (addrinfo* a = found; a; a = a->ai_next) {
    const void* addr =
        a->ai_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (::inet_ntop(a->ai_family, addr, buf, sizeof buf)) wanted.emplace_back(buf);
  }
  ::freeaddrinfo(found);
  for (const auto& w : wanted)
    if (w.rfind("127.", 0) == 0 || w == "::1") return true;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool mine = false;
  for (ifaddrs* i = ifs; i && !mine; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
      continue;
    const void* addr =
        i->ifa_addr->sa_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    if (::inet_ntop(i->ifa_addr->sa_family, addr, buf, sizeof buf))
      mine = std::find(wanted.begin(), wanted.end(), std::string(buf)) != wanted.end();
  }
  ::freeifaddrs(ifs);
  return mine;
}

std::unique_ptr<TcpListener> host_rendezvous(const JoinOptions& o) {
  if (o.backend == "static") {
    if (o.node_rank != 0) return nullptr;
    try {
      return std::make_unique<TcpListener>("0.0.0.0", o.port);
    } catch (const std::system_error& e) {
      throw JoinError("node 0 hosts the job at --master-port " + std::to_string(o.port) +
                      ", but cannot listen there: " + e.what() + "; give a free port");
    }
  }
  // c10d, as torch's backend picks its store's server: the endpoint's host serves, and when
  // several nodes run there, the first to bind the port.
  if (!is_this_machine(o.host)) return nullptr;
  try {
    return std::make_unique<TcpListener>("0.0.0.0", o.port);
  } catch (const std::system_error& e) {
    if (e.code().value() == EADDRINUSE) return nullptr;
    throw JoinError("cannot host the rendezvous at " + o.host + ":" + std::to_string(o.port) +
                    ": " + e.what());
  }
}

std::string shared_key(const std::string& key_file) {
  std::string key;
  if (!key_file.empty()) {
    std::ifstream in(key_file, std::ios::binary);
    if (!in) throw JoinError("cannot read the key file " + key_file + ": " + std::strerror(errno));
    std::ostringstream all;
    all << in.rdbuf();
    key = all.str();
    while (!key.empty() && (key.back() == '\n' || key.back() == '\r')) key.pop_back();
    if (key.empty()) throw JoinError("the key file " + key_file + " is empty");
  } else if (const char* env = std::getenv("DDIP_RUN_KEY")) {
    key = env;
  }
  if (!key.empty() && key.size() < kMinKeyBytes)
    throw JoinError("the shared key (" +
                    (key_file.empty() ? std::string("DDIP_RUN_KEY") : key_file) + ") has " +
                    std::to_string(key.size()) + " characters; give at least " +
                    std::to_string(kMinKeyBytes) + ", e.g. from `openssl rand -hex 32`");
  return key;
}

// -- the host ---------------------------------------------------------------------------------

struct JobHost::Pending {
  std::unique_ptr<JoinLink> link;
  std::optional<KernelHandshake> handshake;  // keyed, until Hello
  Clock::time_point deadline;
  bool done = false;
};

JobHost::JobHost(JoinOptions opts, std::unique_ptr<TcpListener> listener)
    : opts_(std::move(opts)), listener_(std::move(listener)) {}

void JobHost::accept_new(std::vector<Pending>& pending) {
  while (true) {
    std::string peer;
    Fd fd = listener_->accept(&peer);
    if (!fd) return;
    tune(fd.get(), opts_);
    Pending p;
    p.link = std::make_unique<JoinLink>(std::move(fd), "the node at " + peer);
    p.deadline = Clock::now() + handshake_time(opts_);
    protocol::Welcome w;
    if (!opts_.key.empty()) {
      p.handshake.emplace(opts_.key);
      w.keyed = true;
      w.challenge = to_hex(p.handshake->challenge());
    }
    if (p.link->send(protocol::encode(w), handshake_time(opts_))) pending.push_back(std::move(p));
  }
}

bool JobHost::on_pending(Pending& p) {
  auto refuse = [&](const std::string& why) {
    p.link->send(protocol::encode(protocol::Refuse{why}), milliseconds(1000));
    return true;
  };
  bool open = true;
  try {
    open = p.link->fill();
  } catch (const std::system_error&) {
    return true;
  }
  try {
    while (auto line = p.link->next_line()) {
      auto record = protocol::decode_join(*line);
      if (p.handshake) {
        auto* hello = std::get_if<protocol::Hello>(&record);
        if (!hello) return refuse("this job needs its shared key (--key-file or DDIP_RUN_KEY)");
        KernelHandshake::Accepted ok;
        try {
          ok = p.handshake->accept(from_hex(hello->response));
        } catch (const std::exception&) {
          return refuse("its key is not this job's (--key-file or DDIP_RUN_KEY differ)");
        }
        p.handshake.reset();
        if (!p.link->send(protocol::encode(protocol::Accept{to_hex(ok.proof)}),
                          handshake_time(opts_)))
          return true;
        p.link->seal(ok.keys);
        continue;
      }
      auto* join = std::get_if<protocol::Join>(&record);
      if (!join) return refuse("expected a join record");
      if (join->run_id != opts_.run_id)
        return refuse("it names the job '" + join->run_id + "', this is '" + opts_.run_id +
                      "' (--rdzv-id)");
      if (admitted() >= opts_.nnodes_max)
        return refuse("the job has its " + std::to_string(opts_.nnodes_max) +
                      " nodes already (--nnodes)");
      if (opts_.backend == "static") {
        int k = join->node_rank;
        if (k < 1 || k >= opts_.nnodes_max)
          return refuse("its --node-rank " + std::to_string(k) + " is not one of 1.." +
                        std::to_string(opts_.nnodes_max - 1) + " (node 0 is this one)");
        for (const auto& n : nodes_)
          if (n.join.node_rank == k)
            return refuse("node rank " + std::to_string(k) + " has joined already (" +
                          n.link->peer() + ")");
      }
      Node n;
      n.join = *join;
      n.link = std::move(p.link);
      nodes_.push_back(std::move(n));
      return true;
    }
  } catch (const protocol::ProtocolError& e) {
    return refuse(std::string("it sent a ") + e.what());
  }
  return !open;
}

bool JobHost::complete(Clock::time_point now) const {
  if (admitted() >= opts_.nnodes_max) return true;
  return min_reached_ && now >= *min_reached_ + opts_.last_call;
}

protocol::Start JobHost::gather(int restart, int master_port) {
  std::vector<Pending> pending;
  const auto deadline = Clock::now() + opts_.join_timeout;
  // Gone during the last attempt: out.
  nodes_.erase(std::remove_if(nodes_.begin(), nodes_.end(), [](const Node& n) { return !n.link; }),
               nodes_.end());
  min_reached_.reset();
  // Nodes that came during the last attempt wait in the listener's backlog: a restart admits
  // them, by the same rule as the first attempt (torch's agents meet again for each).
  accept_new(pending);
  while (true) {
    auto now = Clock::now();
    if (!min_reached_ && admitted() >= opts_.nnodes_min) min_reached_ = now;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const Pending& p) { return p.done || now >= p.deadline; }),
                  pending.end());
    if (complete(now)) break;
    if (now >= deadline)
      throw JoinError("only " + std::to_string(admitted()) + " of the " +
                      std::to_string(opts_.nnodes_min) + " nodes needed joined within " +
                      secs(opts_.join_timeout) +
                      " s (rdzv-conf join_timeout); start ddip run on "
                      "every node with the same --rdzv-id and endpoint");
    auto until = deadline;
    if (min_reached_) until = std::min(until, *min_reached_ + opts_.last_call);
    for (const auto& p : pending) until = std::min(until, p.deadline);
    std::vector<pollfd> fds{{listener_->fd(), POLLIN, 0}};
    for (const auto& p : pending) fds.push_back({p.link->fd(), POLLIN, 0});
    auto wait = std::chrono::duration_cast<milliseconds>(until - now).count() + 1;
    int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<int64_t>(wait, 0, 1000)));
    if (rc < 0 && errno != EINTR) throw std::system_error(errno, std::generic_category(), "poll");
    if (rc <= 0) continue;
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents) pending[i - 1].done = on_pending(pending[i - 1]);
    if (fds[0].revents) accept_new(pending);
  }
  for (auto& p : pending)
    p.link->send(protocol::encode(protocol::Refuse{"the job has formed without it"}),
                 milliseconds(1000));
  if (opts_.backend == "static")
    std::sort(nodes_.begin(), nodes_.end(),
              [](const Node& a, const Node& b) { return a.join.node_rank < b.join.node_rank; });
  int world = opts_.nproc;
  for (auto& n : nodes_) world += n.join.nproc;
  protocol::Start start;
  start.restart = restart;
  start.max_restarts = opts_.max_restarts;
  start.world_size = world;
  start.nnodes = admitted();
  start.master_addr = opts_.local_addr.empty() ? opts_.host : opts_.local_addr;
  start.master_port = master_port;
  start.run_id = opts_.run_id;
  start.prompts = opts_.prompts;
  int first = opts_.nproc;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    auto& n = nodes_[i];
    n.node_rank = static_cast<int>(i) + 1;
    n.first_rank = first;
    first += n.join.nproc;
    protocol::Start s = start;
    s.node_rank = n.node_rank;
    s.rank_offset = n.first_rank;
    n.link->send(protocol::encode(s), opts_.link_timeout);  // a node gone now: the attempt says
  }
  return start;
}

void JobHost::end(const protocol::End& end) {
  for (auto& n : nodes_)
    if (n.link && !n.link->send(protocol::encode(end), opts_.link_timeout)) n.link.reset();
}

// -- a member ---------------------------------------------------------------------------------

protocol::JoinRecord JobMember::next(Clock::time_point deadline, const char* waiting_for,
                                     bool pings_extend) {
  while (true) {
    std::string line;
    try {
      line = link_->read_line(deadline);
    } catch (const protocol::ProtocolError& e) {
      throw JoinError("the job's host sent a " + std::string(e.what()));
    } catch (const std::exception& e) {
      throw JoinError("no " + std::string(waiting_for) + " from the job's host (" + opts_.host +
                      ":" + std::to_string(opts_.port) + "): " + e.what());
    }
    try {
      auto record = protocol::decode_join(line);
      if (auto* r = std::get_if<protocol::Refuse>(&record))
        throw JoinError("the job's host at " + opts_.host + ":" + std::to_string(opts_.port) +
                        " refused this node: " + r->why);
      return record;
    } catch (const protocol::ProtocolError& e) {
      // What the host told the last attempt before it heard that this node's had ended (a
      // ping, its stop) is no news now.
      try {
        protocol::decode_control(line);
        if (pings_extend) deadline = std::max(deadline, Clock::now() + opts_.link_timeout);
        continue;
      } catch (const protocol::ProtocolError&) {
      }
      throw JoinError("the job's host sent a " + std::string(e.what()));
    }
  }
}

protocol::Start JobMember::join() {
  const auto deadline = Clock::now() + opts_.join_timeout;
  Fd fd;
  std::string last;
  // From 5 ms, doubling to 100 ms: a host started a moment later (the usual case) is joined
  // within milliseconds, not after a whole 100 ms pause, and one that is late costs 10 tries a
  // second.
  milliseconds pause(5);
  while (!fd) {
    try {
      fd = connect_tcp(opts_.host, opts_.port, std::min(handshake_time(opts_), opts_.join_timeout));
    } catch (const std::exception& e) {
      last = e.what();
      // The host's ddip run may start after this one (srun starts them all at once): try again
      // until the join timeout, as torch's agents do with their store.
      if (Clock::now() + pause >= deadline)
        throw JoinError(last + " within " + secs(opts_.join_timeout) +
                        " s (rdzv-conf join_timeout): is node 0's ddip run started, and is "
                        "this the address it listens on?");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, milliseconds(100));
    }
  }
  tune(fd.get(), opts_);
  link_ = std::make_unique<JoinLink>(
      std::move(fd), "the job's host at " + opts_.host + ":" + std::to_string(opts_.port));
  // A node that comes while an attempt runs waits in the host's backlog until the next one.
  auto first = next(deadline, "welcome");
  auto hs_deadline = Clock::now() + handshake_time(opts_);
  auto* welcome = std::get_if<protocol::Welcome>(&first);
  if (!welcome) throw JoinError("the job's host did not say welcome first: is it a ddip run?");
  if (welcome->keyed && opts_.key.empty())
    throw JoinError(
        "the job's host wants the job's shared key: give it with --key-file or "
        "DDIP_RUN_KEY, as on node 0");
  if (!welcome->keyed && !opts_.key.empty())
    throw JoinError(
        "the job's host runs without a shared key, and this node has one: not "
        "joining a job whose links are not authenticated (give node 0 the key too)");
  if (welcome->keyed) {
    HostHandshake hs(opts_.key, 0);
    std::string response;
    try {
      response = hs.respond(from_hex(welcome->challenge));
    } catch (const std::exception& e) {
      throw JoinError(std::string("the job's host's challenge is malformed: ") + e.what());
    }
    if (!link_->send(protocol::encode(protocol::Hello{to_hex(response)}), handshake_time(opts_)))
      throw JoinError("the job's host closed the link during the handshake");
    auto reply = next(hs_deadline, "proof of the key");
    auto* accept = std::get_if<protocol::Accept>(&reply);
    if (!accept) throw JoinError("the job's host sent no proof of the key");
    try {
      link_->seal(hs.verify(from_hex(accept->proof)));
    } catch (const std::exception&) {
      throw JoinError("the job's host does not know the shared key: not joining");
    }
  }
  protocol::Join j{opts_.run_id, opts_.node_rank, opts_.nproc, opts_.timeout_s, opts_.name};
  if (!link_->send(protocol::encode(j), handshake_time(opts_)))
    throw JoinError("the job's host closed the link before this node could join");
  return next_start();
}

protocol::Start JobMember::next_start() {
  auto record = next(Clock::now() + opts_.join_timeout, "start of the job");
  if (auto* s = std::get_if<protocol::Start>(&record)) return *s;
  throw JoinError("the job's host sent something else than the start of the job");
}

protocol::End JobMember::end() {
  // The host ends the attempt once every node has, which may be long after this one's ranks
  // ended (another's still saving a checkpoint): it pings meanwhile, so only its silence for the
  // link timeout is its loss.
  auto record = next(Clock::now() + opts_.link_timeout, "end of the attempt", true);
  if (auto* e = std::get_if<protocol::End>(&record)) return *e;
  throw JoinError("the job's host sent something else than the end of the attempt");
}

}  // namespace ddip::run
