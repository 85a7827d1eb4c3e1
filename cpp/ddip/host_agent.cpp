#include "ddip/host_agent.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "ddip/auth.hpp"
#include "ddip/channel.hpp"
#include "ddip/connection.hpp"
#include "ddip/coordinator.hpp"
#include "ddip/event_loop.hpp"
#include "ddip/plan.hpp"
#include "ddip/rank_template.hpp"
#include "ddip/tcp.hpp"

extern char** environ;

namespace ddip {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

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

// What a failed or stopped rank template says about why (rank/template.py's JSON "reason", else
// the text itself), on one line.
std::string template_reason(const std::string& detail) {
  std::string text = detail;
  auto j = nlohmann::json::parse(detail, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("reason") && j["reason"].is_string())
    text = j["reason"].get<std::string>();
  auto first = text.find_first_not_of(" \t\r\n"), last = text.find_last_not_of(" \t\r\n");
  text = first == std::string::npos ? "it gave no reason" : text.substr(first, last - first + 1);
  for (auto nl = text.find('\n'); nl != std::string::npos; nl = text.find('\n', nl + 3))
    text.replace(nl, 1, " | ");
  return text;
}

}  // namespace
}  // namespace detail

std::string unforkable(const SpawnSpec& tmpl, const SpawnSpec& rank) {
  const std::string& python = tmpl.argv.empty() ? std::string() : tmpl.argv.front();
  if (rank.argv.size() < 3 || rank.argv[0] != python || rank.argv[1] != "-c")
    return "ranks run " + (rank.argv.empty() ? std::string("nothing") : rank.argv[0]) + ", not `" +
           python + " -c ...`";
  // Python reads these once at start-up; the ranks get PYTHONUNBUFFERED=1 either way.
  auto startup = [](const std::vector<std::string>& env) {
    std::map<std::string, std::string> vars;
    for (const auto& kv : env)
      if (kv.starts_with("PYTHON") && !kv.starts_with("PYTHONUNBUFFERED="))
        if (auto eq = kv.find('='); eq != std::string::npos)
          vars.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    return vars;
  };
  auto ours = startup(tmpl.env), theirs = startup(rank.env);
  for (const auto* side : {&ours, &theirs})
    for (const auto& [k, v] : *side) {
      auto a = ours.find(k), b = theirs.find(k);
      if (a == ours.end() || b == theirs.end() || a->second != b->second)
        return "the ranks' " + k + " differs from the rank template's, and Python reads it only " +
               "at start-up";
    }
  return "";
}

HostAgent::HostAgent(AgentOptions options) : options_(std::move(options)) {}

HostAgent::~HostAgent() = default;

void HostAgent::note(std::string text) {
  // On stderr too: the kernel keeps the tail of its launcher's output, which explains an agent
  // that failed.
  std::fprintf(stderr, "ddip host agent: %s\n", text.c_str());
  notes_.push_back(std::move(text));
}

// Every way to cold ranks but the kernel's choice (ticket warm 0), the host's (DDIP_PREWARM=0: no
// template spec) and a template still importing that the group does not wait for is a note, in
// the words of the kernel's own template (python/ddip/kernel/template.py).
RankTemplate* HostAgent::warm_template(const std::vector<SpawnSpec>& workers, bool may_wait) {
  if (options_.ticket.warm == 0) return nullptr;
  if (!template_unstartable_.empty()) {
    note("ranks start cold: the rank template could not start: " + template_unstartable_);
    return nullptr;
  }
  if (!template_ || !template_spec_) return nullptr;
  for (const auto& w : workers)
    if (std::string why = unforkable(*template_spec_, w); !why.empty()) {
      note("ranks start cold: " + why);
      return nullptr;
    }
  auto st = template_->status();
  if (st.state == RankTemplate::State::kDead) {
    // Killed or crashed since the last group: a new one, as the kernel replaces its own.
    note("the rank template had stopped (" + detail::template_reason(st.detail) +
         "); started a new one");
    try {
      template_->start(*template_spec_);
    } catch (const std::exception& e) {
      note(std::string("ranks start cold: the rank template could not start: ") + e.what());
      return nullptr;
    }
    st = template_->status();
  }
  // One template importing torch costs the cores less than each rank importing it cold.
  if (st.state == RankTemplate::State::kStarting && options_.ticket.warm == 2 && may_wait)
    st = template_->wait_ready(options_.template_wait);
  if (st.state == RankTemplate::State::kReady) return template_.get();
  if (st.state == RankTemplate::State::kStarting && options_.ticket.warm == 2 && may_wait)
    note("ranks start cold: the rank template is still importing " + preloads() + "after " +
         std::to_string(options_.template_wait.count() / 1000) + " s");
  else if (st.state != RankTemplate::State::kStarting)
    note("ranks start cold: the rank template failed: " + detail::template_reason(st.detail));
  return nullptr;
}

void HostAgent::after_forks(RankTemplate* tmpl, uint64_t refusals_before) {
  if (!tmpl || tmpl->refusals() == refusals_before) return;
  // The first refusal is the cause; later ones only say the template was gone by then.
  auto st = tmpl->status();
  bool ended = st.state == RankTemplate::State::kDead || st.state == RankTemplate::State::kFailed;
  note("some ranks started cold: " +
       (ended ? detail::template_reason(st.detail) : tmpl->last_error()));
}

// What the template was asked to preload ("torch, torch._dynamo "), or "".
std::string HostAgent::preloads() const {
  const std::string var = "DDIP_TEMPLATE_MODULES=";
  std::string out;
  for (const auto& kv : template_spec_->env)
    if (kv.starts_with(var))
      for (size_t at = var.size(); at < kv.size();) {
        size_t comma = std::min(kv.find(',', at), kv.size());
        if (comma > at) out += (out.empty() ? "" : ", ") + kv.substr(at, comma - at);
        at = comma + 1;
      }
  return out.empty() ? out : out + " ";
}

int HostAgent::serve(int input, std::optional<SpawnSpec> template_spec) {
  template_spec_ = std::move(template_spec);
  int rc = 0;
  while (true) {
    std::string line;
    while (true) {
      if (auto nl = input_.find('\n'); nl != std::string::npos) {
        line = input_.substr(0, nl);
        input_.erase(0, nl + 1);
        break;
      }
      pollfd p{input, POLLIN, 0};
      int idle_ms = static_cast<int>(options_.idle_timeout.count());
      int ready = ::poll(&p, 1, idle_ms);
      if (ready < 0 && errno != EINTR) throw_errno("poll", "waiting for a ticket");
      if (ready == 0) {
        why_ = "nothing from the kernel for " + std::to_string(idle_ms) +
               " ms while no group ran: it is gone, or this host is cut off from it";
        return 1;
      }
      char buf[4096];
      ssize_t n = ::read(input, buf, sizeof buf);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n > 0) {
        input_.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (input_.empty()) return rc;  // end of file: the kernel died, or let this host go
      line = std::move(input_);
      input_.clear();
      break;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    options_.ticket = LinkTicket::decode(line);
    if (!options_.ticket.standing) {
      // One group: the key is in memory now, and stdin is left to nothing.
      Fd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      if (null) ::dup2(null.get(), input);
      return run();
    }
    if (lifeline_ < 0) {
      lifeline_ = input;  // watched during each group: its end of file ends everything
      ::fcntl(input, F_SETFL, ::fcntl(input, F_GETFL) | O_NONBLOCK);
    }
    if (options_.ticket.warm && template_spec_ && !template_) {
      // Imports while the link comes up; kept for every later group on this host.
      template_ = std::make_unique<RankTemplate>();
      try {
        template_->start(*template_spec_);
      } catch (const std::exception& e) {
        template_unstartable_ = e.what();  // said to each group that wants warm ranks
        template_spec_.reset();
      }
    }
    why_.clear();
    clean_ = false;
    rc = run();  // throws when it can't connect or authenticate
    if (let_go_) return 0;
    if (!clean_) return rc ? rc : 1;  // a group that did not end cleanly: this agent is done
  }
}

namespace {

// One connect and handshake; std::runtime_error saying why it failed, with what the kernel's
// listener said when it refused the connection (too many strangers holding the port busy).
Channel handshake_once(const LinkTicket& t, detail::Clock::time_point deadline,
                       std::chrono::milliseconds user_timeout) {
  auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::Clock::now());
  Fd sock = connect_tcp(t.address, t.port, std::max(left, std::chrono::milliseconds(1)));
  // Each read: a refusal in place of what was expected is the listener's word on why.
  auto read = [&](size_t n) {
    std::string got = read_upto(sock.get(), n, deadline);
    if (std::string why = refusal_in(got); !why.empty()) {
      // The rest of its line, which ends with the connection.
      try {
        got += read_upto(sock.get(), 512,
                         std::min(deadline, detail::Clock::now() + std::chrono::seconds(1)));
      } catch (const std::exception&) {
      }
      throw std::runtime_error(refusal_in(got));
    }
    if (got.size() < n)
      throw std::runtime_error("the kernel closed the connection after " +
                               std::to_string(got.size()) + " of " + std::to_string(n) +
                               " bytes of the handshake");
    return got;
  };
  HostHandshake hs(t.key, t.host);
  write_all(sock.get(), hs.respond(read(KernelHandshake::kChallengeBytes)), deadline);
  // Throws AuthError when whoever answered does not know the key: not our kernel.
  LinkKeys keys = hs.verify(read(KernelHandshake::kProofBytes));
  if (user_timeout.count() > 0) try {
      set_user_timeout(sock.get(), user_timeout);  // a cut link ends, as the kernel's end does
    } catch (const std::system_error&) {
    }
  Channel channel(std::move(sock));
  channel.seal(std::move(keys));
  return channel;
}

}  // namespace

// The agent's link to the kernel, authenticated. Strangers may hold the kernel's port busy (its
// listener then closes the oldest handshakes, maybe ours): tried again with a growing pause
// until `connect_timeout`; throws with the last cause (and the listener's refusal, if any).
// Only a kernel that does not know the key (AuthError) is not tried again: it never will.
Channel connect_to_kernel(const LinkTicket& t, std::chrono::milliseconds connect_timeout,
                          std::chrono::milliseconds user_timeout) {
  using detail::Clock;
  auto deadline = Clock::now() + connect_timeout;
  auto pause = std::chrono::milliseconds(50);
  std::string last, refused;
  int tries = 0;
  while (true) {
    ++tries;
    try {
      return handshake_once(t, deadline, user_timeout);
    } catch (const AuthError&) {
      throw;
    } catch (const std::exception& e) {
      last = e.what();
      if (last.starts_with("the kernel's listener refused")) refused = last;
    }
    auto now = Clock::now();
    if (now + pause >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(2000));
  }
  std::string why = "could not connect to the kernel at " + t.address + ":" +
                    std::to_string(t.port) + " within " + std::to_string(connect_timeout.count()) +
                    " ms (" + std::to_string(tries) + " tries): " + last;
  if (!refused.empty() && refused != last) why += "; earlier, " + refused;
  throw std::runtime_error(why);
}

// One group on this host: the authenticated link to the kernel, this host's workers (a
// Coordinator of its own) and the frames relayed between them, on one thread and one event loop;
// the workers' events reach it from the Coordinator's IO thread as a posted command. One method
// per event; run() turns the loop until the workers or the link are gone.
class HostAgent::Relay {
 public:
  Relay(HostAgent& agent, Channel channel);
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;
  // 0 when the kernel ended the group, 1 when the link failed or the workers never started.
  int run();

 private:
  using Clock = detail::Clock;
  HostAgent& agent_;
  const AgentOptions& options_;
  // Declared before what watches fds on it: those go first.
  EventLoop loop_{"the host agent has stopped"};
  std::unique_ptr<Connection> link_;
  std::optional<Coordinator> coord_;
  std::vector<int> global_;   // local worker index -> the kernel's slot
  std::map<int, int> local_;  // the kernel's slot -> local worker index
  // Where the link receives buffers, and the workers' Coordinator keeps them (keep_segment).
  // Before coord_: it outlives it.
  SegmentPool pool_;
  ReplyGather gather_{options_.ticket.reply_window_ms > 0
                          ? std::chrono::milliseconds(options_.ticket.reply_window_ms)
                          : ReplyGather::kWindow};
  EventLoop::TimerId gather_timer_ = 0;
  // What the workers' IO thread reads to wake this one for a gathered request's first reply and
  // its last, not for each (on_event): that request's seq, how many of its replies are still to
  // be queued, and whether this thread was woken for it already and holds its replies (their
  // window's timer wakes it, if the last is late). At 8 ranks a host, 3 wakes a request, not 9.
  std::atomic<uint64_t> gather_seq_{0};
  std::atomic<long> gather_left_{0};
  std::atomic<bool> quiet_{false};
  std::vector<bool> exited_;
  size_t alive_ = 0;
  bool link_lost_ = false, failed_ = false, kernel_closed_ = false;
  bool workers_broken_ = false;  // the workers' Coordinator failed: they are all gone
  Clock::time_point last_frame_ = Clock::now();

  void lose(std::string why);
  void send(Frame f);
  void send_notes();  // what the agent said since (HostAgent::note), for the kernel to show
  // The kernel's side.
  void on_frame(Frame f);
  void start_workers(const Frame& f);
  void start_again(const Frame& f);
  SpawnSpec on_this_host(SpawnSpec spec) const;
  bool serving() const;
  void ack_host_heartbeat(const Frame& f);
  void keep_segment(Frame& f);
  std::string refer(Frame& f, std::vector<uint64_t>& segments);
  void to_worker(int l, Frame f, const std::vector<uint64_t>& segments);
  void fan_out(Frame f, const std::vector<uint64_t>& segments);
  // Gathered replies that are due (`all`: every one held), and the timer for the next.
  void send_replies(bool all = false);
  void before_worker(int slot);  // its held reply goes before anything else of the worker's
  bool vouched(int l) const;
  void on_link_end(Connection::End how, const std::string& why);
  void watch_kernel();
  // The workers' side, and the agent's stdin.
  void on_worker_events();
  void on_worker_event(Event& e);
  void on_lifeline();
};

HostAgent::Relay::Relay(HostAgent& agent, Channel channel)
    : agent_(agent), options_(agent.options_) {
  link_ = std::make_unique<Connection>(
      loop_, std::move(channel), [this](Frame f) { on_frame(std::move(f)); },
      [this](Connection::End how, const std::string& why) { on_link_end(how, why); });
  link_->channel().receive_buffers_from([this](size_t n) { return pool_.take_buffer(n); });
  loop_.at(last_frame_ + options_.kernel_timeout, [this] { watch_kernel(); });
  if (agent_.lifeline_ >= 0)
    loop_.try_watch(agent_.lifeline_, EPOLLIN, [this](uint32_t) { on_lifeline(); });
}

// A standing agent serves its link until the kernel closes it, even with every worker dead:
// the kernel may start one again (a heal). A one-shot one is done when its workers are.
bool HostAgent::Relay::serving() const {
  if (link_lost_ || failed_ || workers_broken_) return false;
  return !coord_ || alive_ > 0 || options_.ticket.standing;
}

int HostAgent::Relay::run() {
  while (serving()) loop_.run_once();
  // What is still queued for the kernel (replies held, the last exits) is written before the
  // link closes.
  send_replies(true);
  auto flush_until = Clock::now() + options_.kernel_timeout;
  while (!link_lost_ && link_->channel().wants_write() && Clock::now() < flush_until)
    loop_.run_once(flush_until);
  agent_.clean_ = alive_ == 0 && (!link_lost_ || kernel_closed_) && !agent_.let_go_;
  if (!coord_) return 1;
  // Gone with the link: every worker's process group, at once.
  coord_->close(link_lost_ ? std::chrono::milliseconds(0) : std::chrono::milliseconds(2000));
  coord_.reset();
  loop_.close();
  loop_.discard();
  link_.reset();
  return (link_lost_ && alive_ > 0) || failed_ ? 1 : 0;  // failed: the workers never started
}

void HostAgent::Relay::lose(std::string why) {
  if (agent_.why_.empty()) agent_.why_ = std::move(why);
  link_lost_ = true;
}

void HostAgent::Relay::send(Frame f) {
  if (link_) link_->send(std::move(f));  // a failure ends the link (on_link_end)
}

void HostAgent::Relay::send_notes() {
  for (auto& text : agent_.notes_) send(Frame::make(kHostNote, kHostRank, 0, std::move(text)));
  agent_.notes_.clear();
}

void HostAgent::Relay::on_frame(Frame f) {
  last_frame_ = Clock::now();
  if (!coord_) {
    if (failed_) return;
    if (f.kind != kSpawn) return lose("the kernel's first frame was not the list of workers");
    return start_workers(f);
  }
  if (f.kind == kSegment) return keep_segment(f);
  if (f.kind == kForget) return pool_.release(f.seq);  // the kernel's reference
  std::vector<uint64_t> segments;
  if (std::string bad = refer(f, segments); !bad.empty()) return lose(bad);
  if (f.kind == kHeartbeat && f.rank == kHostRank) return ack_host_heartbeat(f);
  if (f.kind == kSpawn) return start_again(f);
  if (f.kind == kFanOut) return fan_out(std::move(f), segments);
  auto it = local_.find(f.rank);
  if (it == local_.end()) return;  // not one of ours: nothing to do with it
  to_worker(it->second, std::move(f), segments);
}

// A buffer the kernel sends once per host (kSegment), for the frames that name it (refs): kept in
// the workers' Coordinator's pool under the kernel's id, which the workers' releases name. It
// returns to that pool once the kernel forgot it (kForget) and every worker that got it released
// it or exited; the link receives the next buffer into it (receive_buffers_from). So a push
// after the first reuses this host's pages: no rank frees 8 MiB of them as it lets go of a
// copy, and the agent allocates none.
void HostAgent::Relay::keep_segment(Frame& f) {
  if (!f.fds || f.fds->size() != 1 || !(*f.fds)[0])
    return lose("the kernel sent a segment without its buffer");
  try {
    pool_.adopt(f.seq, std::move((*f.fds)[0]), f.fd_bytes.empty() ? 0 : f.fd_bytes[0]);
  } catch (const std::exception& e) {
    lose(std::string("could not keep a segment for the workers: ") + e.what());
  }
}

// The segments a frame names in place of its fds, taken out of it; or why the frame can't be
// right (the link is then not to be trusted).
std::string HostAgent::Relay::refer(Frame& f, std::vector<uint64_t>& segments) {
  if (f.refs.empty()) return {};
  for (uint64_t id : f.refs)
    if (id == 0 || !pool_.contains(id))
      return "the kernel referred to segment " + std::to_string(id) + ", which it never sent";
  segments = std::move(f.refs);
  f.refs.clear();
  f.fds.reset();
  f.fd_bytes.clear();
  return {};
}

// A worker's spec from the kernel, as it runs here.
SpawnSpec HostAgent::Relay::on_this_host(SpawnSpec spec) const {
  spec.env = detail::merged_environment(spec.env);
  plan::add_thread_default(spec.env);  // this host's cores: the kernel can't count them
  // The notebook's directory, where this host shares it; else the agent's own (the home).
  if (!spec.cwd.empty() && ::access(spec.cwd.c_str(), X_OK) != 0) spec.cwd.clear();
  return spec;
}

void HostAgent::Relay::start_workers(const Frame& f) {
  auto spawn = decode_spawn(f.data());
  CoordinatorOptions co;
  for (auto& [slot, spec] : spawn) {
    local_[slot] = static_cast<int>(co.workers.size());
    global_.push_back(slot);
    co.workers.push_back(on_this_host(std::move(spec)));
  }
  RankTemplate* tmpl = agent_.warm_template(co.workers);
  uint64_t refusals = tmpl ? tmpl->refusals() : 0;
  co.rank_template = tmpl;
  // Ahead of every worker's frames: the kernel has them once the workers are up.
  send_notes();
  last_frame_ = Clock::now();  // a wait for the template is no silence of the kernel's
  co.heartbeat_timeout = std::chrono::milliseconds(0);  // the kernel judges, from our acks
  co.pool = &pool_;
  co.on_event = [this](const Pushed& p) {
    if (p.plain_reply && p.seq == gather_seq_.load()) {
      long left =
          gather_left_.fetch_sub(static_cast<long>(p.replies)) - static_cast<long>(p.replies);
      if (left > 0 && quiet_.exchange(true)) return;  // taken with the last, or at the window's end
    }
    try {
      loop_.post([this] { on_worker_events(); });
    } catch (const std::runtime_error&) {
      // The agent is ending; its workers are being stopped.
    }
  };
  exited_.assign(global_.size(), false);
  alive_ = global_.size();
  try {
    coord_.emplace(std::move(co));
  } catch (const std::exception& e) {
    // Nothing was left running; every worker of this host is reported with why.
    for (int slot : global_)
      send(Frame::make(kExit, slot, 0,
                       encode_exit(ExitStatus{127, 0, false},
                                   std::string("could not start the worker: ") + e.what())));
    alive_ = 0;
    failed_ = true;
    if (agent_.why_.empty()) agent_.why_ = e.what();
  }
  agent_.after_forks(tmpl, refusals);
  send_notes();
}

// A later kSpawn: workers of this host that exited, started again in their slots, forked from
// the host's template when it is ready (never waited for: the link would go unserved). One that
// can't be started is reported exited, with why; a slot that is not an exited worker of this
// host is a kernel that can't be trusted.
void HostAgent::Relay::start_again(const Frame& f) {
  std::vector<std::pair<int, SpawnSpec>> spawn;
  try {
    spawn = decode_spawn(f.data());
  } catch (const std::exception& e) {
    return lose(std::string("the kernel's request to start workers again: ") + e.what());
  }
  for (auto& [slot, spec] : spawn) {
    auto it = local_.find(slot);
    if (it == local_.end() || !exited_[it->second])
      return lose("the kernel asked to start rank slot " + std::to_string(slot) +
                  " again, which is not an exited worker of this host");
    int l = it->second;
    SpawnSpec here = on_this_host(std::move(spec));
    RankTemplate* tmpl = agent_.warm_template({here}, false);
    uint64_t refusals = tmpl ? tmpl->refusals() : 0;
    try {
      coord_->respawn(l, std::move(here), tmpl);
      agent_.after_forks(tmpl, refusals);
      send_notes();
    } catch (const std::exception& e) {
      send_notes();
      send(Frame::make(kExit, slot, 0,
                       encode_exit(ExitStatus{127, 0, false},
                                   std::string("could not start the worker again: ") + e.what())));
      continue;
    }
    exited_[l] = false;
    ++alive_;
  }
}

// Vouch for a worker only while it answers its own heartbeats here.
bool HostAgent::Relay::vouched(int l) const {
  long long age = coord_->heartbeat_age_ms(l);
  return age >= 0 && age <= options_.worker_stale.count();
}

// One ack for the host: the workers that answer their own heartbeats here.
void HostAgent::Relay::ack_host_heartbeat(const Frame& f) {
  std::vector<int> fresh;
  for (auto [slot, l] : local_)
    if (vouched(l)) fresh.push_back(slot);
  send(Frame::make(kHeartbeatAck, kHostRank, f.seq, encode_slots(fresh)));
}

void HostAgent::Relay::to_worker(int l, Frame f, const std::vector<uint64_t>& segments) {
  try {
    if (f.kind == kHeartbeat) {
      if (vouched(l)) send(Frame::make(kHeartbeatAck, f.rank, f.seq));
    } else if (f.kind == kSignal) {
      auto [sig, whole] = decode_signal(f.data());
      coord_->signal(l, sig, whole);
    } else if (f.kind != kSpawn) {
      coord_->send(l, std::move(f), segments);
    }
  } catch (const std::exception&) {
    // The worker is gone (its exit is on its way to the kernel) or the group is stopping.
  }
}

// One frame for several workers here: written to each (one command to the workers' IO thread,
// the payload and the buffers shared); a request's replies are gathered (ReplyGather).
void HostAgent::Relay::fan_out(Frame f, const std::vector<uint64_t>& segments) {
  FanOut out;
  try {
    out = decode_fan_out(f.data());
  } catch (const std::exception& e) {
    return lose(std::string("the kernel's frame for several workers: ") + e.what());
  }
  if (out.kind == kHeartbeat || out.kind == kSignal || out.kind == kSpawn || out.kind == kFanOut)
    return lose("the kernel fanned out a frame of kind " + std::to_string(out.kind) +
                ", which goes to one worker or the host only");
  std::vector<int> locals, replying;
  for (int slot : out.slots) {
    auto it = local_.find(slot);
    if (it == local_.end()) continue;  // not one of ours: nothing to do with it
    if (exited_[it->second]) continue;
    locals.push_back(it->second);
    replying.push_back(slot);
  }
  if (locals.empty()) return;
  Frame inner = Frame::make(out.kind, 0, f.seq);
  inner.payload = std::make_shared<const std::string>(std::move(out.payload));
  inner.fds = std::move(f.fds);
  if (out.kind == kRequest && replying.size() > 1) {
    gather_.expect(f.seq, replying);
    gather_left_ = static_cast<long>(replying.size());  // before the seq: see on_event
    gather_seq_ = f.seq;
  }
  try {
    coord_->send(locals, std::move(inner), segments);
  } catch (const std::exception&) {
    // The group is stopping: its workers' exits are on their way to the kernel.
  }
}

void HostAgent::Relay::send_replies(bool all) {
  for (Frame& f : gather_.take(Clock::now(), all)) send(std::move(f));
  if (gather_timer_) {
    loop_.cancel(gather_timer_);
    gather_timer_ = 0;
  }
  if (auto due = gather_.next_due())
    gather_timer_ = loop_.at(*due, [this] {
      gather_timer_ = 0;
      on_worker_events();  // with the replies that woke no one (on_event)
    });
}

void HostAgent::Relay::before_worker(int slot) {
  if (gather_.holds(slot)) send_replies(true);
}

void HostAgent::Relay::on_link_end(Connection::End how, const std::string& why) {
  kernel_closed_ = how == Connection::End::kClosed;
  if (how == Connection::End::kClosed)
    lose("the kernel closed the connection");
  else if (how == Connection::End::kFailed && why.starts_with("could not write"))
    lose("could not write to the kernel");
  else
    lose("the link failed: " + why);
}

void HostAgent::Relay::watch_kernel() {
  auto silent_until = last_frame_ + options_.kernel_timeout;
  if (Clock::now() < silent_until) {
    loop_.at(silent_until, [this] { watch_kernel(); });
    return;
  }
  lose("no frame from the kernel for " + std::to_string(options_.kernel_timeout.count()) + " ms");
}

void HostAgent::Relay::on_worker_events() {
  while (true) {
    while (coord_ && alive_ > 0) {
      auto e = coord_->next_event(std::chrono::milliseconds(0));
      if (!e) break;
      on_worker_event(*e);
    }
    send_replies();  // those that this batch of events completed
    // Holding replies, this thread is woken by their window's timer, or the last of them. Else
    // the next reply wakes it: one queued before quiet_ was cleared woke no one, and is taken now.
    if (gather_.next_due() || !coord_ || alive_ == 0) return;
    quiet_ = false;
    auto e = coord_->next_event(std::chrono::milliseconds(0));
    if (!e) return;
    on_worker_event(*e);
  }
}

void HostAgent::Relay::on_worker_event(Event& e) {
  int slot = e.slot >= 0 ? global_[e.slot] : -1;
  switch (e.kind) {
    case Event::kOutput:
      before_worker(slot);
      send(Frame::make(kOutput, slot, static_cast<uint64_t>(e.stream), std::move(e.text)));
      break;
    case Event::kFrame:
    case Event::kTruncated:
      // A reply with buffers goes by itself, with its fds (a frame carries at most 16).
      if (e.kind == Event::kFrame && e.frame.kind == kDone &&
          (!e.frame.fds || e.frame.fds->empty()) &&
          gather_.add(slot, e.frame.seq, e.frame.payload, Clock::now()))
        break;
      before_worker(slot);
      e.frame.rank = slot;
      send(std::move(e.frame));
      break;
    case Event::kExited:
      exited_[e.slot] = true;
      --alive_;
      before_worker(slot);
      gather_.gone(slot);
      send(Frame::make(kExit, slot, 0, encode_exit(e.status, e.text)));
      break;
    case Event::kFailed:
      send_replies(true);
      for (size_t i = 0; i < global_.size(); ++i)
        if (!exited_[i])
          send(Frame::make(kExit, global_[i], 0, encode_exit(ExitStatus{0, 0, true}, e.text)));
      alive_ = 0;
      workers_broken_ = true;  // none can be started again either
      break;
    default:
      break;  // connections and heartbeats of our own workers are ours to judge
  }
}

void HostAgent::Relay::on_lifeline() {
  char buf[4096];
  auto end = read_available(agent_.lifeline_, buf, sizeof buf, [this](std::string_view piece) {
    agent_.input_.append(piece);  // the next ticket, early: kept for serve()
    return true;
  });
  if (end != ReadEnd::kEnded) return;
  loop_.unwatch(agent_.lifeline_);
  agent_.let_go_ = true;
  lose("the kernel let this host go (end of file on the agent's stdin)");
}

int HostAgent::run() {
  if (options_.ticket.timeout_ms > 0)
    options_.kernel_timeout = std::chrono::milliseconds(options_.ticket.timeout_ms);
  Channel channel = connect_to_kernel(
      options_.ticket, options_.connect_timeout,
      options_.ticket.timeout_ms > 0 ? options_.kernel_timeout : std::chrono::milliseconds(0));
  Relay relay(*this, std::move(channel));
  return relay.run();
}

}  // namespace ddip
