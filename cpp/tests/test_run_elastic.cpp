// torchrun's elastic contract in ddip run's ranks (cpp/tools/run_elastic.hpp): the variables,
// the error files' directory, and reading and passing on what torch's @record writes.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "run_elastic.hpp"

using namespace ddip::run;

namespace {

std::map<std::string, std::string> as_map(const std::vector<std::string>& env) {
  std::map<std::string, std::string> m;
  for (const auto& e : env) m[e.substr(0, e.find('='))] = e.substr(e.find('=') + 1);
  return m;
}

// What torch's ErrorHandler.record_exception writes (json.dump of this shape, ASCII only).
const char* const kRecorded =
    R"({"message": {"message": "ValueError: bad batch \u00e9 \ud83d\ude00", "extraInfo": )"
    R"({"py_callstack": "Traceback (most recent call last):\n  File \"/x/train.py\", line 7, in )"
    R"(main\n    raise ValueError(\"bad batch\")\nValueError: bad batch\n", "timestamp": )"
    R"("1700000000"}}})";

}  // namespace

TEST(RunElastic, RunIdsAreUuid4AndDiffer) {
  std::set<std::string> ids;
  for (int i = 0; i < 100; ++i) {
    std::string id = new_run_id();
    EXPECT_TRUE(std::regex_match(
        id, std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")))
        << id;
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 100u);
}

TEST(RunElastic, TheVariablesTorchrunsAgentSets) {
  std::vector<std::string> env = {"RANK=1", "PATH=/bin"};
  add_elastic_environment(env, "abc", "/tmp/x/rank1.json");
  auto m = as_map(env);
  EXPECT_EQ(m["RANK"], "1");
  EXPECT_EQ(m["TORCHELASTIC_RUN_ID"], "abc");
  EXPECT_EQ(m["TORCHELASTIC_RESTART_COUNT"], "0");
  EXPECT_EQ(m["TORCHELASTIC_MAX_RESTARTS"], "0");
  // "True" would make every rank a client of a TCPStore nobody serves (rendezvous.py).
  EXPECT_EQ(m["TORCHELASTIC_USE_AGENT_STORE"], "False");
  EXPECT_EQ(m["TORCHELASTIC_SIGNALS_TO_HANDLE"], "SIGTERM,SIGINT,SIGHUP");
  EXPECT_EQ(m["TORCHELASTIC_ERROR_FILE"], "/tmp/x/rank1.json");
  std::vector<std::string> none;
  add_elastic_environment(none, "abc", "");
  EXPECT_EQ(as_map(none).count("TORCHELASTIC_ERROR_FILE"), 0u);
}

TEST(RunElastic, AnAttemptAfterRestartsSaysHowMany) {
  std::vector<std::string> env;
  add_elastic_environment(env, "abc", "", 2, 3);
  auto m = as_map(env);
  EXPECT_EQ(m["TORCHELASTIC_RESTART_COUNT"], "2");
  EXPECT_EQ(m["TORCHELASTIC_MAX_RESTARTS"], "3");
}

TEST(RunElastic, ErrorFilesLiveInAPrivateDirectoryThatGoesWithThem) {
  std::string dir;
  {
    ErrorFiles files;
    dir = files.dir();
    struct stat st {};
    ASSERT_EQ(::stat(dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    EXPECT_NE(files.path(0), files.path(1));
    EXPECT_EQ(files.read(3), "") << "not written: nothing";
    std::ofstream(files.path(3)) << kRecorded;
    EXPECT_EQ(files.read(3), kRecorded);
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(RunElastic, ErrorFilesFollowTmpdir) {
  auto base = std::filesystem::temp_directory_path() /
              ("ddip-test-tmpdir-" + std::to_string(::getpid()));
  std::filesystem::create_directories(base);
  const char* old = std::getenv("TMPDIR");
  std::string saved = old ? old : "";
  ::setenv("TMPDIR", base.c_str(), 1);
  {
    ErrorFiles files;
    EXPECT_EQ(std::filesystem::path(files.dir()).parent_path(), base);
  }
  ::setenv("TMPDIR", (base / "missing").c_str(), 1);
  try {
    ErrorFiles files;
    ADD_FAILURE() << "made a directory in a missing one";
  } catch (const std::system_error& e) {
    EXPECT_NE(std::string(e.what()).find("set TMPDIR to a writable directory"), std::string::npos);
  }
  if (old)
    ::setenv("TMPDIR", saved.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  std::filesystem::remove_all(base);
}

TEST(RunElastic, ReadsWhatRecordWrites) {
  auto e = read_rank_error(kRecorded);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "ValueError: bad batch \xc3\xa9 \xf0\x9f\x98\x80");
  EXPECT_EQ(e->traceback,
            (std::vector<std::string>{"Traceback (most recent call last):",
                                      "  File \"/x/train.py\", line 7, in main",
                                      "    raise ValueError(\"bad batch\")",
                                      "ValueError: bad batch"}));
  // The newer form: a plain message.
  e = read_rank_error(R"({"message": "worker lost", "timestamp": 5})");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "worker lost");
  EXPECT_TRUE(e->traceback.empty());
  // Not torch's: nothing to show.
  for (const char* bad : {"", "{", "[1, 2]", R"({"other": 1})", R"({"message": 3})",
                          R"({"message": {"message": "x")", R"({"message": "a\q"})",
                          R"({"message": "x"} trailing)", "{\"message\": \"a\nb\"}"})
    EXPECT_FALSE(read_rank_error(bad)) << bad;
}

TEST(RunElastic, TheParentsErrorFileIsTheRanksWithItsErrorCode) {
  std::string out = parent_error_json(kRecorded, 1);
  auto e = read_rank_error(out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "ValueError: bad batch \xc3\xa9 \xf0\x9f\x98\x80");
  EXPECT_EQ(e->traceback.back(), "ValueError: bad batch");
  EXPECT_NE(out.find(R"("timestamp":"1700000000"},"errorCode":1})"), std::string::npos) << out;
  // A signal, as torch counts it; an errorCode already there is replaced; 0 leaves it alone.
  EXPECT_NE(parent_error_json(out, -11).find(R"("errorCode":-11})"), std::string::npos);
  EXPECT_EQ(parent_error_json(out, -11).find("\"errorCode\":1"), std::string::npos);
  EXPECT_EQ(parent_error_json(kRecorded, 0).find("errorCode"), std::string::npos);
  // The plain form has nowhere to put it (torch skips it too); anything kept as it was, in
  // its order (as JSON: 2.5e3 is 2500.0).
  EXPECT_EQ(parent_error_json(R"({"message": "lost", "n": [1, 2.5e3, true, null], "a": {}})", 1),
            R"({"message":"lost","n":[1,2500.0,true,null],"a":{}})");
  EXPECT_THROW(parent_error_json("[1]", 1), std::invalid_argument);
  EXPECT_THROW(parent_error_json("{", 1), std::invalid_argument);
}
