#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "run_args.hpp"

using namespace ddip::run;

namespace {

using Args = std::vector<std::string>;

RunOptions parse(const Args& args) {
  CommandLine cl;
  return cl.parse(args);
}

// The message CLI11 would print for `args`, or "" when they parse.
std::string error_of(const Args& args) {
  CommandLine cl;
  try {
    cl.parse(args);
  } catch (const CLI::Error& e) {
    return e.what();
  }
  return "";
}

std::map<std::string, std::string> as_map(const std::vector<std::string>& env) {
  std::map<std::string, std::string> m;
  for (const auto& e : env) {
    auto eq = e.find('=');
    EXPECT_TRUE(m.emplace(e.substr(0, eq), e.substr(eq + 1)).second) << "twice: " << e;
  }
  return m;
}

std::string invalid(const std::vector<std::string>& req, std::optional<std::string> visible,
                    std::optional<int> count) {
  try {
    resolve_gpus(req, visible, count);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(CommandLine, TakesFlagsThenTheCommandWithItsOwnFlags) {
  auto o = parse({"run", "-n", "3", "python", "train.py", "-n", "7", "--lr", "0.1"});
  EXPECT_EQ(o.nproc, 3);
  EXPECT_EQ(o.command, (Args{"python", "train.py", "-n", "7", "--lr", "0.1"}));
  EXPECT_TRUE(o.gpus.empty());
  EXPECT_EQ(o.tee, "all");
  EXPECT_EQ(o.timeout_s, 0);
}

TEST(CommandLine, DoubleDashEndsTheFlags) {
  auto o = parse({"run", "--nproc-per-node=2", "--tee", "0", "--", "-weird", "--", "x"});
  EXPECT_EQ(o.nproc, 2);
  EXPECT_EQ(o.tee, "0");
  EXPECT_EQ(o.command, (Args{"-weird", "--", "x"}));
}

TEST(CommandLine, AttachedValues) {
  auto o = parse({"run", "-n4", "--timeout=2.5", "--log-dir=/tmp/x", "true"});
  EXPECT_EQ(o.nproc, 4);
  EXPECT_DOUBLE_EQ(o.timeout_s, 2.5);
  EXPECT_EQ(o.log_dir, "/tmp/x");
  EXPECT_EQ(o.command, (Args{"true"}));
}

TEST(CommandLine, DefaultsToOneRank) { EXPECT_EQ(parse({"run", "true"}).nproc, 1); }

TEST(CommandLine, DieWithParentIsAFlag) {
  EXPECT_FALSE(parse({"run", "true"}).die_with_parent);
  auto o = parse({"run", "--die-with-parent", "-n", "2", "true", "--die-with-parent"});
  EXPECT_TRUE(o.die_with_parent);
  EXPECT_EQ(o.command, (Args{"true", "--die-with-parent"}));
}

TEST(CommandLine, GpusAreAList) {
  auto o = parse({"run", "--gpus", "3,1", "python", "x.py"});
  EXPECT_EQ(o.gpus, (Args{"3", "1"}));
  EXPECT_EQ(o.command, (Args{"python", "x.py"}));
}

TEST(CommandLine, NAndGpusExcludeEachOther) {
  EXPECT_NE(error_of({"run", "-n", "2", "--gpus", "0,1", "true"}).find("excludes"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--gpus", "0", "-n", "2", "true"}).find("excludes"),
            std::string::npos);
}

TEST(CommandLine, BadN) {
  EXPECT_NE(error_of({"run", "-n", "0", "true"}).find("not in range"), std::string::npos);
  EXPECT_NE(error_of({"run", "-n", "-3", "true"}), "");
  EXPECT_NE(error_of({"run", "-n", "two", "true"}), "");
  EXPECT_NE(error_of({"run", "-n", "2000", "true"}).find("not in range"), std::string::npos);
  EXPECT_NE(error_of({"run", "-n"}), "");
}

TEST(CommandLine, BadGpus) {
  EXPECT_NE(error_of({"run", "--gpus", "0,,1", "true"}).find("empty"), std::string::npos);
  EXPECT_NE(error_of({"run", "--gpus", "", "true"}), "");
}

TEST(CommandLine, MissingCommand) {
  EXPECT_EQ(error_of({"run", "-n", "2"}), "COMMAND is required");
  EXPECT_EQ(error_of({"run", "-n", "2", "--"}), "COMMAND is required");
  EXPECT_NE(error_of({}), "");  // no subcommand
}

TEST(CommandLine, UnknownFlagIsAnErrorNotTheCommand) {
  EXPECT_NE(error_of({"run", "--bogus", "python"}).find("--bogus"), std::string::npos);
}

TEST(CommandLine, TeeValues) {
  EXPECT_EQ(parse({"run", "--tee", "none", "true"}).tee, "none");
  EXPECT_EQ(parse({"run", "--tee", "0,2", "true"}).tee, "0,2");
  EXPECT_NE(error_of({"run", "--tee", "some", "true"}).find("'some' is not a rank"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--tee", "-1", "true"}), "");
}

TEST(CommandLine, BadTimeout) {
  EXPECT_NE(error_of({"run", "--timeout", "0", "true"}), "");
  EXPECT_NE(error_of({"run", "--timeout", "soon", "true"}), "");
}

TEST(CommandLine, HelpIsAskedFor) {
  CommandLine cl;
  EXPECT_THROW(cl.parse({"run", "--help"}), CLI::CallForHelp);
}

TEST(TeeRanks, AllNoneAndLists) {
  EXPECT_EQ(tee_ranks("all", 3), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(tee_ranks("none", 2), (std::vector<bool>{false, false}));
  EXPECT_EQ(tee_ranks("0", 3), (std::vector<bool>{true, false, false}));
  EXPECT_EQ(tee_ranks("2, 0", 3), (std::vector<bool>{true, false, true}));
}

TEST(TeeRanks, RankOutsideTheWorldIsAnError) {
  try {
    tee_ranks("2", 2);
    FAIL() << "no error";
  } catch (const CLI::ValidationError& e) {
    EXPECT_NE(std::string(e.what()).find("there is no rank 2: ranks are 0-1"), std::string::npos);
  }
}

TEST(ResolveGpus, PhysicalIndicesInTheGivenOrder) {
  EXPECT_EQ(resolve_gpus({"3", "1"}, std::nullopt, 4), (Args{"3", "1"}));
  EXPECT_EQ(resolve_gpus({"3", "1"}, std::nullopt, std::nullopt), (Args{"3", "1"}));
  EXPECT_EQ(resolve_gpus({"01"}, std::nullopt, 2), (Args{"1"}));
}

TEST(ResolveGpus, PositionsInTheLaunchersVisibleList) {
  EXPECT_EQ(resolve_gpus({"1", "0"}, "4,6", std::nullopt), (Args{"6", "4"}));
  EXPECT_EQ(resolve_gpus({"1"}, "GPU-aaa,GPU-bbb", 0), (Args{"GPU-bbb"}));
}

TEST(ResolveGpus, UuidsPassThrough) {
  EXPECT_EQ(resolve_gpus({"GPU-abc", "MIG-def"}, "0", 1), (Args{"GPU-abc", "MIG-def"}));
}

TEST(ResolveGpus, All) {
  EXPECT_EQ(resolve_gpus({"all"}, std::nullopt, 3), (Args{"0", "1", "2"}));
  EXPECT_EQ(resolve_gpus({"all"}, "5,2", 8), (Args{"5", "2"}));
  EXPECT_NE(invalid({"all"}, std::nullopt, 0).find("no NVIDIA GPU"), std::string::npos);
  EXPECT_NE(invalid({"all"}, "", 4).find("no GPU is visible"), std::string::npos);
  EXPECT_NE(invalid({"all"}, std::nullopt, std::nullopt).find("list them"), std::string::npos);
}

TEST(ResolveGpus, OutsideTheVisibleListIsAClearError) {
  EXPECT_EQ(invalid({"2"}, "4,6", 8),
            "GPU 2 is not visible: CUDA_VISIBLE_DEVICES = 4,6 lists 2 GPU(s), so --gpus takes "
            "positions 0-1");
  EXPECT_NE(invalid({"0"}, "", 8).find("no GPU is visible"), std::string::npos);
  EXPECT_EQ(invalid({"2"}, std::nullopt, 2), "GPU 2 does not exist: this machine has GPUs 0-1");
  EXPECT_NE(invalid({"0"}, std::nullopt, 0).find("no NVIDIA GPU"), std::string::npos);
}

TEST(ResolveGpus, BadEntries) {
  EXPECT_NE(invalid({"x"}, std::nullopt, 2).find("'x' is not a GPU"), std::string::npos);
  EXPECT_NE(invalid({"-1"}, std::nullopt, 2).find("is not a GPU"), std::string::npos);
  EXPECT_NE(invalid({"99999999999"}, std::nullopt, std::nullopt).find("is not a GPU"),
            std::string::npos);
  EXPECT_NE(invalid({"1", "1"}, std::nullopt, 2).find("listed twice"), std::string::npos);
  EXPECT_NE(invalid({"1", "0"}, "3,3", 4).find("GPU 3 is listed twice"), std::string::npos);
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
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(env["PYTHONUNBUFFERED"], "1");
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

TEST(RankEnvironment, OneRankKeepsOpenMPThreads) {
  LaunchEnv launch;
  auto env = as_map(rank_environment({}, launch, 0));
  EXPECT_EQ(env.count("OMP_NUM_THREADS"), 0u);
  EXPECT_EQ(env["WORLD_SIZE"], "1");
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

// -- --hosts ---------------------------------------------------------------------------------

namespace {
bool only_localhost(const std::string& name) { return name == "localhost"; }

std::string hosts_error(const std::string& text) {
  try {
    parse_hosts(text, only_localhost);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
}  // namespace

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
  EXPECT_NE(hosts_error("-oProxyCommand=x:1").find("is not a host name"), std::string::npos);
}

TEST(Hosts, CommandLine) {
  auto o = parse({"run", "--hosts", "a:2,b:1", "--launcher", "ssh -p 2222", "python", "t.py"});
  EXPECT_EQ(o.world_size(), 3);
  EXPECT_EQ(o.launcher, "ssh -p 2222");
  EXPECT_NE(error_of({"run", "--hosts", "a:2", "-n", "2", "true"}).find("excludes"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--launcher", "ssh", "true"}).find("requires --hosts"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--hosts", "a:1", "--launcher", "rsh", "true"}).find("must be ssh"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--master-port", "0", "true"}).find("--master-port"),
            std::string::npos);
}

TEST(Hosts, NodeOptionsPlaceTheHostsRanks) {
  auto o = parse({"run", "--node", "2,5,1,2", "--node-name", "b", "-n", "3", "true"});
  ASSERT_TRUE(o.node);
  EXPECT_EQ(o.node->rank_offset, 2);
  EXPECT_EQ(o.node->world_size, 5);
  EXPECT_EQ(o.node->node_rank, 1);
  EXPECT_EQ(o.node->nnodes, 2);
  // Its ranks must fit the world it is told about.
  EXPECT_NE(error_of({"run", "--node", "3,5,1,2", "-n", "3", "true"}).find("--node"),
            std::string::npos);
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
  EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
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

TEST(Launchers, SshSlurmAndTemplates) {
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
  EXPECT_THROW(launcher_argv("ssh {host}", "a", cmd), std::invalid_argument);
  EXPECT_THROW(launcher_argv("rsh", "a", cmd), std::invalid_argument);
  EXPECT_THROW(launcher_argv("", "a", cmd), std::invalid_argument);
}

TEST(CommandLine, EnvNamesAndValues) {
  ::setenv("DDIP_TEST_FROM_HERE", "here value", 1);
  auto o = parse({"run", "-e", "A=1", "--env", "DDIP_TEST_FROM_HERE", "--env=B=x=y", "python", "-e"});
  EXPECT_EQ(o.env, (std::vector<std::string>{"A=1", "DDIP_TEST_FROM_HERE=here value", "B=x=y"}));
  EXPECT_EQ(o.command, (std::vector<std::string>{"python", "-e"}));
  ::unsetenv("DDIP_TEST_FROM_HERE");
  EXPECT_NE(error_of({"run", "--env", "DDIP_TEST_FROM_HERE", "true"}).find("is not set here"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--env", "1X=2", "true"}).find("is not NAME or NAME=VALUE"),
            std::string::npos);
}

TEST(Hosts, GpusForEveryHostOrPerHost) {
  EXPECT_EQ(hosts_with_gpus(std::string("node1,node2"), "0,1"), "node1[0,1] node2[0,1]");
  EXPECT_EQ(hosts_with_gpus(std::string("node1 node2"), "node2:3 node1:0,1"),
            "node1[0,1] node2[3]");  // in --hosts' order
  EXPECT_EQ(hosts_with_gpus(std::nullopt, "node1:0,1 node2:GPU-ab"), "node1[0,1] node2[GPU-ab]");
  auto o = parse({"run", "--hosts", "a,b", "--gpus", "1,0", "python", "t.py"});
  ASSERT_EQ(o.hosts.size(), 2u);
  EXPECT_EQ(o.hosts[1].gpus, (std::vector<std::string>{"1", "0"}));
  EXPECT_TRUE(o.gpus.empty());  // the hosts' now
  EXPECT_EQ(o.world_size(), 4);
  o = parse({"run", "--gpus", "a:0 b:1,2", "--launcher", "ssh -p 2", "true"});
  EXPECT_EQ(o.world_size(), 3);
  EXPECT_EQ(o.hosts[0].name, "a");
  for (auto [args, words] : std::vector<std::pair<Args, std::string>>{
           {{"run", "--hosts", "a:2,b", "--gpus", "0", "true"}, "by name only"},
           {{"run", "--hosts", "a,b", "--gpus", "all", "true"}, "can't count the GPUs"},
           {{"run", "--hosts", "a,b", "--gpus", "a:0", "true"}, "other hosts than --hosts"},
           {{"run", "--gpus", "a:0 a:1", "true"}, "names host a twice"},
           {{"run", "--gpus", "a:", "true"}, "write HOST:GPUS"},
           {{"run", "--gpus", "a:0,0", "true"}, "lists a GPU twice"},
       })
    EXPECT_NE(error_of(args).find(words), std::string::npos) << error_of(args);
}
