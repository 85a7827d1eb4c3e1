#include "run_args.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>

namespace ddip::run {
namespace detail {

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

// A small non-negative decimal, or nullopt; nine digits keep it inside int.
std::optional<int> index_of(const std::string& s) {
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), ::isdigit)) return std::nullopt;
  return std::stoi(s);
}

std::string positions(size_t n) {
  return n == 1 ? "position 0" : "positions 0-" + std::to_string(n - 1);
}

}  // namespace detail

CommandLine::CommandLine()
    : app_("ddip: distributed data-parallel PyTorch on a C++ runtime", "ddip") {
  app_.require_subcommand(1);
  run_ = app_.add_subcommand(
      "run",
      "Start COMMAND once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
      "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and show every rank's output line by line, "
      "labelled [rank]. The first rank to fail stops the others; ddip run then exits with its "
      "code.");
  auto* n = run_->add_option("-n,--nproc-per-node", opts_.nproc,
                             "Number of ranks (CPU processes), default 1")
                ->type_name("N")
                ->check(CLI::Range(1, 1024));
  run_->add_option("--gpus", gpus_,
                   "One rank per listed GPU, in this order: rank i uses device index i. "
                   "Entries are indices (positions in CUDA_VISIBLE_DEVICES when that is set), "
                   "GPU-/MIG- UUIDs, or 'all'. Across hosts: 'node1:0,1 node2:2,3', or with "
                   "--hosts node1,node2 the GPUs every host uses")
      ->type_name("LIST")
      ->excludes(n);
  run_->add_option("--tee", opts_.tee,
                   "Ranks whose output reaches the terminal: all (default), none, or a comma "
                   "list of ranks such as 0")
      ->check(
          [](const std::string& v) -> std::string {
            if (v == "all" || v == "none") return {};
            for (const auto& item : detail::split_list(v))
              if (!detail::index_of(item))
                return "'" + item + "' is not a rank; give all, none, or ranks like 0 or 0,2";
            return {};
          },
          "")
      ->type_name("all|none|RANKS");
  run_->add_option("--log-dir", opts_.log_dir,
                   "Also write each rank's full output to DIR/rank<i>.stdout and "
                   "DIR/rank<i>.stderr (DIR is created)")
      ->type_name("DIR");
  run_->add_option("--timeout", opts_.timeout_s,
                   "Stop every rank after this many seconds and exit with 124")
      ->type_name("SECONDS")
      ->check(CLI::Validator(CLI::PositiveNumber).description(""));
  run_->add_option("-e,--env", env_,
                   "Set NAME for every rank, on every host: NAME=VALUE, or NAME alone for its "
                   "value here. Repeat for more. Ranks on other hosts otherwise start with "
                   "their host's own environment; values travel on a command line there, so "
                   "pass no secrets this way")
      ->type_name("NAME[=VALUE]")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  run_->add_option("--hosts", hosts_,
                   "Ranks on several hosts, numbered host by host: node1:4,node2:4 (CPU ranks), "
                   "'node1[0,1] node2[2,3]' (one rank per listed GPU), or node1,node2 with "
                   "--gpus. This machine may be one of them (localhost or its name); every other "
                   "host is reached with --launcher and runs the same ddip program (--ddip)")
      ->type_name("LIST")
      ->excludes(n);
  run_->add_option("--launcher", opts_.launcher,
                   "How --hosts are reached: ssh (default; 'ssh -p 2222' adds ssh options), "
                   "slurm (srun, inside an allocation; 'slurm --mpi=none' adds srun options), or "
                   "a template with {host} and {command}, run by /bin/sh")
      ->type_name("LAUNCHER");
  run_->add_option("--ddip", opts_.remote_ddip,
                   "The ddip program on the other hosts (default: this one's path, as for a "
                   "shared or identical environment)")
      ->type_name("PATH");
  run_->add_option("--link-timeout", opts_.link_timeout_s,
                   "With --hosts: how long another host's ddip run goes on without hearing from "
                   "this one (or without being able to send its output) before it stops its ranks; "
                   "ssh gives up on a silent host after about as long. Default 30")
      ->type_name("SECONDS")
      ->check(CLI::Range(1.0, 86400.0));
  run_->add_option("--master-addr", opts_.master_addr,
                   "MASTER_ADDR for every rank (default: 127.0.0.1 on one host; with --hosts, "
                   "rank 0's host: its name, or this machine's address towards the first other "
                   "host)")
      ->type_name("ADDR");
  run_->add_option("--master-port", opts_.master_port,
                   "MASTER_PORT for every rank (default: a free port here; a random one in "
                   "29500-30499 when rank 0 runs on another host)")
      ->type_name("PORT")
      ->check(CLI::Range(1, 65535));
  // Set by a ddip run on the ddip run it starts on each other host; not for people.
  run_->add_option("--node", node_spec_, "RANK_OFFSET,WORLD_SIZE,NODE_RANK,NNODES")->group("");
  run_->add_option("--node-name", node_.name)->group("");
  run_->add_option("--node-cwd", node_.cwd)->group("");
  run_->add_flag("--die-with-parent", opts_.die_with_parent,
                 "Exit, and so stop every rank, when the process that started ddip run dies "
                 "(for programs that drive it, such as %%diprun)");
  // Never given to CLI11 (parse() splits the command off first); declared so that --help shows
  // the usage line and what COMMAND is.
  run_->add_option("COMMAND", command_doc_,
                   "What every rank runs, with its arguments, e.g. python train.py --lr 0.1. "
                   "Put it after -- when it could be taken for a flag of ddip run");
  run_->footer(
      "Each rank's stdin is /dev/null. Ranks also get OMP_NUM_THREADS=1 (when their host runs "
      "more than one) and PYTHONUNBUFFERED=1, unless already set. Ctrl-C (SIGINT) and SIGTERM "
      "are forwarded to every rank's process group, on every host; a second one kills the "
      "ranks. With --hosts, ranks on other hosts get that host's own environment (as under "
      "torchrun) plus the variables above, and run in this directory when it exists there.");
}

RunOptions CommandLine::parse(const std::vector<std::string>& args) {
  opts_ = RunOptions{};
  gpus_.clear();
  hosts_.clear();
  env_.clear();
  node_spec_.clear();
  node_ = NodeOptions{};
  // The command's own flags must never reach CLI11: it starts at the first token that is neither
  // one of our flags nor a flag's value, or after "--".
  std::vector<std::string> ours;
  std::vector<std::string> command;
  bool in_run = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!in_run) {
      ours.push_back(a);
      in_run = a == "run";
      continue;
    }
    if (a == "--") {
      command.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      break;
    }
    if (a.size() < 2 || a[0] != '-') {
      command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
      break;
    }
    ours.push_back(a);
    // "--flag value" and "-n 2" take the next token too; "--flag=value" and "-n2" don't.
    bool attached = a.rfind("--", 0) == 0 ? a.find('=') != std::string::npos : a.size() > 2;
    const CLI::Option* opt = run_->get_option_no_throw(a);
    if (!attached && opt && opt->get_items_expected_min() > 0 && i + 1 < args.size())
      ours.push_back(args[++i]);
  }
  std::reverse(ours.begin(), ours.end());  // CLI11 takes a vector last-first
  app_.parse(ours);
  if (command.empty()) throw CLI::RequiredError("COMMAND");
  opts_.command = std::move(command);
  // --gpus says each host's GPUs when there are hosts: with --hosts node1,node2, or naming them.
  bool across = run_->count("--hosts") || (run_->count("--gpus") && gpus_.find(':') != std::string::npos);
  if (run_->count("--gpus") && !across) {
    opts_.gpus = detail::split_list(gpus_);
    for (const auto& g : opts_.gpus)
      if (g.empty())
        throw CLI::ValidationError("--gpus", "an entry is empty; give GPUs like 0,3 or all");
  }
  if (!across) {
    for (const char* flag : {"--launcher", "--ddip"})
      if (run_->count(flag))
        throw CLI::ValidationError(flag, std::string(flag) + " requires --hosts");
  }
  for (const auto& e : env_) {
    auto eq = e.find('=');
    std::string name = e.substr(0, eq);
    bool ok = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
              std::all_of(name.begin(), name.end(), [](char c) {
                return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
              });
    if (!ok)
      throw CLI::ValidationError("--env", "'" + e + "' is not NAME or NAME=VALUE");
    if (eq != std::string::npos) {
      opts_.env.push_back(e);
    } else if (const char* v = std::getenv(name.c_str())) {
      opts_.env.push_back(name + "=" + v);
    } else {
      throw CLI::ValidationError("--env", name + " is not set here; give NAME=VALUE");
    }
  }
  if (across) {
    try {
      std::string text = hosts_;
      if (run_->count("--gpus"))
        text = hosts_with_gpus(run_->count("--hosts") ? std::optional<std::string>(hosts_)
                                                      : std::nullopt,
                               gpus_);
      opts_.hosts = parse_hosts(text, is_this_host);
      std::vector<std::string> remote = {"true"};
      for (const auto& h : opts_.hosts)
        if (!h.local) launcher_argv(opts_.launcher, h.name, remote);
    } catch (const std::invalid_argument& e) {
      const char* flag = run_->count("--launcher") ? "--launcher"
                         : run_->count("--gpus")   ? "--gpus"
                                                   : "--hosts";
      throw CLI::ValidationError(flag, e.what());
    }
  }
  if (run_->count("--node")) {
    auto parts = detail::split_list(node_spec_);
    std::vector<int> v;
    for (const auto& p : parts)
      if (auto i = detail::index_of(p)) v.push_back(*i);
    if (parts.size() != 4 || v.size() != 4 || v[1] < 1 || v[3] < 1 || v[2] >= v[3] ||
        v[0] + opts_.world_size() > v[1])
      throw CLI::ValidationError("--node", "expected RANK_OFFSET,WORLD_SIZE,NODE_RANK,NNODES "
                                           "that fit this host's ranks, got " + node_spec_);
    node_.rank_offset = v[0];
    node_.world_size = v[1];
    node_.node_rank = v[2];
    node_.nnodes = v[3];
    opts_.node = node_;
  }
  return opts_;
}

bool is_this_host(const std::string& name) {
  if (name == "localhost" || name == "127.0.0.1" || name == "::1") return true;
  char buf[HOST_NAME_MAX + 1] = {};
  return ::gethostname(buf, sizeof buf - 1) == 0 && name == buf;
}

std::vector<HostSpec> parse_hosts(const std::string& text,
                                  bool (*is_local)(const std::string& name)) {
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
  std::vector<HostSpec> out;
  std::set<std::string> seen;
  int locals = 0;
  for (const auto& item : items) {
    HostSpec h;
    auto open = item.find('[');
    if (open != std::string::npos) {
      if (item.back() != ']')
        throw std::invalid_argument("can't read host '" + item +
                                    "': write NAME[GPUS], e.g. node1[0,1]");
      h.name = item.substr(0, open);
      std::string inner = item.substr(open + 1, item.size() - open - 2);
      h.gpus = detail::split_list(inner);
      for (const auto& g : h.gpus) {
        bool uuid = g.rfind("GPU-", 0) == 0 || g.rfind("MIG-", 0) == 0;
        if (!uuid && !detail::index_of(g))
          throw std::invalid_argument("host '" + h.name + "': '" + g +
                                      "' is not a GPU; write GPUs as indices or UUIDs, e.g. " +
                                      h.name + "[0,1]");
      }
      if (std::set<std::string>(h.gpus.begin(), h.gpus.end()).size() != h.gpus.size())
        throw std::invalid_argument("host '" + h.name + "' lists a GPU twice: [" + inner + "]");
      h.ranks = static_cast<int>(h.gpus.size());
    } else {
      auto colon = item.rfind(':');
      if (colon == std::string::npos)
        throw std::invalid_argument("host '" + item + "' has no rank count: write " + item +
                                    ":4 (CPU ranks) or " + item + "[0,1] (one rank per GPU)");
      h.name = item.substr(0, colon);
      auto count = detail::index_of(item.substr(colon + 1));
      if (!count)
        throw std::invalid_argument("can't read host '" + item +
                                    "': write NAME:RANKS (node1:4) or NAME[GPUS] (node1[0,1])");
      if (*count < 1 || *count > 1024)
        throw std::invalid_argument("host '" + h.name + "' needs 1 to 1024 ranks, got " +
                                    std::to_string(*count));
      h.ranks = *count;
    }
    if (!name_ok(h.name))
      throw std::invalid_argument("'" + h.name + "' is not a host name");
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
  auto items = [](const std::string& text, const char* seps) {
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
  };
  std::vector<std::string> names;
  if (hosts) {
    names = items(*hosts, ", \t");
    if (names.empty()) throw std::invalid_argument("no host given; write hosts like node1,node2");
    for (const auto& n : names) {
      auto colon = n.rfind(':');
      if (n.find('[') != std::string::npos ||
          (colon != std::string::npos && detail::index_of(n.substr(colon + 1))))
        throw std::invalid_argument("with --gpus, list the hosts by name only (node1,node2), got '" +
                                    n + "'; --gpus says their GPUs");
    }
  }
  std::vector<std::pair<std::string, std::string>> per_host;  // host, its GPU list
  if (gpus.find(':') != std::string::npos) {
    for (const auto& item : items(gpus, " \t;")) {
      auto colon = item.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == item.size())
        throw std::invalid_argument("can't read --gpus '" + item +
                                    "': write HOST:GPUS for each host, e.g. 'node1:0,1 node2:2,3'");
      std::string name = item.substr(0, colon);
      for (const auto& [h, _] : per_host)
        if (h == name) throw std::invalid_argument("--gpus names host " + name + " twice");
      per_host.emplace_back(name, item.substr(colon + 1));
    }
    if (hosts) {
      std::vector<std::string> a = names, b;
      for (const auto& [h, _] : per_host) b.push_back(h);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b)
        throw std::invalid_argument("--gpus names other hosts than --hosts; give each host's GPUs "
                                    "once, e.g. --gpus 'node1:0,1 node2:2,3'");
      std::vector<std::pair<std::string, std::string>> ordered;
      for (const auto& n : names)
        for (const auto& hp : per_host)
          if (hp.first == n) ordered.push_back(hp);
      per_host = std::move(ordered);
    }
  } else {
    if (!hosts)
      throw std::invalid_argument("GPUs for several hosts need the hosts: --gpus 'node1:0,1 node2:2,3'");
    if (gpus == "all")
      throw std::invalid_argument("'all' can't count the GPUs of other hosts from here; list them, "
                                  "e.g. --gpus 0,1,2,3");
    for (const auto& n : names) per_host.emplace_back(n, gpus);
  }
  std::string out;
  for (const auto& [h, g] : per_host) out += (out.empty() ? "" : " ") + h + "[" + g + "]";
  return out;
}

std::string uniform_cpus(const std::string& cpus_per_node) {
  // "8(x2),8" -> "8"; "8(x2),2" -> "": srun on a node with fewer CPUs would refuse the step.
  std::string value;
  for (const auto& item : detail::split_list(cpus_per_node)) {
    std::string n = item.substr(0, item.find('('));
    if (!detail::index_of(n) || (!value.empty() && n != value)) return "";
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
                                       const std::vector<std::string>& remote,
                                       const std::string& slurm_cpus, double link_timeout_s) {
  std::string command;
  for (const auto& w : remote) command += (command.empty() ? "" : " ") + shell_quote(w);
  bool has_host = launcher.find("{host}") != std::string::npos;
  bool has_command = launcher.find("{command}") != std::string::npos;
  if (has_host || has_command) {
    if (!has_host || !has_command)
      throw std::invalid_argument("a launcher template needs both {host} and {command}, e.g. "
                                  "'docker exec -i {host} {command}'");
    std::string text = launcher;
    for (auto [key, value] : {std::pair<std::string, std::string>{"{host}", shell_quote(host)},
                              {"{command}", command}}) {
      for (size_t at = text.find(key); at != std::string::npos;
           at = text.find(key, at + value.size()))
        text.replace(at, key.size(), value);
    }
    return {"/bin/sh", "-c", text};
  }
  auto words = split_words(launcher);
  if (words.empty())
    throw std::invalid_argument("the launcher is empty; give ssh, slurm or a template");
  std::vector<std::string> extra(words.begin() + 1, words.end());
  std::vector<std::string> argv;
  if (words[0] == "ssh") {
    // The user's options first: ssh keeps an option's first value. BatchMode: never a password
    // prompt nobody can answer. -T: no terminal, so stdin stays the control channel.
    // ServerAlive: a network that drops without a word ends ssh after about link_timeout_s (the
    // host's ddip run notices the silence itself). exec: no shell left between sshd and ddip.
    int alive = std::max(1, static_cast<int>(link_timeout_s / 3));
    argv = {"ssh"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), {"-T", "-o", "BatchMode=yes", "-o",
                             "ServerAliveInterval=" + std::to_string(alive), "-o",
                             "ServerAliveCountMax=3"});
    argv.push_back(host);
    argv.push_back("exec " + command);
    return argv;
  }
  if (words[0] == "slurm" || words[0] == "srun") {
    // One job step with one task on the host, sharing the allocation with the other hosts'.
    argv = {"srun", "--nodes=1", "--ntasks=1", "--nodelist=" + host, "--overlap",
            "--kill-on-bad-exit=1", "--job-name=ddip"};
    if (!slurm_cpus.empty() && detail::index_of(slurm_cpus))
      argv.push_back("--cpus-per-task=" + slurm_cpus);
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), remote.begin(), remote.end());
    return argv;
  }
  throw std::invalid_argument("the launcher must be ssh, slurm or a template with {host} and "
                              "{command}, got '" + launcher + "'");
}

std::vector<bool> tee_ranks(const std::string& tee, int world_size) {
  std::vector<bool> shown(static_cast<size_t>(world_size), tee == "all");
  if (tee == "all" || tee == "none") return shown;
  for (const auto& item : detail::split_list(tee)) {
    auto r = detail::index_of(item);
    if (!r)
      throw CLI::ValidationError("--tee",
                                 "'" + item + "' is not a rank; give all, none, or ranks like 0,2");
    if (*r >= world_size)
      throw CLI::ValidationError(
          "--tee", "there is no rank " + item + ": ranks are 0-" + std::to_string(world_size - 1));
    shown[static_cast<size_t>(*r)] = true;
  }
  return shown;
}

std::vector<std::string> resolve_gpus(const std::vector<std::string>& requested,
                                      const std::optional<std::string>& visible,
                                      std::optional<int> device_count) {
  std::vector<std::string> view;
  if (visible && !visible->empty()) view = detail::split_list(*visible);
  auto uuid = [](const std::string& s) {
    return s.rfind("GPU-", 0) == 0 || s.rfind("MIG-", 0) == 0;
  };
  std::vector<std::string> out;
  if (requested.size() == 1 && requested[0] == "all") {
    if (visible) {
      out = view;
    } else if (device_count) {
      for (int i = 0; i < *device_count; ++i) out.push_back(std::to_string(i));
    } else {
      throw std::invalid_argument(
          "'all' needs to count this machine's GPUs, and /proc/driver/nvidia/gpus is missing; "
          "list them instead, e.g. --gpus 0,1");
    }
    if (out.empty())
      throw std::invalid_argument(
          visible ? "'all', but CUDA_VISIBLE_DEVICES is empty: no GPU is visible"
                  : "'all', but this machine has no NVIDIA GPU; use -n 2 (for example) for CPU "
                    "processes");
    return out;
  }
  for (const auto& entry : requested) {
    if (uuid(entry)) {
      out.push_back(entry);
      continue;
    }
    auto idx = detail::index_of(entry);
    if (!idx)
      throw std::invalid_argument("'" + entry +
                                  "' is not a GPU; give indices like 0,3, UUIDs (GPU-..., "
                                  "MIG-...), or all");
    if (visible) {
      if (static_cast<size_t>(*idx) >= view.size()) {
        std::string have = view.empty()
                               ? "is empty, so no GPU is visible"
                               : "= " + *visible + " lists " + std::to_string(view.size()) +
                                     " GPU(s), so --gpus takes " + detail::positions(view.size());
        throw std::invalid_argument("GPU " + entry + " is not visible: CUDA_VISIBLE_DEVICES " +
                                    have);
      }
      out.push_back(view[static_cast<size_t>(*idx)]);
    } else {
      if (device_count && *idx >= *device_count)
        throw std::invalid_argument(
            "GPU " + entry + " does not exist: this machine has " +
            (*device_count
                 ? "GPUs 0-" + std::to_string(*device_count - 1)
                 : std::string("no NVIDIA GPU; use -n 2 (for example) for CPU processes")));
      out.push_back(std::to_string(*idx));
    }
  }
  for (size_t i = 0; i < out.size(); ++i)
    if (std::find(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(i), out[i]) !=
        out.begin() + static_cast<std::ptrdiff_t>(i))
      throw std::invalid_argument("GPU " + out[i] +
                                  " is listed twice; each rank needs its own GPU");
  return out;
}

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
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", launch.master_addr},
      {"MASTER_PORT", std::to_string(launch.master_port)},
  };
  if (launch.cuda_visible_devices)
    ours.emplace_back("CUDA_VISIBLE_DEVICES", *launch.cuda_visible_devices);
  // Defaults torchrun applies too, each only where the user has not chosen: one OpenMP thread
  // per rank so that N ranks don't oversubscribe the cores, NCCL errors surfacing as exceptions,
  // and (torchrun runs `python -u`) output that arrives as it is printed.
  std::vector<std::pair<std::string, std::string>> defaults = {
      {"PYTHONUNBUFFERED", "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}};
  if (launch.local_size() > 1) defaults.emplace_back("OMP_NUM_THREADS", "1");
  if (launch.cpu_ranks) defaults.emplace_back("ACCELERATE_USE_CPU", "true");

  std::vector<std::string> env;
  env.reserve(base.size() + ours.size() + defaults.size());
  for (const auto& entry : base) {
    std::string key = entry.substr(0, entry.find('='));
    // An inherited TORCHELASTIC_USE_AGENT_STORE (ddip run inside torchrun) would make rank 0
    // wait for a store that nobody serves.
    if (key.rfind("TORCHELASTIC_", 0) == 0) continue;
    if (std::any_of(ours.begin(), ours.end(), [&](const auto& kv) { return kv.first == key; }))
      continue;
    std::erase_if(defaults, [&](const auto& kv) { return kv.first == key; });
    env.push_back(entry);
  }
  for (const auto& [k, v] : ours) env.push_back(k + "=" + v);
  for (const auto& [k, v] : defaults) env.push_back(k + "=" + v);
  return env;
}

}  // namespace ddip::run
