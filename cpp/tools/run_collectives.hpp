// Where every rank is when `ddip run` times out or is interrupted (the first Ctrl-C): before it
// stops them, it asks each rank for its torch flight recorder's collectives and its main thread's
// Python stack, and prints the collective picture (ddip/collectives.hpp: who has not joined which
// collective, who disagrees), then each rank's stack.
//
// A rank answers through ddip's startup hook (python/ddip/rank/run_hook.py), which nothing in the
// user's script or command line asks for: ddip run writes a sitecustomize.py that starts it into
// a private directory and puts that directory first on every rank's PYTHONPATH, with
// DDIP_RUN_HOOK=1 (DDIP_RUN_HOOK=0 from the user turns it off). The hook blocks SIGURG in the
// rank's main thread before any other thread exists, and a thread of its own answers each SIGURG
// with one RankState record on the rank's stderr (run_protocol.hpp). SIGURG is ignored by
// default, so a rank without the hook is unharmed; whether a rank has it is read from the
// signals its main thread blocks, so nobody waits for a rank that will never answer.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ddip/fd.hpp"
#include "ddip/supervisor.hpp"
#include "run_loop.hpp"
#include "run_protocol.hpp"

namespace ddip::run {

// The variable that turns the hook on in a rank (1), or, set to 0 by the user, off.
inline constexpr const char* kRunHookVariable = "DDIP_RUN_HOOK";
// How long ddip run waits for the ranks' answers before it goes on without the rest.
inline constexpr std::chrono::milliseconds kStateWait{3000};

// The run_hook.py of the ddip package this launcher (its path) was installed with, for ranks
// whose Python cannot import ddip (ddip installed in another environment): beside it in the
// package (ddip/bin/ddip), in a --target folder, or under PREFIX/lib/python3.X beside PREFIX/bin;
// an editable build's source tree. "" when there is none.
std::string own_hook(const std::filesystem::path& launcher);

// Writes the sitecustomize.py that starts the hook into `dir` (made if missing); returns `dir`.
// The rank's own ddip's hook goes first; `hook` (own_hook's) when that Python has no ddip.
// Throws std::system_error naming the file it could not write.
std::string write_startup_hook(const std::string& dir, const std::string& hook = "");

// A rank's environment with the hook in `hook_dir` ("": none) added: PYTHONPATH begins with it
// and DDIP_RUN_HOOK=1; unchanged when the environment already says DDIP_RUN_HOOK=0.
void add_hook_environment(std::vector<std::string>& env, const std::string& hook_dir);

// Whether process `pid`'s main thread blocks SIGURG: a Python rank whose hook started, which
// answers SIGURG. False for any other process, and for one that is gone.
bool answers_sigurg(pid_t pid);

// How a rank's Python script ended, when the process `pid` then died of SIGABRT: torch can abort
// a rank in Python's teardown, after its script has ended ("terminate called without an active
// exception": one of gloo's threads drops its tensors once Python has begun to shut down). The
// hook's last atexit handler, which runs before that teardown, writes the status Python is about
// to exit with into `dir` (the launch's private directory, where the hook's own directory is),
// in a file named by the process id; this reads it and removes the file. nullopt when there is
// none: the process died before its script ended (a crash is a crash), it is not a Python rank
// with the hook, or the hook could not tell (`raise SystemExit(n)` itself, `python -c`).
std::optional<int> script_status(const std::string& dir, pid_t pid);

// torch's TCPStore, listening before any rank starts. Without it, a rank whose store client
// connects before rank 0's server is up is refused and backs off, and its init_process_group
// takes half a second instead of a hundredth. ddip run makes the listening socket (port
// MASTER_PORT, every address, as torch's server binds) and hands it to rank 0; the hook there
// gives it to the TCPStore server that init_process_group makes at MASTER_PORT (torch's
// TCPStore takes a listening socket as master_listen_fd). Clients connect at once, into the
// socket's backlog, and are answered once rank 0 serves.
inline constexpr const char* kStoreFdVariable = "DDIP_STORE_FD";

// For rank 0's `spec`: a socket listening on its MASTER_PORT, inheritable, returned in `socket`,
// and the spec with DDIP_STORE_FD naming it. `spec` itself, and `socket` empty, where the rank
// would not take it: a command that is not Python, the hook turned off (DDIP_RUN_HOOK=0), or a
// port that can't be had (it is busy: rank 0 then fails to bind it as it would have).
SpawnSpec with_store_socket(const SpawnSpec& spec, Fd& socket);

// One request for every rank's state: who was asked, their answers, until each rank asked has
// answered or the deadline has passed; then the text to show.
class RankStates {
 public:
  // A new request, answered by `deadline` or not at all; forgets the last one.
  void begin(Clock::time_point deadline);
  // Rank `rank` was sent SIGURG (or is on a host that was sent Collect): it should answer.
  void asked(int rank);
  // A rank's answer; an empty snapshot says it can't answer (it has ended, or has no hook).
  // Ignored when no request is open (a late answer).
  void answer(protocol::RankState state);
  bool open() const { return deadline_.has_value(); }
  // Every rank asked has answered.
  bool complete() const;
  // While open: when to stop waiting.
  std::optional<Clock::time_point> deadline() const { return deadline_; }

  // Ends the request. The collective picture, then each rank's stack ("[rank N]", in rank
  // order), then each rank that did not answer; "" when no rank had collectives to show (no
  // rank uses torch.distributed, or none answered).
  std::string end();

 private:
  std::optional<Clock::time_point> deadline_;
  std::set<int> asked_;
  std::map<int, protocol::RankState> answers_;  // with a snapshot
  std::set<int> unable_;                        // said they can't answer
};

}  // namespace ddip::run
