#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "ddip/auth.hpp"
#include "ddip/channel.hpp"
#include "ddip/tcp.hpp"
#include "helpers.hpp"

using namespace ddip;
using test::drain;

namespace {

const std::string kKey = random_bytes(kKeyBytes);

std::pair<Fd, Fd> socket_pair() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  return {Fd(sv[0]), Fd(sv[1])};
}


void put(int fd, std::string_view bytes) {
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
}

// A sender and a receiver whose bytes pass through the test's hands in between, as they would
// through an attacker on the network.
struct Wire {
  Channel sender{Fd()};
  Channel receiver{Fd()};
  Fd sender_far, receiver_far;

  Wire() {
    auto [s, sf] = socket_pair();
    auto [r, rf] = socket_pair();
    KernelHandshake kernel(kKey);
    HostHandshake host(kKey, 0);
    auto accepted = kernel.accept(host.respond(kernel.challenge()));
    LinkKeys host_keys = host.verify(accepted.proof);
    sender = Channel(std::move(s));
    receiver = Channel(std::move(r));
    sender.seal(accepted.keys);
    receiver.seal(host_keys);
    sender_far = std::move(sf);
    receiver_far = std::move(rf);
  }
  std::string sent(Frame f) {
    sender.send(std::move(f));
    return drain(sender_far.get());
  }
};

}  // namespace

TEST(Auth, ABodyMacIsAesGcmsTagOverItsBytesHoweverTheyArePieced) {
  auto hex = [](const std::string& b) {
    std::string out;
    char two[3];
    for (unsigned char c : b) {
      std::snprintf(two, sizeof two, "%02x", c);
      out += two;
    }
    return out;
  };
  // The GCM specification's test case 13: AES-256, key and IV all zero, nothing at all.
  BodyMac empty(std::string(32, '\0'), std::string(12, '\0'));
  EXPECT_EQ(hex(empty.final()), "530f8afbc74536b9a963b4f1c4cb738b");
  // Its test case 14's key and IV with our bytes as additional data: one piece or many, one tag.
  const std::string key(32, '\x42'), nonce(12, '\x07');
  std::string bytes(100000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + 7);
  BodyMac whole(key, nonce);
  whole.update(bytes);
  std::string tag = whole.final();
  EXPECT_EQ(tag.size(), kBodyMacBytes);
  BodyMac pieces(key, nonce);
  for (size_t at = 0, n = 1; at < bytes.size(); at += n, n = n * 3 + 1)
    pieces.update(std::string_view(bytes).substr(at, n));
  EXPECT_EQ(pieces.final(), tag);
  // Another nonce, another key, one more byte: another tag.
  for (auto [k, n, b] :
       {std::tuple{key, std::string(12, '\x08'), bytes},
        std::tuple{std::string(32, '\x43'), nonce, bytes}, std::tuple{key, nonce, bytes + "x"}}) {
    BodyMac other(k, n);
    other.update(b);
    EXPECT_NE(other.final(), tag);
  }
  EXPECT_THROW(BodyMac(std::string(16, 'k'), nonce), std::invalid_argument);
}

TEST(Auth, HandshakeAuthenticatesBothEnds) {
  KernelHandshake kernel(kKey);
  HostHandshake host(kKey, 7);
  auto accepted = kernel.accept(host.respond(kernel.challenge()));
  EXPECT_EQ(accepted.host, 7u);
  LinkKeys host_keys = host.verify(accepted.proof);
  // One key per direction, each the other end's receiving key.
  EXPECT_EQ(accepted.keys.send, host_keys.recv);
  EXPECT_EQ(accepted.keys.recv, host_keys.send);
  EXPECT_NE(accepted.keys.send, accepted.keys.recv);
}

TEST(Auth, EveryConnectionHasFreshKeys) {
  KernelHandshake k1(kKey), k2(kKey);
  HostHandshake h1(kKey, 0), h2(kKey, 0);
  auto a1 = k1.accept(h1.respond(k1.challenge()));
  auto a2 = k2.accept(h2.respond(k2.challenge()));
  EXPECT_NE(k1.challenge(), k2.challenge());
  EXPECT_NE(a1.keys.send, a2.keys.send);
}

TEST(Auth, WrongKeyIsRejectedByTheKernel) {
  KernelHandshake kernel(kKey);
  HostHandshake host(random_bytes(kKeyBytes), 0);
  EXPECT_THROW(kernel.accept(host.respond(kernel.challenge())), AuthError);
}

TEST(Auth, WrongKeyIsRejectedByTheHost) {
  // A host that connected to an impostor (who answers with another key) finds out.
  KernelHandshake impostor(random_bytes(kKeyBytes));
  HostHandshake host(kKey, 0);
  std::string response = host.respond(impostor.challenge());
  EXPECT_THROW(impostor.accept(response), AuthError);
  EXPECT_THROW(host.verify(std::string(kMacBytes, 'x')), AuthError);
}

TEST(Auth, AnotherReleasesHandshakeIsNamedAsSuch) {
  KernelHandshake kernel(kKey);
  HostHandshake host(kKey, 0);
  std::string response = host.respond(kernel.challenge());
  response[7] = '1';  // an agent of the release before bodies were authenticated by AES-GCM
  try {
    kernel.accept(response);
    FAIL() << "accepted another link protocol";
  } catch (const AuthError& e) {
    EXPECT_STREQ(e.what(),
                 "the host's agent speaks link protocol 1 and this ddip speaks 2: install the same "
                 "ddip release on every host (pip show ddip)");
  }
  std::string challenge = kernel.challenge();
  challenge[7] = '3';
  HostHandshake other(kKey, 0);
  EXPECT_THROW(
      {
        try {
          other.respond(challenge);
        } catch (const AuthError& e) {
          EXPECT_NE(std::string(e.what()).find("the kernel speaks link protocol 3"),
                    std::string::npos);
          throw;
        }
      },
      AuthError);
  EXPECT_THROW(kernel.accept(std::string(KernelHandshake::kResponseBytes, 'x')), AuthError);
}

TEST(Auth, ResponseForAnotherChallengeIsRejected) {
  // A recorded response is worth nothing: the next connection's challenge differs.
  KernelHandshake first(kKey), second(kKey);
  HostHandshake host(kKey, 0);
  std::string recorded = host.respond(first.challenge());
  EXPECT_NO_THROW(first.accept(recorded));
  EXPECT_THROW(second.accept(recorded), AuthError);
}

TEST(Auth, TamperedHostIdIsRejected) {
  KernelHandshake kernel(kKey);
  HostHandshake host(kKey, 1);
  std::string response = host.respond(kernel.challenge());
  response[8 + kNonceBytes] ^= 1;  // host 1 -> host 0
  EXPECT_THROW(kernel.accept(response), AuthError);
}

TEST(Auth, GarbageAndTruncatedMessagesAreRejected) {
  KernelHandshake kernel(kKey);
  HostHandshake host(kKey, 0);
  std::string response = host.respond(kernel.challenge());
  EXPECT_THROW(kernel.accept(response.substr(0, response.size() - 1)), AuthError);
  EXPECT_THROW(kernel.accept(std::string(KernelHandshake::kResponseBytes, 'G')), AuthError);
  EXPECT_THROW(kernel.accept("GET / HTTP/1.1\r\n\r\n"), AuthError);
  HostHandshake other(kKey, 0);
  EXPECT_THROW(other.respond(kernel.challenge().substr(1)), AuthError);
}

TEST(Auth, TruncatedHandshakeOnASocketTimesOutOrFails) {
  auto [a, b] = socket_pair();
  put(b.get(), "ddip");  // half a response, then the peer goes away
  b.reset();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  EXPECT_THROW(read_exact(a.get(), KernelHandshake::kResponseBytes, deadline), std::runtime_error);
  auto [c, d] = socket_pair();
  put(d.get(), "ddip");  // half a response, and the peer stays silent
  deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  EXPECT_THROW(read_exact(c.get(), KernelHandshake::kResponseBytes, deadline), std::runtime_error);
}

TEST(SealedChannel, FramesArriveIntact) {
  Wire w;
  put(w.receiver_far.get(), w.sent(Frame::make(kRequest, 3, 42, "hello")));
  put(w.receiver_far.get(), w.sent(Frame::make(kDone, 1, 43, "")));
  auto f = w.receiver.recv();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->kind, kRequest);
  EXPECT_EQ(f->rank, 3);
  EXPECT_EQ(f->seq, 42u);
  EXPECT_EQ(f->data(), "hello");
  f = w.receiver.recv();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->data(), "");
}

TEST(SealedChannel, TamperedFrameIsRejected) {
  Wire w;
  std::string bytes = w.sent(Frame::make(kRequest, 0, 1, "print('hi')"));
  bytes[30] ^= 0x20;  // one bit of the payload
  put(w.receiver_far.get(), bytes);
  EXPECT_THROW(w.receiver.recv(), AuthError);
}

TEST(SealedChannel, TamperedHeaderIsRejected) {
  Wire w;
  std::string bytes = w.sent(Frame::make(kRequest, 0, 1, "x"));
  bytes[16] = static_cast<char>(kShutdown);  // the kind
  put(w.receiver_far.get(), bytes);
  EXPECT_THROW(w.receiver.recv(), AuthError);
}

TEST(SealedChannel, ReplayedFrameIsRejected) {
  Wire w;
  std::string bytes = w.sent(Frame::make(kRequest, 0, 1, "x = 1"));
  put(w.receiver_far.get(), bytes);
  EXPECT_TRUE(w.receiver.recv());
  put(w.receiver_far.get(), bytes);
  EXPECT_THROW(w.receiver.recv(), AuthError);
}

TEST(SealedChannel, ReorderedFramesAreRejected) {
  Wire w;
  std::string first = w.sent(Frame::make(kRequest, 0, 1, "first"));
  std::string second = w.sent(Frame::make(kRequest, 0, 2, "second"));
  put(w.receiver_far.get(), second + first);
  EXPECT_THROW(w.receiver.recv(), AuthError);
}

TEST(SealedChannel, FrameFromAnotherConnectionIsRejected) {
  Wire w1, w2;
  std::string bytes = w1.sent(Frame::make(kRequest, 0, 1, "x"));
  put(w2.receiver_far.get(), bytes);
  EXPECT_THROW(w2.receiver.recv(), AuthError);
}

TEST(SealedChannel, UnsealedFrameIsRejected) {
  // What an attacker without the key can send: a well-formed plain frame.
  Wire w;
  auto [a, far] = socket_pair();
  Channel plain(std::move(a));
  plain.send(Frame::make(kRequest, 0, 1, std::string(64, 'p')));
  put(w.receiver_far.get(), drain(far.get()));
  EXPECT_THROW(w.receiver.recv(), AuthError);
}

TEST(SealedChannel, ImpossibleLengthIsRejectedBeforeAllocating) {
  Wire w;
  std::string bytes = w.sent(Frame::make(kRequest, 0, 1, "x"));
  uint64_t huge = uint64_t(1) << 50;
  std::memcpy(bytes.data(), &huge, sizeof huge);
  put(w.receiver_far.get(), bytes);
  EXPECT_THROW(w.receiver.recv(), AuthError);
}

TEST(SealedChannel, FdsTravelAsTheirContents) {
  Wire w;
  Frame f = Frame::make(kDone, 0, 5, "table");
  f.fds = std::make_shared<std::vector<Fd>>();
  for (std::string text : {"first buffer", "second, longer buffer"}) {
    // A memfd stands in for a segment; fd_bytes says how much of it matters.
    Fd m(::memfd_create("t", MFD_CLOEXEC));
    ASSERT_EQ(::write(m.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
    ASSERT_EQ(::write(m.get(), "padding", 7), 7);
    f.fds->push_back(std::move(m));
    f.fd_bytes.push_back(text.size());
  }
  put(w.receiver_far.get(), w.sent(std::move(f)));
  auto got = w.receiver.recv();
  ASSERT_TRUE(got);
  EXPECT_EQ(got->data(), "table");
  ASSERT_TRUE(got->fds);
  ASSERT_EQ(got->fds->size(), 2u);
  std::string expect[] = {"first buffer", "second, longer buffer"};
  for (size_t i = 0; i < 2; ++i) {
    char buf[64] = {};
    ssize_t n = ::pread((*got->fds)[i].get(), buf, sizeof buf, 0);
    EXPECT_EQ(std::string(buf, static_cast<size_t>(n)), expect[i]);
  }
}

TEST(SealedChannel, WorksOverTcp) {
  TcpListener listener("127.0.0.1", 0);
  EXPECT_NE(listener.port(), 0);
  std::thread host([&] {
    Fd s = connect_tcp("127.0.0.1", listener.port(), std::chrono::seconds(5));
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    HostHandshake hs(kKey, 2);
    std::string challenge = read_exact(s.get(), KernelHandshake::kChallengeBytes, deadline);
    write_all(s.get(), hs.respond(challenge), deadline);
    LinkKeys keys = hs.verify(read_exact(s.get(), KernelHandshake::kProofBytes, deadline));
    Channel ch(std::move(s));
    ch.seal(keys);
    ch.send(Frame::make(kHello, 2, 0, "from the host"));
    auto reply = ch.recv();
    ASSERT_TRUE(reply);
    EXPECT_EQ(reply->data(), "from the kernel");
  });
  Fd conn;
  std::string peer;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!conn && std::chrono::steady_clock::now() < deadline) conn = listener.accept(&peer);
  ASSERT_TRUE(conn);
  EXPECT_EQ(peer.rfind("127.0.0.1:", 0), 0u);
  KernelHandshake hs(kKey);
  write_all(conn.get(), hs.challenge(), deadline);
  auto accepted = hs.accept(read_exact(conn.get(), KernelHandshake::kResponseBytes, deadline));
  EXPECT_EQ(accepted.host, 2u);
  write_all(conn.get(), accepted.proof, deadline);
  int flags = ::fcntl(conn.get(), F_GETFL);
  ::fcntl(conn.get(), F_SETFL, flags & ~O_NONBLOCK);
  Channel ch(std::move(conn));
  ch.seal(accepted.keys);
  auto hello = ch.recv();
  ASSERT_TRUE(hello);
  EXPECT_EQ(hello->data(), "from the host");
  ch.send(Frame::make(kRequest, 2, 1, "from the kernel"));
  host.join();
}

TEST(Auth, HexRoundTrip) {
  EXPECT_EQ(from_hex(to_hex(kKey)), kKey);
  EXPECT_THROW(from_hex("abc"), std::invalid_argument);
  EXPECT_THROW(from_hex("zz"), std::invalid_argument);
}
