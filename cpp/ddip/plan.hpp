// The launch plan: everything decided before a rank starts, in one place for every way in
// (Group, ranch, %makedip, ddip run): which hosts, how many ranks on each, which GPUs (resolved
// against what is visible), each rank's environment (torchrun's variables, the thread-count rule),
// where rank 0 listens, and the command line that reaches another host. Plain data in, data out;
// only is_this_host(), source_address(), free_port() and the count functions look at the machine.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace ddip::plan {

// The most ranks one host runs: a typo (node1:40000) must not fork-bomb a machine.
inline constexpr int kMaxRanksPerHost = 1024;
// When rank 0 runs on another host, ports free there can't be seen from here: one is drawn from
// torchrun's customary range.
inline constexpr int kRemotePortLow = 29500, kRemotePortHigh = 30499;

// "a, b,c" -> {"a", "b", "c"}: comma-separated entries, spaces around each trimmed, empty ones kept.
std::vector<std::string> split_list(const std::string& s);
// A small non-negative decimal ("3", "03"), or nullopt; nine digits keep it inside int.
std::optional<int> parse_index(const std::string& s);

// One host of a launch: its ranks' count, or one rank per listed GPU.
struct Host {
  std::string name;
  int ranks = 0;
  std::vector<std::string> gpus;  // CUDA_VISIBLE_DEVICES entries ("node1[0,1]"); empty: CPU ranks
  bool local = false;             // this machine: its ranks start here, without a launcher
};

// Whether `name` is this machine: localhost, 127.0.0.1, ::1, its host name or its fully
// qualified name.
bool is_this_host(const std::string& name);

// "node1:4,node2:4" or "node1[0,1] node2[2,3]" (commas or spaces between hosts) -> hosts, in
// rank order. A host name is letters, digits and ".-_:" and never starts with '-' (it would reach
// ssh as a flag); 1 to kMaxRanksPerHost ranks each. Throws std::invalid_argument saying what is
// wrong and how to write it.
std::vector<Host> parse_hosts(const std::string& text,
                              bool (*is_local)(const std::string& name) = is_this_host);

// Hosts and GPUs given apart, as one host list for parse_hosts(): the same GPUs on every host
// (hosts "node1,node2", gpus "0,1"), or each host's own (gpus "node1:0,1 node2:2,3", with or
// without hosts naming the same hosts). Throws std::invalid_argument.
std::string hosts_with_gpus(const std::optional<std::string>& hosts, const std::string& gpus);

// -- GPUs -------------------------------------------------------------------------------------

// This machine's NVIDIA GPUs as the driver lists them (/proc/driver/nvidia/gpus), or, where /proc
// has no such list (WSL, some containers), as `nvidia-smi -L` does; 0 without one.
int nvidia_device_count();

// A launcher's visible GPUs as CUDA_VISIBLE_DEVICES entries, in device-index order. Unset: every
// physical GPU. Like CUDA, the list ends at the first invalid entry: an empty or negative one
// ("" or "-1" hide every GPU), a word that is no index, UUID (GPU-...) or MIG id (MIG-...), or an
// index past the GPUs there are. With no GPU (`physical_count` 0) nothing is visible, whatever
// the variable lists: it hides GPUs, it can't add them.
std::vector<std::string> visible_gpus(const std::optional<std::string>& visible_env,
                                      int physical_count);

// What GPU requests are resolved against.
struct GpuView {
  std::optional<std::string> env;  // the CUDA_VISIBLE_DEVICES that positions refer to, if set
  int physical_count = 0;          // GPUs this machine has
  std::vector<std::string> uuids;  // their UUIDs in index order, when known (nvidia-smi)
  std::string who = "this process";  // whose view it is, for messages ("the notebook")
  std::string cpu_hint;              // how to ask for CPU ranks instead, for messages
};

// One rank's GPU: its CUDA_VISIBLE_DEVICES entry, and its position in the view's visible list
// (its device index there), when it is visible.
struct Gpu {
  std::string entry;
  std::optional<int> position;
};

// "all", positions ("0", "3": places in the visible list), UUIDs or MIG ids -> one Gpu per rank,
// in the order given. Throws std::invalid_argument naming what is visible when the request can't
// be met: a position outside the list, no GPU at all (also when CUDA_VISIBLE_DEVICES lists some
// on a machine without any), the same GPU twice.
std::vector<Gpu> select_gpus(const std::vector<std::string>& requested, const GpuView& view);

// -- where rank 0 listens --------------------------------------------------------------------------

// This machine's address on the route to `host` (a UDP connect() sends nothing, but picks the
// route). Throws std::invalid_argument when `host` can't be resolved or reached.
std::string source_address(const std::string& host);
// A TCP port free on `address` now ("0.0.0.0": on every address).
int free_port(const std::string& address = "127.0.0.1");

// Hosts laid out rank by rank: where rank 0 serves torch.distributed's store, and the address
// by which other hosts reach this machine.
struct Layout {
  std::vector<Host> hosts;
  std::vector<int> slot_host;   // rank -> index in hosts
  std::vector<int> local_rank;  // rank -> its place on its host
  std::vector<int> first_rank;  // host -> its first rank
  std::string master_addr;      // MASTER_ADDR for every rank
  std::string bind;             // this machine's address towards the other hosts
  int size() const { return static_cast<int>(slot_host.size()); }
};

// `master_addr`, `bind`: the user's, or "" to choose: 127.0.0.1 on one host; with other hosts,
// this machine's address towards the first of them (bind), and MASTER_ADDR rank 0's host: that
// address when rank 0 runs here, else its name. `need_bind`: false when nothing connects back
// to this machine (ddip run), so bind is found only when MASTER_ADDR needs it. Throws
// std::invalid_argument.
Layout lay_out(std::vector<Host> hosts, const std::string& master_addr = "",
               const std::string& bind = "", bool need_bind = true);

// MASTER_PORT when the user gave none: free here when rank 0 runs here, else drawn from
// kRemotePortLow..kRemotePortHigh.
int master_port(bool rank0_here, const std::string& address = "0.0.0.0");

// -- each rank's environment ------------------------------------------------------------------

// The CPUs this process may run on (sched_getaffinity).
int cpu_count();
// The one thread-count rule: OMP_NUM_THREADS for ranks that did not choose, the host's cores
// divided among its ranks (torchrun sets 1 for several; dividing is the same on small machines
// and leaves CPU work on big ones its share of cores).
int omp_threads(int cores, int local_ranks);

// What is shared by every rank of one launch on one host.
struct LaunchEnv {
  int world_size = 1;        // every host's ranks together
  int local_world_size = 0;  // this host's; 0: world_size (one host)
  int rank_offset = 0;       // RANK of this host's first rank (RANK = rank_offset + local rank)
  int group_rank = 0, group_world_size = 1;  // this host's place among the hosts
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::optional<std::string> cuda_visible_devices;  // the GPUs, or "" to keep CPU ranks off them
  // No GPU for these ranks: accelerate is told so (ACCELERATE_USE_CPU), or it would run each
  // CPU rank as a world of its own.
  bool cpu_ranks = false;
  int cores = 0;  // this host's CPUs for the thread rule; 0: leave OMP_NUM_THREADS to the host
  std::string role = "default";  // ROLE_NAME (torchrun's --role)
  int local_size() const { return local_world_size ? local_world_size : world_size; }
};

// torchrun's environment for one rank, on top of `base` ("KEY=value" entries): RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE,
// ROLE_NAME, MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES when set, without any TORCHELASTIC_*
// variable (there is no elastic agent to talk to); and, each unless `base` sets it,
// PYTHONUNBUFFERED=1, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, OMP_NUM_THREADS by omp_threads() (when
// `cores` is known), ACCELERATE_USE_CPU=true for CPU ranks, and TORCH_FR_BUFFER_SIZE (torch's
// flight recorder on, kFlightRecorderEntries long) unless `base` sets it or
// TORCH_NCCL_TRACE_BUFFER_SIZE.
inline constexpr int kFlightRecorderEntries = 256;
std::vector<std::string> rank_environment(const std::vector<std::string>& base,
                                          const LaunchEnv& launch, int local_rank);

// On the host where a rank starts, for a plan made elsewhere (cores 0): OMP_NUM_THREADS by the
// thread rule, for this host's cores and the LOCAL_WORLD_SIZE `env` says, unless `env` sets it.
void add_thread_default(std::vector<std::string>& env);

// -- reaching other hosts -----------------------------------------------------------------------

// SLURM_JOB_CPUS_PER_NODE ("8(x2),8") -> the CPUs every node has, or "" when they differ or it
// can't be read: srun's --cpus-per-task for one task per node.
std::string uniform_cpus(const std::string& cpus_per_node);

// A string the POSIX shell reads back as exactly `word`.
std::string shell_quote(const std::string& word);
// Splits a launcher into words as the shell would (quotes, backslashes; no expansion). Throws
// std::invalid_argument for an unclosed quote.
std::vector<std::string> split_words(const std::string& text);

// The command, run on this machine, that starts `command` on `host`: launcher "ssh [ssh options]"
// (default), "slurm [srun options]", or a launcher command with {host} and {command}, run by
// /bin/sh. `slurm_cpus`: CPUs of every node (uniform_cpus), or "". ssh gives up on a silent
// server after about `link_timeout_s`. The user's ssh options come first, so they win over ddip's
// (BatchMode=yes, ServerAlive*): ssh takes an option's first value. Throws std::invalid_argument
// for a launcher it can't use.
std::vector<std::string> launcher_argv(const std::string& launcher, const std::string& host,
                                       const std::vector<std::string>& command,
                                       const std::string& slurm_cpus = "",
                                       double link_timeout_s = 30);

}  // namespace ddip::plan
