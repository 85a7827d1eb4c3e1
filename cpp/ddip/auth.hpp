// Authentication of the TCP links between the kernel and remote hosts, with libcrypto's
// HMAC-SHA256 and a per-group random key.
//
// The handshake is a mutual challenge-response on fixed-size messages, so nothing an
// unauthenticated peer sends is ever parsed as a frame:
//
//   kernel -> host: challenge = magic | nonce_k                      (kChallengeBytes)
//   host -> kernel: response  = magic | nonce_h | host id | MAC_c    (kResponseBytes)
//   kernel -> host: proof     = MAC_k                                (kProofBytes)
//
// MAC_c = HMAC(key, "ddip host" | nonce_k | nonce_h | host id) proves the host knows the key;
// MAC_k = HMAC(key, "ddip kernel" | nonce_k | nonce_h | host id) proves the kernel does. Both
// sides then derive one frame key per direction from both nonces, so every connection has fresh
// keys, and a FrameMac per direction authenticates each frame together with its position in the
// stream: a frame replayed, reordered, dropped or moved to another connection fails to verify.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ddip {

inline constexpr size_t kKeyBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kBodyMacBytes = 16;  // AES-GCM's tag
inline constexpr size_t kNonceBytes = 32;

class AuthError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// `n` bytes from the OpenSSL CSPRNG.
std::string random_bytes(size_t n);
// HMAC-SHA256 of the concatenation of `parts`.
std::string hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts);
// Constant-time comparison (CRYPTO_memcmp); false when the sizes differ.
bool same_mac(std::string_view a, std::string_view b);

// A sealed frame's body MAC: AES-256-GCM's tag (GMAC) over what it is fed, all of it taken as
// additional data (nothing is encrypted). It runs at several GB/s with AES-NI and PCLMULQDQ, where
// HMAC-SHA256 ran at 1.8 and took 45% of the CPU of a push across hosts. `nonce` (12 bytes) must
// never repeat under one key: FrameMac makes it of the frame's count.
class BodyMac {
 public:
  BodyMac(std::string_view key, std::string_view nonce);
  BodyMac(BodyMac&&) noexcept;
  BodyMac& operator=(BodyMac&&) noexcept;
  ~BodyMac();
  void update(std::string_view bytes);
  std::string final();  // kBodyMacBytes; once

 private:
  void* ctx_ = nullptr;  // EVP_CIPHER_CTX, opaque here so that no OpenSSL header leaks
};

// The frame keys of one authenticated connection.
struct LinkKeys {
  std::string send;
  std::string recv;
};

// Authenticates frames in one direction. Each call covers the next frame: the count of frames
// before it is part of what is authenticated, so the two ends must see the same stream.
class FrameMac {
 public:
  FrameMac() = default;
  explicit FrameMac(std::string key);
  bool enabled() const { return !key_.empty(); }
  // The MAC of the next frame, made of `header` and `body` (HMAC-SHA256: ddip run's frames over a
  // launcher's stdio, small ones).
  std::string sign(std::string_view header, std::string_view body);
  // Throws AuthError unless `mac` is that of the next frame.
  void verify(std::string_view header, std::string_view body, std::string_view mac);
  // A sealed channel's frame in two parts, so that a receiver trusts the header (and the length
  // it announces) before it allocates anything for the body: the header's own MAC, then the
  // body's, made with the same count (domain-separated), after which the count moves on.
  std::string header_mac(std::string_view header) const;
  // Throws AuthError (naming the header) unless `mac` is header_mac(header).
  void verify_header(std::string_view header, std::string_view mac) const;
  // The MAC of the next frame's header and body, fed the body as it streams (a key of its own, the
  // frame's count its nonce); then advance() to the next frame.
  BodyMac body_mac(std::string_view header) const;
  void advance() { ++count_; }

 private:
  std::string key_;
  std::string body_key_;  // the bodies' AES key, derived from key_
  uint64_t count_ = 0;
  std::string compute(std::string_view header, std::string_view body) const;
};

class KernelHandshake {
 public:
  static constexpr size_t kChallengeBytes = 8 + kNonceBytes;
  static constexpr size_t kResponseBytes = 8 + kNonceBytes + 4 + kMacBytes;
  static constexpr size_t kProofBytes = kMacBytes;

  explicit KernelHandshake(std::string key);
  const std::string& challenge() const { return challenge_; }

  struct Accepted {
    uint32_t host = 0;
    std::string proof;  // to send back, so the host knows it talks to the kernel
    LinkKeys keys;
  };
  // Throws AuthError when the response is not one made with the key for this challenge.
  Accepted accept(std::string_view response) const;

 private:
  std::string key_;
  std::string nonce_;
  std::string challenge_;
};

class HostHandshake {
 public:
  HostHandshake(std::string key, uint32_t host);
  // The response to the kernel's challenge; throws AuthError when it is no challenge of ours.
  std::string respond(std::string_view challenge);
  // Throws AuthError unless the proof shows the kernel knows the key.
  LinkKeys verify(std::string_view proof) const;

 private:
  std::string key_;
  uint32_t host_;
  std::string kernel_nonce_;
  std::string nonce_;
};

// The key travels to hosts as text (on the launcher's stdin): lowercase hex.
std::string to_hex(std::string_view bytes);
// Throws std::invalid_argument for anything but an even-length hex string.
std::string from_hex(std::string_view hex);

}  // namespace ddip
