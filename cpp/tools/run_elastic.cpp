#include "run_elastic.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace ddip::run {

namespace {

// The error files' JSON (torch's ErrorHandler writes it with Python's json.dump), read with
// nlohmann/json; ordered_json keeps the members in the order they came, so what is read is
// written back as it was, with errorCode last (parent_error_json).
using Json = nlohmann::ordered_json;

// The string at `key` of object `j`, or nullptr.
const std::string* string_at(const Json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get_ptr<const std::string*>() : nullptr;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  return lines;
}

constexpr std::uintmax_t kMaxErrorFile = 1 << 20;

}  // namespace

std::string new_run_id() {
  std::random_device rd;
  std::uniform_int_distribution<unsigned> byte(0, 255);
  unsigned char b[16];
  for (auto& x : b) x = static_cast<unsigned char>(byte(rd));
  b[6] = static_cast<unsigned char>((b[6] & 0x0F) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3F) | 0x80);  // RFC 4122 variant
  static const char* hex = "0123456789abcdef";
  std::string id;
  for (int k = 0; k < 16; ++k) {
    if (k == 4 || k == 6 || k == 8 || k == 10) id += '-';
    id += hex[b[k] >> 4];
    id += hex[b[k] & 0xF];
  }
  return id;
}

void add_elastic_environment(std::vector<std::string>& env, const std::string& run_id,
                             const std::string& error_file, int restart_count, int max_restarts) {
  env.push_back("TORCHELASTIC_RUN_ID=" + run_id);
  env.push_back("TORCHELASTIC_RESTART_COUNT=" + std::to_string(restart_count));
  env.push_back("TORCHELASTIC_MAX_RESTARTS=" + std::to_string(max_restarts));
  env.push_back("TORCHELASTIC_USE_AGENT_STORE=False");
  env.push_back("TORCHELASTIC_SIGNALS_TO_HANDLE=" + std::string(kSignalsToHandle));
  if (!error_file.empty()) env.push_back("TORCHELASTIC_ERROR_FILE=" + error_file);
}

ErrorFiles::ErrorFiles() {
  const char* tmp = std::getenv("TMPDIR");
  std::string base = tmp && *tmp ? tmp : "/tmp";
  std::string tmpl = base + "/ddip-run-XXXXXX";
  if (!::mkdtemp(tmpl.data()))
    throw std::system_error(errno, std::generic_category(),
                            "cannot make a directory for the ranks' error files in " + base +
                                " (set TMPDIR to a writable directory)");
  dir_ = tmpl;
}

ErrorFiles::~ErrorFiles() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string ErrorFiles::path(int rank) const {
  return dir_ + "/rank" + std::to_string(rank) + ".json";
}

std::string ErrorFiles::read_file(const std::string& path) {
  std::error_code ec;
  auto size = std::filesystem::file_size(path, ec);
  if (ec || size > kMaxErrorFile) return {};
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::optional<RankError> read_rank_error(std::string_view json) {
  Json doc = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  auto message = doc.is_object() ? doc.find("message") : doc.end();
  if (message == doc.end()) return std::nullopt;
  RankError e;
  if (message->is_string()) {
    e.message = message->get<std::string>();
    return e;
  }
  if (!message->is_object()) return std::nullopt;
  if (const std::string* m = string_at(*message, "message")) e.message = *m;
  if (auto info = message->find("extraInfo"); info != message->end() && info->is_object())
    if (const std::string* stack = string_at(*info, "py_callstack")) e.traceback = lines_of(*stack);
  if (e.message.empty() && e.traceback.empty()) return std::nullopt;
  return e;
}

std::string parent_error_json(std::string_view json, int error_code) {
  Json doc = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) throw std::invalid_argument("not a JSON object");
  auto message = doc.find("message");
  if (error_code != 0 && message != doc.end() && message->is_object())
    (*message)["errorCode"] = error_code;
  return doc.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace ddip::run
