// `ddip run`'s launch as data: for a command line and a machine given here, what each unit (a
// rank here, another host's launcher) runs and with which environment. Nothing is started.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>

#include "run_plan.hpp"

using namespace ddip::run;

namespace {

using Args = std::vector<std::string>;

RunOptions parse(const Args& args) {
  CommandLine cl;
  return cl.parse(args);
}

// A machine with 8 cores and no GPU, in /work, whose free port is 29555.
Machine machine() {
  Machine m;
  m.env = {"HOME=/home/me", "PATH=/usr/bin", "A=here"};
  m.cores = 8;
  m.gpu_count = [] { return 0; };
  m.cwd = "/work";
  m.self = "/opt/ddip/bin/ddip";
  m.master_port = [](bool, const std::string&) { return 29555; };
  return m;
}

// The value of `name` in a unit's environment.
std::optional<std::string> var(const UnitPlan& p, const std::string& name) {
  std::optional<std::string> found;
  for (const auto& kv : p.spec.env)
    if (kv.rfind(name + "=", 0) == 0) {
      EXPECT_FALSE(found) << name << " is set twice";
      found = kv.substr(name.size() + 1);
    }
  return found;
}

// The flags `argv` gives after `flag`, every time.
Args after(const Args& argv, const std::string& flag) {
  Args out;
  for (size_t i = 0; i + 1 < argv.size(); ++i)
    if (argv[i] == flag) out.push_back(argv[i + 1]);
  return out;
}

}  // namespace

TEST(RunPlan, RanksHereGetTorchrunsEnvironmentOnTopOfThisOne) {
  Elastic elastic{"run-1", nullptr, ""};
  auto units = plan_units(parse({"run", "-n", "2", "--env", "A=mine", "python", "t.py"}), machine(),
                          elastic, "");
  ASSERT_EQ(units.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const UnitPlan& p = units[static_cast<size_t>(r)];
    EXPECT_FALSE(p.host);
    EXPECT_EQ(p.first_rank, r);
    EXPECT_TRUE(p.shown);
    EXPECT_EQ(p.spec.argv, (Args{"python", "t.py"}));
    EXPECT_EQ(var(p, "RANK"), std::to_string(r));
    EXPECT_EQ(var(p, "LOCAL_RANK"), std::to_string(r));
    EXPECT_EQ(var(p, "WORLD_SIZE"), "2");
    EXPECT_EQ(var(p, "MASTER_ADDR"), "127.0.0.1");
    EXPECT_EQ(var(p, "MASTER_PORT"), "29555");
    EXPECT_EQ(var(p, "OMP_NUM_THREADS"), "4");  // 8 cores, 2 ranks
    EXPECT_EQ(var(p, "ACCELERATE_USE_CPU"), "true");  // no GPU here
    EXPECT_EQ(var(p, "A"), "mine");                   // --env wins over the environment here
    EXPECT_EQ(var(p, "HOME"), "/home/me");
    EXPECT_EQ(var(p, "TORCHELASTIC_RUN_ID"), "run-1");
    EXPECT_EQ(var(p, "TORCHELASTIC_ERROR_FILE"), std::nullopt);  // --check: no error files
  }
}

TEST(RunPlan, EachRankGetsItsErrorFileAndShowChoosesWhoIsShown) {
  ErrorFiles errors;
  Elastic elastic{"run-2", &errors, ""};
  auto units = plan_units(parse({"run", "-n", "3", "--show", "1", "--master-addr", "10.1.1.1",
                                 "--master-port", "1234", "true"}),
                          machine(), elastic, "");
  ASSERT_EQ(units.size(), 3u);
  EXPECT_EQ((std::vector<bool>{units[0].shown, units[1].shown, units[2].shown}),
            (std::vector<bool>{false, true, false}));
  EXPECT_EQ(var(units[2], "TORCHELASTIC_ERROR_FILE"), errors.path(2));
  EXPECT_EQ(var(units[0], "MASTER_ADDR"), "10.1.1.1");
  EXPECT_EQ(var(units[0], "MASTER_PORT"), "1234");
}

TEST(RunPlan, GpusAreResolvedAgainstTheVisibleOnes) {
  Machine m = machine();
  m.env.push_back("CUDA_VISIBLE_DEVICES=2,3");
  m.gpu_count = [] { return 4; };
  auto units =
      plan_units(parse({"run", "--gpus", "1,0", "true"}), m, Elastic{"r", nullptr, ""}, "");
  ASSERT_EQ(units.size(), 2u);
  for (const auto& p : units) {
    EXPECT_EQ(var(p, "CUDA_VISIBLE_DEVICES"), "3,2");
    EXPECT_EQ(var(p, "WORLD_SIZE"), "2");
    EXPECT_EQ(var(p, "ACCELERATE_USE_CPU"), std::nullopt);
  }
  EXPECT_THROW(plan_units(parse({"run", "--gpus", "2", "true"}), m, Elastic{"r", nullptr, ""}, ""),
               std::invalid_argument);
}

TEST(RunPlan, ANodeRunsItsShareOfTheRanksOfTheWholeLaunch) {
  auto units = plan_units(parse({"run", "--node", "2,5,1,3", "--node-name", "b", "-n", "2",
                                 "--master-addr", "a", "--master-port", "4000", "true"}),
                          machine(), Elastic{"shared", nullptr, ""}, "");
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[1].first_rank, 3);
  EXPECT_EQ(var(units[1], "RANK"), "3");
  EXPECT_EQ(var(units[1], "LOCAL_RANK"), "1");
  EXPECT_EQ(var(units[1], "WORLD_SIZE"), "5");
  EXPECT_EQ(var(units[1], "LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(var(units[1], "GROUP_RANK"), "1");
  EXPECT_EQ(var(units[1], "GROUP_WORLD_SIZE"), "3");
  EXPECT_EQ(var(units[1], "MASTER_ADDR"), "a");
  EXPECT_EQ(var(units[1], "TORCHELASTIC_RUN_ID"), "shared");
}

TEST(RunPlan, AnotherHostGetsItsLauncherRunningDdipRunThereWithItsPlace) {
  Machine m = machine();
  m.env.push_back("SLURM_JOB_CPUS_PER_NODE=8(x2)");
  std::optional<bool> asked;
  m.master_port = [&](bool rank0_here, const std::string&) {
    asked = rank0_here;
    return 29555;
  };
  auto units = plan_units(parse({"run", "--hosts", "localhost:1,node1:2", "--launcher", "slurm",
                                 "--master-addr", "10.0.0.1", "--env", "A=1", "--log-dir", "logs",
                                 "--ship", "t.py", "python", "t.py"}),
                          m, Elastic{"run-3", nullptr, ""}, "the files");
  EXPECT_EQ(asked, true);  // rank 0 runs here: a port free here
  ASSERT_EQ(units.size(), 2u);
  const UnitPlan& here = units[0];
  EXPECT_FALSE(here.host);
  EXPECT_EQ(var(here, "RANK"), "0");
  EXPECT_EQ(var(here, "WORLD_SIZE"), "3");
  EXPECT_EQ(var(here, "LOCAL_WORLD_SIZE"), "1");
  EXPECT_EQ(var(here, "GROUP_WORLD_SIZE"), "2");
  EXPECT_EQ(var(here, "MASTER_ADDR"), "10.0.0.1");
  EXPECT_EQ(var(here, "OMP_NUM_THREADS"), "8");

  const UnitPlan& there = units[1];
  EXPECT_TRUE(there.host);
  EXPECT_EQ(there.name, "node1");
  EXPECT_EQ(there.first_rank, 1);
  EXPECT_EQ(there.nranks, 2);
  EXPECT_EQ(there.ship, "the files");
  EXPECT_TRUE(there.spec.stdin_pipe);
  EXPECT_EQ(there.spec.env, m.env);  // the launcher gets this environment as it is
  const Args& argv = there.spec.argv;
  ASSERT_FALSE(argv.empty());
  EXPECT_EQ(argv[0], "srun");
  EXPECT_NE(std::find(argv.begin(), argv.end(), "--nodelist=node1"), argv.end());
  EXPECT_NE(std::find(argv.begin(), argv.end(), "--cpus-per-task=8"), argv.end());
  auto ddip = std::find(argv.begin(), argv.end(), "/opt/ddip/bin/ddip");
  ASSERT_NE(ddip, argv.end());
  Args node(ddip, argv.end());
  EXPECT_EQ(after(node, "--node"), (Args{"1,3,1,2"}));
  EXPECT_EQ(after(node, "--node-name"), (Args{"node1"}));
  EXPECT_EQ(after(node, "--node-run-id"), (Args{"run-3"}));
  EXPECT_EQ(after(node, "--master-addr"), (Args{"10.0.0.1"}));
  EXPECT_EQ(after(node, "--master-port"), (Args{"29555"}));
  EXPECT_EQ(after(node, "--node-cwd"), (Args{"/work"}));
  EXPECT_EQ(after(node, "--node-files"), (Args{"1"}));
  EXPECT_EQ(after(node, "--link-timeout"), (Args{"30"}));
  EXPECT_EQ(after(node, "--env"), (Args{"A=1"}));
  EXPECT_EQ(after(node, "-n"), (Args{"2"}));
  EXPECT_EQ(after(node, "--log-dir"), (Args{"/work/logs"}));
  EXPECT_EQ(after(node, "--show"), (Args{"all"}));
  EXPECT_EQ(after(node, "--tee"), (Args{"0"}));
  EXPECT_EQ(after(node, "--redirects"), (Args{"0"}));
  EXPECT_EQ(after(node, "--role"), (Args{"default"}));
  EXPECT_EQ(after(node, "--signals-to-handle"), (Args{"SIGTERM,SIGINT,SIGHUP,SIGQUIT"}));
  Args tail(node.end() - 3, node.end());
  EXPECT_EQ(tail, (Args{"--", "python", "t.py"}));
}

// torchrun's options on one node (issue 32): the plan is where they take effect.
TEST(RunPlan, TorchrunsRedirectsTeeAndLocalRanksFilter) {
  Elastic elastic{"job", nullptr, "", 1, 3};
  auto o = parse({"run", "-n", "3", "-r", "0:1,2:3", "-t", "0:2", "--local-ranks-filter", "0,2",
                  "true"});
  o.log_job_dir = "/logs/job_abcdefgh";
  auto units = plan_units(o, machine(), elastic, "");
  ASSERT_EQ(units.size(), 3u);
  // Redirected streams reach the files only, teed ones both; rank 1 is filtered out.
  EXPECT_EQ((std::vector<bool>{units[0].shown, units[1].shown, units[2].shown}),
            (std::vector<bool>{true, false, true}));
  EXPECT_EQ(units[0].streams.to_file, 3);
  EXPECT_EQ(units[0].streams.to_console, 2);
  EXPECT_EQ(units[1].streams.to_file, 0);
  EXPECT_EQ(units[1].streams.to_console, 3);
  EXPECT_EQ(units[2].streams.to_file, 3);
  EXPECT_EQ(units[2].streams.to_console, 0);
  // The attempt's directory, torchrun's layout.
  EXPECT_EQ(units[2].streams.dir, "/logs/job_abcdefgh/attempt_1/2");
  // --log-dir alone keeps every stream (-t 3); nothing asked, no directory.
  o = parse({"run", "-n", "2", "--log-dir", "L", "true"});
  o.log_job_dir = "L/x";
  units = plan_units(o, machine(), elastic, "");
  EXPECT_EQ(units[1].streams.to_file, 3);
  EXPECT_EQ(units[1].streams.to_console, 3);
  units = plan_units(parse({"run", "-n", "2", "true"}), machine(), elastic, "");
  EXPECT_EQ(units[1].streams.to_file, 0);
  EXPECT_EQ(units[1].streams.dir, "");
}

TEST(RunPlan, RoleAndTorchDistributedLaunchsLocalRankArgument) {
  auto units = plan_units(parse({"run", "-n", "2", "--role", "trainer", "--local-rank-arg",
                                 "--no-python", "true", "x"}),
                          machine(), Elastic{"j", nullptr, ""}, "");
  EXPECT_EQ(var(units[1], "ROLE_NAME"), "trainer");
  EXPECT_EQ(var(units[1], "TORCHELASTIC_SIGNALS_TO_HANDLE"), "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  auto usr1 = plan_units(parse({"run", "--signals-to-handle", "SIGUSR1", "true"}), machine(),
                         Elastic{"j", nullptr, ""}, "");
  EXPECT_EQ(var(usr1[0], "TORCHELASTIC_SIGNALS_TO_HANDLE"), "SIGUSR1");
  EXPECT_EQ(units[0].spec.argv, (Args{"true", "--local-rank=0", "x"}));
  EXPECT_EQ(units[1].spec.argv, (Args{"true", "--local-rank=1", "x"}));
}

TEST(RunPlan, AnotherHostGetsTheCommandAsGivenToRunWithItsOwnPython) {
  auto units = plan_units(parse({"run", "--hosts", "node1:1", "-m", "pkg.train", "--",
                                 "--depth=24"}),
                          machine(), Elastic{"j", nullptr, ""}, "");
  // ssh: one shell command line.
  const std::string& line = units[0].spec.argv.back();
  EXPECT_NE(line.find(" --module -- pkg.train --depth=24"), std::string::npos) << line;
  EXPECT_EQ(line.find("python"), std::string::npos) << line;
}

TEST(RunPlan, HostsWithGpusPassTheirListAndRank0ElsewhereDrawsARemotePort) {
  Machine m = machine();
  m.gpu_count = [] {
    ADD_FAILURE() << "no rank starts here: this machine's GPUs are not asked for";
    return 0;
  };
  std::optional<bool> asked;
  m.master_port = [&](bool rank0_here, const std::string&) {
    asked = rank0_here;
    return 29600;
  };
  auto units = plan_units(parse({"run", "--hosts", "node1[0,1] node2[3]", "--ddip", "/x/ddip",
                                 "--launcher", "slurm", "true"}),
                          m, Elastic{"r", nullptr, ""}, "");
  EXPECT_EQ(asked, false);
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[1].first_rank, 2);
  const Args& argv = units[1].spec.argv;
  auto ddip = std::find(argv.begin(), argv.end(), "/x/ddip");
  ASSERT_NE(ddip, argv.end());
  Args node(ddip, argv.end());
  EXPECT_EQ(after(node, "--gpus"), (Args{"3"}));
  EXPECT_EQ(after(node, "-n"), Args{});
  EXPECT_EQ(after(node, "--master-addr"), (Args{"node1"}));  // rank 0's host
  EXPECT_EQ(after(node, "--node-files"), Args{});            // nothing shipped
  EXPECT_EQ(after(units[0].spec.argv, "--gpus"), (Args{"0,1"}));
}

TEST(RunPlan, RanksGetTheBreakpointHookAndAStdinPipeOnlyWhenSomeoneCanAnswer) {
  Elastic elastic{"run-5", nullptr, ""};
  RunOptions opts = parse({"run", "-n", "2", "python", "t.py"});
  auto units = plan_units(opts, machine(), elastic, "");
  for (const auto& p : units) {
    EXPECT_EQ(var(p, "PYTHONBREAKPOINT"), "ddip.rank.run_debug.set_trace");
    EXPECT_FALSE(p.spec.stdin_pipe) << "nobody to answer: /dev/null";
  }
  opts.prompts = true;  // ddip run's stdin is a terminal or a pipe (main decides)
  for (const auto& p : plan_units(opts, machine(), elastic, "")) EXPECT_TRUE(p.spec.stdin_pipe);

  // The user's own choice stays, from the environment here or from --env.
  Machine m = machine();
  m.env.push_back("PYTHONBREAKPOINT=0");
  EXPECT_EQ(var(plan_units(opts, m, elastic, "")[0], "PYTHONBREAKPOINT"), "0");
  auto mine = plan_units(parse({"run", "-n", "1", "--env", "PYTHONBREAKPOINT=mod.hook", "python",
                                "t.py"}),
                         machine(), elastic, "");
  EXPECT_EQ(var(mine[0], "PYTHONBREAKPOINT"), "mod.hook");
}

TEST(RunPlan, AnotherHostIsToldWhetherItsRanksPromptsCanBeAnswered) {
  RunOptions opts = parse({"run", "--hosts", "localhost:1,node1:1", "--master-addr", "10.0.0.1",
                           "python", "t.py"});
  // ssh gets the host's command line as one word.
  auto has = [](const UnitPlan& p) {
    return std::any_of(p.spec.argv.begin(), p.spec.argv.end(), [](const std::string& a) {
      return a.find(" --node-prompts ") != std::string::npos;
    });
  };
  EXPECT_FALSE(has(plan_units(opts, machine(), Elastic{"run-6", nullptr, ""}, "")[1]));
  opts.prompts = true;
  auto units = plan_units(opts, machine(), Elastic{"run-6", nullptr, ""}, "");
  EXPECT_TRUE(units[1].host);
  EXPECT_TRUE(has(units[1]));
  // And that host's ddip run reads it back.
  EXPECT_TRUE(parse({"run", "--node", "1,2,1,2", "--node-name", "node1", "--node-prompts", "-n",
                     "1", "python", "t.py"})
                  .prompts);
}

TEST(RunPlan, RanksHereGetDdipsStartupHookFirstOnPythonpathUnlessTurnedOff) {
  Elastic elastic{"run-7", nullptr, "/tmp/ddip-run-x/hook"};
  Machine m = machine();
  m.env.push_back("PYTHONPATH=/mine");
  for (const auto& p : plan_units(parse({"run", "-n", "2", "python", "t.py"}), m, elastic, "")) {
    EXPECT_EQ(var(p, "PYTHONPATH"), "/tmp/ddip-run-x/hook:/mine");
    EXPECT_EQ(var(p, "DDIP_RUN_HOOK"), "1");
  }
  // Turned off by the user, here or with --env: the environment stays as it was.
  auto off = plan_units(parse({"run", "-n", "1", "--env", "DDIP_RUN_HOOK=0", "python", "t.py"}),
                        m, elastic, "");
  EXPECT_EQ(var(off[0], "PYTHONPATH"), "/mine");
  EXPECT_EQ(var(off[0], "DDIP_RUN_HOOK"), "0");
  // Another host's ddip run makes its own hook there: its launcher's environment has none.
  auto hosts = plan_units(parse({"run", "--hosts", "localhost:1,node1:1", "--master-addr",
                                 "10.0.0.1", "python", "t.py"}),
                          m, elastic, "");
  EXPECT_EQ(var(hosts[0], "DDIP_RUN_HOOK"), "1");
  EXPECT_TRUE(hosts[1].host);
  EXPECT_EQ(var(hosts[1], "PYTHONPATH"), "/mine");
}
