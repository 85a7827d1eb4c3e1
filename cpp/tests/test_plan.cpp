#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "ddip/plan.hpp"

using namespace ddip::plan;

namespace {

using Args = std::vector<std::string>;

std::map<std::string, std::string> as_map(const std::vector<std::string>& env) {
  std::map<std::string, std::string> m;
  for (const auto& e : env) {
    auto eq = e.find('=');
    EXPECT_TRUE(m.emplace(e.substr(0, eq), e.substr(eq + 1)).second) << "twice: " << e;
  }
  return m;
}

bool only_localhost(const std::string& name) { return name == "localhost"; }

std::string hosts_error(const std::string& text) {
  try {
    parse_hosts(text, only_localhost);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

GpuView view(std::optional<std::string> env, int physical, Args uuids = {}) {
  GpuView v;
  v.env = std::move(env);
  v.physical_count = physical;
  v.uuids = std::move(uuids);
  v.who = "the notebook";
  v.cpu_hint = "; for CPU ranks, give n=";
  return v;
}

Args entries(const Args& req, const GpuView& v) {
  Args out;
  for (const auto& g : select_gpus(req, v)) out.push_back(g.entry);
  return out;
}

std::string gpu_error(const Args& req, const GpuView& v) {
  try {
    select_gpus(req, v);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

std::string launcher_error(const std::string& launcher) {
  try {
    launcher_argv(launcher, "a", {"/opt/ddip", "run"});
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(VisibleGpus, UnsetMeansEveryPhysicalGpu) {
  EXPECT_EQ(visible_gpus(std::nullopt, 3), (Args{"0", "1", "2"}));
  EXPECT_EQ(visible_gpus(std::nullopt, 0), Args{});
}

TEST(VisibleGpus, TheListEndsAtTheFirstInvalidEntryLikeCuda) {
  EXPECT_EQ(visible_gpus("0,1,-1,2", 8), (Args{"0", "1"}));
  EXPECT_EQ(visible_gpus("-1", 8), Args{});
  EXPECT_EQ(visible_gpus("", 8), Args{});
  EXPECT_EQ(visible_gpus("0,,1", 8), (Args{"0"}));
  EXPECT_EQ(visible_gpus("0,junk,1", 8), (Args{"0"}));
  EXPECT_EQ(visible_gpus("0,9,1", 2), (Args{"0"}));      // past the GPUs there are
  EXPECT_EQ(visible_gpus(" 2 , GPU-ab,MIG-x/1 ", 8), (Args{"2", "GPU-ab", "MIG-x/1"}));
}

TEST(VisibleGpus, NoGpuHereMeansNoneVisibleWhateverTheVariableLists) {
  // CUDA_VISIBLE_DEVICES hides GPUs; it can't add any to a machine that has none.
  EXPECT_EQ(visible_gpus("0,1", 0), Args{});
  EXPECT_EQ(visible_gpus("GPU-aaa,MIG-bbb", 0), Args{});
  EXPECT_EQ(visible_gpus(std::nullopt, 0), Args{});
}

TEST(SelectGpus, ANamedGpuOnAMachineWithoutAnyNamesWhatIsVisible) {
  const std::string no_gpu =
      " is not visible: the notebook sees no GPU: its CUDA_VISIBLE_DEVICES='0,1' names GPUs, but "
      "this machine has no NVIDIA GPU; for CPU ranks, give n=";
  EXPECT_EQ(gpu_error({"1"}, view("0,1", 0)), "GPU 1" + no_gpu);
  EXPECT_EQ(gpu_error({"0", "1"}, view("0,1", 0)), "GPU 0" + no_gpu);
  EXPECT_EQ(gpu_error({"all"}, view("0,1", 0)),
            "'all' GPUs, but the notebook sees no GPU: its CUDA_VISIBLE_DEVICES='0,1' names GPUs, "
            "but this machine has no NVIDIA GPU; for CPU ranks, give n=");
  EXPECT_EQ(gpu_error({"GPU-aaa"}, view("GPU-aaa", 0)),
            "GPU-aaa is not visible: the notebook sees no GPU: its CUDA_VISIBLE_DEVICES='GPU-aaa' "
            "names GPUs, but this machine has no NVIDIA GPU; for CPU ranks, give n=");
  // A variable that hides everything says just that.
  EXPECT_EQ(gpu_error({"0"}, view("-1", 0)),
            "GPU 0 is not visible: the notebook sees no GPU (CUDA_VISIBLE_DEVICES='-1'); for CPU "
            "ranks, give n=");
}

// Where /proc lists no driver's GPUs, nvidia-smi -L is asked: its GPU lines, not its MIG ones.
TEST(NvidiaDeviceCount, WithoutTheDriversListNvidiaSmiIsAsked) {
  if (std::filesystem::exists("/proc/driver/nvidia/gpus"))
    GTEST_SKIP() << "the driver lists this machine's GPUs in /proc";
  auto dir =
      std::filesystem::temp_directory_path() / ("ddip-fake-smi-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const char* old_path = std::getenv("PATH");
  std::string saved = old_path ? old_path : "";
  auto smi = [&](const std::string& body) {
    std::ofstream(dir / "nvidia-smi") << "#!/bin/sh\n" << body;
    std::filesystem::permissions(dir / "nvidia-smi", std::filesystem::perms::owner_all);
  };
  ::setenv("PATH", (dir.string() + ":" + saved).c_str(), 1);
  smi("[ \"$1\" = -L ] || exit 9\n"
      "echo 'GPU 0: NVIDIA A100 (UUID: GPU-0aaa0)'\n"
      "echo '  MIG 1g.10gb Device 0: (UUID: MIG-1bbb1)'\n"
      "echo 'GPU 1: NVIDIA A100 (UUID: GPU-1aaa1)'\n");
  int listed = nvidia_device_count();
  smi("echo 'GPU 0: NVIDIA A100'; echo 'NVIDIA-SMI has failed' >&2; exit 1\n");
  int failed = nvidia_device_count();
  std::filesystem::remove(dir / "nvidia-smi");
  int missing = nvidia_device_count();
  ::setenv("PATH", saved.c_str(), 1);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(listed, 2);
  EXPECT_EQ(failed, 0);  // a failing nvidia-smi lists nothing, whatever it printed
  EXPECT_EQ(missing, 0);
}

TEST(SelectGpus, PositionsInTheVisibleListInTheGivenOrder) {
  EXPECT_EQ(entries({"3", "1"}, view(std::nullopt, 4)), (Args{"3", "1"}));
  EXPECT_EQ(entries({"1", "0"}, view("4,6", 8)), (Args{"6", "4"}));
  EXPECT_EQ(entries({"1"}, view("GPU-aaa,GPU-bbb", 1)), (Args{"GPU-bbb"}));
  auto g = select_gpus({"1", "0"}, view("4,6", 8));
  EXPECT_EQ(g[0].position, 1);
  EXPECT_EQ(g[1].position, 0);
}

TEST(SelectGpus, All) {
  EXPECT_EQ(entries({"all"}, view(std::nullopt, 3)), (Args{"0", "1", "2"}));
  EXPECT_EQ(entries({"all"}, view("5,2", 8)), (Args{"5", "2"}));
  EXPECT_EQ(gpu_error({"all"}, view(std::nullopt, 0)),
            "'all' GPUs, but this machine has no NVIDIA GPU; for CPU ranks, give n=");
  EXPECT_EQ(gpu_error({"all"}, view("-1", 4)),
            "'all' GPUs, but the notebook sees no GPU (CUDA_VISIBLE_DEVICES='-1'); for CPU ranks, "
            "give n=");
}

TEST(SelectGpus, OutsideTheVisibleListNamesWhatIsVisible) {
  EXPECT_EQ(gpu_error({"2"}, view("4,6", 8)),
            "GPU 2 is not visible: the notebook sees 2 GPUs (CUDA_VISIBLE_DEVICES=4,6): give "
            "positions 0-1, 'all', or their UUIDs");
  EXPECT_EQ(gpu_error({"1"}, view(std::nullopt, 1)),
            "GPU 1 is not visible: the notebook sees 1 GPU: give positions 0, 'all', or their UUIDs");
  EXPECT_EQ(gpu_error({"-1"}, view(std::nullopt, 2)).rfind("GPU -1 is not visible", 0), 0u);
  // No GPU at all: one answer for every way in.
  EXPECT_EQ(gpu_error({"0"}, view(std::nullopt, 0)),
            "GPU 0 is not visible: this machine has no NVIDIA GPU; for CPU ranks, give n=");
  EXPECT_EQ(gpu_error({"GPU-ab"}, view(std::nullopt, 0)),
            "GPU-ab is not visible: this machine has no NVIDIA GPU; for CPU ranks, give n=");
}

TEST(SelectGpus, UuidsAreMatchedAgainstWhatIsVisible) {
  // Visible by UUID: its position there.
  auto g = select_gpus({"GPU-bbb"}, view("GPU-aaa,GPU-bbb", 2));
  EXPECT_EQ(g[0].position, 1);
  EXPECT_EQ(gpu_error({"GPU-ccc"}, view("GPU-aaa", 1)),
            "GPU-ccc is not visible: the notebook sees 1 GPU (CUDA_VISIBLE_DEVICES=GPU-aaa): give "
            "positions 0, 'all', or their UUIDs");
  // Nothing hidden: a (prefix of a) physical GPU's UUID; its index is its position.
  g = select_gpus({"GPU-1a"}, view(std::nullopt, 2, {"GPU-0aaa0", "GPU-1aaa1"}));
  EXPECT_EQ(g[0].entry, "GPU-1a");
  EXPECT_EQ(g[0].position, 1);
  EXPECT_EQ(gpu_error({"GPU-ff"}, view(std::nullopt, 2, {"GPU-0aaa0", "GPU-1aaa1"})),
            "no GPU has UUID GPU-ff; this machine has GPU-0aaa0, GPU-1aaa1");
  // MIG ids are CUDA's to resolve in the rank; unknown UUIDs pass when nothing lists them.
  EXPECT_EQ(select_gpus({"MIG-x"}, view(std::nullopt, 2, {"GPU-0aaa0"}))[0].position, std::nullopt);
  EXPECT_EQ(entries({"GPU-abc", "MIG-def"}, view(std::nullopt, 1)), (Args{"GPU-abc", "MIG-def"}));
}

TEST(SelectGpus, EachRankItsOwnGpu) {
  EXPECT_EQ(gpu_error({"1", "1"}, view(std::nullopt, 2)),
            "GPUs 1,1 list GPU 1 more than once; each rank needs its own GPU");
  // A position and its UUID are the same GPU.
  EXPECT_NE(gpu_error({"1", "GPU-1a"}, view(std::nullopt, 2, {"GPU-0aaa0", "GPU-1aaa1"}))
                .find("more than once"),
            std::string::npos);
  EXPECT_NE(gpu_error({"x"}, view(std::nullopt, 2)).find("'x' is not a GPU"), std::string::npos);
  EXPECT_NE(gpu_error({"99999999999"}, view(std::nullopt, 2)).find("is not a GPU"),
            std::string::npos);
  EXPECT_NE(gpu_error({}, view(std::nullopt, 2)).find("no GPU given"), std::string::npos);
}

TEST(RankEnvironment, TorchrunsVariablesPerRank) {
  LaunchEnv launch;
  launch.world_size = 3;
  launch.master_port = 29511;
  for (int r = 0; r < 3; ++r) {
    auto env = as_map(rank_environment({"PATH=/bin", "HOME=/root"}, launch, r));
    EXPECT_EQ(env["RANK"], std::to_string(r));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(r));
    EXPECT_EQ(env["ROLE_RANK"], std::to_string(r));
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], "29511");
    EXPECT_EQ(env.count("OMP_NUM_THREADS"), 0u);  // cores not given
    EXPECT_EQ(env["PYTHONUNBUFFERED"], "1");
    EXPECT_EQ(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1");
    EXPECT_EQ(env["PATH"], "/bin");
    EXPECT_EQ(env["HOME"], "/root");
    EXPECT_EQ(env.count("CUDA_VISIBLE_DEVICES"), 0u);
  }
}

TEST(RankEnvironment, InheritedRankVariablesAndTorchElasticAreReplaced) {
  LaunchEnv launch;
  launch.world_size = 2;
  auto env = as_map(rank_environment({"RANK=7", "WORLD_SIZE=9", "TORCHELASTIC_USE_AGENT_STORE=True",
                                      "TORCHELASTIC_RUN_ID=x", "CUDA_VISIBLE_DEVICES=0,1,2"},
                                     launch, 1));
  EXPECT_EQ(env["RANK"], "1");
  EXPECT_EQ(env["WORLD_SIZE"], "2");
  EXPECT_EQ(env.count("TORCHELASTIC_USE_AGENT_STORE"), 0u);
  EXPECT_EQ(env.count("TORCHELASTIC_RUN_ID"), 0u);
  EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "0,1,2");  // -n leaves the GPUs alone
}

TEST(RankEnvironment, UserChoicesWin) {
  LaunchEnv launch;
  launch.world_size = 4;
  auto env = as_map(rank_environment({"OMP_NUM_THREADS=8", "PYTHONUNBUFFERED="}, launch, 0));
  EXPECT_EQ(env["OMP_NUM_THREADS"], "8");
  EXPECT_EQ(env["PYTHONUNBUFFERED"], "");
}

TEST(RankEnvironment, OneThreadRuleTheHostsCoresDividedAmongItsRanks) {
  LaunchEnv launch;
  launch.world_size = 3;
  launch.cores = 8;
  EXPECT_EQ(as_map(rank_environment({}, launch, 0))["OMP_NUM_THREADS"], "2");
  launch.cores = 2;  // never 0
  EXPECT_EQ(as_map(rank_environment({}, launch, 0))["OMP_NUM_THREADS"], "1");
  launch.world_size = 1;
  launch.cores = 8;
  EXPECT_EQ(as_map(rank_environment({}, launch, 0))["OMP_NUM_THREADS"], "8");
  launch.cores = 0;  // not known here: the host that starts the ranks decides
  EXPECT_EQ(as_map(rank_environment({}, launch, 0)).count("OMP_NUM_THREADS"), 0u);
  std::vector<std::string> there = {"A=1"};
  add_thread_default(there);
  EXPECT_EQ(as_map(there)["OMP_NUM_THREADS"], std::to_string(cpu_count()));
  there = {"LOCAL_WORLD_SIZE=2"};
  add_thread_default(there);
  EXPECT_EQ(as_map(there)["OMP_NUM_THREADS"], std::to_string(omp_threads(cpu_count(), 2)));
  there = {"OMP_NUM_THREADS=3"};
  add_thread_default(there);
  EXPECT_EQ(there, (std::vector<std::string>{"OMP_NUM_THREADS=3"}));
}

TEST(RankEnvironment, CpuRanksTellAccelerateUnlessTheUserDid) {
  LaunchEnv launch;
  launch.world_size = 2;
  EXPECT_EQ(as_map(rank_environment({}, launch, 0)).count("ACCELERATE_USE_CPU"), 0u);
  launch.cpu_ranks = true;
  EXPECT_EQ(as_map(rank_environment({}, launch, 1))["ACCELERATE_USE_CPU"], "true");
  EXPECT_EQ(as_map(rank_environment({"ACCELERATE_USE_CPU=false"}, launch, 1))["ACCELERATE_USE_CPU"],
            "false");
}

TEST(RankEnvironment, TheFlightRecorderIsOnUnlessTheUserSizedIt) {
  LaunchEnv launch;
  launch.world_size = 2;
  EXPECT_EQ(as_map(rank_environment({}, launch, 0))["TORCH_FR_BUFFER_SIZE"],
            std::to_string(kFlightRecorderEntries));
  EXPECT_EQ(as_map(rank_environment({"TORCH_FR_BUFFER_SIZE=0"}, launch, 0))["TORCH_FR_BUFFER_SIZE"],
            "0");
  // torch's older name for it counts as the user's choice too (0: off).
  auto old = as_map(rank_environment({"TORCH_NCCL_TRACE_BUFFER_SIZE=0"}, launch, 0));
  EXPECT_EQ(old.count("TORCH_FR_BUFFER_SIZE"), 0u);
  EXPECT_EQ(old["TORCH_NCCL_TRACE_BUFFER_SIZE"], "0");
}

TEST(RankEnvironment, GpusListedInRankOrderForEveryRank) {
  LaunchEnv launch;
  launch.world_size = 2;
  launch.cuda_visible_devices = "3,1";
  for (int r = 0; r < 2; ++r) {
    auto env = as_map(rank_environment({"CUDA_VISIBLE_DEVICES=0,1,2,3"}, launch, r));
    EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "3,1");
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(r));
  }
}

TEST(Hosts, CountsAndGpuListsInRankOrder) {
  auto h = parse_hosts("node1:4, node2[3,1] localhost:1", only_localhost);
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[0].name, "node1");
  EXPECT_EQ(h[0].ranks, 4);
  EXPECT_TRUE(h[0].gpus.empty());
  EXPECT_FALSE(h[0].local);
  EXPECT_EQ(h[1].name, "node2");
  EXPECT_EQ(h[1].ranks, 2);
  EXPECT_EQ(h[1].gpus, (std::vector<std::string>{"3", "1"}));
  EXPECT_TRUE(h[2].local);
  EXPECT_EQ(parse_hosts("10.0.0.2:2,10.0.0.3[GPU-ab12]", only_localhost)[1].gpus,
            (std::vector<std::string>{"GPU-ab12"}));
}

TEST(Hosts, BadListsSayHowToWriteThem) {
  EXPECT_NE(hosts_error("").find("no host given"), std::string::npos);
  EXPECT_NE(hosts_error("node1").find("has no rank count: write node1:4"), std::string::npos);
  EXPECT_NE(hosts_error("node1:x").find("write NAME:RANKS"), std::string::npos);
  EXPECT_NE(hosts_error("node1:0").find("needs 1 to 1024 ranks"), std::string::npos);
  EXPECT_NE(hosts_error("a:1,a:2").find("listed twice"), std::string::npos);
  EXPECT_NE(hosts_error("a[0,0]").find("lists a GPU twice"), std::string::npos);
  EXPECT_NE(hosts_error("a[x]").find("'x' is not a GPU"), std::string::npos);
  EXPECT_NE(hosts_error("-oProxyCommand=x:1").find("can't start with '-'"), std::string::npos);
  EXPECT_NE(hosts_error("-v[0]").find("can't start with '-'"), std::string::npos);
  EXPECT_NE(hosts_error("node1:1025").find("needs 1 to 1024 ranks"), std::string::npos);
}

TEST(Hosts, RankEnvironmentOnTheSecondHost) {
  LaunchEnv launch;
  launch.world_size = 5;
  launch.local_world_size = 3;
  launch.rank_offset = 2;
  launch.group_rank = 1;
  launch.group_world_size = 2;
  launch.master_addr = "node1";
  launch.master_port = 29501;
  auto env = as_map(rank_environment({}, launch, 1));
  EXPECT_EQ(env["RANK"], "3");
  EXPECT_EQ(env["LOCAL_RANK"], "1");
  EXPECT_EQ(env["WORLD_SIZE"], "5");
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
  EXPECT_EQ(env["GROUP_RANK"], "1");
  EXPECT_EQ(env["GROUP_WORLD_SIZE"], "2");
  EXPECT_EQ(env["ROLE_RANK"], "3");
  EXPECT_EQ(env["MASTER_ADDR"], "node1");
  EXPECT_EQ(env["MASTER_PORT"], "29501");
}

TEST(Launchers, SlurmCpusOnlyWhenEveryNodeHasTheSame) {
  EXPECT_EQ(uniform_cpus("16"), "16");
  EXPECT_EQ(uniform_cpus("16(x3),16"), "16");
  EXPECT_EQ(uniform_cpus("16(x2),4"), "");
  EXPECT_EQ(uniform_cpus(""), "");
  EXPECT_EQ(uniform_cpus("junk"), "");
}

TEST(Launchers, QuotingAndWords) {
  EXPECT_EQ(shell_quote("plain/path-1.py"), "plain/path-1.py");
  EXPECT_EQ(shell_quote("it's $HOME"), "'it'\\''s $HOME'");
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(split_words("ssh -F 'my config' -o \"A=b c\" x\\ y"),
            (std::vector<std::string>{"ssh", "-F", "my config", "-o", "A=b c", "x y"}));
  EXPECT_THROW(split_words("ssh 'open"), std::invalid_argument);
}

TEST(Launchers, SshSlurmAndLauncherCommands) {
  std::vector<std::string> cmd = {"/opt/ddip", "run", "--", "python", "it's.py"};
  EXPECT_EQ(launcher_argv("ssh -p 2222", "node2", cmd),
            (std::vector<std::string>{"ssh", "-p", "2222", "-T", "-o", "BatchMode=yes", "-o",
                                      "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3",
                                      "node2",
                                      "exec /opt/ddip run -- python 'it'\\''s.py'"}));
  auto srun = launcher_argv("slurm --mpi=none", "node3", cmd, "16");
  EXPECT_EQ(srun.front(), "srun");
  EXPECT_NE(std::find(srun.begin(), srun.end(), "--nodelist=node3"), srun.end());
  EXPECT_NE(std::find(srun.begin(), srun.end(), "--cpus-per-task=16"), srun.end());
  EXPECT_NE(std::find(srun.begin(), srun.end(), "--mpi=none"), srun.end());
  EXPECT_EQ(std::vector<std::string>(srun.end() - 5, srun.end()), cmd);  // argv, not a shell
  EXPECT_EQ(launcher_argv("docker exec -i {host} {command}", "box", cmd),
            (std::vector<std::string>{
                "/bin/sh", "-c", "docker exec -i box /opt/ddip run -- python 'it'\\''s.py'"}));
  // A shorter --link-timeout shortens ssh's patience with a silent host too.
  auto quick = launcher_argv("ssh", "a", cmd, "", 6);
  EXPECT_NE(std::find(quick.begin(), quick.end(), "ServerAliveInterval=2"), quick.end());
  // Each refusal names the problem and the fix, in the docs' words ("launcher command").
  EXPECT_EQ(launcher_error("ssh {host}"),
            "the launcher command 'ssh {host}' has no {command}: a launcher command needs both "
            "{host} and {command}, e.g. 'docker exec -i {host} {command}'");
  EXPECT_NE(launcher_error("kubectl exec -i x -- {command}").find("has no {host}"),
            std::string::npos);
  EXPECT_EQ(launcher_error("rsh"),
            "the launcher must be ssh, slurm or a launcher command with {host} and {command} "
            "(e.g. 'docker exec -i {host} {command}'), got 'rsh'");
  EXPECT_EQ(launcher_error(""),
            "the launcher is empty: give ssh (the default), slurm or a launcher command with "
            "{host} and {command}");
}

TEST(Hosts, GpusForEveryHostOrPerHost) {
  EXPECT_EQ(hosts_with_gpus(std::string("node1,node2"), "0,1"), "node1[0,1] node2[0,1]");
  EXPECT_EQ(hosts_with_gpus(std::string("node1 node2"), "node2:3 node1:0,1"),
            "node1[0,1] node2[3]");  // in the host list's order
  EXPECT_EQ(hosts_with_gpus(std::nullopt, "node1:0,1 node2:GPU-ab"), "node1[0,1] node2[GPU-ab]");
  EXPECT_THROW(hosts_with_gpus(std::nullopt, "0,1"), std::invalid_argument);
  EXPECT_THROW(hosts_with_gpus(std::string("a,b"), "all"), std::invalid_argument);
}

TEST(Layout, RanksHostByHostAndWhereRankZeroListens) {
  auto l = lay_out(parse_hosts("localhost:2,b:1", only_localhost), "", "10.0.0.1");
  EXPECT_EQ(l.size(), 3);
  EXPECT_EQ(l.slot_host, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(l.local_rank, (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(l.first_rank, (std::vector<int>{0, 2}));
  EXPECT_EQ(l.bind, "10.0.0.1");
  EXPECT_EQ(l.master_addr, "10.0.0.1");  // rank 0 here: this machine's address towards b
  l = lay_out(parse_hosts("b:1,localhost:2", only_localhost), "", "10.0.0.1");
  EXPECT_EQ(l.master_addr, "b");  // rank 0 there: its name
  l = lay_out(parse_hosts("localhost:2", only_localhost));
  EXPECT_EQ(l.master_addr, "127.0.0.1");
  EXPECT_EQ(l.bind, "127.0.0.1");
  l = lay_out(parse_hosts("b:1", only_localhost), "node-b.lan", "", false);
  EXPECT_EQ(l.master_addr, "node-b.lan");  // the user's
  EXPECT_THROW(lay_out(parse_hosts("b:1", only_localhost), "", "not-an-ip"), std::invalid_argument);
}

TEST(Layout, MasterPortFreeHereOrFromTorchrunsRange) {
  int p = master_port(false);
  EXPECT_GE(p, kRemotePortLow);
  EXPECT_LE(p, kRemotePortHigh);
  EXPECT_GT(master_port(true, "127.0.0.1"), 0);
  EXPECT_THROW(free_port("nonsense"), std::invalid_argument);
}

TEST(Hosts, ThisMachine) {
  EXPECT_TRUE(is_this_host("localhost"));
  EXPECT_TRUE(is_this_host("127.0.0.1"));
  EXPECT_FALSE(is_this_host("surely-not-this-host.invalid"));
}

TEST(Launchers, TheUsersSshOptionsWinAndHostsAreNeverFlags) {
  Args cmd = {"python", "-m", "ddip.remote"};
  auto argv = launcher_argv("ssh -o BatchMode=no", "node2", cmd);
  auto mine = std::find(argv.begin(), argv.end(), "BatchMode=no");
  auto ours = std::find(argv.begin(), argv.end(), "BatchMode=yes");
  ASSERT_NE(mine, argv.end());
  EXPECT_LT(mine, ours);  // ssh takes an option's first value
  EXPECT_THROW(launcher_argv("ssh", "-v", cmd), std::invalid_argument);
}
