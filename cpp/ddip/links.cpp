#include "ddip/links.hpp"

#include <arpa/inet.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <set>
#include <stdexcept>

#include "ddip/link_protocol.hpp"

namespace ddip {

using Clock = std::chrono::steady_clock;

namespace {

// After a launcher ended while its host was connected: how long the link gets to end by itself
// (the agent's last frames and its close may still be unread) before the host is taken as lost.
constexpr std::chrono::milliseconds kLauncherGrace{1000};

// `name` as the address a connection from it would show, when it is an IP literal; else "".
std::string numeric_address(const std::string& name) {
  unsigned char buf[sizeof(in6_addr)];
  char text[INET6_ADDRSTRLEN];
  for (int family : {AF_INET, AF_INET6})
    if (::inet_pton(family, name.c_str(), buf) == 1 &&
        ::inet_ntop(family, buf, text, sizeof text) != nullptr)
      return text;
  return "";
}

}  // namespace

HostLinks::HostLinks(EventLoop& loop, Supervisor& supervisor, SegmentPool& pool,
                     LinkOptions options, const std::vector<SpawnSpec>& workers,
                     Callbacks callbacks)
    : loop_(loop),
      supervisor_(supervisor),
      pool_(pool),
      options_(std::move(options)),
      cb_(std::move(callbacks)) {
  for (size_t h = 0; h < options_.hosts.size(); ++h) {
    if (options_.hosts[h].slots.empty())
      throw std::invalid_argument("remote host " + options_.hosts[h].name + " has no workers");
    for (int slot : options_.hosts[h].slots) {
      if (slot < 0 || static_cast<size_t>(slot) >= workers.size() || slots_.count(slot))
        throw std::invalid_argument("a remote host's slots must be distinct workers");
      slots_[slot].link = h;
      specs_[slot] = workers[static_cast<size_t>(slot)];
    }
  }
  tcp_ = std::make_unique<TcpListener>(options_.bind_address, options_.bind_port);
  key_ = random_bytes(kKeyBytes);
}

HostLinks::~HostLinks() {
  *alive_ = false;
  close();  // the listener and its accept timer too
  for (auto& l : links_) {
    if (!l.launcher_exited && !l.standing) loop_.unwatch(supervisor_.child(l.child).pidfd());
    for (Fd* fd : {&l.out, &l.err})
      if (*fd) loop_.unwatch(fd->get());
  }
}

std::string HostLinks::address() const {
  const std::string& a = tcp_->address();
  std::string host = a.find(':') != std::string::npos ? "[" + a + "]" : a;
  return host + ":" + std::to_string(tcp_->port());
}

size_t HostLinks::rejected() const {
  std::lock_guard lock(mu_);
  return rejected_;
}

std::string HostLinks::last_rejection() const {
  std::lock_guard lock(mu_);
  return last_rejection_;
}

void HostLinks::start() {
  loop_.watch(tcp_->fd(), EPOLLIN, [this](uint32_t) { on_accept(); });
  links_.resize(options_.hosts.size());
  for (size_t h = 0; h < options_.hosts.size(); ++h) {
    Link& l = links_[h];
    l.host = options_.hosts[h];
    LinkTicket ticket{tcp_->address(), tcp_->port(), static_cast<uint32_t>(h), key_};
    ticket.timeout_ms = static_cast<uint32_t>(options_.kernel_silence.count());
    ticket.reply_window_ms = static_cast<uint32_t>(options_.reply_window.count());
    if (options_.keeper) {
      lease_agent(h);
      continue;
    }
    // The key goes on the launcher's stdin: ssh and srun forward it to the agent, and no
    // command line or environment shows it.
    l.host.launcher.stdin_data = ticket.encode();
    l.host.launcher.null_stdin = false;
    l.child = supervisor_.spawn(l.host.launcher);
    Child& c = supervisor_.child(l.child);
    l.out = std::move(c.stdout_pipe());
    l.err = std::move(c.stderr_pipe());
    loop_.watch(c.pidfd(), EPOLLIN, [this, h](uint32_t) { on_launcher_exit(h); });
    if (l.out)
      loop_.watch(l.out.get(), EPOLLIN,
                  [this, h](uint32_t) { on_launcher(h, RankOutput::kStdout); });
    if (l.err)
      loop_.watch(l.err.get(), EPOLLIN,
                  [this, h](uint32_t) { on_launcher(h, RankOutput::kStderr); });
  }
}

void HostLinks::lease_agent(size_t h) {
  // The host's standing agent (keeper.hpp): it outlives this group, and so does its rank
  // template. Its launcher's exit reaches this loop as a posted command.
  Link& l = links_[h];
  LinkTicket ticket{tcp_->address(), tcp_->port(), static_cast<uint32_t>(h), key_};
  ticket.timeout_ms = static_cast<uint32_t>(options_.kernel_silence.count());
  ticket.standing = true;
  ticket.warm = options_.warm;
  ticket.reply_window_ms = static_cast<uint32_t>(options_.reply_window.count());
  l.standing = true;
  l.lease = options_.keeper->lease(l.host.launcher, [this, h] {
    try {
      loop_.post([this, h] { on_launcher_exit(h); });
    } catch (const std::runtime_error&) {
      // The group has stopped: nobody waits for this host any more.
    }
  });
  l.lease->send(ticket.encode());
}

bool HostLinks::relaunch(size_t h) {
  // An agent kept from an earlier group that left before taking this group's ticket (it gave
  // up on a silent kernel just then): one new agent, as a first group would start.
  Link& l = links_[h];
  if (!l.standing || !l.lease || !l.lease->reused() || l.ever_connected || l.conn) return false;
  l.lease.reset();
  try {
    lease_agent(h);
  } catch (const std::exception&) {
    return false;  // the exit already seen is the cause to report
  }
  return true;
}

void HostLinks::on_accept() {
  while (true) {
    std::string peer;
    Fd fd = tcp_->accept(&peer);
    if (!fd) {
      if (tcp_->starved()) pause_accepting();
      return;
    }
    uint64_t id = next_handshake_++ & 0xffffffffu;
    std::string from = address_of(peer);
    make_room(from);
    Handshake h{
        std::move(fd), peer, KernelHandshake(key_), {}, Clock::now() + options_.handshake_timeout,
        from};
    ssize_t n = ::send(h.fd.get(), h.hs.challenge().data(), h.hs.challenge().size(),
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    int fdnum = h.fd.get();
    handshakes_.emplace(id, std::move(h));
    if (n != static_cast<ssize_t>(KernelHandshake::kChallengeBytes)) {
      reject(id, "could not send the challenge");
      continue;
    }
    loop_.watch(fdnum, EPOLLIN, [this, id](uint32_t) { on_handshake(id); });
  }
}

// Out of fds: the connection waits in the backlog. Watching the listener meanwhile would wake the
// loop at once, again and again (level-triggered): it rests, as the Unix listener does, until a
// timer or a handshake that ends (an fd freed) tries again.
void HostLinks::pause_accepting() {
  if (accept_timer_) return;
  loop_.modify(tcp_->fd(), 0);
  accept_timer_ = loop_.after(kAcceptPause, [this] {
    accept_timer_ = 0;
    loop_.modify(tcp_->fd(), EPOLLIN);
  });
}

// Strangers can hold the port busy with idle connections (a local user sees it in /proc/net/tcp).
// Refusing the newcomer would refuse the group's agents with them, so the newcomer always gets
// its chance and the oldest handshake of the most crowded address is closed instead: its own
// address's once that holds kHandshakesPerPeer, and the hosts launched to only when no other
// address is there to close. An agent answers the challenge in one round trip, and retries.
void HostLinks::make_room(const std::string& from) {
  struct Peer {
    size_t count = 0;
    uint64_t oldest = 0;
    Clock::time_point at = Clock::time_point::max();
  };
  std::map<std::string, Peer> peers;
  for (auto& [id, h] : handshakes_) {
    Peer& p = peers[h.from];
    ++p.count;
    if (h.deadline < p.at) p.at = h.deadline, p.oldest = id;  // the same timeout for all
  }
  std::string victim, why;
  // Room for every host's agent too: they may all come from one address (a NAT, this machine).
  size_t per_peer = kHandshakesPerPeer + links_.size();
  auto mine = peers.find(from);
  if (mine != peers.end() && mine->second.count >= per_peer) {
    victim = from;
    why = "too many unauthenticated connections at once from " + from + " (" +
          std::to_string(per_peer) + "; the oldest is closed for each new one)";
  } else if (handshakes_.size() >= kMaxHandshakes) {
    auto launched = [this](const std::string& a) {
      return std::any_of(links_.begin(), links_.end(),
                         [&](const Link& l) { return numeric_address(l.host.name) == a; });
    };
    std::pair<bool, size_t> worst{true, 0};
    for (auto& [a, p] : peers) {
      std::pair<bool, size_t> rank{launched(a), p.count};
      if (victim.empty() || rank.first < worst.first ||
          (rank.first == worst.first && rank.second > worst.second))
        victim = a, worst = rank;
    }
    why = "too many unauthenticated connections at once (" + std::to_string(kMaxHandshakes) +
          ", from " + std::to_string(peers.size()) + " addresses; the most from " + victim + ")";
  } else {
    return;
  }
  ++made_room_;
  made_room_why_ = why;
  reject(peers[victim].oldest, "closed to make room for a newer one: " + why, why);
}

void HostLinks::reject(uint64_t id, const std::string& why, const std::string& tell) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  std::string text = "refused a connection from " + it->second.peer + ": " + why;
  {
    std::lock_guard lock(mu_);
    ++rejected_;
    last_rejection_ = text;
  }
  int fd = it->second.fd.get();
  if (!tell.empty()) {
    // An agent closed to make room reads why where it expected the proof. What the peer sent is
    // read first: a close with unread bytes would be a reset, which may discard the line.
    char scratch[4096];
    (void)!::recv(fd, scratch, sizeof scratch, MSG_DONTWAIT);
    std::string line = refusal_line("the kernel's listener refused the connection: " + tell);
    (void)!::send(fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  loop_.unwatch(fd);
  handshakes_.erase(it);  // closes it: nothing it sent was ever parsed beyond the handshake
  // The kernel's log (the terminal that runs Jupyter): someone may be probing the port.
  log_rejection(text);
  // An fd was freed: a listener resting for want of one may take its connection now.
  if (accept_timer_) {
    loop_.cancel(accept_timer_);
    accept_timer_ = 0;
    loop_.modify(tcp_->fd(), EPOLLIN);
  }
}

// A few lines per window, then a count: a port scan or a flood can't fill the kernel's log.
void HostLinks::log_rejection(const std::string& text) {
  auto now = Clock::now();
  if (now >= log_window_end_) {
    flush_rejection_log("in the last minute");
    log_window_end_ = now + kLogWindow;
    logged_ = 0;
  }
  if (logged_ < kLoggedRefusals) {
    ++logged_;
    std::fprintf(stderr, "ddip: %s\n", text.c_str());
    if (logged_ == kLoggedRefusals)
      std::fprintf(stderr, "ddip: (more refusals within a minute are counted, not shown)\n");
    return;
  }
  ++unlogged_;
  unlogged_last_ = text;
}

void HostLinks::flush_rejection_log(const char* when) {
  if (unlogged_ == 0) return;
  std::fprintf(stderr, "ddip: refused %zu more connection(s) %s; the last: %s\n", unlogged_, when,
               unlogged_last_.c_str());
  unlogged_ = 0;
}

void HostLinks::tick() {
  // One heartbeat per connected host with a live worker there; its agent answers for them all.
  for (size_t link = 0; link < links_.size(); ++link)
    if (links_[link].conn) send_link(link, Frame::make(kHeartbeat, kHostRank, 0));
  auto now = Clock::now();
  if (unlogged_ > 0 && now >= log_window_end_) {
    flush_rejection_log("in the last minute");
    log_window_end_ = now + kLogWindow;
    logged_ = 0;
  }
  std::vector<uint64_t> late;
  for (auto& [id, h] : handshakes_)
    if (now >= h.deadline) late.push_back(id);
  for (uint64_t id : late)
    reject(id, "no valid handshake within " + std::to_string(options_.handshake_timeout.count()) +
                   " ms");
}

void HostLinks::on_handshake(uint64_t id) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  Handshake& h = it->second;
  char buf[KernelHandshake::kResponseBytes];
  size_t want = KernelHandshake::kResponseBytes - h.response.size();
  ssize_t n = ::recv(h.fd.get(), buf, want, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) return reject(id, "closed during the handshake");
  h.response.append(buf, static_cast<size_t>(n));
  if (h.response.size() < KernelHandshake::kResponseBytes) return;
  KernelHandshake::Accepted accepted;
  try {
    accepted = h.hs.accept(h.response);
  } catch (const AuthError& e) {
    return reject(id, e.what());
  }
  if (accepted.host >= links_.size() || links_[accepted.host].conn)
    return reject(id, "authenticated, but for host " + std::to_string(accepted.host) +
                          ", which is not expected (or already connected)");
  Link& l = links_[accepted.host];
  if (::send(h.fd.get(), accepted.proof.data(), accepted.proof.size(),
             MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(accepted.proof.size()))
    return reject(id, "could not send the proof");
  loop_.unwatch(h.fd.get());
  // A link cut off the network can't come back: its agent stops its workers after this long
  // without a frame. The kernel always has a heartbeat in flight, so TCP says so after as long.
  if (options_.kernel_silence.count() > 0) try {
      set_user_timeout(h.fd.get(), options_.kernel_silence);
    } catch (const std::system_error&) {
      // Only then the loss is noticed later, by TCP's own retries.
    }
  Channel ch(std::move(h.fd));
  handshakes_.erase(it);
  ch.seal(std::move(accepted.keys));
  size_t link = accepted.host;
  l.conn = std::make_unique<Connection>(
      loop_, std::move(ch), [this, link](Frame f) { on_frame(link, std::move(f)); },
      [this, link](Connection::End how, const std::string& why) {
        if (how == Connection::End::kCorrupt)
          std::fprintf(stderr, "ddip: dropped the link to host %s: %s\n",
                       links_[link].host.name.c_str(), why.c_str());
        if (how == Connection::End::kFailed && why.find("timed out") != std::string::npos)
          return lose_link(
              link, "it acknowledged nothing for " +
                        std::to_string(options_.kernel_silence.count()) +
                        " ms (the heartbeat timeout): the network to it is down or the host "
                        "hung, and its agent stops its ranks after as long without the kernel (" +
                        why + ")");
        Link& closed = links_[link];
        if (how == Connection::End::kClosed && closed.standing && closed.lease &&
            !closed.lease->exit_status() && !host_done(closed)) {
          // A standing agent closes its link by itself when its stdin ends, i.e. its launcher
          // is gone; that exit comes from the keeper's thread, maybe just after this: it gets
          // the grace to arrive and be named as the cause (on_launcher_exit), else `why` is.
          closed.shipped.clear();
          launcher_grace_[link] = loop_.after(kLauncherGrace, [this, link, why] {
            launcher_grace_.erase(link);
            links_[link].lost_why = why;
            for (int slot : links_[link].host.slots)
              lose_slot(slot, "lost the link to its host " + links_[link].host.name + ": " + why);
          });
          closed.lost_why = why;
          // Last: it destroys this callback (and what it captured). The agent stops its workers.
          closed.conn.reset();
          return;
        }
        lose_link(link, why);
      });
  l.ever_connected = true;
  std::vector<std::pair<int, SpawnSpec>> specs;
  for (int slot : l.host.slots)
    if (!slots_[slot].gone) specs.emplace_back(slot, specs_[slot]);
  send_link(link, Frame::make(kSpawn, l.host.slots.front(), 0, encode_spawn(specs)));
  for (int slot : l.host.slots) {
    auto waiting = std::move(slots_[slot].waiting);
    slots_[slot].waiting.clear();
    for (auto& [f, segments] : waiting) send(slot, std::move(f), std::move(segments));
  }
}

void HostLinks::send(int slot, Frame f, std::vector<uint64_t> segments) {
  Slot& s = slots_.at(slot);
  if (!s.gone && !links_[s.link].conn) {
    s.waiting.emplace_back(std::move(f), std::move(segments));
    return;
  }
  if (!s.gone) {
    if (!segments.empty() && links_[s.link].conn) {
      for (uint64_t id : segments) ship(s.link, id);
      f.refs = segments;  // the agent fills in its own copies
      f.fds.reset();
      f.fd_bytes.clear();
    }
    send_link(s.link, std::move(f));
  }
  for (uint64_t id : segments) pool_.release(id);
}

void HostLinks::send(const std::vector<int>& slots, const Frame& f,
                     const std::vector<uint64_t>& segments) {
  std::map<size_t, std::vector<int>> by_link;
  for (int slot : slots) {
    const Slot& s = slots_.at(slot);
    if (!s.gone) by_link[s.link].push_back(slot);
  }
  for (auto& [link, targets] : by_link) {
    if (!links_[link].conn || targets.size() == 1) {
      for (int slot : targets) {
        for (uint64_t id : segments) pool_.retain(id);  // send() takes one
        Frame g = f;
        g.rank = slot;
        send(slot, std::move(g), segments);
      }
      continue;
    }
    for (uint64_t id : segments) ship(link, id);
    Frame g = Frame::make(kFanOut, kHostRank, f.seq, encode_fan_out(f.kind, targets, f.data()));
    g.refs = segments;  // the agent fills in its own copies
    send_link(link, std::move(g));
  }
  for (uint64_t id : segments) pool_.release(id);
}

void HostLinks::ship(size_t link, uint64_t id) {
  Link& l = links_[link];
  if (!l.shipped.insert(id).second) return;  // that host has it already
  Frame seg = Frame::make(kSegment, l.host.slots.front(), id);
  seg.fds = std::make_shared<std::vector<Fd>>();
  seg.fds->push_back(pool_.dup_fd(id));
  seg.fd_bytes.push_back(pool_.length(id));
  pool_.retain(id);
  SegmentPool* pool = &pool_;
  seg.hold = std::shared_ptr<void>(nullptr, [pool, id](void*) { pool->release(id); });
  send_link(link, std::move(seg));
  // Every frame of one Coordinator::send is queued by the command that ships the segment, and
  // ids are never reused: once that command is done, no later frame refers to it.
  try {
    loop_.post([this, alive = alive_, link, id] {
      if (!*alive) return;
      Link& l = links_[link];
      if (l.shipped.erase(id) && l.conn)
        send_link(link, Frame::make(kForget, l.host.slots.front(), id));
    });
  } catch (const std::runtime_error&) {
    // The loop is closing: the link and the agent's copies go with it.
  }
}

void HostLinks::send_link(size_t link, Frame f) {
  Link& l = links_[link];
  if (l.conn) l.conn->send(std::move(f));  // a failure loses the link
}

void HostLinks::signal(int slot, int sig, bool whole_group) {
  Slot& s = slots_.at(slot);
  if (s.gone) return;
  if (!links_[s.link].conn && sig == SIGKILL) {
    // Never connected and being killed: its launcher goes, and with it any hope of the host.
    return lose_slot(slot, "stopped before its host " + links_[s.link].host.name + " connected");
  }
  send(slot, Frame::make(kSignal, slot, 0, encode_signal(sig, whole_group)), {});
}

void HostLinks::respawn(int slot, std::optional<SpawnSpec> spec) {
  Slot& s = slots_.at(slot);
  Link& l = links_[s.link];
  std::string which = "worker slot " + std::to_string(slot) + " on host " + l.host.name;
  if (!s.gone)
    throw std::logic_error(which + " is still running (its host has not reported its exit): " +
                           "only a worker that exited can be started again");
  if (!l.standing && host_done(l))
    throw std::logic_error(which + " can't be started again there: that host's agent was a " +
                           "one-shot one (as `ddip run`'s), which leaves with its last worker");
  if (!l.conn)
    throw std::logic_error(
        which + " can't be started again there: the link to that host's agent is gone" +
        (l.lost_why.empty() ? std::string(l.ever_connected ? "" : " (it never connected)")
                            : " (" + l.lost_why + ")"));
  if (spec) specs_[slot] = std::move(*spec);
  s = Slot{};
  s.link = static_cast<size_t>(&l - links_.data());
  send_link(s.link, Frame::make(kSpawn, slot, 0, encode_spawn({{slot, specs_[slot]}})));
}

void HostLinks::on_frame(size_t link, Frame f) {
  Link& l = links_[link];
  if (f.kind == kHeartbeatAck && f.rank == kHostRank) {
    std::vector<int> vouched;
    try {
      vouched = decode_slots(f.data());
    } catch (const std::exception& e) {
      return lose_link(link, e.what());
    }
    for (int slot : vouched) {
      if (std::find(l.host.slots.begin(), l.host.slots.end(), slot) == l.host.slots.end())
        return lose_link(link, "it vouched for rank slot " + std::to_string(slot) +
                                   ", which is not on that host");
      if (!slots_[slot].gone) cb_.frame(slot, Frame::make(kHeartbeatAck, slot, f.seq));
    }
    return;
  }
  if (f.kind == kReplies && f.rank == kHostRank) return on_replies(l, link, f);
  if (f.kind == kHostNote && f.rank == kHostRank) {
    if (cb_.note) cb_.note(l.host.name, std::string(f.data()));
    return;
  }
  int slot = f.rank;
  if (std::find(l.host.slots.begin(), l.host.slots.end(), slot) == l.host.slots.end())
    return lose_link(link, "it sent a frame for rank slot " + std::to_string(slot) +
                               ", which is not on that host");
  Slot& s = slots_[slot];
  if (s.gone) return;
  if (f.kind == kOutput) return cb_.output(slot, static_cast<int>(f.seq), std::string(f.data()));
  if (f.kind == kExit) {
    std::pair<ExitStatus, std::string> exit;
    try {
      exit = decode_exit(f.data());
    } catch (const std::exception& e) {
      return lose_link(link, e.what());
    }
    s.gone = true;
    for (auto& [waiting, segments] : s.waiting)
      for (uint64_t id : segments) pool_.release(id);
    s.waiting.clear();
    return cb_.exited(slot, exit.first, std::move(exit.second));
  }
  if (f.kind == kDone) ++reply_frames_;
  if (f.kind == kHello && !s.said_hello) {
    s.said_hello = true;
    cb_.hello(slot);
  }
  cb_.frame(slot, std::move(f));
}

void HostLinks::on_replies(Link& l, size_t link, const Frame& f) {
  std::vector<GatheredReply> replies;
  try {
    replies = decode_replies(f.data());
  } catch (const std::exception& e) {
    return lose_link(link, e.what());
  }
  for (const auto& reply : replies)
    for (int slot : reply.slots)
      if (std::find(l.host.slots.begin(), l.host.slots.end(), slot) == l.host.slots.end())
        return lose_link(link, "it sent a reply for rank slot " + std::to_string(slot) +
                                   ", which is not on that host");
  ++reply_frames_;
  for (auto& reply : replies) {
    std::vector<int> live;
    for (int slot : reply.slots)
      if (!slots_[slot].gone) live.push_back(slot);
    if (live.empty()) continue;
    Frame done = Frame::make(kDone, live.front(), f.seq);
    done.payload = std::make_shared<const std::string>(std::move(reply.payload));
    cb_.replies(std::move(live), std::move(done));
  }
}

void HostLinks::lose_slot(int slot, const std::string& why) {
  Slot& s = slots_.at(slot);
  if (s.gone) return;
  s.gone = true;
  s.lost = true;
  for (auto& [f, segments] : s.waiting)
    for (uint64_t id : segments) pool_.release(id);
  s.waiting.clear();
  cb_.lost(slot, why);
}

void HostLinks::lose_link(size_t link, const std::string& why) {
  Link& l = links_[link];
  // A standing agent closes its link itself once its launcher is gone (end of file on its
  // stdin), before that exit reaches this loop: the launcher's end is the cause then.
  std::optional<ExitStatus> gone;
  if (l.standing && l.lease && l.conn) gone = l.lease->exit_status();
  l.conn.reset();  // closed: the agent stops its workers when it sees that
  l.shipped.clear();
  std::string cause = gone ? launcher_gone(link, *gone) : why;
  l.lost_why = cause;
  for (int slot : l.host.slots)
    lose_slot(slot, "lost the link to its host " + l.host.name + ": " + cause);
}

std::string HostLinks::launcher_gone(size_t link, const ExitStatus& status) {
  Link& l = links_[link];
  std::string why = "its launcher (" + l.host.launcher.argv.front() + ") ended with " +
                    status.describe() + " while host " + l.host.name + " was connected";
  std::string lines = launcher_tail(link);
  if (!lines.empty()) why += "; its last lines:\n" + lines;
  return why;
}

void HostLinks::on_launcher(size_t link, int stream) {
  Link& l = links_[link];
  Fd& fd = stream == RankOutput::kStdout ? l.out : l.err;
  if (!fd) return;
  char buf[8192];
  auto end = read_available(fd.get(), buf, sizeof buf, [&](std::string_view piece) {
    // Kept for the tail only (ssh's and the agent's own complaints), both streams as one.
    l.output.feed(RankOutput::kStderr, piece);
    return true;
  });
  if (end == ReadEnd::kEnded) {
    loop_.unwatch(fd.get());
    fd.reset();
  }
}

std::optional<ExitStatus> HostLinks::launcher_status(size_t link) {
  Link& l = links_[link];
  if (l.standing) return l.lease ? l.lease->exit_status() : std::nullopt;
  on_launcher(link, RankOutput::kStdout);
  on_launcher(link, RankOutput::kStderr);
  auto status = supervisor_.poll(l.child);
  if (status) loop_.unwatch(supervisor_.child(l.child).pidfd());
  return status;
}

std::string HostLinks::launcher_tail(size_t link) {
  Link& l = links_[link];
  if (l.standing) return l.lease ? l.lease->tail() : std::string();
  std::string tail = l.output.flush(RankOutput::kStderr, true);
  std::string lines = l.output.stderr_tail();
  if (!tail.empty()) lines += (lines.empty() ? "" : "\n") + tail;
  return lines;
}

bool HostLinks::host_done(const Link& l) const {
  return std::all_of(l.host.slots.begin(), l.host.slots.end(),
                     [this](int slot) { return slots_.at(slot).gone; });
}

void HostLinks::return_lease(Link& l) {
  if (!l.lease) return;
  // Reused only where the group ended cleanly: every worker's exit reported over a link that
  // held. Anything else (a lost link, a worker never heard of) and the agent is let go.
  bool clean = l.ever_connected && !l.launcher_exited &&
               std::all_of(l.host.slots.begin(), l.host.slots.end(), [this](int slot) {
                 const Slot& s = slots_.at(slot);
                 return s.gone && !s.lost;
               });
  if (!clean) l.lease->retire();
  l.lease.reset();
}

void HostLinks::on_launcher_exit(size_t link) {
  Link& l = links_[link];
  if (l.launcher_exited) return;
  auto status = launcher_status(link);
  if (!status) return;  // woken early; the pidfd stays watched
  if (relaunch(link)) return;
  l.launcher_exited = true;
  if (l.ever_connected) {
    if (!l.conn) {
      auto closing = launcher_grace_.find(link);
      if (closing == launcher_grace_.end())
        return;  // the link ended first and spoke for its workers
      // The agent closed its link as its launcher went (above): the launcher's end is the cause.
      loop_.cancel(closing->second);
      launcher_grace_.erase(closing);
      std::string why = launcher_gone(link, *status);
      l.lost_why = why;
      for (int slot : l.host.slots)
        lose_slot(slot, "lost the link to its host " + l.host.name + ": " + why);
      return;
    }
    // The host's agent lives no longer than its launcher: unless the link ends by itself within
    // the grace (the agent's last frames), it is closed, so the agent stops its workers there.
    std::string why = launcher_gone(link, *status);
    launcher_grace_[link] = loop_.after(kLauncherGrace, [this, link, why] {
      launcher_grace_.erase(link);
      if (links_[link].conn) lose_link(link, why);
    });
    return;
  }
  std::string lines = launcher_tail(link);
  std::string why = "its launcher (" + l.host.launcher.argv.front() + ") ended with " +
                    status->describe() + " before host " + l.host.name + " connected";
  if (made_room_ > 0)
    why += " (meanwhile the kernel's listener closed " + std::to_string(made_room_) +
           " unauthenticated connection(s): " + made_room_why_ + ")";
  if (!lines.empty()) why += "; its last lines:\n" + lines;
  l.lost_why = why;
  for (int slot : l.host.slots) lose_slot(slot, why);
}

bool HostLinks::launchers_exited() const {
  // A standing agent stays; it is done with this group once every worker there is gone.
  return std::all_of(links_.begin(), links_.end(), [this](auto& l) {
    return l.launcher_exited || (l.standing && (!l.lease || (!l.lease->retired() && host_done(l))));
  });
}

void HostLinks::signal_launchers(int sig) {
  // A launcher normally leaves with its agent; one still there after the grace is stopped. A
  // standing agent whose workers are not all gone is let go instead: its stdin is closed, and
  // it stops them and exits (SIGKILL after the keeper's grace).
  for (auto& l : links_) try {
      if (l.launcher_exited) continue;
      if (l.standing && l.lease && !host_done(l)) l.lease->retire();
      if (!l.standing) supervisor_.signal(l.child, sig);
    } catch (const std::exception&) {
    }
}

void HostLinks::close() {
  // The port is freed now, not when the last reference to a closed group is dropped (a
  // traceback's frame may hold it until the garbage collector runs).
  if (accept_timer_) loop_.cancel(accept_timer_);
  accept_timer_ = 0;
  if (tcp_) {
    loop_.unwatch(tcp_->fd());
    tcp_->close();
  }
  for (auto& [link, timer] : launcher_grace_) loop_.cancel(timer);
  launcher_grace_.clear();
  flush_rejection_log("before the group closed");
  for (auto& l : links_) return_lease(l);
  for (auto& l : links_) l.conn.reset();
  for (auto& [id, h] : handshakes_) loop_.unwatch(h.fd.get());
  handshakes_.clear();
}

}  // namespace ddip
