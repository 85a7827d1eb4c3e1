#include "run_args.hpp"

#include <algorithm>
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
                   "GPU-/MIG- UUIDs, or 'all'")
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
  run_->add_flag("--die-with-parent", opts_.die_with_parent,
                 "Exit, and so stop every rank, when the process that started ddip run dies "
                 "(for programs that drive it, such as %%diprun)");
  // Never given to CLI11 (parse() splits the command off first); declared so that --help shows
  // the usage line and what COMMAND is.
  run_->add_option("COMMAND", command_doc_,
                   "What every rank runs, with its arguments, e.g. python train.py --lr 0.1. "
                   "Put it after -- when it could be taken for a flag of ddip run");
  run_->footer(
      "Each rank's stdin is /dev/null. Ranks also get OMP_NUM_THREADS=1 (when there is more "
      "than one) and PYTHONUNBUFFERED=1, unless already set. Ctrl-C (SIGINT) and SIGTERM are "
      "forwarded to every rank's process group; a second one kills the ranks.");
}

RunOptions CommandLine::parse(const std::vector<std::string>& args) {
  opts_ = RunOptions{};
  gpus_.clear();
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
  if (run_->count("--gpus")) {
    opts_.gpus = detail::split_list(gpus_);
    for (const auto& g : opts_.gpus)
      if (g.empty())
        throw CLI::ValidationError("--gpus", "an entry is empty; give GPUs like 0,3 or all");
  }
  return opts_;
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
                                          const LaunchEnv& launch, int rank) {
  const std::string world = std::to_string(launch.world_size);
  const std::string r = std::to_string(rank);
  // torchrun's names, one host: the local rank is the rank and the group is this host.
  std::vector<std::pair<std::string, std::string>> ours = {
      {"RANK", r},
      {"LOCAL_RANK", r},
      {"WORLD_SIZE", world},
      {"LOCAL_WORLD_SIZE", world},
      {"GROUP_RANK", "0"},
      {"GROUP_WORLD_SIZE", "1"},
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
  if (launch.world_size > 1) defaults.emplace_back("OMP_NUM_THREADS", "1");

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
