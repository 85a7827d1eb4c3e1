#include "run_elastic.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace ddip::run {

namespace {

// The error files' JSON: torch's ErrorHandler writes it with Python's json.dump. A reader of
// RFC 8259 text small enough to read whole, rather than a JSON library as a build dependency
// for one small file: values keep their order, numbers their text, so what is read is written
// back as it was (parent_error_json).
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  std::string text;  // a string's value; a number's or a literal's text
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;

  const Json* get(std::string_view key) const {
    for (const auto& [k, v] : members)
      if (k == key) return &v;
    return nullptr;
  }
  Json* get(std::string_view key) {
    for (auto& [k, v] : members)
      if (k == key) return &v;
    return nullptr;
  }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view s) : s_(s) {}

  Json document() {
    Json v = value(0);
    space();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("not JSON: " + what + " at byte " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nested too deep");
    space();
    if (i_ >= s_.size()) fail("end of text");
    Json v;
    char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.kind = Json::kObject;
      if (eat('}')) return v;
      do {
        space();
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = Json::kArray;
      if (eat(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Json::kString;
      v.text = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::kNumber;
      v.text = number();
    } else {
      for (std::string_view lit : {"true", "false", "null"})
        if (s_.substr(i_, lit.size()) == lit) {
          i_ += lit.size();
          v.kind = lit == "null" ? Json::kNull : Json::kBool;
          v.text = lit;
          return v;
        }
      fail("unexpected character");
    }
    return v;
  }

  std::string number() {
    size_t start = i_;
    auto digits = [&] {
      size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == from) fail("a number without digits");
    };
    if (s_[i_] == '-') ++i_;
    digits();
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      digits();
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return std::string(s_.substr(start, i_ - start));
  }

  unsigned hex4() {
    if (i_ + 4 > s_.size()) fail("a short \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<unsigned>(h - 'A' + 10);
      else fail("a bad \\u escape");
    }
    return v;
  }

  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string");
    ++i_;
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("an unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("an unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          // A UTF-16 surrogate pair is one character; a lone surrogate (Python writes them for
          // undecodable bytes) becomes U+FFFD.
          if (cp >= 0xD800 && cp < 0xDC00 && s_.substr(i_, 2) == "\\u") {
            size_t back = i_;
            i_ += 2;
            unsigned lo = hex4();
            if (lo >= 0xDC00 && lo < 0xE000) {
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else {
              i_ = back;
              cp = 0xFFFD;
            }
          } else if (cp >= 0xD800 && cp < 0xE000) {
            cp = 0xFFFD;
          }
          utf8(out, cp);
          break;
        }
        default: fail("a bad escape");
      }
    }
  }

  std::string_view s_;
  size_t i_ = 0;
};

void write_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          static const char* hex = "0123456789abcdef";
          out += "\\u00";
          out += hex[(c >> 4) & 0xF];
          out += hex[c & 0xF];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void write(std::string& out, const Json& v) {
  switch (v.kind) {
    case Json::kString: write_string(out, v.text); return;
    case Json::kArray:
      out += '[';
      for (size_t k = 0; k < v.items.size(); ++k) {
        if (k) out += ", ";
        write(out, v.items[k]);
      }
      out += ']';
      return;
    case Json::kObject:
      out += '{';
      for (size_t k = 0; k < v.members.size(); ++k) {
        if (k) out += ", ";
        write_string(out, v.members[k].first);
        out += ": ";
        write(out, v.members[k].second);
      }
      out += '}';
      return;
    default: out += v.text;
  }
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
                             const std::string& error_file) {
  env.push_back("TORCHELASTIC_RUN_ID=" + run_id);
  env.push_back("TORCHELASTIC_RESTART_COUNT=0");
  env.push_back("TORCHELASTIC_MAX_RESTARTS=0");
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

std::string ErrorFiles::read(int rank) const {
  std::error_code ec;
  auto size = std::filesystem::file_size(path(rank), ec);
  if (ec || size > kMaxErrorFile) return {};
  std::ifstream in(path(rank), std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::optional<RankError> read_rank_error(std::string_view json) {
  Json doc;
  try {
    doc = JsonReader(json).document();
  } catch (const std::invalid_argument&) {
    return std::nullopt;
  }
  const Json* message = doc.kind == Json::kObject ? doc.get("message") : nullptr;
  if (!message) return std::nullopt;
  RankError e;
  if (message->kind == Json::kString) {
    e.message = message->text;
    return e;
  }
  if (message->kind != Json::kObject) return std::nullopt;
  if (const Json* m = message->get("message"); m && m->kind == Json::kString) e.message = m->text;
  if (const Json* info = message->get("extraInfo"); info && info->kind == Json::kObject)
    if (const Json* stack = info->get("py_callstack"); stack && stack->kind == Json::kString)
      e.traceback = lines_of(stack->text);
  if (e.message.empty() && e.traceback.empty()) return std::nullopt;
  return e;
}

std::string parent_error_json(std::string_view json, int error_code) {
  Json doc = JsonReader(json).document();
  if (doc.kind != Json::kObject) throw std::invalid_argument("not a JSON object");
  Json* message = doc.get("message");
  if (error_code != 0 && message && message->kind == Json::kObject) {
    Json code;
    code.kind = Json::kNumber;
    code.text = std::to_string(error_code);
    if (Json* old = message->get("errorCode"))
      *old = std::move(code);
    else
      message->members.emplace_back("errorCode", std::move(code));
  }
  std::string out;
  write(out, doc);
  return out;
}

}  // namespace ddip::run
