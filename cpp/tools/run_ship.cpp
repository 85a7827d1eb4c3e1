#include "run_ship.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "ddip/fd.hpp"
#include "run_protocol.hpp"

namespace ddip::run {
namespace {

// A header line longer than this is garbage (a path is at most PATH_MAX, escaped).
constexpr size_t kMaxHeader = 16 * 1024;

std::string name_of(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

// Waits until `fd` can be read, at most `silence`.
void await(int fd, std::chrono::milliseconds silence) {
  pollfd p{fd, POLLIN, 0};
  while (true) {
    int n = ::poll(&p, 1, static_cast<int>(silence.count()));
    if (n > 0) return;
    if (n == 0)
      throw std::runtime_error("nothing arrived for " + std::to_string(silence.count() / 1000) +
                               " s");
    if (errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));
  }
}

// Up to `n` bytes; throws at the end of the channel.
size_t read_some(int fd, char* buf, size_t n, std::chrono::milliseconds silence) {
  while (true) {
    await(fd, silence);
    ssize_t got = ::read(fd, buf, n);
    if (got > 0) return static_cast<size_t>(got);
    if (got == 0) throw std::runtime_error("the channel closed");
    if (errno != EINTR && errno != EAGAIN)
      throw std::runtime_error(std::string("read: ") + std::strerror(errno));
  }
}

}  // namespace

std::string ship_payload(const std::vector<std::string>& paths) {
  std::string out;
  std::set<std::string> names;
  for (const auto& path : paths) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      throw std::invalid_argument("can't ship " + path + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      throw std::invalid_argument("can't ship " + path + ": it is not a regular file");
    std::string name = name_of(path);
    if (!names.insert(name).second)
      throw std::invalid_argument("can't ship two files named " + name + " (" + path +
                                  "): each host puts its copies in one directory");
    std::ifstream in(path, std::ios::binary);
    std::ostringstream content;
    content << in.rdbuf();
    if (!in.good() && !in.eof())
      throw std::invalid_argument("can't ship " + path + ": it can't be read");
    std::string bytes = content.str();
    if (bytes.size() > protocol::kMaxShipBytes)
      throw std::invalid_argument("can't ship " + path + ": larger than 4 GiB");
    out += protocol::encode(protocol::FileHeader{path, bytes.size(), st.st_mode & 0700u});
    out += bytes;
  }
  return out;
}

ShippedFiles::~ShippedFiles() {
  if (dir_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);  // nothing to do about a failure at the end
}

void ShippedFiles::receive(int fd, size_t count, std::chrono::milliseconds silence) {
  if (count == 0) return;
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/ddip-run-XXXXXX";
  // mkdtemp makes it 0700: only this user reads the copies.
  if (::mkdtemp(templ.data()) == nullptr)
    throw std::runtime_error("can't make a directory for the shipped files in " + templ + ": " +
                             std::strerror(errno));
  dir_ = templ;
  std::vector<char> buf(64 * 1024);
  for (size_t i = 0; i < count; ++i) {
    // The header, byte by byte: what follows it is the file's, and then the control channel's.
    std::string line;
    char c = 0;
    while (c != '\n') {
      read_some(fd, &c, 1, silence);
      line += c;
      if (line.size() > kMaxHeader)
        throw std::runtime_error("a shipped file's header has no line end");
    }
    protocol::FileHeader h = protocol::decode_file_header(line);
    std::string name = name_of(h.path);
    if (name.empty() || name == "." || name == "..")
      throw std::runtime_error("a shipped file's path '" + h.path + "' names no file");
    std::string copy = dir_ + "/" + name;
    Fd out(::open(copy.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, (h.mode & 0700u) | 0400u));
    if (!out) throw std::runtime_error("can't create " + copy + ": " + std::strerror(errno));
    for (uint64_t left = h.size; left > 0;) {
      size_t n = read_some(fd, buf.data(),
                           static_cast<size_t>(std::min<uint64_t>(left, buf.size())), silence);
      for (size_t done = 0; done < n;) {
        ssize_t w = ::write(out.get(), buf.data() + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) throw std::runtime_error("can't write " + copy + ": " + std::strerror(errno));
        done += static_cast<size_t>(w);
      }
      left -= n;
    }
    files_.emplace_back(h.path, copy);
  }
}

std::vector<std::string> ShippedFiles::rewrite(std::vector<std::string> argv) const {
  for (auto& a : argv)
    for (const auto& [given, copy] : files_)
      if (a == given) a = copy;
  return argv;
}

}  // namespace ddip::run
