// Files shipped with a launch (cpp/tools/run_ship.hpp): what the starting side puts on a host's
// channel, and the host's side writing them into a private directory over a real pipe,
// replacing the command's arguments, and removing everything when it ends.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "ddip/fd.hpp"
#include "run_protocol.hpp"
#include "run_ship.hpp"

using namespace ddip::run;
namespace fs = std::filesystem;
using std::chrono::milliseconds;

namespace {

struct Dir {
  fs::path path;
  Dir() {
    std::string t = (fs::temp_directory_path() / "ddip-ship-test-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~Dir() { fs::remove_all(path); }
  std::string write(const std::string& name, const std::string& content,
                    fs::perms perms = fs::perms(0644)) {
    auto p = path / name;
    std::ofstream(p, std::ios::binary) << content;
    fs::permissions(p, perms);
    return p.string();
  }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST(RunShip, FileHeaderRoundTripsAndRefusesGarbage) {
  protocol::FileHeader h{"dir with space/cell.py", 12345, 0700};
  std::string line = protocol::encode(h);
  EXPECT_EQ(line, std::string("\x1e"
                              "ddip file dir\\swith\\sspace/cell.py 12345 448\n"));
  EXPECT_EQ(protocol::decode_file_header(line), h);
  EXPECT_THROW(protocol::decode_file_header("\x1e"
                                            "ddip file x 99999999999999 384\n"),
               protocol::ProtocolError);
  EXPECT_THROW(protocol::decode_file_header("\x1e"
                                            "ddip file x 1 4096\n"),
               protocol::ProtocolError);
  EXPECT_THROW(protocol::decode_file_header("\x1e"
                                            "ddip ping\n"),
               protocol::ProtocolError);
  EXPECT_THROW(protocol::decode_file_header("\x1e"
                                            "ddip file \\e 1 384\n"),
               protocol::ProtocolError);
}

TEST(RunShip, FilesTravelIntoAPrivateDirectoryThatGoesAtTheEnd) {
  Dir here;
  std::string big(300000, 'x');  // more than a pipe holds: the writer and reader take turns
  big[12345] = '\0';
  std::string script = here.write("cell.py", "print('hi')\n");
  std::string data = here.write("data.bin", big, fs::perms(0700));
  std::string payload = ship_payload({script, data});
  auto p = ddip::make_pipe();
  // The control channel goes on after the files: what follows must be left unread.
  const std::string after = protocol::encode(protocol::Control{protocol::Ping{}});
  std::thread writer([&] {
    std::string all = payload + after;
    for (size_t done = 0; done < all.size();) {
      ssize_t n = ::write(p.write.get(), all.data() + done, all.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
  });
  std::string dir;
  {
    ShippedFiles shipped;
    shipped.receive(p.read.get(), 2, milliseconds(10000));
    writer.join();
    dir = shipped.dir();
    struct stat st {};
    ASSERT_EQ(::stat(dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);  // only this user reads the copies
    EXPECT_NE(dir, here.path.string());
    EXPECT_EQ(slurp(dir + "/cell.py"), "print('hi')\n");
    EXPECT_EQ(slurp(dir + "/data.bin"), big);
    EXPECT_EQ(fs::status(dir + "/data.bin").permissions() & fs::perms::owner_all,
              fs::perms::owner_all);
    EXPECT_EQ(shipped.rewrite({"python", script, "--data", data, "cell.py"}),
              (std::vector<std::string>{"python", dir + "/cell.py", "--data", dir + "/data.bin",
                                        "cell.py"}));
    char rest[64] = {};
    ASSERT_EQ(::read(p.read.get(), rest, sizeof rest), static_cast<ssize_t>(after.size()));
    EXPECT_EQ(std::string(rest, after.size()), after);
  }
  EXPECT_FALSE(fs::exists(dir));
}

TEST(RunShip, WhatCantBeShippedIsNamed) {
  Dir here;
  auto message = [](const std::vector<std::string>& paths) {
    try {
      ship_payload(paths);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message({(here.path / "nope.py").string()}).find("nope.py: No such file"),
            std::string::npos);
  EXPECT_NE(message({here.path.string()}).find("not a regular file"), std::string::npos);
  fs::create_directory(here.path / "sub");
  std::string a = here.write("a.py", "1"), b = here.write("sub/a.py", "2");
  EXPECT_NE(message({a, b}).find("two files named a.py"), std::string::npos);
}

TEST(RunShip, AChannelThatEndsMidFileFailsAndLeavesNothing) {
  Dir here;
  std::string payload = ship_payload({here.write("cell.py", std::string(1000, 'y'))});
  auto p = ddip::make_pipe();
  ASSERT_EQ(::write(p.write.get(), payload.data(), 500), 500);
  p.write.reset();
  std::string dir;
  {
    ShippedFiles shipped;
    try {
      shipped.receive(p.read.get(), 1, milliseconds(10000));
      ADD_FAILURE() << "a cut-off file was taken";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("the channel closed"), std::string::npos) << e.what();
    }
    dir = shipped.dir();
    EXPECT_TRUE(fs::exists(dir));
  }
  EXPECT_FALSE(fs::exists(dir));
  // Garbage instead of a header, and silence, are refused too.
  auto q = ddip::make_pipe();
  ASSERT_EQ(::write(q.write.get(), "hello\n", 6), 6);
  ShippedFiles garbage;
  EXPECT_THROW(garbage.receive(q.read.get(), 1, milliseconds(10000)), protocol::ProtocolError);
  auto r = ddip::make_pipe();
  ShippedFiles silent;
  EXPECT_THROW(silent.receive(r.read.get(), 1, milliseconds(50)), std::runtime_error);
}
