#include "ddip/plan.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "ddip/fd.hpp"

namespace ddip::plan {
namespace detail {

// Items separated by any of `seps`, empty ones dropped.
std::vector<std::string> split_any(const std::string& text, const char* seps) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : text) {
    if (std::strchr(seps, ch)) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

bool is_id(const std::string& s) { return s.rfind("GPU-", 0) == 0 || s.rfind("MIG-", 0) == 0; }

std::string quoted(const std::string& s) { return "'" + s + "'"; }

// What the view sees, and what to give instead: for messages.
std::string describe(const std::vector<std::string>& visible, const GpuView& view) {
  if (visible.empty()) {
    // A list that names GPUs on a machine without any: nothing is visible, whatever it says.
    if (view.env && view.physical_count <= 0 && !visible_gpus(view.env, INT_MAX).empty())
      return view.who + " sees no GPU: its CUDA_VISIBLE_DEVICES=" + quoted(*view.env) +
             " names GPUs, but this machine has no NVIDIA GPU";
    if (view.env) return view.who + " sees no GPU (CUDA_VISIBLE_DEVICES=" + quoted(*view.env) + ")";
    return "this machine has no NVIDIA GPU";
  }
  size_t n = visible.size();
  std::string where = view.env ? " (CUDA_VISIBLE_DEVICES=" + *view.env + ")" : "";
  std::string positions = n == 1 ? "0" : "0-" + std::to_string(n - 1);
  return view.who + " sees " + std::to_string(n) + " GPU" + (n > 1 ? "s" : "") + where +
         ": give positions " + positions + ", 'all', or their UUIDs";
}

}  // namespace detail

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t end = s.find(',', start);
    std::string item = s.substr(start, end == std::string::npos ? end : end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    out.push_back(std::move(item));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}


std::optional<int> parse_index(const std::string& s) {
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), ::isdigit)) return std::nullopt;
  return std::stoi(s);
}


bool is_this_host(const std::string& name) {
  if (name == "localhost" || name == "127.0.0.1" || name == "::1") return true;
  char buf[HOST_NAME_MAX + 1] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return false;
  if (name == buf) return true;
  if (name.find('.') == std::string::npos) return false;
  // A fully qualified name: the canonical name of this host's own name.
  addrinfo hints{};
  hints.ai_flags = AI_CANONNAME;
  addrinfo* found = nullptr;
  if (::getaddrinfo(buf, nullptr, &hints, &found) != 0) return false;
  bool same = found && found->ai_canonname && name == found->ai_canonname;
  ::freeaddrinfo(found);
  return same;
}

std::vector<Host> parse_hosts(const std::string& text, bool (*is_local)(const std::string& name)) {
  // Commas and whitespace separate hosts, except inside [...].
  std::vector<std::string> items;
  std::string cur;
  int depth = 0;
  for (char ch : text) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (depth == 0 && (ch == ',' || std::isspace(static_cast<unsigned char>(ch)))) {
      if (!cur.empty()) items.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) items.push_back(cur);
  if (items.empty()) throw std::invalid_argument("no host given; write hosts like node1:4,node2:4");
  auto name_ok = [](const std::string& n) {
    return !n.empty() && n[0] != '-' && std::all_of(n.begin(), n.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' ||
             c == ':';
    });
  };
  std::vector<Host> out;
  std::set<std::string> seen;
  int locals = 0;
  for (const auto& item : items) {
    Host h;
    auto open = item.find('[');
    if (open != std::string::npos) {
      if (item.back() != ']')
        throw std::invalid_argument("can't read host '" + item +
                                    "': write NAME[GPUS], e.g. node1[0,1]");
      h.name = item.substr(0, open);
      std::string inner = item.substr(open + 1, item.size() - open - 2);
      h.gpus = split_list(inner);
      for (const auto& g : h.gpus)
        if (!detail::is_id(g) && !parse_index(g))
          throw std::invalid_argument("host '" + h.name + "': '" + g +
                                      "' is not a GPU; write GPUs as indices or UUIDs, e.g. " +
                                      h.name + "[0,1]");
      if (std::set<std::string>(h.gpus.begin(), h.gpus.end()).size() != h.gpus.size())
        throw std::invalid_argument("host '" + h.name + "' lists a GPU twice: [" + inner + "]");
      h.ranks = static_cast<int>(h.gpus.size());
    } else {
      auto colon = item.rfind(':');
      if (colon == std::string::npos)
        throw std::invalid_argument("host '" + item + "' has no rank count: write " + item +
                                    ":4 (CPU ranks) or " + item + "[0,1] (one rank per GPU)");
      h.name = item.substr(0, colon);
      auto count = parse_index(item.substr(colon + 1));
      if (!count)
        throw std::invalid_argument("can't read host '" + item +
                                    "': write NAME:RANKS (node1:4) or NAME[GPUS] (node1[0,1])");
      if (*count < 1 || *count > kMaxRanksPerHost)
        throw std::invalid_argument("host '" + h.name + "' needs 1 to " +
                                    std::to_string(kMaxRanksPerHost) + " ranks, got " +
                                    std::to_string(*count));
      h.ranks = *count;
    }
    if (!name_ok(h.name))
      throw std::invalid_argument(
          "'" + h.name + "' is not a host name" +
          (!h.name.empty() && h.name[0] == '-' ? " (a host name can't start with '-')" : ""));
    if (!seen.insert(h.name).second)
      throw std::invalid_argument("host '" + h.name + "' is listed twice");
    h.local = is_local(h.name);
    locals += h.local;
    out.push_back(std::move(h));
  }
  if (locals > 1)
    throw std::invalid_argument("this machine is listed twice (as localhost and by its name)");
  return out;
}

std::string hosts_with_gpus(const std::optional<std::string>& hosts, const std::string& gpus) {
  std::vector<std::string> names;
  if (hosts) {
    names = detail::split_any(*hosts, ", \t");
    if (names.empty()) throw std::invalid_argument("no host given; write hosts like node1,node2");
    for (const auto& n : names) {
      auto colon = n.rfind(':');
      if (n.find('[') != std::string::npos ||
          (colon != std::string::npos && parse_index(n.substr(colon + 1))))
        throw std::invalid_argument("with GPUs, list the hosts by name only (node1,node2), got '" +
                                    n + "'; the GPUs say the rest");
    }
  }
  std::vector<std::pair<std::string, std::string>> per_host;  // host, its GPU list
  if (gpus.find(':') != std::string::npos) {
    for (const auto& item : detail::split_any(gpus, " \t;")) {
      auto colon = item.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == item.size())
        throw std::invalid_argument("can't read GPUs '" + item +
                                    "': write HOST:GPUS for each host, e.g. 'node1:0,1 node2:2,3'");
      std::string name = item.substr(0, colon);
      for (const auto& [h, _] : per_host)
        if (h == name) throw std::invalid_argument("the GPUs name host " + name + " twice");
      per_host.emplace_back(name, item.substr(colon + 1));
    }
    if (hosts) {
      std::vector<std::string> a = names, b;
      for (const auto& [h, _] : per_host) b.push_back(h);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b)
        throw std::invalid_argument("the GPUs name other hosts than the host list; give each "
                                    "host's GPUs once, e.g. 'node1:0,1 node2:2,3'");
      std::vector<std::pair<std::string, std::string>> ordered;
      for (const auto& n : names)
        for (const auto& hp : per_host)
          if (hp.first == n) ordered.push_back(hp);
      per_host = std::move(ordered);
    }
  } else {
    if (!hosts)
      throw std::invalid_argument(
          "GPUs for several hosts need the hosts: write GPUs as 'node1:0,1 node2:2,3'");
    if (gpus == "all")
      throw std::invalid_argument("'all' can't count the GPUs of other hosts from here; list "
                                  "them, e.g. 0,1,2,3");
    for (const auto& n : names) per_host.emplace_back(n, gpus);
  }
  std::string out;
  for (const auto& [h, g] : per_host) out += (out.empty() ? "" : " ") + h + "[" + g + "]";
  return out;
}

// -- GPUs -------------------------------------------------------------------------------------

namespace detail {

// What `argv` prints on stdout, when it runs and exits 0 within `timeout_ms`; nullopt otherwise
// (not installed, failed, or silent too long: then it is killed). Only our own child is waited
// for; a foreign reaper that took its status leaves what it printed.
std::optional<std::string> output_of(const std::vector<std::string>& argv, int timeout_ms) {
  Pipe out = make_pipe(true);
  posix_spawn_file_actions_t actions;
  if (::posix_spawn_file_actions_init(&actions) != 0) return std::nullopt;
  ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  ::posix_spawn_file_actions_adddup2(&actions, out.write.get(), 1);
  ::posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  out.write.reset();
  if (rc != 0) return std::nullopt;  // ENOENT: not installed
  std::string text;
  char buf[4096];
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool ended = false;
  while (!ended) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{out.read.get(), POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // silent past the deadline, or poll failed: given up on
    ended = read_available(out.read.get(), buf, sizeof buf, [&](std::string_view piece) {
              text.append(piece);
              return true;
            }) == ReadEnd::kEnded;
  }
  if (!ended) ::kill(pid, SIGKILL);
  int status = 0;
  pid_t waited;
  do waited = ::waitpid(pid, &status, 0);
  while (waited < 0 && errno == EINTR);
  if (!ended) return std::nullopt;
  if (waited == pid && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) return std::nullopt;
  return text;
}

}  // namespace detail

int nvidia_device_count() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec);
  if (!ec) {
    int n = 0;
    for (; it != std::filesystem::directory_iterator(); it.increment(ec)) ++n;
    return n;
  }
  // No driver listing in /proc (WSL, some containers): nvidia-smi still knows. Its GPU lines
  // start "GPU <index>:"; MIG devices are indented under their GPU.
  auto listed = detail::output_of({"nvidia-smi", "-L"}, 20000);
  if (!listed) return 0;
  int n = 0;
  for (const auto& line : detail::split_any(*listed, "\n"))
    if (line.rfind("GPU ", 0) == 0) ++n;
  return n;
}

std::vector<std::string> visible_gpus(const std::optional<std::string>& visible_env,
                                      int physical_count) {
  std::vector<std::string> out;
  // No GPU here: CUDA_VISIBLE_DEVICES can hide GPUs, never add them.
  if (physical_count <= 0) return out;
  if (!visible_env) {
    for (int i = 0; i < physical_count; ++i) out.push_back(std::to_string(i));
    return out;
  }
  for (const auto& e : split_list(*visible_env)) {
    if (detail::is_id(e)) {
      out.push_back(e);
      continue;
    }
    auto idx = parse_index(e);
    if (!idx || *idx >= physical_count) break;
    out.push_back(e);
  }
  return out;
}

std::vector<Gpu> select_gpus(const std::vector<std::string>& requested, const GpuView& view) {
  const std::vector<std::string> visible = visible_gpus(view.env, view.physical_count);
  auto joined = [&] {
    std::string s;
    for (const auto& r : requested) s += (s.empty() ? "" : ",") + r;
    return s;
  };
  auto nothing_hint = [&] { return visible.empty() ? view.cpu_hint : std::string(); };
  if (requested.empty())
    throw std::invalid_argument("no GPU given; give 'all', positions like 0,3, or GPU UUIDs");
  std::vector<Gpu> out;
  if (requested.size() == 1 && requested[0] == "all") {
    if (visible.empty())
      throw std::invalid_argument("'all' GPUs, but " + detail::describe(visible, view) +
                                  nothing_hint());
    for (size_t i = 0; i < visible.size(); ++i) out.push_back({visible[i], static_cast<int>(i)});
    return out;
  }
  for (const auto& item : requested) {
    if (detail::is_id(item)) {
      auto at = std::find(visible.begin(), visible.end(), item);
      if (at != visible.end()) {
        out.push_back({item, static_cast<int>(at - visible.begin())});
      } else if (view.env) {
        throw std::invalid_argument(item + " is not visible: " + detail::describe(visible, view) +
                                    nothing_hint());
      } else if (view.physical_count == 0) {
        throw std::invalid_argument(item + " is not visible: " + detail::describe(visible, view) +
                                    view.cpu_hint);
      } else {
        // Nothing hidden: a UUID names a physical GPU (CUDA takes a unique prefix too), and its
        // index is its position. MIG ids are resolved by CUDA in the rank.
        std::optional<int> position;
        for (size_t i = 0; i < view.uuids.size(); ++i)
          if (!view.uuids[i].empty() && view.uuids[i].rfind(item, 0) == 0)
            position = static_cast<int>(i);
        bool known = std::any_of(view.uuids.begin(), view.uuids.end(),
                                 [](const std::string& u) { return !u.empty(); });
        if (!position && known && item.rfind("GPU-", 0) == 0) {
          std::string have;
          for (const auto& u : view.uuids)
            if (!u.empty()) have += (have.empty() ? "" : ", ") + u;
          throw std::invalid_argument("no GPU has UUID " + item + "; this machine has " + have);
        }
        out.push_back({item, position});
      }
      continue;
    }
    bool negative = item.size() > 1 && item[0] == '-';
    auto pos = parse_index(negative ? item.substr(1) : item);
    if (!pos)
      throw std::invalid_argument("'" + item +
                                  "' is not a GPU; give 'all', positions like 0,3, or GPU UUIDs "
                                  "(GPU-..., MIG-...)");
    if (negative || static_cast<size_t>(*pos) >= visible.size())
      throw std::invalid_argument("GPU " + item + " is not visible: " +
                                  detail::describe(visible, view) + nothing_hint());
    out.push_back({visible[static_cast<size_t>(*pos)], *pos});
  }
  // The same GPU named twice (a position and its UUID, say) is a duplicate too.
  auto key = [](const Gpu& g) { return g.position ? std::to_string(*g.position) : g.entry; };
  std::map<std::string, int> count;
  for (const auto& g : out) ++count[key(g)];
  std::set<std::string> twice;
  for (const auto& g : out)
    if (count[key(g)] > 1) twice.insert(g.entry);
  if (!twice.empty()) {
    std::string dup;
    for (const auto& d : twice) dup += (dup.empty() ? "" : ", ") + d;
    throw std::invalid_argument("GPUs " + joined() + " list GPU " + dup +
                                " more than once; each rank needs its own GPU");
  }
  return out;
}

// -- where rank 0 listens --------------------------------------------------------------------------

std::string source_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0)
    throw std::invalid_argument("can't resolve host " + host + " (" + ::gai_strerror(rc) +
                                "); check the name, or give its address");
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);
  for (addrinfo* a = found; a; a = a->ai_next) {
    Fd s(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!s || ::connect(s.get(), a->ai_addr, a->ai_addrlen) != 0) continue;
    sockaddr_storage me{};
    socklen_t len = sizeof me;
    if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&me), &len) != 0) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* where =
        me.ss_family == AF_INET6
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&me)->sin6_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&me)->sin_addr);
    if (::inet_ntop(me.ss_family, where, text, sizeof text)) return text;
  }
  throw std::invalid_argument("no route to host " + host +
                              "; give this machine's address on the network the hosts share "
                              "(bind= / --bind, or --master-addr for ddip run)");
}

int free_port(const std::string& address) {
  bool v6 = address.find(':') != std::string::npos;
  Fd s(::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  check(s.get(), "socket", "finding a free port");
  sockaddr_storage ss{};
  socklen_t len;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    if (::inet_pton(AF_INET6, address.c_str(), &a->sin6_addr) != 1)
      throw std::invalid_argument("'" + address + "' is not an IP address");
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    if (::inet_pton(AF_INET, address.c_str(), &a->sin_addr) != 1)
      throw std::invalid_argument("'" + address + "' is not an IP address");
    len = sizeof *a;
  }
  check(::bind(s.get(), reinterpret_cast<sockaddr*>(&ss), len), "bind", "finding a free port");
  check(::getsockname(s.get(), reinterpret_cast<sockaddr*>(&ss), &len), "getsockname",
        "finding a free port");
  return ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                  : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

Layout lay_out(std::vector<Host> hosts, const std::string& master_addr, const std::string& bind,
               bool need_bind) {
  if (hosts.empty()) throw std::invalid_argument("no host given");
  Layout l;
  const Host* remote = nullptr;
  for (const auto& h : hosts)
    if (!h.local && !remote) remote = &h;
  if (!bind.empty()) {
    in6_addr any{};
    if (::inet_pton(bind.find(':') != std::string::npos ? AF_INET6 : AF_INET, bind.c_str(),
                    &any) != 1)
      throw std::invalid_argument("the bind address must be an IP address of this machine, got '" +
                                  bind + "'");
    l.bind = bind;
  } else if (!remote) {
    l.bind = "127.0.0.1";
  } else if (need_bind || (master_addr.empty() && hosts[0].local)) {
    l.bind = source_address(remote->name);
  }
  if (!master_addr.empty())
    l.master_addr = master_addr;
  else if (!hosts[0].local)
    l.master_addr = hosts[0].name;
  else
    l.master_addr = remote ? l.bind : "127.0.0.1";
  for (size_t i = 0; i < hosts.size(); ++i) {
    l.first_rank.push_back(l.size());
    for (int r = 0; r < hosts[i].ranks; ++r) {
      l.slot_host.push_back(static_cast<int>(i));
      l.local_rank.push_back(r);
    }
  }
  l.hosts = std::move(hosts);
  return l;
}

int master_port(bool rank0_here, const std::string& address) {
  if (rank0_here) return free_port(address);
  std::random_device rd;
  return kRemotePortLow + static_cast<int>(rd() % (kRemotePortHigh - kRemotePortLow + 1));
}

// -- each rank's environment ------------------------------------------------------------------

int cpu_count() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int omp_threads(int cores, int local_ranks) { return std::max(1, cores / std::max(1, local_ranks)); }

std::vector<std::string> rank_environment(const std::vector<std::string>& base,
                                          const LaunchEnv& launch, int local_rank) {
  const std::string world = std::to_string(launch.world_size);
  const std::string r = std::to_string(launch.rank_offset + local_rank);
  // torchrun's names: the group is this host, numbered among the hosts.
  std::vector<std::pair<std::string, std::string>> ours = {
      {"RANK", r},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", world},
      {"LOCAL_WORLD_SIZE", std::to_string(launch.local_size())},
      {"GROUP_RANK", std::to_string(launch.group_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(launch.group_world_size)},
      {"ROLE_RANK", r},
      {"ROLE_WORLD_SIZE", world},
      {"ROLE_NAME", launch.role},
      {"MASTER_ADDR", launch.master_addr},
      {"MASTER_PORT", std::to_string(launch.master_port)},
  };
  if (launch.cuda_visible_devices)
    ours.emplace_back("CUDA_VISIBLE_DEVICES", *launch.cuda_visible_devices);
  // Defaults torchrun applies too, each only where the user has not chosen: output that arrives
  // as it is printed (torchrun runs `python -u`), NCCL errors surfacing as exceptions, and the
  // thread rule so that N ranks don't oversubscribe the cores.
  std::vector<std::pair<std::string, std::string>> defaults = {
      {"PYTHONUNBUFFERED", "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}};
  if (launch.cores > 0)
    defaults.emplace_back("OMP_NUM_THREADS",
                          std::to_string(omp_threads(launch.cores, launch.local_size())));
  if (launch.cpu_ranks) defaults.emplace_back("ACCELERATE_USE_CPU", "true");
  // torch's flight recorder, so a hang can be told by its collective (%dipstack, a timed-out
  // cell): the last kFlightRecorderEntries collectives of each rank, kept by torch itself.
  defaults.emplace_back("TORCH_FR_BUFFER_SIZE", std::to_string(kFlightRecorderEntries));

  std::vector<std::string> env;
  env.reserve(base.size() + ours.size() + defaults.size());
  for (const auto& entry : base) {
    std::string key = entry.substr(0, entry.find('='));
    // An inherited TORCHELASTIC_USE_AGENT_STORE (a launch inside torchrun) would make rank 0
    // wait for a store that nobody serves.
    if (key.rfind("TORCHELASTIC_", 0) == 0) continue;
    if (std::any_of(ours.begin(), ours.end(), [&](const auto& kv) { return kv.first == key; }))
      continue;
    std::erase_if(defaults, [&](const auto& kv) {
      // torch reads TORCH_NCCL_TRACE_BUFFER_SIZE where TORCH_FR_BUFFER_SIZE is unset: the user's.
      return kv.first == key ||
             (kv.first == "TORCH_FR_BUFFER_SIZE" && key == "TORCH_NCCL_TRACE_BUFFER_SIZE");
    });
    env.push_back(entry);
  }
  for (const auto& [k, v] : ours) env.push_back(k + "=" + v);
  for (const auto& [k, v] : defaults) env.push_back(k + "=" + v);
  return env;
}

void add_thread_default(std::vector<std::string>& env) {
  int local_ranks = 1;
  for (const auto& e : env) {
    if (e.rfind("OMP_NUM_THREADS=", 0) == 0) return;
    if (e.rfind("LOCAL_WORLD_SIZE=", 0) == 0)
      local_ranks = parse_index(e.substr(e.find('=') + 1)).value_or(1);
  }
  env.push_back("OMP_NUM_THREADS=" + std::to_string(omp_threads(cpu_count(), local_ranks)));
}

// -- reaching other hosts -----------------------------------------------------------------------

std::string uniform_cpus(const std::string& cpus_per_node) {
  // "8(x2),8" -> "8"; "8(x2),2" -> "": srun on a node with fewer CPUs would refuse the step.
  std::string value;
  for (const auto& item : split_list(cpus_per_node)) {
    std::string n = item.substr(0, item.find('('));
    if (!parse_index(n) || (!value.empty() && n != value)) return "";
    value = n;
  }
  return value;
}

std::string shell_quote(const std::string& word) {
  if (!word.empty() && std::all_of(word.begin(), word.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("@%+=:,./_-", c);
      }))
    return word;
  std::string out = "'";
  for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> words;
  std::string cur;
  bool in_word = false;
  char quote = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (quote) {
      if (c == quote) {
        quote = 0;
      } else if (c == '\\' && quote == '"' && i + 1 < text.size()) {
        cur += text[++i];
      } else {
        cur += c;
      }
    } else if (c == '\'' || c == '"') {
      quote = c;
      in_word = true;
    } else if (c == '\\' && i + 1 < text.size()) {
      cur += text[++i];
      in_word = true;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      if (in_word) words.push_back(cur);
      cur.clear();
      in_word = false;
    } else {
      cur += c;
      in_word = true;
    }
  }
  if (quote) throw std::invalid_argument("unclosed quote in '" + text + "'");
  if (in_word) words.push_back(cur);
  return words;
}

std::vector<std::string> launcher_argv(const std::string& launcher, const std::string& host,
                                       const std::vector<std::string>& command,
                                       const std::string& slurm_cpus, double link_timeout_s) {
  if (host.empty() || host[0] == '-')
    throw std::invalid_argument("'" + host + "' is not a host name");
  std::string line;
  for (const auto& w : command) line += (line.empty() ? "" : " ") + shell_quote(w);
  bool has_host = launcher.find("{host}") != std::string::npos;
  bool has_command = launcher.find("{command}") != std::string::npos;
  if (has_host || has_command) {
    if (!has_host || !has_command)
      throw std::invalid_argument("the launcher command '" + launcher + "' has no " +
                                  (has_host ? "{command}" : "{host}") +
                                  ": a launcher command needs both {host} and {command}, e.g. "
                                  "'docker exec -i {host} {command}'");
    std::string text = launcher;
    for (auto [key, value] : {std::pair<std::string, std::string>{"{host}", shell_quote(host)},
                              {"{command}", line}}) {
      for (size_t at = text.find(key); at != std::string::npos;
           at = text.find(key, at + value.size()))
        text.replace(at, key.size(), value);
    }
    return {"/bin/sh", "-c", text};
  }
  auto words = split_words(launcher);
  if (words.empty())
    throw std::invalid_argument(
        "the launcher is empty: give ssh (the default), slurm or a "
        "launcher command with {host} and {command}");
  std::vector<std::string> extra(words.begin() + 1, words.end());
  std::vector<std::string> argv;
  if (words[0] == "ssh") {
    // The user's options first: ssh keeps an option's first value. BatchMode: never a password
    // prompt nobody can answer. -T: no terminal, so stdin stays the control channel.
    // ServerAlive: a network that drops without a word ends ssh after about link_timeout_s.
    // exec: no shell left between sshd and the command.
    int alive = std::max(1, static_cast<int>(link_timeout_s / 3));
    argv = {"ssh"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), {"-T", "-o", "BatchMode=yes", "-o",
                             "ServerAliveInterval=" + std::to_string(alive), "-o",
                             "ServerAliveCountMax=3"});
    argv.push_back(host);
    argv.push_back("exec " + line);
    return argv;
  }
  if (words[0] == "slurm" || words[0] == "srun") {
    // One job step with one task on the host, sharing the allocation with the other hosts'.
    argv = {"srun", "--nodes=1", "--ntasks=1", "--nodelist=" + host, "--overlap",
            "--kill-on-bad-exit=1", "--job-name=ddip"};
    if (!slurm_cpus.empty() && parse_index(slurm_cpus))
      argv.push_back("--cpus-per-task=" + slurm_cpus);
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  }
  throw std::invalid_argument(
      "the launcher must be ssh, slurm or a launcher command with {host} "
      "and {command} (e.g. 'docker exec -i {host} {command}'), got '" +
      launcher + "'");
}

}  // namespace ddip::plan
