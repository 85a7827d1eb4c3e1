// Where every rank is when ddip run times out or is interrupted (cpp/tools/run_collectives.hpp):
// the startup hook's file and environment, which processes answer SIGURG, and one request's
// answers gathered until every rank asked has answered or the deadline, then shown in rank order.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "run_collectives.hpp"

using namespace ddip::run;
using ddip::Fd;
using ddip::SpawnSpec;
using protocol::RankState;
using std::chrono::milliseconds;

namespace {

std::string env_value(const std::vector<std::string>& env, const std::string& name) {
  for (const auto& kv : env)
    if (kv.rfind(name + "=", 0) == 0) return kv.substr(name.size() + 1);
  return "<unset>";
}

// rank 0 waits in all_reduce #2, which rank 1 (whose last was #1) has not entered: the snapshots
// as python/ddip/rank/collectives.py writes them.
std::string all_reduce(int seq, bool done, long long created_ns) {
  return R"({"seq": )" + std::to_string(seq) +
         R"(, "p2p": false, "pg": "0", "op": "all_reduce", "sizes": [[4]], "dtypes": ["Float"], )"
         R"("done": )" +
         (done ? "true" : "false") + R"(, "created_ns": )" + std::to_string(created_ns) + "}";
}

std::string waiting_in_2(int rank) {
  return R"({"rank": )" + std::to_string(rank) +
         R"(, "world": 2, "now_ns": 7000000000, "groups": {"0": [0, 1]}, "entries": [)" +
         all_reduce(1, true, 1000000000) +
         (rank == 0 ? ", " + all_reduce(2, false, 2000000000) : std::string()) + "]}";
}

const Clock::time_point t0 = Clock::now();

}  // namespace

TEST(RunCollectives, TheStartupHookFileLoadsDdipsHookAndChainsToTheHiddenSitecustomize) {
  auto dir = std::filesystem::temp_directory_path() /
             ("ddip-test-hook-" + std::to_string(::getpid()));
  EXPECT_EQ(write_startup_hook(dir.string()), dir.string());
  std::ifstream in(dir / "sitecustomize.py");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("\"rank\", \"run_hook.py\""), std::string::npos);
  EXPECT_NE(text.str().find("hook.start(here)"), std::string::npos);
  EXPECT_NE(text.str().find("import sitecustomize"), std::string::npos) << "the hidden one";
  std::filesystem::remove_all(dir);
  EXPECT_THROW(write_startup_hook("/proc/no-such-dir"), std::system_error);
}

// The hook of the package the launcher came with, found from the launcher's path in each layout
// pip makes, and written into the startup file for ranks whose Python has no ddip.
TEST(RunCollectives, TheLaunchersOwnHookIsFoundBesideItAndWrittenForRanksWithoutDdip) {
  namespace fs = std::filesystem;
  auto root = fs::temp_directory_path() / ("ddip-test-own-hook-" + std::to_string(::getpid()));
  auto make = [](const fs::path& file) {
    fs::create_directories(file.parent_path());
    std::ofstream(file) << "#\n";
    return file.string();
  };
  // A virtual environment (or pipx's): PREFIX/bin/ddip, PREFIX/lib/python3.X/site-packages/ddip.
  std::string venv = make(root / "venv/lib/python3.12/site-packages/ddip/rank/run_hook.py");
  EXPECT_EQ(own_hook(root / "venv/bin/ddip"), venv);
  // Debian's Python under a prefix: dist-packages.
  std::string deb = make(root / "usr/lib/python3/dist-packages/ddip/rank/run_hook.py");
  EXPECT_EQ(own_hook(root / "usr/bin/ddip"), deb);
  // pip install --target DIR: DIR/bin/ddip beside DIR/ddip.
  std::string target = make(root / "target/ddip/rank/run_hook.py");
  EXPECT_EQ(own_hook(root / "target/bin/ddip"), target);
  // The copy inside the package, ddip/bin/ddip (what %%diprun starts).
  EXPECT_EQ(own_hook(root / "target/ddip/bin/ddip"), target);
  auto dir = root / "hook";
  write_startup_hook(dir.string(), venv);
  std::ifstream in(dir / "sitecustomize.py");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("OWN_HOOK = \"" + venv + "\""), std::string::npos);
  EXPECT_NE(text.str().find("hook.IMPORTABLE = False"), std::string::npos);
  fs::remove_all(root);
}

TEST(RunCollectives, TheHookGoesFirstOnPythonpathUnlessTheUserTurnedItOff) {
  std::vector<std::string> env = {"PATH=/bin"};
  add_hook_environment(env, "/tmp/d/hook");
  EXPECT_EQ(env_value(env, "PYTHONPATH"), "/tmp/d/hook");
  EXPECT_EQ(env_value(env, "DDIP_RUN_HOOK"), "1");

  env = {"PYTHONPATH=/mine:/theirs", "DDIP_RUN_HOOK=1"};
  add_hook_environment(env, "/tmp/d/hook");
  EXPECT_EQ(env_value(env, "PYTHONPATH"), "/tmp/d/hook:/mine:/theirs");
  EXPECT_EQ(env, (std::vector<std::string>{"PYTHONPATH=/tmp/d/hook:/mine:/theirs",
                                           "DDIP_RUN_HOOK=1"}))
      << "each variable once";

  env = {"PYTHONPATH=/mine", "DDIP_RUN_HOOK=0"};
  add_hook_environment(env, "/tmp/d/hook");
  EXPECT_EQ(env, (std::vector<std::string>{"PYTHONPATH=/mine", "DDIP_RUN_HOOK=0"}));

  env = {"PATH=/bin"};
  add_hook_environment(env, "");  // no hook could be written
  EXPECT_EQ(env, (std::vector<std::string>{"PATH=/bin"}));
}

TEST(RunCollectives, AProcessAnswersSigurgWhenItsMainThreadBlocksIt) {
  // This test runs on the main thread: what /proc says of this process.
  sigset_t urg, old;
  sigemptyset(&urg);
  sigaddset(&urg, SIGURG);
  ASSERT_EQ(::pthread_sigmask(SIG_UNBLOCK, &urg, &old), 0);
  EXPECT_FALSE(answers_sigurg(::getpid()));
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &urg, nullptr), 0);
  EXPECT_TRUE(answers_sigurg(::getpid()));
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  EXPECT_FALSE(answers_sigurg(0x3fffffff)) << "a process that does not exist";
}

TEST(RunCollectives, AScriptsStatusIsReadOnceForItsOwnProcess) {
  auto dir = std::filesystem::temp_directory_path() /
             ("ddip-test-ended-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "ended.4242") << "3";
  EXPECT_EQ(script_status(dir.string(), 4243), std::nullopt) << "another process";
  EXPECT_EQ(script_status(dir.string(), 4242), 3);
  EXPECT_EQ(script_status(dir.string(), 4242), std::nullopt) << "read once: the file is gone";
  std::ofstream(dir / "ended.4244") << "garbled";
  EXPECT_EQ(script_status(dir.string(), 4244), std::nullopt);
  std::ofstream(dir / "ended.4245") << "300";
  EXPECT_EQ(script_status(dir.string(), 4245), std::nullopt) << "no exit status";
  std::filesystem::remove_all(dir);
}

TEST(RunCollectives, RankZerosStoreSocketListensOnItsMasterPortOnlyWhereItsHookTakesIt) {
  int port = 0;
  {
    Fd probe(::socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    socklen_t len = sizeof a;
    ASSERT_EQ(::bind(probe.get(), reinterpret_cast<sockaddr*>(&a), len), 0);
    ASSERT_EQ(::getsockname(probe.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
    port = ntohs(a.sin_port);
  }
  SpawnSpec spec;
  spec.argv = {"/usr/bin/python3", "-u", "train.py"};
  spec.env = {"MASTER_PORT=" + std::to_string(port), "DDIP_RUN_HOOK=1"};
  Fd socket;
  SpawnSpec out = with_store_socket(spec, socket);
  ASSERT_TRUE(socket);
  EXPECT_EQ(env_value(out.env, kStoreFdVariable), std::to_string(socket.get()));
  EXPECT_EQ(::fcntl(socket.get(), F_GETFD) & FD_CLOEXEC, 0) << "for the rank to inherit";
  Fd client(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(client.get(), reinterpret_cast<sockaddr*>(&to), sizeof to), 0)
      << "it listens before anyone serves";

  Fd busy;
  EXPECT_EQ(with_store_socket(spec, busy).env, spec.env) << "the port is taken (by the first)";
  EXPECT_FALSE(busy);
  socket.reset();
  for (auto argv : std::vector<std::vector<std::string>>{
           {"/bin/sh", "-c", "python train.py"}, {"python3", "-I", "train.py"},
           {"python", "-X", "dev", "-E", "train.py"}, {"python3", "-sS", "train.py"}}) {
    SpawnSpec other = spec;
    other.argv = argv;
    Fd none;
    EXPECT_EQ(with_store_socket(other, none).env, spec.env) << argv[0] << " " << argv[1];
    EXPECT_FALSE(none);
  }
  SpawnSpec off = spec;
  off.env = {"MASTER_PORT=" + std::to_string(port), "DDIP_RUN_HOOK=0"};
  Fd none;
  EXPECT_EQ(with_store_socket(off, none).env, off.env) << "the hook is off";
  EXPECT_FALSE(none);
  SpawnSpec module = spec;
  module.argv = {"python3", "-u", "-m", "pkg.train", "-I"};
  EXPECT_NE(with_store_socket(module, none).env, spec.env) << "-I after -m is the module's";
  EXPECT_TRUE(none);
}

TEST(RunCollectives, WaitsForEveryRankAskedAndShowsThePictureThenTheStacksInRankOrder) {
  RankStates s;
  EXPECT_FALSE(s.open());
  s.answer({0, waiting_in_2(0), "late"});  // no request open: ignored
  s.begin(t0 + kStateWait);
  EXPECT_EQ(s.deadline(), t0 + kStateWait);
  s.asked(1);
  s.asked(0);
  s.answer({2, "", ""});  // can't answer (a host said so): nobody waits for it
  EXPECT_FALSE(s.complete());
  s.answer({1, waiting_in_2(1), "  File \"train.py\", line 9, in <module>\n    time.sleep(600)\n"});
  EXPECT_FALSE(s.complete());
  s.answer(
      {0, waiting_in_2(0), "  File \"train.py\", line 7, in <module>\n    dist.all_reduce(t)\n"});
  EXPECT_TRUE(s.complete());
  std::string text = s.end();
  EXPECT_FALSE(s.open());
  EXPECT_EQ(s.deadline(), std::nullopt);
  // The picture first (ddip::CollectivePicture's own words), then each stack, rank 0 first
  // though it answered last, then the rank that could not answer.
  size_t picture = text.find("collectives (torch's flight recorder):\n");
  size_t missing = text.find("rank 1 has not entered all_reduce #2");
  size_t stack0 =
      text.find("[rank 0]\n  File \"train.py\", line 7, in <module>\n    dist.all_reduce(t)\n");
  size_t stack1 =
      text.find("[rank 1]\n  File \"train.py\", line 9, in <module>\n    time.sleep(600)\n");
  size_t silent = text.find("rank 2: no answer (not a Python rank with ddip's hook, or busy)\n");
  EXPECT_EQ(picture, 0u) << text;
  EXPECT_NE(missing, std::string::npos) << text;
  EXPECT_NE(stack0, std::string::npos) << text;
  EXPECT_NE(stack1, std::string::npos) << text;
  EXPECT_NE(silent, std::string::npos) << text;
  EXPECT_LT(missing, stack0);
  EXPECT_LT(stack0, stack1);
  EXPECT_LT(stack1, silent);
}

TEST(RunCollectives, AtTheDeadlineTheRanksThatDidNotAnswerAreNamed) {
  RankStates s;
  s.begin(t0 + milliseconds(10));
  s.asked(0);
  s.asked(1);
  s.asked(3);
  s.answer({0, waiting_in_2(0), "stack of 0\n"});
  EXPECT_FALSE(s.complete());
  std::string text = s.end();  // the launcher's deadline has passed
  EXPECT_NE(text.find("[rank 0]\nstack of 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: no answer (not a Python rank with ddip's hook, or busy)\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 3: no answer"), std::string::npos) << text;
  s.answer({1, waiting_in_2(1), "too late"});  // after the end: ignored
  EXPECT_FALSE(s.open());
}

TEST(RunCollectives, NothingIsShownWhenNoRankUsesTorchDistributed) {
  RankStates s;
  s.begin(t0 + kStateWait);
  s.asked(0);
  s.asked(1);
  s.answer({0, R"({"off": "torch.distributed is not initialized"})", "stack\n"});
  s.answer({1, R"({"off": "torch.distributed is not initialized"})", "stack\n"});
  EXPECT_TRUE(s.complete());
  EXPECT_EQ(s.end(), "");
  // Nobody asked at all (every rank has ended, or none has the hook): complete at once, nothing.
  s.begin(t0 + kStateWait);
  s.answer({0, "", ""});
  EXPECT_TRUE(s.complete());
  EXPECT_EQ(s.end(), "");
}

TEST(RunCollectives, ANewRequestForgetsTheLastOnesAnswers) {
  RankStates s;
  s.begin(t0);
  s.asked(0);
  s.answer({0, waiting_in_2(0), "old stack\n"});
  s.begin(t0 + kStateWait);
  s.asked(1);
  s.answer({1, waiting_in_2(1), "new stack\n"});
  std::string text = s.end();
  EXPECT_EQ(text.find("old stack"), std::string::npos) << text;
  EXPECT_NE(text.find("new stack"), std::string::npos) << text;
}
