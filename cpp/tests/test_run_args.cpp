#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

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
  auto o = parse({"run", "--nproc-per-node=2", "--tee", "0", "--", "-weird", "--", "x"});
  EXPECT_EQ(o.nproc, 2);
  EXPECT_EQ(o.show, "0");
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

TEST(CommandLine, APythonScriptAsTheProgramNamesThePythonItNeeds) {
  // torchrun's `torchrun --nproc-per-node 2 train.py`: here the command needs its interpreter.
  EXPECT_EQ(error_of({"run", "-n", "2", "train.py", "--lr", "0.1"}),
            "COMMAND: train.py is a Python script, and ddip run starts a program on every rank: "
            "name the interpreter, as in `ddip run -n 2 python train.py` (torchrun adds python "
            "itself)");
  EXPECT_EQ(error_of({"run", "-n", "2", "python", "train.py"}), "");
  // A script that runs by itself (its shebang, its x bit) is a program like any other.
  char dir[] = "/tmp/ddip-run-args-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  std::string script = std::string(dir) + "/train.py";
  std::FILE* f = std::fopen(script.c_str(), "w");
  std::fputs("#!/usr/bin/env python3\n", f);
  std::fclose(f);
  EXPECT_NE(error_of({"run", "-n", "2", script}), "");
  ::chmod(script.c_str(), 0755);
  EXPECT_EQ(error_of({"run", "-n", "2", script}), "");
  std::remove(script.c_str());
  ::rmdir(dir);
}

TEST(CommandLine, UnknownFlagIsAnErrorNotTheCommand) {
  EXPECT_NE(error_of({"run", "--bogus", "python"}).find("--bogus"), std::string::npos);
}

TEST(CommandLine, TeeValues) {
  EXPECT_EQ(parse({"run", "--tee", "none", "true"}).show, "none");
  EXPECT_EQ(parse({"run", "--tee", "0,2", "true"}).show, "0,2");
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
  EXPECT_EQ(shown_ranks("all", 3), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(shown_ranks("none", 2), (std::vector<bool>{false, false}));
  EXPECT_EQ(shown_ranks("0", 3), (std::vector<bool>{true, false, false}));
  EXPECT_EQ(shown_ranks("2, 0", 3), (std::vector<bool>{true, false, true}));
}

TEST(TeeRanks, RankOutsideTheWorldIsAnError) {
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
  EXPECT_NE(error_of({"run", "--hosts", "a:1", "--launcher", "rsh", "true"}).find("must be ssh"),
            std::string::npos);
  EXPECT_NE(error_of({"run", "--master-port", "0", "true"}).find("--master-port"),
            std::string::npos);
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
      EXPECT_EQ(printed.rfind("--nproc-per-node: Value 0 not in range 1 to 1024\n", 0), 0u)
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
