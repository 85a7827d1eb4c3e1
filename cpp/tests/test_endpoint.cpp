#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "ddip/endpoint.hpp"

using namespace ddip;
using namespace std::chrono_literals;

namespace {

Channel accept_one(Listener& l) {
  Fd fd;
  while (!(fd = l.accept())) std::this_thread::sleep_for(1ms);
  return Channel(std::move(fd));
}

std::optional<Frame> read_frame(Channel& c) {
  for (int i = 0; i < 10000; ++i) {
    if (auto f = c.next()) return f;
    if (c.read_some() == Channel::ReadResult::kEof) return std::nullopt;
    std::this_thread::sleep_for(1ms);
  }
  return std::nullopt;
}

}  // namespace

TEST(Endpoint, SaysHelloAndExchangesFrames) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 4, "hi");
  Channel server = accept_one(l);
  auto hello = read_frame(server);
  ASSERT_TRUE(hello);
  EXPECT_EQ(hello->kind, kHello);
  EXPECT_EQ(hello->rank, 4);
  EXPECT_EQ(hello->data(), "hi");

  EXPECT_FALSE(ep.recv(10ms));  // nothing yet: times out
  set_nonblocking(server.fd());
  server.queue(Frame::make(kRequest, 4, 11, "work"));
  while (!server.flush()) {
  }
  auto req = ep.recv(5s);
  ASSERT_TRUE(req);
  EXPECT_EQ(req->seq, 11u);
  EXPECT_EQ(req->data(), "work");
  ep.send(Frame::make(kDone, 0, 11, "result"));
  auto done = read_frame(server);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->rank, 4);  // the endpoint stamps its own rank
  EXPECT_EQ(done->data(), "result");
}

TEST(Endpoint, WatchdogAnswersHeartbeatsWhileTheCallerIsBusy) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "");
  Channel server = accept_one(l);
  ASSERT_TRUE(read_frame(server));  // hello
  server.queue(Frame::make(kHeartbeat, 0, 77, ""));
  while (!server.flush()) {
  }
  auto ack = read_frame(server);  // nobody called ep.recv()
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->kind, kHeartbeatAck);
  EXPECT_EQ(ack->seq, 77u);
}

TEST(Endpoint, RecvThrowsOnceTheKernelIsGone) {
  RuntimeDir d;
  Listener l(d.socket_path());
  Endpoint ep(d.socket_path(), 0, "", 60s);
  {
    Channel server = accept_one(l);
    server.queue(Frame::make(kRequest, 0, 1, "last"));
    while (!server.flush()) {
    }
  }
  auto last = ep.recv(5s);  // frames that arrived before the hang-up are still delivered
  ASSERT_TRUE(last);
  EXPECT_EQ(last->data(), "last");
  EXPECT_THROW(ep.recv(5s), EndpointClosed);
}

TEST(Endpoint, BusyProcessExitsWhenTheKernelGoesAway) {
  RuntimeDir d;
  Listener l(d.socket_path());
  pid_t pid = ::fork();
  if (pid == 0) {
    Endpoint ep(d.socket_path(), 0, "", 100ms);
    ::pause();  // "stuck in user code": never calls recv
    ::_exit(0);
  }
  {
    Channel server = accept_one(l);
  }  // the kernel hangs up
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
}
