#include "run_collectives.hpp"

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "ddip/collectives.hpp"

namespace ddip::run {
namespace {

// Runs first in every Python rank (site imports it): loads ddip's hook by its file, without
// importing the ddip package (tens of milliseconds a rank would pay at start), then imports the
// sitecustomize this one hides (Debian's Python has one), as site would have.
constexpr const char* kSiteCustomize =
    R"(# Written by `ddip run` for its ranks (run_collectives.hpp):
# starts ddip's hook, python/ddip/rank/run_hook.py, then imports the sitecustomize this one hides.
def _ddip_run_hook():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != here]
    me = sys.modules.pop("sitecustomize")
    try:  # importlib.machinery's own, loaded already: importing that would cost a rank 0.5 ms
        from _frozen_importlib_external import SourceFileLoader
    except ImportError:
        from importlib.machinery import SourceFileLoader

    # Where `import ddip` finds it: on sys.path, else (an editable install) through the finders
    # import asks for a top-level package, which find the package without importing it.
    def first(paths):
        return next((p for p in paths if os.path.exists(p)), None)

    path = first(os.path.join(d or ".", "ddip", "rank", "run_hook.py") for d in sys.path)
    if path is None:
        finds = (getattr(f, "find_spec", None) for f in sys.meta_path)
        spec = next(filter(None, (find("ddip", None) for find in finds if find)), None)
        places = (spec.submodule_search_locations or []) if spec else []
        path = first(os.path.join(d, "rank", "run_hook.py") for d in places)
    if path:  # else a Python without ddip (or without the hook): the rank runs as it would
        hook = type(sys)("_ddip_run_hook")
        hook.__file__ = path
        SourceFileLoader(hook.__name__, path).exec_module(hook)
        hook.start(here)
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        sys.modules["sitecustomize"] = me  # none to hide: site finds this one where it left it


_ddip_run_hook()
del _ddip_run_hook
)";

}  // namespace

std::string write_startup_hook(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = dir + "/sitecustomize.py";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << kSiteCustomize;
  out.close();
  if (ec || !out)
    throw std::system_error(ec ? ec : std::make_error_code(std::errc::io_error),
                            "cannot write ddip's startup hook for the ranks, " + path +
                                " (set TMPDIR to a writable directory)");
  return dir;
}

void add_hook_environment(std::vector<std::string>& env, const std::string& hook_dir) {
  if (hook_dir.empty()) return;
  const std::string off = std::string(kRunHookVariable) + "=";
  for (const auto& kv : env)
    if (kv.rfind(off, 0) == 0 && kv.substr(off.size()) == "0") return;
  bool pythonpath = false;
  for (auto& kv : env) {
    if (kv.rfind(off, 0) == 0) kv = off + "1";
    if (kv.rfind("PYTHONPATH=", 0) == 0) {
      std::string rest = kv.substr(11);
      kv = "PYTHONPATH=" + hook_dir + (rest.empty() ? "" : ":" + rest);
      pythonpath = true;
    }
  }
  if (!pythonpath) env.push_back("PYTHONPATH=" + hook_dir);
  if (std::none_of(env.begin(), env.end(),
                   [&](const std::string& kv) { return kv.rfind(off, 0) == 0; }))
    env.push_back(off + "1");
}

std::optional<int> script_status(const std::string& dir, pid_t pid) {
  const std::string path = dir + "/ended." + std::to_string(pid);
  std::ifstream in(path);
  int status = -1;
  if (!(in >> status)) return std::nullopt;
  in.close();
  std::error_code ec;
  std::filesystem::remove(path, ec);  // a later process with the same id must not find it
  if (status < 0 || status > 255) return std::nullopt;
  return status;
}

bool answers_sigurg(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("SigBlk:", 0) != 0) continue;
    try {
      unsigned long long mask = std::stoull(line.substr(7), nullptr, 16);
      return (mask >> (SIGURG - 1)) & 1ULL;
    } catch (const std::exception&) {
      return false;
    }
  }
  return false;
}

void RankStates::begin(Clock::time_point deadline) {
  deadline_ = deadline;
  asked_.clear();
  answers_.clear();
  unable_.clear();
}

void RankStates::asked(int rank) {
  if (open()) asked_.insert(rank);
}

void RankStates::answer(protocol::RankState state) {
  if (!open()) return;
  if (state.snapshot.empty())
    unable_.insert(state.rank);
  else
    answers_[state.rank] = std::move(state);
}

bool RankStates::complete() const {
  for (int r : asked_)
    if (!answers_.count(r) && !unable_.count(r)) return false;
  return true;
}

std::string RankStates::end() {
  deadline_.reset();
  std::map<int, std::string> snapshots;
  for (const auto& [rank, state] : answers_) snapshots[rank] = state.snapshot;
  CollectivePicture picture(snapshots);
  if (!picture.known()) return {};
  std::string out = picture.describe() + "\n";
  for (const auto& [rank, state] : answers_) {
    std::string stack = state.stack;
    while (!stack.empty() && (stack.back() == '\n' || stack.back() == ' ')) stack.pop_back();
    out += "[rank " + std::to_string(rank) + "]\n" + (stack.empty() ? "(no Python stack)" : stack) +
           "\n";
  }
  std::set<int> silent;
  for (int r : asked_)
    if (!answers_.count(r)) silent.insert(r);
  for (int r : unable_)
    if (!answers_.count(r)) silent.insert(r);
  for (int r : silent)
    out += "rank " + std::to_string(r) +
           ": no answer (not a Python rank with ddip's hook, or busy)\n";
  return out;
}

}  // namespace ddip::run
