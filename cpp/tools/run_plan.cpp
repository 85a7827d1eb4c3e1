#include "run_plan.hpp"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <system_error>

#include "ddip/plan.hpp"
#include "run_collectives.hpp"

extern char** environ;

namespace ddip::run {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "" : ",") + x;
  return out;
}

// -r/-t as torchrun's command line writes them ("3", "0:1,1:2").
std::string streams_text(const StdStreams& s) {
  if (!s.per_rank) return std::to_string(s.all);
  std::string out;
  for (auto [rank, streams] : s.by_local_rank)
    out += (out.empty() ? "" : ",") + std::to_string(rank) + ":" + std::to_string(streams);
  return out;
}

// The value `env` gives `name`, as getenv() reads it.
std::optional<std::string> lookup(const std::vector<std::string>& env, const std::string& name) {
  const std::string key = name + "=";
  for (const auto& kv : env)
    if (kv.rfind(key, 0) == 0) return kv.substr(key.size());
  return std::nullopt;
}

// What --gpus entries are resolved against: this process's CUDA_VISIBLE_DEVICES, else the
// machine's GPUs.
plan::GpuView gpu_view(const Machine& m) {
  plan::GpuView view;
  view.env = lookup(m.env, "CUDA_VISIBLE_DEVICES");
  view.physical_count = m.gpu_count();
  view.who = "ddip run";
  view.cpu_hint = "; for CPU processes, give -n 2 (for example) instead of --gpus";
  return view;
}

// --gpus entries -> CUDA_VISIBLE_DEVICES for every rank, in rank order.
std::string resolved_gpus(const std::vector<std::string>& requested, const Machine& m) {
  std::string out;
  for (const auto& g : plan::select_gpus(requested, gpu_view(m)))
    out += (out.empty() ? "" : ",") + g.entry;
  return out;
}

// Ranks given no --gpus see no GPU here: CUDA_VISIBLE_DEVICES hides them all, or there is none.
bool no_visible_gpu(const Machine& m) {
  auto view = gpu_view(m);
  return plan::visible_gpus(view.env, view.physical_count).empty();
}

// --env values replace what the environment here says; torchrun's variables replace both.
std::vector<std::string> base_environment(const std::vector<std::string>& here,
                                          const std::vector<std::string>& overrides) {
  std::vector<std::string> base;
  for (const auto& entry : here) {
    std::string key = entry.substr(0, entry.find('=') + 1);
    if (std::none_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return o.rfind(key, 0) == 0; }))
      base.push_back(entry);
  }
  base.insert(base.end(), overrides.begin(), overrides.end());
  return base;
}

// Whether -r or -t keep any stream in a file.
bool keeps_files(const RunOptions& opts) {
  for (const StdStreams* s : {&opts.redirects, &opts.tee}) {
    if (s->all) return true;
    for (auto [rank, streams] : s->by_local_rank)
      if (streams) return true;
  }
  return false;
}

// torchrun's -r/-t for one local rank: redirected streams go to its files only, teed ones to both;
// --log-dir without either keeps both (ddip run's, as -t 3). Its directory is the attempt's.
RankStreams rank_streams(const RunOptions& opts, int local_rank, int attempt) {
  RankStreams s;
  const int redirect = opts.redirects.of(local_rank), tee = opts.tee.of(local_rank);
  s.to_file = redirect | tee;
  if (!keeps_files(opts) && !opts.log_dir.empty()) s.to_file = 3;
  s.to_console = 3 & ~(redirect & ~tee);
  if (!opts.log_job_dir.empty())
    s.dir =
        opts.log_job_dir + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank);
  return s;
}

// The ranks this machine starts itself, `launch.local_size()` of them.
void add_ranks(std::vector<UnitPlan>& plans, const RunOptions& opts, const Machine& m,
               const LaunchEnv& launch, const std::vector<bool>& shown, const Elastic& elastic) {
  std::vector<std::string> base = base_environment(m.env, opts.env);
  for (int r = 0; r < launch.local_size(); ++r) {
    UnitPlan p;
    p.first_rank = launch.rank_offset + r;
    // --show names ranks of the launch; torchrun's --local-ranks-filter, this node's.
    const auto& only = opts.local_ranks_filter;
    p.shown = shown[static_cast<size_t>(p.first_rank)] &&
              (only.empty() || std::find(only.begin(), only.end(), r) != only.end());
    p.streams = rank_streams(opts, r, elastic.restart_count);
    p.spec.argv = opts.command;
    // torch.distributed.launch without --use-env: the script reads its local rank from argv.
    if (opts.local_rank_arg_at >= 0)
      p.spec.argv.insert(p.spec.argv.begin() + opts.local_rank_arg_at,
                         "--local-rank=" + std::to_string(r));
    p.spec.env = rank_environment(base, launch, r);
    // torchrun's layout with a log directory: <local rank>/error.json beside its stream logs.
    if (elastic.errors)
      p.error_file = p.streams.dir.empty() ? elastic.errors->path(p.first_rank)
                                           : p.streams.dir + "/error.json";
    add_elastic_environment(p.spec.env, elastic.run_id, p.error_file, elastic.restart_count,
                            elastic.max_restarts);
    // torchrun's value is its --signals-to-handle, which ddip run forwards (forwarded_signals).
    for (auto& kv : p.spec.env)
      if (kv.rfind("TORCHELASTIC_SIGNALS_TO_HANDLE=", 0) == 0)
        kv = "TORCHELASTIC_SIGNALS_TO_HANDLE=" + join(opts.signals_to_handle);
    // breakpoint() prompts through ddip run (run_prompts.hpp); a user's own choice stays.
    if (!lookup(p.spec.env, "PYTHONBREAKPOINT"))
      p.spec.env.push_back(std::string("PYTHONBREAKPOINT=") + kBreakpointHook);
    // Where every rank is, at a timeout or Ctrl-C (run_collectives.hpp); DDIP_RUN_HOOK=0 stays.
    add_hook_environment(p.spec.env, elastic.hook_dir);
    p.spec.stdin_pipe = opts.prompts;
    plans.push_back(std::move(p));
  }
}

// What every host of a launch shares.
struct Meeting {
  std::string master_addr;
  int master_port = 0;
  int world_size = 0;
  int nhosts = 0;
};

// Host `i` (this machine) of several: its ranks' place among all of them.
LaunchEnv this_host(const RunOptions& opts, const Machine& m, const Meeting& at, size_t i,
                    int first_rank) {
  const HostSpec& h = opts.hosts[i];
  LaunchEnv here;
  here.world_size = at.world_size;
  here.local_world_size = h.ranks;
  here.rank_offset = first_rank;
  here.group_rank = static_cast<int>(i);
  here.group_world_size = at.nhosts;
  here.master_addr = at.master_addr;
  here.master_port = at.master_port;
  here.cores = m.cores;
  if (!h.gpus.empty())
    here.cuda_visible_devices = resolved_gpus(h.gpus, m);
  else
    here.cpu_ranks = no_visible_gpu(m);
  return here;
}

// The ddip run that host `i` starts for its ranks (--node and its companions), and the flags of
// this one it passes on.
std::vector<std::string> node_command(const RunOptions& opts, const Machine& m, const Meeting& at,
                                      size_t i, int first_rank, const Elastic& elastic,
                                      bool shipping) {
  const HostSpec& h = opts.hosts[i];
  std::vector<std::string> cmd = {opts.remote_ddip.empty() ? m.self : opts.remote_ddip,
                                  "run",
                                  "--node",
                                  std::to_string(first_rank) + "," + std::to_string(at.world_size) +
                                      "," + std::to_string(i) + "," + std::to_string(at.nhosts),
                                  "--node-name",
                                  h.name,
                                  "--node-run-id",
                                  elastic.run_id,
                                  "--master-addr",
                                  at.master_addr,
                                  "--master-port",
                                  std::to_string(at.master_port),
                                  "--show",
                                  opts.show,
                                  "--role",
                                  opts.role,
                                  "--tee",
                                  streams_text(opts.tee),
                                  "--redirects",
                                  streams_text(opts.redirects),
                                  "--signals-to-handle",
                                  join(opts.signals_to_handle)};
  if (!opts.local_ranks_filter.empty()) {
    std::string f;
    for (int r : opts.local_ranks_filter) f += (f.empty() ? "" : ",") + std::to_string(r);
    cmd.insert(cmd.end(), {"--local-ranks-filter", f});
  }
  if (!m.cwd.empty()) cmd.insert(cmd.end(), {"--node-cwd", m.cwd});
  if (shipping) cmd.insert(cmd.end(), {"--node-files", std::to_string(opts.ship.size())});
  // The attempt's count, for its ranks' TORCHELASTIC_RESTART_COUNT (this ddip run restarts).
  if (elastic.max_restarts > 0) {
    // append(), not +: GCC 12's -Wrestrict misfires on the latter at -O3.
    std::string restart = std::to_string(elastic.restart_count);
    restart.append(",").append(std::to_string(elastic.max_restarts));
    cmd.insert(cmd.end(), {"--node-restart", restart});
  }
  if (opts.prompts) cmd.push_back("--node-prompts");
  if (opts.raw) cmd.push_back("--raw");  // a host's ddip run collapses its own ranks' repeats
  std::ostringstream t;
  t << opts.link_timeout_s;
  cmd.insert(cmd.end(), {"--link-timeout", t.str()});
  for (const auto& e : opts.env) cmd.insert(cmd.end(), {"--env", e});
  if (h.gpus.empty())
    cmd.insert(cmd.end(), {"-n", std::to_string(h.ranks)});
  else
    cmd.insert(cmd.end(), {"--gpus", join(h.gpus)});
  // Relative to this directory, which that host may not share.
  if (!opts.log_dir.empty())
    cmd.insert(cmd.end(), {"--log-dir", (std::filesystem::path(m.cwd) / opts.log_dir).string()});
  // The command as given: that host's ddip run finds its own Python for a script.
  if (opts.module) cmd.push_back("--module");
  if (opts.no_python) cmd.push_back("--no-python");
  if (opts.run_path) cmd.push_back("--run-path");
  if (opts.local_rank_arg_at >= 0) cmd.push_back("--local-rank-arg");
  cmd.push_back("--");
  cmd.insert(cmd.end(), opts.given_command.begin(), opts.given_command.end());
  return cmd;
}

// Host `i`, another one: its launcher, with the host's ddip run as its command.
UnitPlan other_host(const RunOptions& opts, const Machine& m, const Meeting& at, size_t i,
                    int first_rank, const Elastic& elastic, const std::string& shipped) {
  const HostSpec& h = opts.hosts[i];
  UnitPlan p;
  p.host = true;
  p.name = h.name;
  p.first_rank = first_rank;
  p.nranks = h.ranks;
  p.spec.argv = launcher_argv(
      opts.launcher, h.name, node_command(opts, m, at, i, first_rank, elastic, !shipped.empty()),
      uniform_cpus(lookup(m.env, "SLURM_JOB_CPUS_PER_NODE").value_or("")), opts.link_timeout_s);
  p.spec.env = m.env;
  p.spec.stdin_pipe = true;
  p.ship = shipped;
  return p;
}

// Ranks host by host. Rank 0's host serves MASTER_ADDR:MASTER_PORT for torch.distributed.
void add_hosts(std::vector<UnitPlan>& plans, const RunOptions& opts, const Machine& m, int world,
               const std::vector<bool>& shown, const Elastic& elastic, const std::string& shipped) {
  plan::Layout layout = plan::lay_out(opts.hosts, opts.master_addr, "", false);
  Meeting at;
  at.master_addr = layout.master_addr;
  at.master_port =
      opts.master_port ? opts.master_port : m.master_port(opts.hosts[0].local, "0.0.0.0");
  at.world_size = world;
  at.nhosts = static_cast<int>(opts.hosts.size());
  for (size_t i = 0; i < opts.hosts.size(); ++i) {
    const int first_rank = layout.first_rank[i];
    if (opts.hosts[i].local)
      add_ranks(plans, opts, m, this_host(opts, m, at, i, first_rank), shown, elastic);
    else
      plans.push_back(other_host(opts, m, at, i, first_rank, elastic, shipped));
  }
}

std::string self_path() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("ddip") : p.string();
}

}  // namespace

Machine this_machine() {
  Machine m;
  for (char** e = ::environ; *e; ++e) m.env.emplace_back(*e);
  m.cores = plan::cpu_count();
  m.gpu_count = plan::nvidia_device_count;
  std::error_code ec;
  m.cwd = std::filesystem::current_path(ec).string();
  m.self = self_path();
  m.master_port = [](bool rank0_here, const std::string& address) {
    return plan::master_port(rank0_here, address);
  };
  return m;
}

std::string make_log_job_dir(const RunOptions& opts, const std::string& run_id,
                             const std::string& prog) {
  if (!opts.log_dir.empty()) return make_job_log_dir(opts.log_dir, run_id);
  if (!keeps_files(opts)) return "";
  std::string dir = make_temporary_log_dir();
  std::cerr << prog << ": log files in " << dir << " (-r/-t without --log-dir)\n";
  return make_job_log_dir(dir, run_id);
}

std::vector<UnitPlan> plan_units(const RunOptions& opts, const Machine& m, const Elastic& elastic,
                                 const std::string& shipped) {
  LaunchEnv launch;
  launch.cores = m.cores;
  if (!opts.gpus.empty()) {
    launch.cuda_visible_devices = resolved_gpus(opts.gpus, m);
    launch.world_size = static_cast<int>(plan::split_list(*launch.cuda_visible_devices).size());
  } else if (opts.hosts.empty()) {
    launch.world_size = opts.nproc;
    launch.cpu_ranks = no_visible_gpu(m);
  }
  const int world = opts.node ? opts.node->world_size : opts.world_size();
  const std::vector<bool> shown = shown_ranks(opts.show, world);
  std::vector<UnitPlan> plans;
  if (!opts.hosts.empty()) {
    add_hosts(plans, opts, m, world, shown, elastic, shipped);
    return plans;
  }
  if (opts.node) {
    launch.local_world_size = launch.world_size;
    launch.world_size = opts.node->world_size;
    launch.rank_offset = opts.node->rank_offset;
    launch.group_rank = opts.node->node_rank;
    launch.group_world_size = opts.node->nnodes;
  }
  launch.master_addr = opts.master_addr.empty() ? "127.0.0.1" : opts.master_addr;
  launch.master_port = opts.master_port ? opts.master_port : m.master_port(true, "127.0.0.1");
  launch.role = opts.role;
  add_ranks(plans, opts, m, launch, shown, elastic);
  return plans;
}

}  // namespace ddip::run
