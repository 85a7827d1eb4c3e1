// Files that travel with a launch to the other hosts (--ship): read here and sent on each
// host's control channel before anything else (run_protocol.hpp's FileHeader, then the bytes);
// written there into a private directory (0700) that lives exactly as long as that host's
// ddip run, and the rank's command names the copy. For a script that exists only here (a
// notebook cell's, say) on hosts that share no filesystem with this one.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace ddip::run {

// Each file's header and content, in order: what a host's channel carries first. Throws
// std::invalid_argument naming a file that can't be shipped (missing, not a regular file,
// unreadable) or two with the same name (they would land on one copy).
std::string ship_payload(const std::vector<std::string>& paths);

// The receiving end, on a host's ddip run: the files, in a directory of its own.
class ShippedFiles {
 public:
  ShippedFiles() = default;
  ShippedFiles(const ShippedFiles&) = delete;
  ShippedFiles& operator=(const ShippedFiles&) = delete;
  // Removes the directory and everything in it.
  ~ShippedFiles();

  // Reads `count` files from `fd` (the channel), waiting at most `silence` for each read.
  // Throws std::runtime_error saying why (the channel closed or fell silent, a garbled header,
  // the disk is full); what was written so far is removed with the directory.
  void receive(int fd, size_t count, std::chrono::milliseconds silence);
  // `argv` with every argument equal to a shipped file's path (as given where it was shipped
  // from) replaced by the path of its copy here.
  std::vector<std::string> rewrite(std::vector<std::string> argv) const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::pair<std::string, std::string>> files_;  // path as given -> its copy here
};

}  // namespace ddip::run
