// `ddip run`: a torchrun-compatible launcher. One thread, one epoll set over every rank's
// stdout/stderr pipes and pidfd, a signalfd, and deadlines; no Python anywhere, so a launch costs
// what starting the ranks costs.
//
// main reads the command line, has the launch planned as data (run_plan) and runs it. The
// Launcher here wires the launcher's units together: the event loop (run_loop), the ranks' output
// (run_output), the channel to other hosts' ddip runs (run_channel, speaking run_protocol), the
// failure policy (run_policy), the ranks' debugger prompts (run_prompts), where the ranks are
// when it times out or is interrupted (run_collectives) and the report (run_report).
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "ddip/fd.hpp"
#include "ddip/supervisor.hpp"
#include "run_args.hpp"
#include "run_channel.hpp"
#include "run_collectives.hpp"
#include "run_elastic.hpp"
#include "run_join.hpp"
#include "run_loop.hpp"
#include "run_output.hpp"
#include "run_plan.hpp"
#include "run_policy.hpp"
#include "run_prompts.hpp"
#include "run_protocol.hpp"
#include "run_report.hpp"
#include "run_ship.hpp"

namespace ddip::run {
namespace {

// SIGTERM to SIGKILL when stopping ranks, as torch elastic and tini do; long enough for a rank
// to leave a collective and flush its logs.
constexpr milliseconds kGrace{5000};
// After the last rank has exited, how long its pipes may stay open: a descendant that left the
// rank's process group can hold them forever.
constexpr milliseconds kDrain{1000};

// A rank's command could not be started (not found, not executable): the shell's 127 / 126.
struct CannotStart : std::system_error {
  using std::system_error::system_error;
  int exit_code() const { return code().value() == ENOENT ? 127 : 126; }
};

// How this ddip run is linked to the other nodes of a job that formed from one ddip run per
// node (run_join.hpp): the job's host has every other node's link, each a unit after its own
// ranks; another node has its link to the host, its control channel.
struct Joined {
  std::vector<JobHost::Node>* nodes = nullptr;
  JoinLink* host = nullptr;
};

// Starts every unit, hands their output to LabelledStreams, their exits, the signals and the
// control channel's messages to the FailurePolicy, and carries out its decisions (the Crew).
class Launcher final : Crew {
 public:
  // `node`: this ddip run was started on its host by another one (--node); its stdin is then
  // that one's control channel. `errors`: where the ranks here write their error files.
  // `error_file`: this ddip run's own TORCHELASTIC_ERROR_FILE ("" when unset), which gets the
  // root cause's error file at the end, as torchrun's does.
  Launcher(RunOptions opts, std::vector<UnitPlan> plans, std::optional<NodeOptions> node,
           const ErrorFiles& errors, std::string error_file, Joined joined = {});

  // Runs the ranks to the end; returns the launcher's exit code.
  int run();
  const Outcome& outcome() const { return policy_.outcome(); }
  const std::vector<UnitEnd>& ends() const { return ends_; }
  // The job's host: the nodes that vanished during the attempt (indices into Joined::nodes).
  const std::vector<size_t>& vanished() const { return vanished_; }

 private:
  // Crew: the policy's decisions, done.
  void terminate() override;
  void kill() override;
  void forward(int sig) override;
  void report_upstream(const RootCause& cause) override;
  void collect() override;

  void start_units();
  // Rank unit `u` is about to get `sig` to stop it: it counts as stopped, as it stands now.
  void stopping(size_t u, int sig);
  void pass_on_error_file() const;
  void on_exit(size_t u);
  // A joined node (unit `u`) has said it is done, or its link is gone (`why`).
  void on_node_done(size_t u);
  void on_node_gone(size_t u, std::string why);
  bool joined_node(size_t u) const { return u >= first_node_; }
  void on_signal();
  void on_control(const protocol::Control& message);
  void on_record(size_t u, std::string_view line);
  void on_prompt(size_t u, protocol::Prompt prompt);
  // Every rank here is sent SIGURG if it answers it; from the top, every host is sent Collect.
  // A rank that can't answer is said so at once (here, or upstream from another host).
  void ask_states();
  void on_state(size_t u, protocol::RankState state);
  // The ranks' answers are in, or the wait is over: the picture is shown, and the policy goes on.
  void show_states();
  // The line typed at rank `rank`'s prompt (nullopt: nobody can answer), to it: through its
  // stdin here, or through the control channel of its host (unit `u`).
  void answer(size_t u, int rank, std::optional<std::string> line);
  int finish();
  bool all_exited() const {
    return std::all_of(ends_.begin(), ends_.end(),
                       [](const UnitEnd& e) { return e.status.has_value(); });
  }
  std::string me() const {
    return node_ && !joined_.host ? "ddip run on " + node_->name : std::string("ddip run");
  }

  RunOptions opts_;
  std::optional<NodeOptions> node_;
  Joined joined_;
  size_t first_node_;  // the first joined node's unit (the job's host); past the end without
  std::vector<size_t> vanished_;
  const ErrorFiles& errors_;
  std::string error_file_;
  milliseconds link_timeout_;
  std::vector<UnitPlan> plans_;
  std::vector<UnitEnd> ends_;  // per unit, as the Supervisor numbers them
  Supervisor sup_;
  RunLoop loop_;
  Terminal terminal_;
  LabelledStreams streams_;
  Prompts prompts_;
  RankStates states_;
  FailurePolicy policy_;
  Downstream downstream_;
  std::optional<Upstream> upstream_;  // node mode
  NodeReports reports_;               // the job's host: the joined nodes' records
  Fd signals_;
  Clock::time_point drain_until_;
};

Launcher::Launcher(RunOptions opts, std::vector<UnitPlan> plans, std::optional<NodeOptions> node,
                   const ErrorFiles& errors, std::string error_file, Joined joined)
    : opts_(std::move(opts)),
      node_(std::move(node)),
      joined_(joined),
      first_node_(plans.size()),
      errors_(errors),
      error_file_(std::move(error_file)),
      link_timeout_(std::chrono::duration_cast<milliseconds>(
          std::chrono::duration<double>(opts_.link_timeout_s))),
      plans_(std::move(plans)),
      // On another host, output goes back through the launcher: if it can't be sent for the
      // link timeout, the link is gone (a network that dropped without a word).
      terminal_(node_ && !joined_.host ? link_timeout_ : milliseconds::zero()),
      streams_(loop_, terminal_, me(),
               {[this](size_t u, std::string_view line) { on_record(u, line); },
                [this] {
                  if (node_)
                    policy_.link_lost("its output could not be sent back for " +
                                          seconds_text(link_timeout_) + " s",
                                      Clock::now());
                }}),
      prompts_(loop_, terminal_,
               opts_.prompt_records ? Prompts::Show::kRecords : Prompts::Show::kText,
               [this](size_t u, int rank, std::optional<std::string> line) {
                 answer(u, rank, std::move(line));
               }),
      policy_(*this, {kGrace, opts_.timeout_s, node_.has_value(), !node_.has_value()},
              Clock::now()),
      downstream_(loop_, link_timeout_,
                  [this](size_t u) {
                    if (joined_node(u))
                      on_node_gone(u, "it did not stop its ranks within 3 s of being told to");
                    else
                      sup_.signal(u, SIGKILL);
                  }),
      reports_(loop_, {[this](size_t u, std::string_view line) { on_record(u, line); },
                       [this](size_t u, std::string why) { on_node_gone(u, std::move(why)); }}) {
  if (joined_.nodes) {
    // Every other node of the job: a host unit, reached through its link, after this one's ranks.
    for (const auto& n : *joined_.nodes) {
      UnitPlan p;
      p.host = true;
      p.name = "node " + std::to_string(n.node_rank) + ", " + n.join.name;
      p.first_rank = n.first_rank;
      p.nranks = n.join.nproc;
      plans_.push_back(std::move(p));
    }
  }
  for (const auto& p : plans_) {
    UnitEnd e;
    e.host = p.host;
    e.name = p.name;
    e.first_rank = p.first_rank;
    e.nranks = p.nranks;
    ends_.push_back(std::move(e));
    if (p.host)
      streams_.add_host();
    else
      streams_.add_rank(p.first_rank, p.shown, p.streams);
  }
  // --timeout stands still while a prompt waits for its line.
  prompts_.on_asking([this](bool asking) { policy_.paused(asking, Clock::now()); });
  loop_.deadline([this] { return policy_.next_deadline(all_exited()); },
                 [this](Clock::time_point now) { policy_.tick(now, all_exited()); });
  loop_.deadline(
      [this]() -> std::optional<Clock::time_point> {
        if (!all_exited()) return std::nullopt;
        return drain_until_;
      },
      [](Clock::time_point) {});  // run_until's condition ends the loop
  loop_.deadline([this] { return states_.deadline(); },
                 [this](Clock::time_point) { show_states(); });
  if (node_)
    upstream_.emplace(loop_, terminal_, link_timeout_,
                      Upstream::Hooks{[this](const protocol::Control& m) { on_control(m); },
                                      [this](std::string why) {
                                        policy_.link_closed(std::move(why), Clock::now());
                                      },
                                      [this](std::string why) {
                                        policy_.link_lost(std::move(why), Clock::now());
                                      }});
}

void Launcher::start_units() {
  for (size_t u = first_node_; u < plans_.size(); ++u) {
    JoinLink& link = *(*joined_.nodes)[u - first_node_].link;
    downstream_.add(u, link);
    reports_.add(u, link);
  }
  for (size_t u = 0; u < first_node_; ++u) {
    const UnitPlan& p = plans_[u];
    try {
      Fd store;  // rank 0's TCPStore socket, listening before any rank starts; closed here after
      sup_.spawn(p.host || p.first_rank != 0 ? p.spec : with_store_socket(p.spec, store));
    } catch (const std::system_error& e) {
      std::string what = std::string(e.what()).substr(0, std::string(e.what()).rfind(':'));
      throw CannotStart(e.code(), p.host ? "cannot start the launcher of host " + p.name + ": " +
                                               what
                                         : "cannot start rank " + std::to_string(p.first_rank) +
                                               ": " + what);
    }
    Child& c = sup_.child(u);
    streams_.attach(u, std::move(c.stdout_pipe()), std::move(c.stderr_pipe()));
    loop_.watch(c.pidfd(), EPOLLIN, [this, u](uint32_t) { on_exit(u); });
    if (p.host) {
      downstream_.add(u, std::move(c.stdin_pipe()));
      if (!p.ship.empty()) downstream_.ship(u, p.ship);
    } else if (c.stdin_pipe()) {
      // Written only at its prompts, a line at a time: a rank gone meanwhile must not block us.
      set_nonblocking(c.stdin_pipe().get());
    }
  }
}

void Launcher::stopping(size_t u, int sig) {
  if (ends_[u].stopped) return;  // SIGKILL after the SIGTERM: its stance then is what counts
  ends_[u].stopped = true;
  // Not reaped (running() said so), so the pid is still this rank's.
  ends_[u].at_stop = stance(sup_.child(u).pid(), sig);
}

void Launcher::terminate() {
  for (size_t u = 0; u < ends_.size(); ++u) {
    // One that has exited, even if its pidfd has not been read yet, ended on its own.
    if (ends_[u].host || ends_[u].status || !sup_.running(u)) continue;
    stopping(u, SIGTERM);
    sup_.signal(u, SIGTERM);
  }
  // Each host's ddip run stops its own ranks the same way (SIGTERM, grace, SIGKILL).
  downstream_.tell(protocol::Stop{});
}

void Launcher::kill() {
  for (size_t u = 0; u < ends_.size(); ++u) {
    if (ends_[u].host || ends_[u].status || !sup_.running(u)) continue;
    stopping(u, SIGKILL);
    sup_.signal(u, SIGKILL);
  }
  downstream_.kill();
}

void Launcher::forward(int sig) {
  for (size_t u = 0; u < ends_.size(); ++u)
    if (!ends_[u].host && !ends_[u].status) sup_.signal(u, sig);
  downstream_.tell(protocol::Signal{sig});
}

void Launcher::report_upstream(const RootCause& cause) {
  upstream_->send(protocol::RankFailed{cause.rank, cause.exit_code, cause.signal, cause.when_ns,
                                       cause.what, cause.error, cause.tail});
}

void Launcher::collect() {
  states_.begin(Clock::now() + kStateWait);
  ask_states();
  if (states_.complete()) show_states();
}

void Launcher::ask_states() {
  for (size_t u = 0; u < ends_.size(); ++u) {
    const UnitPlan& p = plans_[u];
    const bool live = !ends_[u].status && (joined_node(u) || sup_.running(u));
    if (p.host) {
      for (int r = p.first_rank; r < p.first_rank + p.nranks; ++r)
        live ? states_.asked(r) : states_.answer({r, "", ""});
      if (live) downstream_.tell(u, protocol::Collect{});
    } else if (live && answers_sigurg(sup_.child(u).pid())) {
      states_.asked(p.first_rank);
      sup_.signal(u, SIGURG, false);  // the rank itself: its children have no hook
    } else if (node_) {
      upstream_->send(protocol::RankState{p.first_rank, "", ""});
    } else {
      states_.answer({p.first_rank, "", ""});
    }
  }
}

void Launcher::on_state(size_t u, protocol::RankState state) {
  if (!plans_[u].host) state.rank = plans_[u].first_rank;  // its own number, whatever RANK says
  if (node_) {
    upstream_->send(state);
    return;
  }
  states_.answer(std::move(state));
  if (states_.open() && states_.complete()) show_states();
}

void Launcher::show_states() {
  if (!states_.open()) return;
  std::string text = states_.end();
  if (!text.empty()) terminal_.write(2, me() + ": " + text);
  policy_.collected(Clock::now());
}

void Launcher::on_record(size_t u, std::string_view line) {
  try {
    auto report = protocol::decode_report(line);
    if (auto* p = std::get_if<protocol::Prompt>(&report)) {
      on_prompt(u, std::move(*p));
    } else if (auto* s = std::get_if<protocol::RankState>(&report)) {
      on_state(u, std::move(*s));
    } else if (plans_[u].host == false) {
      throw protocol::ProtocolError("record that only a host's ddip run sends: " +
                                    std::string(line.substr(protocol::kPrefix.size())));
    } else if (auto* m = std::get_if<protocol::RankFailed>(&report)) {
      RootCause cause;
      cause.unit = u;
      cause.rank = m->rank;
      cause.who = "rank " + std::to_string(m->rank) + " (on " + plans_[u].name + ")";
      cause.what = std::move(m->what);
      cause.exit_code = m->exit_code;
      cause.signal = m->signal;
      cause.code = ExitStatus{m->exit_code, m->signal, false}.shell_code();
      cause.tail = std::move(m->tail);
      cause.error = std::move(m->error);
      cause.when_ns = m->when_ns;
      cause.reported = true;
      policy_.failed(std::move(cause), Clock::now());
    } else if (auto* sig = std::get_if<protocol::Signalled>(&report)) {
      // Ctrl-C (or a scheduler's signal) at another node: for every node, as if here.
      if (policy_.signalled(sig->number, Clock::now()) == FailurePolicy::Signalled::kKilling)
        std::cerr << me() << ": " << signal_name(sig->number) << " again at " << plans_[u].name
                  << ": killing every rank\n";
    } else {
      auto& done = std::get<protocol::NodeDone>(report);
      auto& ranks = ends_[u].ranks;
      ranks.insert(ranks.end(), done.ranks.begin(), done.ranks.end());
      if (joined_node(u)) on_node_done(u);
    }
  } catch (const protocol::ProtocolError& e) {
    // Shown now, and kept with the host's last words in case it is what failed.
    std::string why = (plans_[u].host ? "host " + plans_[u].name
                                      : "rank " + std::to_string(plans_[u].first_rank)) +
                      " sent a " + e.what();
    std::cerr << me() << ": " << why << "\n";
    streams_.note(u, why);
  }
}

void Launcher::on_prompt(size_t u, protocol::Prompt prompt) {
  // The rank's own number, whatever its environment says.
  if (!plans_[u].host) prompt.rank = plans_[u].first_rank;
  // What it printed before it stopped goes first (from a host, as far as it has arrived).
  if (!joined_node(u)) streams_.drain(u, RankOutput::kStdout);
  if (node_)
    upstream_->send(prompt);  // the ddip run that started this one asks, and answers (Answer)
  else
    prompts_.waiting(u, std::move(prompt));
}

void Launcher::answer(size_t u, int rank, std::optional<std::string> line) {
  if (plans_[u].host) {
    downstream_.tell(u, protocol::Answer{rank, !line, line.value_or("")});
    return;
  }
  if (ends_[u].status || !sup_.running(u)) return;
  Fd& in = sup_.child(u).stdin_pipe();
  if (!in) return;
  // Closed for nobody-can-answer, or when the rank does not take it (it has closed its stdin):
  // its debugger then goes on.
  if (!line || !write_all(in.get(), *line + "\n", milliseconds(1000))) in.reset();
}

void Launcher::on_exit(size_t u) {
  auto st = sup_.poll(u);
  if (!st) return;
  UnitEnd& un = ends_[u];
  // An abort in Python's teardown after the script ended ends the rank as its script did.
  if (!un.host && st->signal == SIGABRT)
    if (auto script = script_status(errors_.dir(), sup_.child(u).pid())) st = ExitStatus{*script};
  un.status = st;
  prompts_.ended(u);
  loop_.unwatch(sup_.child(u).pidfd());
  if (un.host) downstream_.ended(u);
  streams_.drain(u);
  if (un.host) {
    // Its host's ddip run has ended: release what it held back, then judge the launcher's exit.
    streams_.flush(u);
    // A failing launcher without a report from its host is the root cause (ssh could not
    // connect, say, with ssh's message in its stderr).
    if (st->shell_code() != 0) {
      RootCause cause;
      cause.unit = u;
      cause.who = "host " + un.name;
      cause.what = "its launcher (or ddip run there) ended with " + st->describe() +
                   " before any of its ranks reported a failure";
      cause.code = st->shell_code();
      cause.tail = streams_.launcher_tail(u);
      policy_.launcher_failed(std::move(cause), Clock::now());
    }
  } else if (st->shell_code() != 0) {
    RootCause cause;
    cause.unit = u;
    cause.rank = un.first_rank;
    cause.who = "rank " + std::to_string(un.first_rank);
    cause.what = st->describe();
    cause.code = st->shell_code();
    cause.exit_code = st->code;
    cause.signal = st->signal;
    cause.tail = streams_.stderr_tail(u);
    cause.error = ErrorFiles::read_file(plans_[u].error_file);
    policy_.failed(std::move(cause), Clock::now());
  }
  if (all_exited()) drain_until_ = Clock::now() + kDrain;
}

void Launcher::on_node_done(size_t u) {
  ends_[u].status = ExitStatus{0, 0, false};
  // Still pinged (not ended() in downstream_): its ddip run waits for the job's end, and takes
  // a silent host for a gone one.
  reports_.done(u);
  if (all_exited()) drain_until_ = Clock::now() + kDrain;
}

void Launcher::on_node_gone(size_t u, std::string why) {
  if (ends_[u].status) return;
  ends_[u].status = ExitStatus{1, 0, false};
  downstream_.ended(u);
  reports_.done(u);
  vanished_.push_back(u - first_node_);
  RootCause cause;
  cause.unit = u;
  cause.who = plans_[u].name;
  cause.what = "its ddip run vanished before its ranks ended (" + why + ")";
  std::cerr << me() << ": " << cause.who << ": " << cause.what << "\n";
  cause.code = 1;
  policy_.launcher_failed(std::move(cause), Clock::now());
  if (all_exited()) drain_until_ = Clock::now() + kDrain;
}

void Launcher::on_signal() {
  signalfd_siginfo si{};
  while (::read(signals_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    int sig = static_cast<int>(si.ssi_signo);
    if (joined_.host && upstream_->linked()) {
      // The job's host acts on it for every node, this one included (told_signal).
      upstream_->send(protocol::Signalled{sig});
      continue;
    }
    // Its ssh session ending: the control channel says.
    if (node_ && !joined_.host && sig == SIGHUP) continue;
    if (policy_.signalled(sig, Clock::now()) == FailurePolicy::Signalled::kKilling)
      std::cerr << me() << ": " << signal_name(sig) << " again: killing every rank\n";
  }
}

void Launcher::on_control(const protocol::Control& message) {
  auto now = Clock::now();
  if (auto* s = std::get_if<protocol::Signal>(&message))
    policy_.told_signal(s->number, now);
  else if (std::holds_alternative<protocol::Stop>(message))
    policy_.stop(now);
  else if (std::holds_alternative<protocol::Kill>(message))
    policy_.told_kill(now);
  else if (auto* a = std::get_if<protocol::Answer>(&message)) {
    for (size_t u = 0; u < plans_.size(); ++u)
      if (!plans_[u].host && plans_[u].first_rank == a->rank)
        answer(u, a->rank, a->end ? std::nullopt : std::optional<std::string>(a->line));
  } else if (std::holds_alternative<protocol::Collect>(message)) {
    ask_states();
  }
  // Ping: hearing it was the point (Upstream keeps the time).
}

int Launcher::finish() {
  const Outcome& outcome = policy_.outcome();
  if (node_) {
    if (!outcome.lost.empty()) std::cerr << me() << ": " << outcome.lost << "; stopped its ranks\n";
    // The ddip run that started this one writes the summary; it gets each rank's end.
    upstream_->send(node_done(ends_));
    return outcome.exit_code();
  }
  std::string report = summary(outcome, ends_);
  if (!report.empty()) write_all(2, report);
  pass_on_error_file();
  return outcome.exit_code();
}

void Launcher::pass_on_error_file() const {
  const auto& root = policy_.outcome().root;
  // torchrun writes nothing there when the root cause left no error file.
  if (error_file_.empty() || !root || root->error.empty()) return;
  try {
    // torch counts a signal as its negative exit code.
    int code = root->signal ? -root->signal : root->exit_code;
    std::string json = parent_error_json(root->error, code);
    std::error_code ec;
    std::filesystem::remove(error_file_, ec);
    Fd out(check(::open(error_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                 "open", "writing TORCHELASTIC_ERROR_FILE " + error_file_));
    if (!write_all(out.get(), json)) throw std::runtime_error("writing " + error_file_ + " failed");
  } catch (const std::exception& e) {
    std::cerr << me() << ": could not pass " << root->who << "'s error file on: " << e.what()
              << "\n";
  }
}

int Launcher::run() {
  // Signals arrive as data in the loop; the ranks get an empty mask back before exec.
  sigset_t mask;
  sigemptyset(&mask);
  for (int s : forwarded_signals(opts_)) sigaddset(&mask, s);
  check(::sigprocmask(SIG_BLOCK, &mask, nullptr), "sigprocmask", "taking over SIGINT and SIGTERM");
  signals_ = Fd(check(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK), "signalfd",
                      "taking over SIGINT and SIGTERM"));
  // A closed terminal or pipe must not kill the launcher (and with it, every rank).
  ::signal(SIGPIPE, SIG_IGN);
  loop_.watch(signals_.get(), EPOLLIN, [this](uint32_t) { on_signal(); });
  std::string no_channel;
  if (joined_.host) {
    upstream_->open(*joined_.host, "the job's host (node 0)");
  } else if (node_) {
    // The control channel is this process's stdin; the ranks get /dev/null instead.
    no_channel = upstream_->open(
        Fd(check(::fcntl(0, F_DUPFD_CLOEXEC, 3), "fcntl", "keeping the control channel")));
    // Writes back through the launcher are bounded (Terminal): they must not block for good.
    set_nonblocking(1);
    set_nonblocking(2);
  }
  // Ranks' prompts are answered from this stdin (a terminal, or %%diprun's pipe).
  if (!node_ && opts_.prompts)
    prompts_.open(Fd(check(::fcntl(0, F_DUPFD_CLOEXEC, 3), "fcntl", "keeping stdin for prompts")));
  Fd null(check(::open("/dev/null", O_RDONLY | O_CLOEXEC), "open", "opening /dev/null"));
  check(::dup2(null.get(), 0), "dup2", "giving the ranks /dev/null as stdin");
  streams_.open_logs();
  if (!opts_.raw) streams_.collapse_repeats(kRepeatWindowS);
  start_units();
  if (!no_channel.empty()) policy_.link_lost(no_channel, Clock::now());

  loop_.run_until([this] {
    return all_exited() && (!streams_.any_open() || Clock::now() >= drain_until_);
  });
  streams_.flush_open();
  return finish();
}

}  // namespace
}  // namespace ddip::run

namespace ddip::run {
namespace {

// A terminal, or a pipe or socket a program writes to (%%diprun): someone can answer a rank's
// debugger prompt. /dev/null, a file, or no stdin at all: nobody can.
bool stdin_can_answer() {
  struct stat st {};
  if (::fstat(0, &st) != 0) return false;
  return ::isatty(0) == 1 || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode);
}

// On another host: the files shipped with the launch, read first from the control channel, and
// the command's arguments pointed at the copies. False when they could not be received (said).
bool receive_shipped(RunOptions& opts, ShippedFiles& shipped, const std::string& prog) {
  try {
    shipped.receive(0, static_cast<size_t>(opts.node->files),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::duration<double>(opts.link_timeout_s)));
  } catch (const std::exception& e) {
    std::cerr << prog << ": could not receive the files shipped with the launch: " << e.what()
              << "\n";
    return false;
  }
  opts.command = shipped.rewrite(opts.command);
  return true;
}

// The ranks' error files: made before any rank starts, removed once every rank here has ended.
// False when they could not be made (said).
bool make_error_files(std::optional<ErrorFiles>& errors, Elastic& elastic,
                      const std::string& prog) {
  try {
    elastic.errors = &errors.emplace();
  } catch (const std::exception& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return false;
  }
  return true;
}

// ddip's startup hook for the Python ranks (run_collectives.hpp), beside their error files. Without
// it (said) the ranks run as they would, but can't say where they are at a timeout or Ctrl-C.
void add_startup_hook(Elastic& elastic, const ErrorFiles& errors, const std::string& prog) {
  try {
    std::error_code ec;
    auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    elastic.hook_dir = write_startup_hook(errors.dir() + "/hook", ec ? "" : own_hook(self));
  } catch (const std::exception& e) {
    std::cerr << prog << ": " << e.what()
              << "; the ranks run without it (no picture of their collectives at a timeout or "
                 "Ctrl-C)\n";
  }
}

// On another host, for the ddip run that started it: in that one's directory when it exists
// here too.
void enter_node_directory(const NodeOptions& node, const std::string& prog) {
  if (node.cwd.empty() || ::chdir(node.cwd.c_str()) == 0) return;
  std::error_code ec;
  auto here = std::filesystem::current_path(ec);
  std::cerr << prog << ": " << node.cwd << " does not exist here; running in "
            << (ec ? std::string("its launcher's directory") : here.string()) << "\n";
}

// How one attempt of the launch ended.
struct AttemptEnd {
  int code = 1;
  Outcome outcome;
  std::vector<UnitEnd> ends;
  std::vector<size_t> vanished;  // the job's host: nodes gone (Joined::nodes)
};

// Attempt `restart` of the launch (TORCHELASTIC_RESTART_COUNT): its own error files (the last
// attempt's are not this one's), its plan, its Launcher, run to the end. `node`: this ddip run
// reports to another (--node, or a node that joined a job); `joined`: the job's other nodes.
AttemptEnd run_attempt(const RunOptions& opts, const std::string& run_id, int restart,
                       const std::string& shipping, const std::string& prog,
                       std::optional<NodeOptions> node, Joined joined = {}) {
  AttemptEnd end;
  std::optional<ErrorFiles> errors;
  Elastic elastic{run_id, nullptr, "", restart, opts.max_restarts};
  if (!make_error_files(errors, elastic, prog)) return end;
  add_startup_hook(elastic, *errors, prog);
  try {
    auto plans = plan_units(opts, this_machine(), elastic, shipping);
    // As torchrun's own: the root cause's error file is passed on to it at the end. On another
    // node, the ddip run that started this one (or the job's host) does that.
    const char* own = node ? nullptr : std::getenv("TORCHELASTIC_ERROR_FILE");
    Launcher launcher(opts, std::move(plans), node, *errors, own ? std::string(own) : "", joined);
    end.code = launcher.run();
    end.outcome = launcher.outcome();
    end.ends = launcher.ends();
    end.vanished = launcher.vanished();
  } catch (const std::exception& e) {
    auto* cannot = dynamic_cast<const CannotStart*>(&e);
    end.code = cannot ? cannot->exit_code() : 1;
    std::cerr << prog << ": " << e.what() << "\n";
    RootCause cause;
    cause.who = node ? "rank " + std::to_string(node->rank_offset) : "rank 0";
    cause.rank = node ? node->rank_offset : 0;
    cause.what = e.what();
    cause.code = end.code;
    cause.exit_code = end.code;
    end.outcome.root = cause;
    // The job's host must hear of it, or it would wait for this node's ranks.
    if (joined.host) {
      joined.host->send(protocol::encode(protocol::Report{protocol::RankFailed{
                            cause.rank, end.code, 0, realtime_ns(), cause.what, "", {}}}),
                        milliseconds(1000));
      joined.host->send(protocol::encode(protocol::Report{protocol::NodeDone{}}),
                        milliseconds(1000));
    }
  }
  return end;
}

void say_restart(const std::string& prog, const Outcome& outcome, int restart, int max) {
  std::cerr << prog << ": " << outcome.root->who << " failed; restarting every rank (restart "
            << restart << " of " << max << ", TORCHELASTIC_RESTART_COUNT=" << restart << ")\n";
}

// The launch on this machine (and --hosts), restarted after a failure up to --max-restarts
// times, as torch elastic's agent restarts its worker group; the last attempt's exit code.
int run_attempts(const RunOptions& opts, const std::string& run_id, const std::string& shipping,
                 const std::string& prog) {
  try {
    if (opts.die_with_parent) {
      // SIGKILL: the ranks then die of their own PR_SET_PDEATHSIG.
      pid_t parent = ::getppid();
      ddip::check(::prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl", "tying ddip run to its parent");
      if (::getppid() != parent) return 1;  // the parent died before prctl took effect
    }
  } catch (const std::exception& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return 1;
  }
  // Another host's ddip run (--node) never restarts by itself: the one that started it does,
  // and says which attempt this is (--node-restart).
  if (opts.node) {
    RunOptions here = opts;
    here.max_restarts = opts.node->max_restarts;
    return run_attempt(here, run_id, opts.node->restart, shipping, prog, opts.node).code;
  }
  const int max = opts.max_restarts;
  for (int restart = 0;; ++restart) {
    AttemptEnd end = run_attempt(opts, run_id, restart, shipping, prog, opts.node);
    if (!restarts_after(end.outcome, restart, max)) return end.code;
    say_restart(prog, end.outcome, restart + 1, max);
  }
}

// -- one ddip run per node (run_join.hpp) ------------------------------------------------------

std::string host_name() {
  char buf[256] = {};
  return ::gethostname(buf, sizeof buf - 1) == 0 ? std::string(buf) : std::string("?");
}

// What this node brings to the rendezvous, from torchrun's options. Throws
// std::invalid_argument (a usage error) for what can't form a job.
JoinOptions join_options(const RunOptions& opts) {
  JoinOptions j;
  j.backend = opts.rdzv_backend;
  if (j.backend != "static" && j.backend != "c10d")
    throw std::invalid_argument("--rdzv-backend " + j.backend +
                                " is not one ddip run has: give c10d or static");
  const std::string master = opts.master_addr.empty() ? "127.0.0.1" : opts.master_addr;
  const int master_port = opts.master_port ? opts.master_port : 29500;
  std::tie(j.host, j.port) =
      opts.rdzv_endpoint.empty()
          ? std::pair<std::string, uint16_t>(master, static_cast<uint16_t>(master_port))
          : split_endpoint(opts.rdzv_endpoint, 29400);
  j.local_addr = opts.local_addr;
  j.nnodes_min = opts.nnodes_min;
  j.nnodes_max = opts.nnodes_max;
  if (j.backend == "static" && j.nnodes_min != j.nnodes_max)
    throw std::invalid_argument("--nnodes " + std::to_string(j.nnodes_min) + ":" +
                                std::to_string(j.nnodes_max) +
                                " needs a rendezvous that admits nodes: add --rdzv-backend c10d "
                                "--rdzv-endpoint HOST:PORT");
  j.node_rank = j.backend == "static" ? std::max(opts.node_rank, 0) : -1;
  if (j.node_rank >= j.nnodes_max)
    throw std::invalid_argument("--node-rank " + std::to_string(j.node_rank) +
                                " is not one of 0.." + std::to_string(j.nnodes_max - 1));
  j.run_id = opts.rdzv_id.empty() ? "none" : opts.rdzv_id;
  j.nproc = opts.world_size();
  j.name = host_name();
  j.timeout_s = opts.timeout_s;
  j.max_restarts = opts.max_restarts;
  j.prompts = opts.prompts;
  j.key = shared_key(opts.key_file);
  j.join_timeout = conf_seconds(opts.rdzv_conf, "join_timeout", j.join_timeout);
  j.last_call = conf_seconds(opts.rdzv_conf, "last_call_timeout", j.last_call);
  j.link_timeout = std::chrono::duration_cast<milliseconds>(
      std::chrono::duration<double>(opts.link_timeout_s));
  return j;
}

// Node 0: hosts the job, attempt after attempt; every node hears how each ended.
int host_job(RunOptions opts, const JoinOptions& j, std::unique_ptr<TcpListener> listener,
             const std::string& prog) {
  JobHost host(j, std::move(listener));
  std::cerr << prog << ": node 0 of job '" << j.run_id << "': waiting for "
            << (j.nnodes_min == j.nnodes_max ? std::to_string(j.nnodes_max)
                                             : std::to_string(j.nnodes_min) + " to " +
                                                   std::to_string(j.nnodes_max))
            << " nodes at port " << j.port << "\n";
  for (int restart = 0;; ++restart) {
    auto start = host.gather(restart, plan::master_port(true, "0.0.0.0"));
    // --log-dir's DIR/<run id>_<random>: the run id is the job's, known once the nodes are in.
    if (restart == 0) opts.log_job_dir = make_log_job_dir(opts, start.run_id, prog);
    RunOptions a = opts;
    a.node = NodeOptions{0, start.world_size, 0, start.nnodes, j.name, "", 0, start.run_id};
    a.master_addr = start.master_addr;
    a.master_port = start.master_port;
    std::vector<double> timeouts;
    for (const auto& n : host.nodes()) timeouts.push_back(n.join.timeout_s);
    a.timeout_s = earliest_timeout(opts.timeout_s, timeouts);
    AttemptEnd end =
        run_attempt(a, start.run_id, restart, "", prog, std::nullopt, {&host.nodes(), nullptr});
    for (size_t i : end.vanished) host.drop(i);
    const bool again = restarts_after(end.outcome, restart, opts.max_restarts);
    host.end(end_record(end.outcome, again, end.ends.size() - host.nodes().size(), j.name));
    if (!again) return end.code;
    say_restart(prog, end.outcome, restart + 1, opts.max_restarts);
  }
}

// Any other node: joins the job, runs its ranks in each attempt, and names the root cause as the
// job's host tells it.
int join_job(RunOptions opts, const JoinOptions& j, const std::string& prog) {
  JobMember member(j);
  auto start = member.join();
  opts.log_job_dir = make_log_job_dir(opts, start.run_id, prog);  // as on the job's host
  while (true) {
    RunOptions a = opts;
    a.node = NodeOptions{start.rank_offset, start.world_size, start.node_rank, start.nnodes,
                         j.name,           "",               0,                start.run_id};
    a.master_addr = start.master_addr;
    a.master_port = start.master_port;
    a.prompts = start.prompts;
    a.timeout_s = 0;  // the job's host keeps the earliest node's
    a.max_restarts = start.max_restarts;
    AttemptEnd end =
        run_attempt(a, start.run_id, start.restart, "", prog, a.node, {nullptr, &member.link()});
    if (!end.outcome.lost.empty()) return end.code;  // said; the job's host is gone
    auto said = member.end();
    std::string report = summary(outcome_of(said, end.ends), end.ends);
    if (!report.empty()) write_all(2, report);
    if (!said.restart) return said.exit_code;
    std::cerr << prog << ": restarting every rank (restart " << said.restart << ")\n";
    start = member.next_start();
  }
}

// One ddip run per node (--nnodes above 1): hosts the job, or joins the node that does.
int run_job(CommandLine& cl, const RunOptions& opts, const std::string& prog) {
  JoinOptions j;
  try {
    j = join_options(opts);
  } catch (const std::invalid_argument& e) {
    return cl.exit(CLI::ValidationError(opts.rdzv_endpoint.empty() ? "--nnodes" : "--rdzv-endpoint",
                                        e.what()));
  } catch (const JoinError& e) {
    return cl.exit(CLI::ValidationError("--key-file", e.what()));
  }
  if (opts.check) return 0;
  try {
    auto listener = host_rendezvous(j);
    return listener ? host_job(opts, j, std::move(listener), prog) : join_job(opts, j, prog);
  } catch (const std::exception& e) {  // a JoinError, or --log-dir that can't be made
    std::cerr << prog << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace
}  // namespace ddip::run

int main(int argc, char** argv) {
  using namespace ddip::run;
  CommandLine cl;
  RunOptions opts;
  try {
    opts = cl.parse(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const CLI::Error& e) {
    return cl.exit(e);
  }
  const std::string prog = opts.node ? "ddip run on " + opts.node->name : "ddip run";
  // On another host, --node-prompts says whether the ddip run that started it can answer.
  if (!opts.node) opts.prompts = stdin_can_answer();
  // One ddip run per node, as one torchrun per node: this one joins the others.
  if (opts.nnodes_max > 1 && opts.hosts.empty() && !opts.node) return run_job(cl, opts, prog);
  // Outlives the launch: the copies go once every rank here has ended.
  ShippedFiles shipped;
  if (opts.node && opts.node->files > 0 && !receive_shipped(opts, shipped, prog)) return 1;
  std::optional<ErrorFiles> errors;
  // torchrun's TORCHELASTIC_RUN_ID: --rdzv-id, or a random one (parse() left it "").
  Elastic elastic{opts.node           ? opts.node->run_id
                  : opts.rdzv_id.empty() ? new_run_id()
                                         : opts.rdzv_id,
                  nullptr, ""};
  if (!opts.check && !make_error_files(errors, elastic, prog)) return 1;
  try {
    if (!opts.check) opts.log_job_dir = make_log_job_dir(opts, elastic.run_id, prog);
  } catch (const std::exception& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return 1;
  }
  if (errors) add_startup_hook(elastic, *errors, prog);
  std::string shipping;
  if (!opts.node && !opts.ship.empty()) {
    try {
      shipping = ship_payload(opts.ship);
    } catch (const std::invalid_argument& e) {
      return cl.exit(CLI::ValidationError("--ship", e.what()));
    }
  }
  std::vector<UnitPlan> plans;
  try {
    if (opts.node) enter_node_directory(*opts.node, prog);
    plans = plan_units(opts, this_machine(), elastic, shipping);
  } catch (const std::invalid_argument& e) {
    return cl.exit(CLI::ValidationError(opts.hosts.empty() ? "--gpus" : "--hosts", e.what()));
  } catch (const CLI::Error& e) {
    return cl.exit(e);
  } catch (const std::exception& e) {  // finding a free port, say: nothing has started
    std::cerr << prog << ": " << e.what() << "\n";
    return 1;
  }
  if (opts.check) return 0;  // the command line and the plan are good; nothing was started
  errors.reset();  // each attempt makes its own
  return run_attempts(opts, elastic.run_id, shipping, prog);
}
