#include "run_collectives.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
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

    # ddip run's own run_hook.py (the package it was installed with), for a rank whose Python
    # cannot import ddip (ddip installed elsewhere: pipx, another environment); "" if not found.
    OWN_HOOK = @OWN_HOOK@
    path = first(os.path.join(d or ".", "ddip", "rank", "run_hook.py") for d in sys.path)
    if path is None:
        finds = (getattr(f, "find_spec", None) for f in sys.meta_path)
        spec = next(filter(None, (find("ddip", None) for find in finds if find)), None)
        places = (spec.submodule_search_locations or []) if spec else []
        path = first(os.path.join(d, "rank", "run_hook.py") for d in places)
    importable = path is not None
    if path is None and os.path.exists(OWN_HOOK):  # this Python has no ddip: ddip run's own hook
        path = OWN_HOOK
    if path:  # else a Python without ddip (or without the hook): the rank runs as it would
        hook = type(sys)("_ddip_run_hook")
        hook.__file__ = path
        SourceFileLoader(hook.__name__, path).exec_module(hook)
        if not importable:
            hook.IMPORTABLE = False
        hook.start(here)
    elif "DDIP_STORE_FD" in os.environ:  # rank 0's store socket: its own store binds the port
        os.close(int(os.environ.pop("DDIP_STORE_FD")))
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        sys.modules["sitecustomize"] = me  # none to hide: site finds this one where it left it


_ddip_run_hook()
del _ddip_run_hook
)";

// A Python string literal of `text` (a path: no newline in it, else "").
std::string python_literal(const std::string& text) {
  if (text.find_first_of("\n\r") != std::string::npos) return "\"\"";
  std::string out = "\"";
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string own_hook(const std::filesystem::path& launcher) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path bin = launcher.parent_path(), up = bin.parent_path();
  std::vector<fs::path> candidates = {
      up / "rank" / "run_hook.py",          // the package's own copy: ddip/bin/ddip
      up / "ddip" / "rank" / "run_hook.py"  // pip install --target DIR: DIR/bin, DIR/ddip
  };
  // A virtual environment (pipx's too), ~/.local or a prefix: PREFIX/bin beside
  // PREFIX/lib/python3.X/site-packages (dist-packages on Debian's Python).
  for (const char* lib : {"lib", "lib64"})
    for (fs::directory_iterator it(up / lib, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().filename().string().rfind("python3", 0) == 0)
        for (const char* packages : {"site-packages", "dist-packages"})
          candidates.push_back(it->path() / packages / "ddip" / "rank" / "run_hook.py");
#ifdef DDIP_SOURCE_PACKAGE
  candidates.push_back(fs::path(DDIP_SOURCE_PACKAGE) / "rank" / "run_hook.py");  // editable
#endif
  for (const auto& c : candidates)
    if (fs::is_regular_file(c, ec)) return c.lexically_normal().string();
  return "";
}

std::string write_startup_hook(const std::string& dir, const std::string& hook) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = dir + "/sitecustomize.py";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  std::string text = kSiteCustomize;
  const std::string mark = "@OWN_HOOK@";
  text.replace(text.find(mark), mark.size(), python_literal(hook));
  out << text;
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

namespace {

// A listening TCP socket on `port` of every address: IPv6 and IPv4 where IPv6 exists, as torch's
// server binds. Inheritable (no close-on-exec): it is for a rank. Empty when it can't be made.
Fd listen_everywhere(int port) {
  for (int family : {AF_INET6, AF_INET}) {
    Fd s(::socket(family, SOCK_STREAM, 0));
    if (!s) continue;
    int one = 1, zero = 0;
    ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage ss{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      ::setsockopt(s.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof *a;
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof *a;
    }
    // EADDRINUSE: the port is busy, and another family won't change that.
    if (::bind(s.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
      if (errno == EADDRINUSE) return Fd();
      continue;
    }
    if (::listen(s.get(), 1024) == 0) return s;
  }
  return Fd();
}

std::string env_value(const std::vector<std::string>& env, const std::string& name) {
  for (const auto& kv : env)
    if (kv.size() > name.size() && kv.compare(0, name.size(), name) == 0 && kv[name.size()] == '=')
      return kv.substr(name.size() + 1);
  return "";
}

}  // namespace

SpawnSpec with_store_socket(const SpawnSpec& spec, Fd& socket) {
  socket.reset();
  if (spec.argv.empty() || env_value(spec.env, kRunHookVariable) != "1") return spec;
  // Python itself: another program could bind MASTER_PORT itself, and find it taken.
  std::string program = std::filesystem::path(spec.argv[0]).filename().string();
  if (program.rfind("python", 0) != 0) return spec;
  // -I, -E and -S start Python without PYTHONPATH's sitecustomize, so without the hook.
  for (size_t i = 1; i < spec.argv.size(); ++i) {
    const std::string& a = spec.argv[i];
    if (a.size() < 2 || a[0] != '-' || a == "-m" || a == "-c" || a == "--") break;
    if (a == "-X" || a == "-W") {
      ++i;
      continue;
    }
    if (a[1] != '-' && a.find_first_of("IES") != std::string::npos) return spec;
  }
  int port = 0;
  try {
    port = std::stoi(env_value(spec.env, "MASTER_PORT"));
  } catch (const std::exception&) {
    return spec;
  }
  if (port <= 0 || port > 65535) return spec;
  socket = listen_everywhere(port);
  if (!socket) return spec;
  SpawnSpec out = spec;
  out.env.push_back(std::string(kStoreFdVariable) + "=" + std::to_string(socket.get()));
  return out;
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
