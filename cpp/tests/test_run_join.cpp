// One ddip run per node forming one job (cpp/tools/run_join.hpp): the rendezvous between a
// JobHost and JobMembers over real TCP on this machine, with and without a shared key, and the
// pure rules (endpoints, timeouts, restarts, each node's account of the job's end).
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "run_join.hpp"

using namespace ddip::run;
using namespace std::chrono_literals;

namespace {

JoinOptions options(uint16_t port, int nnodes, int node_rank, int nproc = 2) {
  JoinOptions o;
  o.backend = "static";
  o.host = "127.0.0.1";
  o.port = port;
  o.nnodes_min = o.nnodes_max = nnodes;
  o.node_rank = node_rank;
  o.run_id = "job";
  o.nproc = nproc;
  o.name = "n" + std::to_string(node_rank);
  o.join_timeout = 20s;
  o.last_call = 0ms;
  o.link_timeout = 5s;
  return o;
}

std::string join_error(JoinOptions o) {
  try {
    JobMember(std::move(o)).join();
  } catch (const JoinError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(RunJoin, EndpointsAsTorchWritesThem) {
  EXPECT_EQ(split_endpoint("node1:29400", 1), (std::pair<std::string, uint16_t>("node1", 29400)));
  EXPECT_EQ(split_endpoint("node1", 29400), (std::pair<std::string, uint16_t>("node1", 29400)));
  EXPECT_EQ(split_endpoint("[::1]:5", 1), (std::pair<std::string, uint16_t>("::1", 5)));
  EXPECT_THROW(split_endpoint(":5", 1), std::invalid_argument);
  EXPECT_THROW(split_endpoint("h:99999", 1), std::invalid_argument);
  EXPECT_THROW(split_endpoint("h:x", 1), std::invalid_argument);
}

TEST(RunJoin, RdzvConfTimeoutsInSeconds) {
  std::map<std::string, std::string> conf{{"join_timeout", "5"}, {"last_call_timeout", "0.5"}};
  EXPECT_EQ(conf_seconds(conf, "join_timeout", 1ms), 5000ms);
  EXPECT_EQ(conf_seconds(conf, "last_call_timeout", 1ms), 500ms);
  EXPECT_EQ(conf_seconds(conf, "close_timeout", 7ms), 7ms);
  conf["join_timeout"] = "soon";
  EXPECT_THROW(conf_seconds(conf, "join_timeout", 1ms), std::invalid_argument);
}

TEST(RunJoin, TheEarliestTimeoutOfAnyNodeWins) {
  EXPECT_EQ(earliest_timeout(0, {0, 0}), 0);
  EXPECT_EQ(earliest_timeout(0, {0, 9}), 9);
  EXPECT_EQ(earliest_timeout(20, {9, 30}), 9);
}

TEST(RunJoin, OnlyAFailureRestartsAndOnlyAsOftenAsAsked) {
  Outcome failed;
  failed.root = RootCause{};
  EXPECT_TRUE(restarts_after(failed, 0, 1));
  EXPECT_FALSE(restarts_after(failed, 1, 1));
  Outcome interrupted = failed;
  interrupted.first_signal = 2;
  EXPECT_FALSE(restarts_after(interrupted, 0, 3));
  Outcome timed_out;
  timed_out.timed_out = true;
  EXPECT_FALSE(restarts_after(timed_out, 0, 3));
  EXPECT_FALSE(restarts_after(Outcome{}, 0, 3));
}

TEST(RunJoin, EveryNodeNamesTheRootCause) {
  Outcome o;
  RootCause c;
  c.unit = 1;
  c.rank = 1;
  c.who = "rank 1";
  c.what = "exit code 3";
  c.code = 3;
  c.tail = {"ValueError: bad batch"};
  o.root = c;
  auto e = end_record(o, false, 2, "hostA");
  EXPECT_EQ(e.who, "rank 1 (on node 0, hostA)");
  EXPECT_EQ(e.exit_code, 3);
  // Through the wire, to a node whose ranks are 2 and 3.
  auto back = std::get<ddip::run::protocol::End>(
      ddip::run::protocol::decode_join(ddip::run::protocol::encode(e)));
  EXPECT_EQ(back, e);
  std::vector<UnitEnd> units(2);
  units[0].first_rank = 2;
  units[1].first_rank = 3;
  units[0].status = units[1].status = ddip::ExitStatus{0, 15, false};
  units[0].stopped = units[1].stopped = true;
  std::string text = summary(outcome_of(back, units), units);
  EXPECT_NE(text.find("rank 1 (on node 0, hostA) failed first: exit code 3"), std::string::npos)
      << text;
  EXPECT_NE(text.find("ValueError: bad batch"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 2: killed by SIGTERM"), std::string::npos) << text;
  EXPECT_NE(text.find("exit code 3"), std::string::npos) << text;
}

TEST(RunJoin, StaticNodesJoinTheirHostInNodeRankOrder) {
  auto host_opts = options(0, 3, 0);
  auto listener = host_rendezvous(host_opts);
  ASSERT_TRUE(listener);
  const uint16_t port = listener->port();
  JobHost host(host_opts, std::move(listener));
  // Node 2 arrives first: ranks still go node by node.
  auto two = std::async(std::launch::async, [&] {
    JobMember m(options(port, 3, 2, 1));
    return m.join();
  });
  auto one = std::async(std::launch::async, [&] {
    JobMember m(options(port, 3, 1, 3));
    return m.join();
  });
  auto mine = host.gather(0, 4242);
  EXPECT_EQ(mine.world_size, 6);
  EXPECT_EQ(mine.nnodes, 3);
  EXPECT_EQ(mine.rank_offset, 0);
  auto s1 = one.get(), s2 = two.get();
  EXPECT_EQ(s1.node_rank, 1);
  EXPECT_EQ(s1.rank_offset, 2);
  EXPECT_EQ(s2.node_rank, 2);
  EXPECT_EQ(s2.rank_offset, 5);
  EXPECT_EQ(s2.world_size, 6);
  EXPECT_EQ(s2.master_port, 4242);
  EXPECT_EQ(s2.master_addr, "127.0.0.1");
}

TEST(RunJoin, TheHostsLocalAddrIsEveryRanksMasterAddr) {
  auto host_opts = options(0, 2, 0);
  host_opts.local_addr = "localhost";
  auto listener = host_rendezvous(host_opts);
  const uint16_t port = listener->port();
  JobHost host(host_opts, std::move(listener));
  auto one = std::async(std::launch::async, [&] {
    JobMember m(options(port, 2, 1));
    return m.join();
  });
  EXPECT_EQ(host.gather(0, 1).master_addr, "localhost");
  EXPECT_EQ(one.get().master_addr, "localhost");
}

TEST(RunJoin, AWrongRunIdOrATakenNodeRankIsRefusedWithWhy) {
  auto host_opts = options(0, 3, 0);
  auto listener = host_rendezvous(host_opts);
  const uint16_t port = listener->port();
  JobHost host(host_opts, std::move(listener));
  // The host gathers; the two wrong nodes are refused while it does, and only then do the two
  // right ones join (had they come first, the gathering could end before a wrong one was read).
  auto gathered = std::async(std::launch::async, [&] { return host.gather(0, 1); });
  auto wrong = options(port, 3, 1);
  wrong.run_id = "other";
  EXPECT_NE(join_error(wrong).find("it names the job 'other', this is 'job'"), std::string::npos);
  EXPECT_NE(join_error(options(port, 3, 5)).find("--node-rank 5 is not one of 1..2"),
            std::string::npos);
  auto ok1 = std::async(std::launch::async, [&] {
    JobMember m(options(port, 3, 1));
    return m.join();
  });
  auto ok2 = std::async(std::launch::async, [&] {
    JobMember m(options(port, 3, 2));
    return m.join();
  });
  gathered.get();
  ok1.get();
  ok2.get();
}

TEST(RunJoin, WithASharedKeyOnlyNodesThatKnowItJoin) {
  auto host_opts = options(0, 2, 0);
  host_opts.key = "open sesame, please";
  auto listener = host_rendezvous(host_opts);
  const uint16_t port = listener->port();
  JobHost host(host_opts, std::move(listener));
  auto wrong = options(port, 2, 1);
  wrong.key = "a guess of 16+ chars";
  auto none = options(port, 2, 1);
  auto right = options(port, 2, 1);
  right.key = "open sesame, please";
  auto bad = std::async(std::launch::async, [&] { return join_error(wrong); });
  auto missing = std::async(std::launch::async, [&] { return join_error(none); });
  auto good = std::async(std::launch::async, [&] {
    // Only after both were refused: else the job could form first, refusing them for that.
    bad.wait();
    missing.wait();
    JobMember m(right);
    auto s = m.join();
    EXPECT_TRUE(m.link().sealed());
    auto e = m.end();  // sealed lines both ways
    return std::make_pair(s, e);
  });
  host.gather(0, 1);
  // Refused while the job formed.
  EXPECT_NE(bad.get().find("its key is not this job's"), std::string::npos);
  EXPECT_NE(missing.get().find("wants the job's shared key"), std::string::npos);
  ASSERT_EQ(host.nodes().size(), 1u);
  EXPECT_TRUE(host.nodes()[0].link->sealed());
  protocol::End e;
  e.exit_code = 7;
  host.end(e);
  auto [s, got] = good.get();
  EXPECT_EQ(s.node_rank, 1);
  EXPECT_EQ(got.exit_code, 7);
}

TEST(RunJoin, AShortKeyIsRefusedWithHowToMakeOne) {
  ::setenv("DDIP_RUN_KEY", "short", 1);
  try {
    shared_key("");
    ADD_FAILURE() << "a 5-character key was taken";
  } catch (const JoinError& e) {
    EXPECT_NE(std::string(e.what()).find("openssl rand -hex 32"), std::string::npos);
  }
  ::setenv("DDIP_RUN_KEY", "0123456789abcdef", 1);
  EXPECT_EQ(shared_key(""), "0123456789abcdef");
  ::unsetenv("DDIP_RUN_KEY");
  EXPECT_EQ(shared_key(""), "");
}

TEST(RunJoin, ASealedLineChangedOnTheWayIsRejected) {
  ddip::LinkKeys a{"k1", "k2"}, b{"k2", "k1"};
  SealedLines out(a), in(b);
  std::string line = out.seal(
      "\x1e"
      "ddip stop\n");
  EXPECT_EQ(in.open(line),
            "\x1e"
            "ddip stop\n");
  std::string again = out.seal(
      "\x1e"
      "ddip stop\n");
  std::string forged = again;
  forged[7] = 'x';
  EXPECT_THROW(in.open(forged), protocol::ProtocolError);
  // Replaying the first line in place of the second fails too: its place in the stream differs.
  SealedLines in2(b);
  in2.open(line);
  EXPECT_THROW(in2.open(line), protocol::ProtocolError);
}

TEST(RunJoin, ElasticJobsStartWithTheMinimumAfterTheLastCall) {
  auto host_opts = options(0, 1, 0);
  host_opts.backend = "c10d";
  host_opts.nnodes_min = 2;
  host_opts.nnodes_max = 3;
  host_opts.last_call = 300ms;
  host_opts.node_rank = -1;
  auto listener = std::make_unique<ddip::TcpListener>("127.0.0.1", 0);
  const uint16_t port = listener->port();
  JobHost host(host_opts, std::move(listener));
  auto member = options(port, 1, -1);
  member.backend = "c10d";
  auto one = std::async(std::launch::async, [&] {
    JobMember m(member);
    return m.join();
  });
  auto start = host.gather(0, 1);
  EXPECT_EQ(start.nnodes, 2);  // the third never came; the last call passed
  EXPECT_EQ(one.get().node_rank, 1);
}

TEST(RunJoin, AMemberWithoutAHostGivesUpAtTheJoinTimeout) {
  auto o = options(1, 2, 1);  // nobody listens on port 1
  o.join_timeout = 300ms;
  EXPECT_NE(join_error(o).find("join_timeout"), std::string::npos);
}
