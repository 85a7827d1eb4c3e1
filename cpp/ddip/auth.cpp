#include "ddip/auth.hpp"

// OpenSSL 1.1.1's API (OPENSSL_API_COMPAT, set by CMake), which libcrypto.so.1.1 and
// libcrypto.so.3 both export with the same signatures.
#include <dlfcn.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

namespace ddip {
namespace detail {
namespace {

// "2": bodies are authenticated with AES-GCM's tag; a peer of version 1 fails the handshake.
constexpr std::string_view kMagic{"ddiplnk2", 8};
constexpr std::string_view kHostLabel = "ddip host";
constexpr std::string_view kKernelLabel = "ddip kernel";

// libcrypto is opened at run time, not linked: a wheel then runs with whichever of the two
// sonames the system has and with the system's security updates, and ddip without other hosts
// (the only users of this file) never needs it at all.
struct Libcrypto {
  decltype(&::RAND_bytes) rand_bytes;
  decltype(&::EVP_sha256) sha256;
  decltype(&::HMAC_CTX_new) hmac_ctx_new;
  decltype(&::HMAC_CTX_free) hmac_ctx_free;
  decltype(&::HMAC_Init_ex) hmac_init;
  decltype(&::HMAC_Update) hmac_update;
  decltype(&::HMAC_Final) hmac_final;
  decltype(&::EVP_aes_256_gcm) aes_256_gcm;
  decltype(&::EVP_CIPHER_CTX_new) cipher_ctx_new;
  decltype(&::EVP_CIPHER_CTX_free) cipher_ctx_free;
  decltype(&::EVP_EncryptInit_ex) encrypt_init;
  decltype(&::EVP_EncryptUpdate) encrypt_update;
  decltype(&::EVP_EncryptFinal_ex) encrypt_final;
  decltype(&::EVP_CIPHER_CTX_ctrl) cipher_ctrl;
  decltype(&::CRYPTO_memcmp) memcmp;
  decltype(&::ERR_get_error) get_error;
  decltype(&::ERR_error_string_n) error_string;
};

constexpr const char* kLibcryptos[] = {"libcrypto.so.3", "libcrypto.so.1.1"};

Libcrypto open_libcrypto() {
  void* lib = nullptr;
  const char* name = nullptr;
  // One already in the process first (the Python interpreter's, say), so there is one libcrypto.
  for (int mode : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const char* n : kLibcryptos)
      if ((lib = ::dlopen(n, mode))) {
        name = n;
        break;
      }
    if (lib) break;
  }
  if (!lib) {
    const char* why = ::dlerror();
    throw std::runtime_error(
        "ddip needs OpenSSL's libcrypto (libcrypto.so.3 or libcrypto.so.1.1) to authenticate links "
        "between hosts, and found neither (" +
        std::string(why ? why : "dlopen failed") +
        "): install libssl3 (Debian, Ubuntu; libssl1.1 on older releases), openssl-libs (RHEL, "
        "Fedora) or openssl (conda)");
  }
  Libcrypto c{};
  auto bind = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, symbol));
    if (!fn)
      throw std::runtime_error(std::string(name) + " has no " + symbol +
                               ": ddip needs OpenSSL 1.1.1 or 3.x (libssl3 or libssl1.1)");
  };
  bind(c.rand_bytes, "RAND_bytes");
  bind(c.sha256, "EVP_sha256");
  bind(c.hmac_ctx_new, "HMAC_CTX_new");
  bind(c.hmac_ctx_free, "HMAC_CTX_free");
  bind(c.hmac_init, "HMAC_Init_ex");
  bind(c.hmac_update, "HMAC_Update");
  bind(c.hmac_final, "HMAC_Final");
  bind(c.aes_256_gcm, "EVP_aes_256_gcm");
  bind(c.cipher_ctx_new, "EVP_CIPHER_CTX_new");
  bind(c.cipher_ctx_free, "EVP_CIPHER_CTX_free");
  bind(c.encrypt_init, "EVP_EncryptInit_ex");
  bind(c.encrypt_update, "EVP_EncryptUpdate");
  bind(c.encrypt_final, "EVP_EncryptFinal_ex");
  bind(c.cipher_ctrl, "EVP_CIPHER_CTX_ctrl");
  bind(c.memcmp, "CRYPTO_memcmp");
  bind(c.get_error, "ERR_get_error");
  bind(c.error_string, "ERR_error_string_n");
  return c;
}

// Opened on first use; a failed open throws and is tried again on the next use.
const Libcrypto& libcrypto() {
  static const Libcrypto c = open_libcrypto();
  return c;
}

[[noreturn]] void throw_openssl(const char* call) {
  char buf[256] = "unknown error";
  if (unsigned long e = libcrypto().get_error()) libcrypto().error_string(e, buf, sizeof buf);
  throw std::runtime_error(std::string(call) + " failed: " + buf);
}

// Another release's handshake (the magic's last character is the link protocol's version): says
// so, rather than that the peer is no ddip at all.
void same_version(std::string_view message, const char* peer) {
  std::string_view stem = kMagic.substr(0, kMagic.size() - 1);
  if (message.size() < kMagic.size() || message.substr(0, stem.size()) != stem ||
      message[stem.size()] == kMagic.back())
    return;
  throw AuthError(std::string("the ") + peer + " speaks link protocol " + message[stem.size()] +
                  " and this ddip speaks " + kMagic.back() +
                  ": install the same ddip release on every host (pip show ddip)");
}

std::string_view u32_bytes(const uint32_t& v) {
  return {reinterpret_cast<const char*>(&v), sizeof v};
}

// Both frame keys come from both nonces: a connection's keys are its own.
LinkKeys derive(std::string_view key, std::string_view kernel_nonce, std::string_view host_nonce,
                bool kernel_side) {
  std::string to_host = hmac_sha256(key, {"ddip frames to host", kernel_nonce, host_nonce});
  std::string to_kernel = hmac_sha256(key, {"ddip frames to kernel", kernel_nonce, host_nonce});
  if (kernel_side) return {std::move(to_host), std::move(to_kernel)};
  return {std::move(to_kernel), std::move(to_host)};
}

}  // namespace
}  // namespace detail

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  if (detail::libcrypto().rand_bytes(reinterpret_cast<unsigned char*>(out.data()),
                                     static_cast<int>(n)) != 1)
    detail::throw_openssl("RAND_bytes");
  return out;
}

std::string hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts) {
  const detail::Libcrypto& c = detail::libcrypto();
  std::unique_ptr<HMAC_CTX, decltype(c.hmac_ctx_free)> ctx(c.hmac_ctx_new(), c.hmac_ctx_free);
  if (!ctx) detail::throw_openssl("HMAC_CTX_new");
  if (c.hmac_init(ctx.get(), key.data(), static_cast<int>(key.size()), c.sha256(), nullptr) != 1)
    detail::throw_openssl("HMAC_Init_ex");
  for (std::string_view p : parts)
    if (!p.empty() &&
        c.hmac_update(ctx.get(), reinterpret_cast<const unsigned char*>(p.data()), p.size()) != 1)
      detail::throw_openssl("HMAC_Update");
  std::string out(kMacBytes, '\0');
  unsigned int len = 0;
  if (c.hmac_final(ctx.get(), reinterpret_cast<unsigned char*>(out.data()), &len) != 1 ||
      len != kMacBytes)
    detail::throw_openssl("HMAC_Final");
  return out;
}

bool same_mac(std::string_view a, std::string_view b) {
  return a.size() == b.size() && detail::libcrypto().memcmp(a.data(), b.data(), a.size()) == 0;
}

BodyMac::BodyMac(std::string_view key, std::string_view nonce) {
  const detail::Libcrypto& c = detail::libcrypto();
  if (key.size() != 32 || nonce.size() != 12)
    throw std::invalid_argument("BodyMac needs a 32-byte key and a 12-byte nonce");
  EVP_CIPHER_CTX* ctx = c.cipher_ctx_new();
  if (!ctx) detail::throw_openssl("EVP_CIPHER_CTX_new");
  if (c.encrypt_init(ctx, c.aes_256_gcm(), nullptr,
                     reinterpret_cast<const unsigned char*>(key.data()),
                     reinterpret_cast<const unsigned char*>(nonce.data())) != 1) {
    c.cipher_ctx_free(ctx);
    detail::throw_openssl("EVP_EncryptInit_ex");
  }
  ctx_ = ctx;
}

BodyMac::BodyMac(BodyMac&& o) noexcept : ctx_(o.ctx_) { o.ctx_ = nullptr; }

BodyMac& BodyMac::operator=(BodyMac&& o) noexcept {
  if (this != &o) {
    if (ctx_) detail::libcrypto().cipher_ctx_free(static_cast<EVP_CIPHER_CTX*>(ctx_));
    ctx_ = o.ctx_;
    o.ctx_ = nullptr;
  }
  return *this;
}

BodyMac::~BodyMac() {
  if (ctx_) detail::libcrypto().cipher_ctx_free(static_cast<EVP_CIPHER_CTX*>(ctx_));
}

void BodyMac::update(std::string_view bytes) {
  if (!ctx_) throw std::logic_error("BodyMac used after final()");
  // Additional data, in as many pieces as it comes (all of it before any plaintext: there is none).
  while (!bytes.empty()) {
    int n = static_cast<int>(std::min<size_t>(bytes.size(), size_t(1) << 30));
    int out = 0;
    if (detail::libcrypto().encrypt_update(static_cast<EVP_CIPHER_CTX*>(ctx_), nullptr, &out,
                                           reinterpret_cast<const unsigned char*>(bytes.data()),
                                           n) != 1)
      detail::throw_openssl("EVP_EncryptUpdate");
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

std::string BodyMac::final() {
  if (!ctx_) throw std::logic_error("BodyMac::final() twice");
  const detail::Libcrypto& c = detail::libcrypto();
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  std::string tag(kBodyMacBytes, '\0');
  int out = 0;
  unsigned char none[16];
  bool ok =
      c.encrypt_final(ctx, none, &out) == 1 &&
      c.cipher_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kBodyMacBytes), tag.data()) == 1;
  c.cipher_ctx_free(ctx);
  ctx_ = nullptr;
  if (!ok) detail::throw_openssl("EVP_EncryptFinal_ex");
  return tag;
}

FrameMac::FrameMac(std::string key) : key_(std::move(key)) {
  if (!key_.empty()) body_key_ = hmac_sha256(key_, {"ddip frame body gmac key"});
}

std::string FrameMac::header_mac(std::string_view header) const {
  char count[sizeof count_];
  std::memcpy(count, &count_, sizeof count_);
  return hmac_sha256(key_, {"ddip frame header", std::string_view(count, sizeof count), header});
}

void FrameMac::verify_header(std::string_view header, std::string_view mac) const {
  if (!same_mac(header_mac(header), mac))
    throw AuthError(
        "a frame header failed authentication (forged, tampered, replayed or reordered), before "
        "anything was allocated for the length it announced");
}

BodyMac FrameMac::body_mac(std::string_view header) const {
  char nonce[12] = {};  // the frame's count: unique under this direction's key
  std::memcpy(nonce, &count_, sizeof count_);
  BodyMac s(body_key_, std::string_view(nonce, sizeof nonce));
  s.update(header);
  return s;
}

std::string FrameMac::compute(std::string_view header, std::string_view body) const {
  char count[sizeof count_];
  std::memcpy(count, &count_, sizeof count_);
  return hmac_sha256(key_, {std::string_view(count, sizeof count), header, body});
}

std::string FrameMac::sign(std::string_view header, std::string_view body) {
  std::string mac = compute(header, body);
  ++count_;
  return mac;
}

void FrameMac::verify(std::string_view header, std::string_view body, std::string_view mac) {
  if (!same_mac(compute(header, body), mac))
    throw AuthError("a frame failed authentication (wrong key, tampered, replayed or reordered)");
  ++count_;
}

KernelHandshake::KernelHandshake(std::string key)
    : key_(std::move(key)), nonce_(random_bytes(kNonceBytes)) {
  if (key_.size() < 16) throw std::invalid_argument("a link key needs at least 16 bytes");
  challenge_ = std::string(detail::kMagic) + nonce_;
}

KernelHandshake::Accepted KernelHandshake::accept(std::string_view response) const {
  detail::same_version(response, "host's agent");
  if (response.size() != kResponseBytes || response.substr(0, 8) != detail::kMagic)
    throw AuthError("not a ddip host's response");
  std::string_view host_nonce = response.substr(8, kNonceBytes);
  std::string_view host_id = response.substr(8 + kNonceBytes, 4);
  std::string_view mac = response.substr(8 + kNonceBytes + 4);
  if (!same_mac(hmac_sha256(key_, {detail::kHostLabel, nonce_, host_nonce, host_id}), mac))
    throw AuthError("the host's response was not made with the group's key");
  Accepted a;
  std::memcpy(&a.host, host_id.data(), sizeof a.host);
  a.proof = hmac_sha256(key_, {detail::kKernelLabel, nonce_, host_nonce, host_id});
  a.keys = detail::derive(key_, nonce_, host_nonce, true);
  return a;
}

HostHandshake::HostHandshake(std::string key, uint32_t host)
    : key_(std::move(key)), host_(host), nonce_(random_bytes(kNonceBytes)) {
  if (key_.size() < 16) throw std::invalid_argument("a link key needs at least 16 bytes");
}

std::string HostHandshake::respond(std::string_view challenge) {
  detail::same_version(challenge, "kernel");
  if (challenge.size() != KernelHandshake::kChallengeBytes ||
      challenge.substr(0, 8) != detail::kMagic)
    throw AuthError("not a ddip kernel's challenge");
  kernel_nonce_ = std::string(challenge.substr(8));
  std::string_view id = detail::u32_bytes(host_);
  return std::string(detail::kMagic) + nonce_ + std::string(id) +
         hmac_sha256(key_, {detail::kHostLabel, kernel_nonce_, nonce_, id});
}

LinkKeys HostHandshake::verify(std::string_view proof) const {
  if (kernel_nonce_.empty()) throw std::logic_error("HostHandshake::verify before respond");
  std::string_view id = detail::u32_bytes(host_);
  if (!same_mac(hmac_sha256(key_, {detail::kKernelLabel, kernel_nonce_, nonce_, id}), proof))
    throw AuthError("the kernel's proof was not made with the group's key");
  return detail::derive(key_, kernel_nonce_, nonce_, false);
}

std::string to_hex(std::string_view bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string from_hex(std::string_view hex) {
  auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2) throw std::invalid_argument("a hex string has an even length");
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int hi = value(hex[i]), lo = value(hex[i + 1]);
    if (hi < 0 || lo < 0) throw std::invalid_argument("not a hex string");
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

}  // namespace ddip
