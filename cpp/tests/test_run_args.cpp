#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>

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

}  // namespace

TEST(CommandLine, TakesFlagsThenTheCommandWithItsOwnFlags) {
  auto o = parse({"run", "-n", "3", "python", "train.py", "-n", "7", "--lr", "0.1"});
  EXPECT_EQ(o.nproc, 3);
  EXPECT_EQ(o.command, (Args{"python", "train.py", "-n", "7", "--lr", "0.1"}));
  EXPECT_TRUE(o.gpus.empty());
  EXPECT_EQ(o.show, "all");
  EXPECT_EQ(o.timeout_s, 0);
}

TEST(CommandLine, DoubleDashEndsTheFlags) {
  auto o = parse({"run", "--nproc-per-node=2", "--show", "0", "--", "true", "--", "x"});
  EXPECT_EQ(o.nproc, 2);
  EXPECT_EQ(o.show, "0");
  // torchrun drops one "--": here the one that ends the options.
  EXPECT_EQ(o.command, (Args{"true", "--", "x"}));
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
  EXPECT_EQ(error_of({"run", "-n", "2", "--gpus", "0,1", "true"}),
            "-n excludes --gpus (give the ranks one way)");
  EXPECT_EQ(error_of({"run", "--gpus", "0", "--nproc_per_node", "2", "true"}),
            "--gpus excludes --nproc_per_node (give the ranks one way)");
}

TEST(CommandLine, BadN) {
  EXPECT_EQ(error_of({"run", "-n", "0", "true"}), "-n: Value 0 not in range 1 to 1024");
  EXPECT_NE(error_of({"run", "-n", "-3", "true"}), "");
  EXPECT_EQ(error_of({"run", "--nproc_per_node", "two", "true"}),
            "--nproc_per_node: give a number of ranks (1 to 1024), cpu, gpu or auto; got 'two'");
  EXPECT_NE(error_of({"run", "-n", "2000", "true"}).find("not in range"), std::string::npos);
  EXPECT_EQ(error_of({"run", "-n"}), "-n: needs a value\nCOMMAND is required");
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

TEST(CommandLine, ShowValues) {
  EXPECT_EQ(parse({"run", "--show", "none", "true"}).show, "none");
  EXPECT_EQ(parse({"run", "--show", "0,2", "true"}).show, "0,2");
  EXPECT_NE(error_of({"run", "--show", "some", "true"}).find("'some' is not a rank"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--show", "-1", "true"}), "");
}

TEST(CommandLine, BadTimeout) {
  EXPECT_NE(error_of({"run", "--timeout", "0", "true"}), "");
  EXPECT_NE(error_of({"run", "--timeout", "soon", "true"}), "");
}

TEST(CommandLine, HelpIsAskedFor) {
  CommandLine cl;
  EXPECT_THROW(cl.parse({"run", "--help"}), CLI::CallForHelp);
}

TEST(ShownRanks, AllNoneAndLists) {
  EXPECT_EQ(shown_ranks("all", 3), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(shown_ranks("none", 2), (std::vector<bool>{false, false}));
  EXPECT_EQ(shown_ranks("0", 3), (std::vector<bool>{true, false, false}));
  EXPECT_EQ(shown_ranks("2, 0", 3), (std::vector<bool>{true, false, true}));
}

TEST(ShownRanks, RankOutsideTheWorldIsAnError) {
  try {
    shown_ranks("2", 2);
    FAIL() << "no error";
  } catch (const CLI::ValidationError& e) {
    EXPECT_NE(std::string(e.what()).find("there is no rank 2: ranks are 0-1"), std::string::npos);
  }
}

TEST(Hosts, CommandLine) {
  auto o = parse({"run", "--hosts", "a:2,b:1", "--launcher", "ssh -p 2222", "python", "t.py"});
  EXPECT_EQ(o.world_size(), 3);
  EXPECT_EQ(o.launcher, "ssh -p 2222");
  EXPECT_NE(error_of({"run", "--hosts", "a:2", "-n", "2", "true"}).find("excludes"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--launcher", "ssh", "true"}).find("requires --hosts"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--hosts", "a:1", "--launcher", "rsh", "true"})
                .find("must be ssh, slurm or a launcher command with {host} and {command}"),
            std::string::npos);
  EXPECT_EQ(error_of({"run", "--master-port", "0", "true"}),
            "--master-port: give a port from 1 to 65535, got '0'");
  // --ship: files for the other hosts, as given (each host's copy replaces the argument).
  o = parse(
      {"run", "--hosts", "a:1,b:1", "--ship", "t.py", "--ship", "/x/cfg.yaml", "python", "t.py"});
  EXPECT_EQ(o.ship, (std::vector<std::string>{"t.py", "/x/cfg.yaml"}));
  EXPECT_NE(error_of({"run", "--ship", "t.py", "python", "t.py"}).find("requires --hosts"),
            std::string::npos);
  o = parse({"run", "--node", "1,2,1,2", "--node-files", "2", "-n", "1", "true"});
  EXPECT_EQ(o.node->files, 2);
}

TEST(Hosts, NodeOptionsPlaceTheHostsRanks) {
  auto o = parse({"run", "--node", "2,5,1,2", "--node-name", "b", "-n", "3", "true"});
  ASSERT_TRUE(o.node);
  EXPECT_EQ(o.node->rank_offset, 2);
  EXPECT_EQ(o.node->world_size, 5);
  EXPECT_EQ(o.node->node_rank, 1);
  EXPECT_EQ(o.node->nnodes, 2);
  // What the launching side passes on: its --link-timeout, its output options.
  o = parse({"run", "--node", "0,1,0,1", "--link-timeout", "4", "--show", "0", "-n", "1", "true"});
  EXPECT_DOUBLE_EQ(o.link_timeout_s, 4);
  EXPECT_EQ(o.show, "0");
  // Its ranks must fit the world it is told about.
  EXPECT_NE(error_of({"run", "--node", "3,5,1,2", "-n", "3", "true"}).find("--node"),
            std::string::npos);
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
           {{"run", "--hosts", "a,b", "--gpus", "a:0", "true"}, "other hosts than the host list"},
           {{"run", "--gpus", "a:0 a:1", "true"}, "name host a twice"},
           {{"run", "--gpus", "a:", "true"}, "write HOST:GPUS"},
           {{"run", "--gpus", "a:0,0", "true"}, "lists a GPU twice"},
       })
    EXPECT_NE(error_of(args).find(words), std::string::npos) << error_of(args);
}

// --check: a program (%%diprun) asks whether the command line is good; a usage error is the
// message alone, with exit code 2, so it can show it as its own usage error.
TEST(CommandLine, CheckPrintsAUsageErrorAloneAndExitsWithTwo) {
  EXPECT_FALSE(parse({"run", "true"}).check);
  EXPECT_TRUE(parse({"run", "--check", "-n", "2", "true"}).check);
  for (bool check : {true, false}) {
    CommandLine cl;
    Args args = {"run", "-n", "0", "true"};
    if (check) args.insert(args.begin() + 1, "--check");
    try {
      cl.parse(args);
      FAIL() << "-n 0 parsed";
    } catch (const CLI::Error& e) {
      testing::internal::CaptureStderr();
      EXPECT_EQ(cl.exit(e), 2);
      std::string printed = testing::internal::GetCapturedStderr();
      EXPECT_EQ(printed.rfind("-n: Value 0 not in range 1 to 1024\n", 0), 0u)
          << printed;
      EXPECT_EQ(printed.find("--help") == std::string::npos, check) << printed;
    }
  }
}

TEST(CommandLine, TimeoutMustBePositiveSeconds) {
  EXPECT_DOUBLE_EQ(parse({"run", "--timeout", "0.5", "true"}).timeout_s, 0.5);
  for (const char* bad : {"0", "-1", "soon"})
    EXPECT_EQ(error_of({"run", "--timeout", bad, "true"}),
              std::string("--timeout: give a positive number of seconds, got ") + bad);
}

// -- torchrun's command line (torch/distributed/run.py), issue 32 ------------------------------

namespace {
// A scratch directory with files for COMMAND's lookups; removed at the end.
struct Scratch {
  std::string dir;
  Scratch() {
    char d[] = "/tmp/ddip-run-args-XXXXXX";
    dir = ::mkdtemp(d);
  }
  ~Scratch() { std::filesystem::remove_all(dir); }
  std::string file(const std::string& name, const std::string& text, mode_t mode = 0644) const {
    std::string path = dir + "/" + name;
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(text.c_str(), f);
    std::fclose(f);
    ::chmod(path.c_str(), mode);
    return path;
  }
};

// Sets a variable for one test, and puts back what was there.
struct Env {
  std::string name;
  std::optional<std::string> old;
  Env(std::string n, const std::string& v) : name(std::move(n)) {
    if (const char* o = std::getenv(name.c_str())) old = o;
    ::setenv(name.c_str(), v.c_str(), 1);
  }
  ~Env() {
    if (old)
      ::setenv(name.c_str(), old->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};
}  // namespace

TEST(Torchrun, EveryOptionInDashAndUnderscoreSpellingsAndWithEquals) {
  for (const Args& args : {
           Args{"run", "--nproc_per_node", "2", "--master_port", "1234", "--master_addr", "h",
                "--node_rank", "0", "--max_restarts", "0", "--rdzv_id", "x", "true"},
           Args{"run", "--nproc-per-node=2", "--master-port=1234", "--master-addr=h",
                "--node-rank=0", "--max-restarts=0", "--rdzv-id=x", "true"},
       }) {
    auto o = parse(args);
    EXPECT_EQ(o.nproc, 2);
    EXPECT_EQ(o.master_port, 1234);
    EXPECT_TRUE(o.master_port_given);
    EXPECT_EQ(o.master_addr, "h");
    EXPECT_EQ(o.node_rank, 0);
    EXPECT_EQ(o.rdzv_id, "x");  // a given port keeps the static rendezvous and its id
    EXPECT_EQ(o.rdzv_backend, "static");
    EXPECT_EQ(o.command, Args{"true"});
  }
  // argparse takes a unique prefix of a long option, as torchrun does.
  EXPECT_EQ(parse({"run", "--nproc", "3", "true"}).nproc, 3);
  EXPECT_NE(error_of({"run", "--rdzv", "x", "true"}).find("ambiguous"), std::string::npos);
}

TEST(Torchrun, PetVariablesAreReadAndTheCommandLineWins) {
  Env n("PET_NPROC_PER_NODE", "3"), port("PET_MASTER_PORT", "4321"), role("PET_ROLE", "trainer");
  auto o = parse({"run", "true"});
  EXPECT_EQ(o.nproc, 3);
  EXPECT_EQ(o.master_port, 4321);
  EXPECT_EQ(o.role, "trainer");
  o = parse({"run", "--nproc_per_node", "2", "--role", "r", "true"});
  EXPECT_EQ(o.nproc, 2);
  EXPECT_EQ(o.role, "r");
  // A PET_* flag is a number, as torch's check_env reads it.
  {
    Env s("PET_STANDALONE", "0");
    EXPECT_FALSE(parse({"run", "true"}).standalone);
  }
  {
    Env s("PET_STANDALONE", "1");
    EXPECT_TRUE(parse({"run", "true"}).standalone);
  }
  // --gpus on the command line outranks PET_NPROC_PER_NODE rather than clashing with it.
  EXPECT_EQ(error_of({"run", "--gpus", "0", "true"}).find("excludes"), std::string::npos);
  // A bad PET_* value is named by its variable, before the command line's problems.
  Env bad("PET_MAX_RESTARTS", "x");
  EXPECT_EQ(error_of({"run", "--nnodes", "0", "true"}),
            "PET_MAX_RESTARTS=x: give a number of restarts (0 or more), got 'x'\n"
            "--nnodes: give N or MIN:MAX with 0 < MIN <= MAX, got '0'");
}

TEST(Torchrun, NprocPerNodeCpuGpuAuto) {
  Env none("CUDA_VISIBLE_DEVICES", "");  // no GPU visible, whatever this machine has
  EXPECT_EQ(parse({"run", "--nproc-per-node", "cpu", "true"}).nproc, ddip::plan::cpu_count());
  EXPECT_EQ(parse({"run", "--nproc-per-node", "auto", "true"}).nproc, ddip::plan::cpu_count());
  EXPECT_EQ(error_of({"run", "--nproc-per-node", "gpu", "true"}),
            "--nproc-per-node: there is no GPU here (torchrun: Cuda is not available); give a "
            "number of ranks, cpu or auto");
  EXPECT_NE(error_of({"run", "--nproc-per-node", "xpu", "true"}), "");
}

TEST(Torchrun, NnodesAndNodeRank) {
  for (const char* one : {"1", "1:1"}) {
    auto o = parse({"run", "--nnodes", one, "true"});
    EXPECT_EQ(o.nnodes_min, 1);
    EXPECT_EQ(o.nnodes_max, 1);
  }
  EXPECT_EQ(parse({"run", "--nnodes=1", "--node_rank=0", "true"}).node_rank, 0);
  EXPECT_EQ(parse({"run", "true"}).node_rank, -1);
  for (const char* bad : {"0", "2:1", "x", "1:", ":2", "1:2:3"})
    EXPECT_EQ(error_of({"run", "--nnodes", bad, "true"}),
              std::string("--nnodes: give N or MIN:MAX with 0 < MIN <= MAX, got '") + bad + "'");
  EXPECT_EQ(error_of({"run", "--nnodes", "1", "--node-rank", "1", "--master-port", "2", "true"}),
            "--node-rank: node ranks are 0 to 0 with --nnodes 1");
}

TEST(Torchrun, StandaloneAndOneNodeStaticAreC10dOnAFreePortWithARandomId) {
  for (const Args& args : {Args{"run", "--standalone", "--rdzv-id", "mine", "true"},
                           Args{"run", "--nnodes", "1", "true"}, Args{"run", "true"}}) {
    auto o = parse(args);
    EXPECT_EQ(o.rdzv_backend, "c10d");
    EXPECT_EQ(o.rdzv_endpoint, "localhost:0");
    EXPECT_EQ(o.rdzv_id, "");  // ddip run draws a UUID, as torch's run() does
  }
  EXPECT_TRUE(parse({"run", "--standalone", "true"}).standalone);
  auto o = parse({"run", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5", "--rdzv-id", "j",
                  "--rdzv-conf", "join_timeout=5, is_host=1", "true"});
  EXPECT_EQ(o.rdzv_backend, "c10d");
  EXPECT_EQ(o.rdzv_endpoint, "h:5");
  EXPECT_EQ(o.rdzv_id, "j");
  EXPECT_EQ(o.rdzv_conf, (std::map<std::string, std::string>{{"is_host", "1"},
                                                             {"join_timeout", "5"}}));
  EXPECT_NE(error_of({"run", "--rdzv-backend", "etcd", "true"}).find("static or c10d"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--rdzv-conf", "a=1,b", "true"}).find("--rdzv-conf"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--rdzv-endpoint", "h:port", "true"}).find("port"),
            std::string::npos);
}

TEST(Torchrun, EndpointsAsTorchParsesThem) {
  auto e = parse_endpoint("node1:1234");
  EXPECT_EQ(e.host, "node1");
  EXPECT_EQ(e.port, 1234);
  EXPECT_EQ(parse_endpoint("node1").port, 29400);
  EXPECT_EQ(parse_endpoint("").host, "localhost");
  e = parse_endpoint("[::1]:5");
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.port, 5);
  EXPECT_EQ(parse_endpoint("[fe80::1]").host, "fe80::1");
  EXPECT_THROW(parse_endpoint("h:70000"), std::invalid_argument);
  EXPECT_THROW(parse_endpoint("a b:1"), std::invalid_argument);
}

TEST(Torchrun, RestartsSignalsRoleAndOptionsThatChangeNothing) {
  auto o = parse({"run", "--max-restarts", "0", "--monitor-interval", "0.5", "--start-method",
                  "fork", "--role", "trainer", "--local-addr", "10.0.0.1", "--signals-to-handle",
                  "SIGTERM,SIGUSR1", "--event-log-handler", "null", "true"});
  EXPECT_EQ(o.max_restarts, 0);
  EXPECT_DOUBLE_EQ(o.monitor_interval_s, 0.5);
  EXPECT_EQ(o.start_method, "fork");
  EXPECT_EQ(o.role, "trainer");
  EXPECT_EQ(o.local_addr, "10.0.0.1");
  EXPECT_EQ(o.signals_to_handle, (Args{"SIGTERM", "SIGUSR1"}));
  EXPECT_EQ(parse({"run", "true"}).signals_to_handle,
            (Args{"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}));
  EXPECT_NE(error_of({"run", "--start-method", "thread", "true"}).find("spawn, fork"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--signals-to-handle", "SIGFOO", "true"}).find("SIGFOO"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--max-restarts", "-1", "true"}), "");
  EXPECT_EQ(error_of({"run", "--numa-binding", "node", "true"}),
            "--numa-binding: torchrun's option is not one of ddip run's");
}

TEST(Torchrun, RedirectsTeeAndLocalRanksFilter) {
  auto o = parse({"run", "-t", "3", "-r", "0:1,1:2", "--local-ranks-filter", "0,2", "true"});
  EXPECT_EQ(o.tee.of(0), 3);
  EXPECT_EQ(o.tee.of(5), 3);
  EXPECT_EQ(o.redirects.of(0), 1);
  EXPECT_EQ(o.redirects.of(1), 2);
  EXPECT_EQ(o.redirects.of(2), 0);
  EXPECT_EQ(o.local_ranks_filter, (std::vector<int>{0, 2}));
  o = parse({"run", "--tee=2", "--redirects", "1", "--log_dir", "L", "true"});
  EXPECT_EQ(o.tee.of(0), 2);
  EXPECT_EQ(o.redirects.of(0), 1);
  EXPECT_EQ(o.log_dir, "L");
  EXPECT_EQ(parse({"run", "-t3", "true"}).tee.of(1), 3);
  for (const char* bad : {"4", "x", "0:4", "0:1,", "a:1"})
    EXPECT_NE(error_of({"run", "--tee", bad, "true"}).find("give 0 (none)"), std::string::npos)
        << bad;
  EXPECT_NE(error_of({"run", "--local-ranks-filter", "a", "true"}).find("local ranks"),
            std::string::npos);
}

TEST(Torchrun, AScriptRunsWithPythonAsTorchrunRunsIt) {
  Scratch s;
  Env py("PYTHON_EXEC", "/opt/py/bin/python3");  // torch's own override of sys.executable
  // An executable .py without "#!" is Python's, never /bin/sh's.
  std::string script = s.file("train.py", "print(1)\n", 0755);
  EXPECT_EQ(parse({"run", script, "--lr", "1"}).command,
            (Args{"/opt/py/bin/python3", "-u", script, "--lr", "1"}));
  // -m: a module, and the "--" after it is torchrun's, not the script's.
  EXPECT_EQ(parse({"run", "-m", "pkg.train", "--", "--depth=24"}).command,
            (Args{"/opt/py/bin/python3", "-u", "-m", "pkg.train", "--depth=24"}));
  EXPECT_EQ(parse({"run", "--", script, "--", "x"}).command,
            (Args{"/opt/py/bin/python3", "-u", script, "--", "x"}));
  EXPECT_EQ(parse({"run", script, "x", "--", "y"}).command,
            (Args{"/opt/py/bin/python3", "-u", script, "x", "--", "y"}));
  // --run-path: runpy.run_path in a Python of its own; it outranks --no-python.
  auto o = parse({"run", "--run-path", "--no-python", script, "a"});
  ASSERT_EQ(o.command.size(), 6u);
  EXPECT_EQ(o.command[2], "-c");
  EXPECT_EQ((Args{o.command[4], o.command[5]}), (Args{script, "a"}));
  // A program on PATH (ddip run's habit: python train.py), or --no-python, runs as it is.
  EXPECT_EQ(parse({"run", "true", "x"}).command, (Args{"true", "x"}));
  std::string tool = s.file("tool", "#!/bin/sh\n", 0755);
  EXPECT_EQ(parse({"run", "--no-python", tool}).command, Args{tool});
  EXPECT_EQ(parse({"run", tool}).command, Args{tool});
  // A file that is not a program is a script, whatever its name.
  std::string plain = s.file("train", "print(1)\n");
  EXPECT_EQ(parse({"run", plain}).command, (Args{"/opt/py/bin/python3", "-u", plain}));
  EXPECT_EQ(error_of({"run", "--no-python", "-m", "pkg", "true"}),
            "COMMAND: don't use both --no-python and --module (torchrun's rule)");
  // torch.distributed.launch's forms: --use-env is the default here; --local-rank-arg passes
  // --local-rank=N right after the script.
  EXPECT_EQ(parse({"run", "--use_env", script}).command.size(), 3u);
  EXPECT_EQ(parse({"run", "--local-rank-arg", script, "x"}).local_rank_arg_at, 3);
  EXPECT_EQ(parse({"run", "--local-rank-arg", "true", "x"}).local_rank_arg_at, 1);
  EXPECT_EQ(parse({"run", script}).local_rank_arg_at, -1);
}

TEST(Torchrun, TheInterpreterIsPythonExecElseTheOneBesideDdip) {
  {
    Env py("PYTHON_EXEC", "/x/python");
    EXPECT_EQ(python_interpreter("/y/python"), "/x/python");
  }
  ::unsetenv("PYTHON_EXEC");
  EXPECT_EQ(python_interpreter("/y/python"), "/y/python");  // python -m ddip's sys.executable
  // This test program has no python3 beside it: PATH's.
  EXPECT_EQ(python_interpreter(), "python3");
}

TEST(CommandLine, CheckLooksUpTheProgramAndTheScript) {
  Scratch s;
  EXPECT_EQ(error_of({"run", "--check", "ddip-no-such-program"}),
            "COMMAND: ddip-no-such-program: no such program on PATH and no such file (a program "
            "would exit with 127, not found; a script is run with Python)");
  EXPECT_EQ(error_of({"run", "--no-python", "ddip-no-such-program"}),
            "COMMAND: ddip-no-such-program: no such program (not a file, not on PATH); every "
            "rank would exit with 127 (not found)");
  std::string plain = s.file("tool", "");
  EXPECT_EQ(error_of({"run", "--no-python", plain}),
            "COMMAND: " + plain + " is not executable; every rank would exit with 126");
  EXPECT_EQ(error_of({"run", "-n", "2", "nothere.py"}),
            "COMMAND: nothere.py: no such file here (Python would fail in every rank)");
  // Ranks on other hosts look their files up there.
  EXPECT_EQ(error_of({"run", "--hosts", "a:1,b:1", "nothere.py"}), "");
}

TEST(CommandLine, EveryProblemIsNamedInOrder) {
  // An unknown option's value stays its own when a command follows, so the rest is still read.
  EXPECT_EQ(error_of({"run", "--bogus", "4", "-n", "0", "--frob", "--timeout", "x", "true"}),
            "--bogus: no such option of ddip run (ddip run --help lists them; put the command "
            "after -- if this is its own)\n"
            "-n: Value 0 not in range 1 to 1024\n"
            "--frob: no such option of ddip run (ddip run --help lists them; put the command "
            "after -- if this is its own)\n"
            "--timeout: give a positive number of seconds, got x");
  auto o = parse({"run", "--nproc_per_node", "2", "true", "--bogus", "4"});
  EXPECT_EQ(o.command, (Args{"true", "--bogus", "4"}));
  EXPECT_NE(error_of({"run", "--bogus", "true"}).find("--bogus"), std::string::npos);
  EXPECT_EQ(error_of({"run", "--standalone=1", "true"}), "--standalone: takes no value, got 1");
}

TEST(CommandLine, HostsAndOneDdipRunPerNodeDoNotMix) {
  EXPECT_NE(error_of({"run", "--nnodes", "2", "--hosts", "a:1,b:1", "true"}).find("not both"),
            std::string::npos);
}

TEST(Torchrun, SignalsToHandleAreForwardedBesidesIntTermAndHup) {
  EXPECT_EQ(forwarded_signals(parse({"run", "true"})),
            (std::vector<int>{SIGINT, SIGTERM, SIGHUP, SIGQUIT}));  // torch's default adds SIGQUIT
  EXPECT_EQ(forwarded_signals(parse({"run", "--signals-to-handle", "SIGUSR1,SIGTERM", "true"})),
            (std::vector<int>{SIGINT, SIGTERM, SIGHUP, SIGUSR1}));
  EXPECT_NE(error_of({"run", "--signals-to-handle", "SIGURG", "true"}).find("stops a job"),
            std::string::npos);
}
