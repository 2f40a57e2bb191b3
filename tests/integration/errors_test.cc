// Bad input and failures get a clear error, never a hang: real processes on loopback.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "tests/testing/process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

namespace pb = ::collserve::v1;
using ::testing::HasSubstr;

// A cluster with a sanitizer's lease grace (Cluster's kLeaseGraceFlag: under TSan on CI's
// loaded machine the sidecar of SdkCompletionTest's group renewed its lease past 3 s and the
// generation ended under rank 0's recv).
std::unique_ptr<Cluster> StartCluster(int sidecars) {
  auto c = Cluster::Start(sidecars);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// Waits for a rank process and returns (exit code, output); fails the test on a hang. Under
// TSan on a loaded CI machine issuing 64 staged all_reduces alone took 16 s.
std::pair<int, std::string> Finish(Process& p, absl::Duration timeout = UnderTsan(absl::Seconds(60),
                                                                                  absl::Seconds(180))) {
  auto code = p.Wait(timeout);
  EXPECT_TRUE(code.ok()) << "rank process hung: " << p.Output();
  return {code.ok() ? *code : -1, p.Output()};
}

std::unique_ptr<pb::Registry::Stub> RegistryStub(Cluster& c) {
  return pb::Registry::NewStub(grpc::CreateChannel(c.coordinator_address(), grpc::InsecureChannelCredentials()));
}

// Polls the registry until `rank` has joined `group` (so a later process is the second).
void WaitJoined(Cluster& c, const std::string& group, int rank) {
  auto stub = RegistryStub(c);
  auto joined = [&] {
    grpc::ClientContext ctx;
    client::AddJobToken(ctx, c.job_token());
    pb::DescribeRequest req;
    req.set_group(group);
    pb::DescribeResponse resp;
    if (!stub->Describe(&ctx, req, &resp).ok()) return false;
    for (const auto& m : resp.group().members()) {
      if (m.rank() == rank) return true;
    }
    return false;
  };
  if (!WaitFor(joined, absl::Seconds(20))) ADD_FAILURE() << "rank " << rank << " never joined " << group;
}

TEST(ErrorsTest, CountMismatchOnOneHostNamesTheRanks) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    auto p = cluster->StartRank(r, 3, 0, {"--mode=single", absl::StrCat("--count=", r == 2 ? 999 : 1000)});
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 3) << out;
    EXPECT_THAT(out, HasSubstr("status: INVALID_ARGUMENT"));
    EXPECT_THAT(out, HasSubstr("count=999 on ranks [2]"));
    EXPECT_THAT(out, HasSubstr("count=1000 on ranks [0, 1]"));
  }
}

TEST(ErrorsTest, CountMismatchAcrossHostsNamesTheRanksOnEveryRank) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = cluster->StartRank(r, 4, r % 3, {"--mode=single", absl::StrCat("--count=", r == 1 ? 7 : 1000)});
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 3) << out;
    EXPECT_THAT(out, HasSubstr("status: INVALID_ARGUMENT"));
    EXPECT_THAT(out, HasSubstr("count=7 on ranks [1]"));
    EXPECT_THAT(out, HasSubstr("count=1000 on ranks [0, 2, 3]"));
  }
}

TEST(ErrorsTest, BroadcastRootMismatchAcrossHostsNamesTheRanks) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    auto p = cluster->StartRank(r, 3, r % 2, {"--mode=bcast_root", absl::StrCat("--iters=", r == 2 ? 1 : 0)});
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 3) << out;
    EXPECT_THAT(out, HasSubstr("status: INVALID_ARGUMENT: broadcast #0 of group \"world\": ranks disagree: "
                               "root=0 on ranks [0, 1] but root=1 on ranks [2]"));
  }
}

TEST(ErrorsTest, BarrierWithAMissingRankTimesOutNamingIt) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  const std::map<std::string, std::string> env = {{"COLLSERVE_OP_TIMEOUT_S", "1"}};
  // Rank 0 arrives 3 s late; rank 1's barrier must fail after its 1 s op timeout.
  auto r0 = cluster->StartRank(0, 2, 0, {"--mode=barrier", "--iters=3"}, env);
  auto r1 = cluster->StartRank(1, 2, 0, {"--mode=barrier", "--iters=3"}, env);
  ASSERT_TRUE(r0.ok() && r1.ok());
  auto [code, out] = Finish(**r1, absl::Seconds(10));
  EXPECT_EQ(code, 3) << out;
  EXPECT_THAT(out, HasSubstr("status: DEADLINE_EXCEEDED: barrier #0 of group \"world\" timed out on host host0 after "
                             "1s: local ranks [0] did not call it (local ranks [1] did)"));
}

TEST(ErrorsTest, CudaCallsOnHostMemoryAreClearErrorsAndTheGroupGoesOn) {
  // On a machine without a GPU (or a build without CUDA) the SDK refuses before anything
  // reaches the sidecar: FAILED_PRECONDITION (no CUDA) or INVALID_ARGUMENT (not device memory).
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto p = cluster->StartRank(0, 1, 0, {"--mode=cuda_on_host_memory"});
  ASSERT_TRUE(p.ok());
  auto [code, out] = Finish(**p);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("cuda: INVALID_ARGUMENT: address"),
                                    HasSubstr("cuda: FAILED_PRECONDITION: this collserve build has no CUDA")));
  EXPECT_THAT(out, HasSubstr("after: OK: "));
  // all_to_all_single, gather and scatter on CUDA tensors refuse host memory the same way,
  // and check their own arguments first.
  EXPECT_THAT(out, HasSubstr("cuda piece-wise: INVALID_ARGUMENT: gather: the destination passes world_size (1) "
                             "counts, got 2"));
  EXPECT_THAT(out, HasSubstr("cuda piece-wise: INVALID_ARGUMENT: scatter root 1 is out of range"));
  // send / recv on CUDA tensors: the peer first, then the memory like the collectives.
  EXPECT_THAT(out, HasSubstr("cuda send: INVALID_ARGUMENT: send peer rank 1 is out of range for world_size 1"));
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("cuda recv: INVALID_ARGUMENT: address"),
                                    HasSubstr("cuda recv: FAILED_PRECONDITION: this collserve build has no CUDA")));
}

TEST(ErrorsTest, GroupStaysUsableAfterAMismatch) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  // Each rank: one mismatched all_reduce would fail the process in single mode, so use a
  // sweep after a deliberate dtype disagreement is not possible from the CLI; instead run
  // two groups back to back: the mismatch, then a correct sweep on a new group name.
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster->StartRank(r, 2, r, {"--mode=single", "--group=g1", absl::StrCat("--count=", 10 + r)});
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) EXPECT_EQ(Finish(*p).first, 3);
  ranks.clear();
  for (int r = 0; r < 2; ++r) {
    auto p = cluster->StartRank(r, 2, r, {"--mode=sweep", "--group=g2", "--counts=0,5"});
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 0) << out << cluster->Logs();
  }
}

TEST(ErrorsTest, UnknownGroupIsNotFound) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto stub = RegistryStub(*cluster);
  {
    grpc::ClientContext ctx;
    client::AddJobToken(ctx, cluster->job_token());
    pb::DescribeRequest req;
    req.set_group("no-such-group");
    pb::DescribeResponse resp;
    grpc::Status s = stub->Describe(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("no-such-group"));
  }
  {
    grpc::ClientContext ctx;
    client::AddJobToken(ctx, cluster->job_token());
    pb::LeaveRequest req;
    req.set_group("no-such-group");
    pb::LeaveResponse resp;
    EXPECT_EQ(stub->Leave(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    // A collective on a session that never attached to a group.
    auto sc = pb::Collectives::NewStub(
        grpc::CreateChannel(cluster->sidecar_address(0), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    client::AddJobToken(ctx, cluster->job_token());
    auto stream = sc->Session(&ctx);
    pb::SessionRequest req;
    req.mutable_collective()->set_seq(0);
    ASSERT_TRUE(stream->Write(req));
    stream->WritesDone();
    pb::SessionResponse resp;
    EXPECT_FALSE(stream->Read(&resp));
    grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  }
}

TEST(ErrorsTest, RankOutOfRangeIsInvalidArgumentAtEveryLayer) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  // The SDK rejects it before any RPC.
  auto p = cluster->StartRank(4, 4, 0, {"--mode=init"});
  ASSERT_TRUE(p.ok());
  auto [code, out] = Finish(**p);
  EXPECT_EQ(code, 3);
  EXPECT_THAT(out, HasSubstr("init: INVALID_ARGUMENT: rank 4 is out of range for world_size 4"));
  // The sidecar rejects a raw attach.
  auto sc = pb::Collectives::NewStub(grpc::CreateChannel(cluster->sidecar_address(0), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  client::AddJobToken(ctx, cluster->job_token());
  auto stream = sc->Session(&ctx);
  pb::SessionRequest req;
  req.mutable_attach()->set_group("g");
  req.mutable_attach()->set_rank(7);
  req.mutable_attach()->set_world_size(4);
  ASSERT_TRUE(stream->Write(req));
  pb::SessionResponse resp;
  EXPECT_FALSE(stream->Read(&resp));
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rank 7 is out of range"));
  // The coordinator rejects a raw join.
  auto reg = RegistryStub(*cluster);
  grpc::ClientContext jctx;
  client::AddJobToken(jctx, cluster->job_token());
  pb::JoinRequest jreq;
  jreq.set_group("g");
  jreq.set_world_size(4);
  jreq.mutable_member()->set_rank(-1);
  pb::JoinResponse jresp;
  EXPECT_EQ(reg->Join(&jctx, jreq, &jresp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(ErrorsTest, DuplicateRankOnOneHostIsAlreadyExists) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto first = cluster->StartRank(0, 2, 0, {"--mode=init"});
  ASSERT_TRUE(first.ok());
  WaitJoined(*cluster, "world", 0);
  auto dup = cluster->StartRank(0, 2, 0, {"--mode=init"});
  ASSERT_TRUE(dup.ok());
  auto [code, out] = Finish(**dup);
  EXPECT_EQ(code, 3);
  EXPECT_THAT(out, HasSubstr("init: ALREADY_EXISTS: rank 0 is already attached"));
  // The first one is unaffected: once rank 1 comes, the group forms.
  auto second = cluster->StartRank(1, 2, 0, {"--mode=init"});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(Finish(**first).first, 0) << (*first)->Output();
  EXPECT_EQ(Finish(**second).first, 0) << (*second)->Output();
}

TEST(ErrorsTest, DuplicateRankAcrossHostsIsAlreadyExists) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto first = cluster->StartRank(1, 2, 0, {"--mode=init"});
  ASSERT_TRUE(first.ok());
  WaitJoined(*cluster, "world", 1);
  auto dup = cluster->StartRank(1, 2, 1, {"--mode=init"});
  ASSERT_TRUE(dup.ok());
  auto [code, out] = Finish(**dup);
  EXPECT_EQ(code, 3);
  EXPECT_THAT(out, HasSubstr("init: ALREADY_EXISTS: rank 1 has already joined generation 1"));
  auto zero = cluster->StartRank(0, 2, 1, {"--mode=init"});
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(Finish(**first).first, 0) << (*first)->Output() << cluster->Logs();
  EXPECT_EQ(Finish(**zero).first, 0) << (*zero)->Output() << cluster->Logs();
}

TEST(ErrorsTest, WorldSizeDisagreementIsInvalidArgument) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto first = cluster->StartRank(0, 2, 0, {"--mode=init"}, {{"COLLSERVE_INIT_TIMEOUT_S", "5"}});
  ASSERT_TRUE(first.ok());
  WaitJoined(*cluster, "world", 0);
  auto other = cluster->StartRank(1, 3, 1, {"--mode=init"});
  ASSERT_TRUE(other.ok());
  auto [code, out] = Finish(**other);
  EXPECT_EQ(code, 3);
  EXPECT_THAT(out, HasSubstr("init: INVALID_ARGUMENT: group \"world\" has world_size 2; rank 1 asked for world_size 3"));
}

TEST(ErrorsTest, RendezvousTimeoutNamesMissingRanks) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  const absl::Time start = absl::Now();
  auto p0 = cluster->StartRank(0, 4, 0, {"--mode=init"}, {{"COLLSERVE_INIT_TIMEOUT_S", "2"}});
  auto p2 = cluster->StartRank(2, 4, 1, {"--mode=init"}, {{"COLLSERVE_INIT_TIMEOUT_S", "2"}});
  ASSERT_TRUE(p0.ok() && p2.ok());
  for (Process* p : {p0->get(), p2->get()}) {
    auto [code, out] = Finish(*p, absl::Seconds(30));
    EXPECT_EQ(code, 3);
    EXPECT_THAT(out, HasSubstr("init: DEADLINE_EXCEEDED: rendezvous of group \"world\" timed out"));
    EXPECT_THAT(out, HasSubstr("missing ranks: [1, 3]"));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

TEST(ErrorsTest, SidecarKilledMidCollectiveFailsSurvivorsAndOthersStayHealthy) {
  const int metrics_port = UnusedPort();
  ASSERT_NE(metrics_port, 0);
  auto started = Cluster::Start(2, {}, {}, {{absl::StrCat("--metrics_address=127.0.0.1:", metrics_port)}});
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = std::move(*started);
  const std::map<std::string, std::string> env = {{"COLLSERVE_OP_TIMEOUT_S", "10"}};
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = cluster->StartRank(r, 4, r % 2, {"--mode=loop", "--count=1048576"}, env);
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  // Let every rank complete a few collectives, then kill sidecar 1 while they run.
  for (auto& p : ranks) {
    ASSERT_TRUE(p->WaitForOutput("iter 3 ok", absl::Seconds(30))) << p->Output() << cluster->Logs();
  }
  const absl::Time killed = absl::Now();
  cluster->sidecar(1).Kill(SIGKILL);
  for (int r = 0; r < 4; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(10));  // the op timeout
    ASSERT_TRUE(code.ok()) << "rank " << r << " got no error within the op timeout: " << ranks[r]->Output();
    EXPECT_EQ(*code, 3) << ranks[r]->Output();
    const std::string out = ranks[r]->Output();
    EXPECT_TRUE(out.find("UNAVAILABLE") != std::string::npos || out.find("DEADLINE_EXCEEDED") != std::string::npos)
        << out;
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
  // Sidecar 0 counted the backend's failure against the host that went away.
  EXPECT_THAT(HttpGet(metrics_port, "/metrics"), HasSubstr("collserve_backend_errors_total{peer_host=\"host1\"} 1"));
  // Sidecar 0 is still healthy: a new group on it works.
  ASSERT_FALSE(cluster->sidecar(0).Wait(absl::ZeroDuration()).ok()) << "sidecar 0 died";
  std::vector<std::unique_ptr<Process>> after;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster->StartRank(r, 2, 0, {"--mode=sweep", "--group=after", "--counts=1,1000"});
    ASSERT_TRUE(p.ok());
    after.push_back(std::move(*p));
  }
  for (auto& p : after) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 0) << out << cluster->Logs();
  }
}

// COLLSERVE_MAX_STAGING_BYTES bounds the staging memory of collectives in flight: with room
// for one 1.5 MiB tensor, issuing the second all_reduce returns only once the first has
// completed, while a send in between goes over the limit without waiting (its receive may
// depend on this rank's later calls). With no limit the second returns at once.
// A sidecar that stops (SIGSTOP, a hung daemon) while a remote rank writes a 64 MiB inline
// request: the connection's buffers fill, and the rank's call blocked inside the stream's
// write for good (Work deadlines never ran: the call had not returned a Work), however long
// its op timeout (cancelling the call does not free it: the bytes wait in the socket). The
// session's connection now fails after COLLSERVE_KEEPALIVE_TIMEOUT_S (2 s here: gRPC's
// keepalive, and the TCP_USER_TIMEOUT gRPC sets from it, since a ping cannot go out either),
// the call returns UNAVAILABLE long before its 120 s op timeout, and the sidecar, continued,
// serves on. About 3 s.
TEST(ErrorsTest, ACallWritingToAStoppedSidecarFailsInsteadOfBlocking) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  const std::map<std::string, std::string> env = {{"COLLSERVE_OP_TIMEOUT_S", "120"},
                                                  {"COLLSERVE_KEEPALIVE_TIMEOUT_S", "2"},
                                                  {"COLLSERVE_SIDECAR", cluster->sidecar_tcp_address(0)}};
  auto rank = cluster->StartRank(0, 1, 0, {"--mode=loop", "--count=16777216"}, env);
  ASSERT_TRUE(rank.ok()) << rank.status();
  ASSERT_TRUE((*rank)->WaitForOutput("iter 0 ok", UnderTsan(absl::Seconds(60), absl::Seconds(180))))
      << (*rank)->Output() << cluster->Logs();
  cluster->sidecar(0).Kill(SIGSTOP);
  const absl::Time stopped = absl::Now();
  const bool failed = (*rank)->WaitForOutput("error after", absl::Seconds(60));
  const absl::Duration took = absl::Now() - stopped;
  cluster->sidecar(0).Kill(SIGCONT);
  ASSERT_TRUE(failed) << "the call still blocks " << absl::FormatDuration(took) << " after the sidecar stopped\n"
                      << (*rank)->Output();
  EXPECT_THAT((*rank)->Output(), HasSubstr(": UNAVAILABLE: ")) << (*rank)->Output();
  EXPECT_LT(took, absl::Seconds(60));
  auto [code, out] = Finish(**rank);
  EXPECT_EQ(code, 3) << out;
  // The sidecar, continued, serves a new rank.
  auto after = cluster->StartRank(0, 1, 0, {"--mode=single", "--count=4"},
                                  {{"COLLSERVE_SIDECAR", cluster->sidecar_tcp_address(0)}});
  ASSERT_TRUE(after.ok());
  auto [after_code, after_out] = Finish(**after);
  EXPECT_EQ(after_code, 0) << after_out;
}

TEST(StagingTest, CollectivesWaitForRoomSendsDoNot) {
  for (const char* limit : {"2097152", "0"}) {
    SCOPED_TRACE(absl::StrCat("COLLSERVE_MAX_STAGING_BYTES=", limit));
    const bool capped = std::string(limit) != "0";
    auto cluster = StartCluster(1);
    ASSERT_NE(cluster, nullptr);
    const std::vector<std::string> args = {"--mode=staging", capped ? "--iters=0" : "--iters=1"};
    const std::map<std::string, std::string> env = {{"COLLSERVE_MAX_STAGING_BYTES", limit}};
    auto r0 = cluster->StartRank(0, 2, 0, args, env);
    auto r1 = cluster->StartRank(1, 2, 0, args, env);
    ASSERT_TRUE(r0.ok() && r1.ok());
    auto [c0, out0] = Finish(**r0);
    auto [c1, out1] = Finish(**r1);
    EXPECT_EQ(c0, 0) << out0 << cluster->Logs();
    EXPECT_EQ(c1, 0) << out1;
    EXPECT_THAT(out0, HasSubstr(capped ? "issued B; A completed=1" : "issued B; A completed=0"));
    EXPECT_THAT(out0, HasSubstr("rank 0: staging done, 0 wrong"));
    EXPECT_THAT(out1, HasSubstr("rank 1: staging done, 0 wrong"));
  }
}

// Starts a one-host cluster whose sidecar serves /metrics, runs ranks 0 and 1 of a 2-rank
// group with `args` (each must exit 0) and returns the sidecar's /metrics body ("" when
// it did not answer).
std::string MetricsAfterTwoRanks(const std::vector<std::string>& args) {
  const int port = UnusedPort();
  EXPECT_NE(port, 0);
  auto cluster = Cluster::Start(1, {}, {absl::StrCat("--metrics_address=127.0.0.1:", port)});
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (port == 0 || !cluster.ok()) return "";
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto p = (*cluster)->StartRank(r, 2, 0, args);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return "";
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 0) << out << (*cluster)->Logs();
  }
  return HttpGet(port, "/metrics");
}

// The value of the unlabelled sample `name` in a /metrics body; -1 if absent.
double Sample(const std::string& body, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = body.find(key);
  return at == std::string::npos ? -1 : std::strtod(body.c_str() + at + key.size(), nullptr);
}

// Ops kept in flight reuse their staging segments: 2 ranks, 3 rounds of 64 all_reduces of
// 1 MiB ordinary tensors issued back to back. Rank 0 has all 64 in flight each round (rank
// 1 starts once they are issued): it registers 64 segments in the first round and none
// after, as the SDK keeps up to 128 free ones (with a cap of 32 it made 32 anew in each
// later round: 128 for rank 0 alone). Rank 1's ops complete as it issues them, so it
// reuses its first few segments: between 1 and 64 of its own. Under TSan the tensors are
// 256 KiB (still one 1 MiB segment each): at 1 MiB rank 0 took 23.6 s to issue its 64 on a
// loaded CI machine, and rank 1's 33rd reached the 30 s op timeout.
TEST(StagingTest, OpsInFlightReuseTheirSegments) {
  const std::string body =
      MetricsAfterTwoRanks({"--mode=inflight", UnderTsan("--count=262144", "--count=65536"), "--iters=3"});
  EXPECT_THAT(body, HasSubstr("\ncollserve_sessions "));  // the sidecar answered
  const double segments = Sample(body, "collserve_segments_registered_total");
  EXPECT_GE(segments, 65) << body;
  EXPECT_LE(segments, 128) << body;
  EXPECT_EQ(Sample(body, "collserve_segment_bytes_registered_total"), segments * (1 << 20)) << body;
}

// GET http://127.0.0.1:<port><path> (HTTP/1.0); "" when nothing answers within 30 s.
// The sidecar serves /metrics (it once could not: 128 KiB of static TLS left civetweb's
// 100 KiB thread stacks no room) and counts collectives and tensor bytes by path.
TEST(SidecarMetricsTest, CountsCollectivesAndStagedBytes) {
  const std::string body = MetricsAfterTwoRanks({"--mode=single", "--count=1000"});
  EXPECT_THAT(body, HasSubstr("collserve_collectives_total{code=\"OK\",op=\"all_reduce\"} 2"));
  EXPECT_THAT(body, HasSubstr("collserve_tensor_bytes_total{path=\"staged\"} 8000"));
  EXPECT_THAT(body, HasSubstr("collserve_tensor_bytes_total{path=\"arena\"} 0"));
  EXPECT_THAT(body, HasSubstr("collserve_build_info{daemon=\"sidecar\",version=\""));
  // gRPC's server metrics under the names gRPC dashboards query (go-grpc-prometheus').
  const std::string session =
      "{grpc_method=\"Session\",grpc_service=\"collserve.v1.Collectives\",grpc_type=\"bidi_stream\"}";
  EXPECT_THAT(body, HasSubstr("grpc_server_started_total" + session + " 2"));
  EXPECT_THAT(body, HasSubstr("grpc_server_handling_seconds_bucket{grpc_method=\"Session\""));
  EXPECT_THAT(body, HasSubstr("collserve_sessions "));
  EXPECT_THAT(body, HasSubstr("collserve_coordinator_connected 1"));
  // 1000 float32 = 4000 bytes: the 64KiB size bucket.
  EXPECT_THAT(body, HasSubstr("collserve_collective_duration_seconds_count{op=\"all_reduce\",size=\"64KiB\"} 2"));
  // Series appear when used (issue 40: 13 ops x 7 sizes were 1,547 series in advance): only
  // the one op and size that ran.
  EXPECT_THAT(body, Not(HasSubstr("collserve_collective_duration_seconds_count{op=\"unknown\"")));
  EXPECT_THAT(body, Not(HasSubstr("collserve_collective_duration_seconds_count{op=\"all_reduce\",size=\"0\"}")));
  EXPECT_THAT(body, HasSubstr("collserve_collective_algorithms_total{algorithm=\"local\",op=\"all_reduce\"} 2"));
  EXPECT_THAT(body, HasSubstr("\ncollserve_groups "));
}

// COLLSERVE_STAGING_WINDOW_BYTES paces staged collectives issued back to back but never
// stops them: rank 0 issues 64 all_reduces of 1 MiB ordinary tensors while rank 1 has not
// started (it waits for rank 0's word), so none can complete. With the default 2 MiB window,
// each one past the second waits InitOptions::kStagingWindowWait (10 ms) for room that never
// comes and then goes ahead: issuing takes at least 62 x 10 ms, returns with nothing
// completed, and every result is right once rank 1 joins. With the window off (0) nothing
// waits; that run checks the results only (its speed is the machine's). Under TSan (41 s
// alone at 1 MiB, past the 120 s limit on a loaded machine) the tensors are 256 KiB and the
// window 512 KiB: the same two in the window and 62 waits.
TEST(StagingTest, BackToBackCollectivesArePacedNotStopped) {
  for (const char* window : {"", "0"}) {
    SCOPED_TRACE(absl::StrCat("COLLSERVE_STAGING_WINDOW_BYTES=\"", window, "\""));
    auto cluster = StartCluster(1);
    ASSERT_NE(cluster, nullptr);
    const std::vector<std::string> args = {"--mode=inflight", UnderTsan("--count=262144", "--count=65536"),
                                           "--iters=1"};
    std::map<std::string, std::string> env;
    if (*window != '\0') {
      env["COLLSERVE_STAGING_WINDOW_BYTES"] = window;
    } else if (kThreadSanitized) {
      env["COLLSERVE_STAGING_WINDOW_BYTES"] = "524288";
    }
    auto r0 = cluster->StartRank(0, 2, 0, args, env);
    auto r1 = cluster->StartRank(1, 2, 0, args, env);
    ASSERT_TRUE(r0.ok() && r1.ok());
    auto [c0, out0] = Finish(**r0);
    auto [c1, out1] = Finish(**r1);
    ASSERT_EQ(c0, 0) << out0 << cluster->Logs();
    EXPECT_EQ(c1, 0) << out1;
    EXPECT_THAT(out0, HasSubstr("inflight done, 0 wrong"));
    long long ms = -1;
    int completed = -1;
    const size_t at = out0.find("rank 0: issued 64 in ");
    ASSERT_NE(at, std::string::npos) << out0;
    ASSERT_EQ(std::sscanf(out0.c_str() + at, "rank 0: issued 64 in %lld ms, %d completed", &ms, &completed), 2) << out0;
    EXPECT_EQ(completed, 0) << out0;
    if (*window == '\0') {
      EXPECT_GE(ms, 62 * absl::ToInt64Milliseconds(collserve::client::InitOptions::kStagingWindowWait)) << out0;
    }
    std::printf("COLLSERVE_STAGING_WINDOW_BYTES=\"%s\": rank 0 issued 64 in %lld ms\n", window, ms);
  }
}

TEST(StagingTest, BadLimitsAreInitErrors) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{
           {"COLLSERVE_MAX_STAGING_BYTES", "-1"}, {"COLLSERVE_STAGING_WINDOW_BYTES", "2MiB"}}) {
    auto r0 = cluster->StartRank(0, 1, 0, {"--mode=init"}, {{name, value}});
    ASSERT_TRUE(r0.ok());
    auto [code, out] = Finish(**r0);
    EXPECT_EQ(code, 2) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("INVALID_ARGUMENT: ", name, "=\"", value, "\" is not a non-negative number")));
  }
}

// COLLSERVE_MUTEX_DEADLOCK_DETECTION (common/mutex_mode.h) is checked by InitProcessGroup too:
// a value other than ignore/report/abort is the caller's INVALID_ARGUMENT, naming it.
TEST(ErrorsTest, BadMutexDeadlockDetectionIsAnInitError) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto r0 = cluster->StartRank(0, 1, 0, {"--mode=init"}, {{"COLLSERVE_MUTEX_DEADLOCK_DETECTION", "always"}});
  ASSERT_TRUE(r0.ok());
  auto [code, out] = Finish(**r0);
  EXPECT_EQ(code, 3) << out;  // rank_main's "init failed"
  EXPECT_THAT(out, HasSubstr("init: INVALID_ARGUMENT: COLLSERVE_MUTEX_DEADLOCK_DETECTION=\"always\": use ignore (the default), "
                             "report or abort"));
}

TEST(WorkTest, WaitTimeoutIsCompletedAndCallbacks) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto r0 = cluster->StartRank(0, 2, 0, {"--mode=async"});
  auto r1 = cluster->StartRank(1, 2, 1, {"--mode=async"});
  ASSERT_TRUE(r0.ok() && r1.ok());
  auto [c1, out1] = Finish(**r1);
  auto [c0, out0] = Finish(**r0);
  EXPECT_EQ(c0, 0) << out0;
  EXPECT_EQ(c1, 0) << out1;
  EXPECT_THAT(out0, HasSubstr("early wait: DEADLINE_EXCEEDED: Work::Wait timed out after 100ms; the operation is "
                              "still running; completed=0"));
  for (const std::string& out : {out0, out1}) {
    EXPECT_THAT(out, HasSubstr("wait: OK: ; completed=1; result=[3, 30]"));
    EXPECT_THAT(out, HasSubstr("callbacks=1 status=OK"));
    EXPECT_THAT(out, HasSubstr("late callback ran inline=1"));
    EXPECT_THAT(out, HasSubstr("bxor on float: INVALID_ARGUMENT: ReduceOp.BXOR is defined for integer dtypes only"));
  }
}

TEST(ErrorsTest, RankKilledDuringRendezvousCanBeReplaced) {
  // A pod restarted while its group is still forming: the dead rank's join is withdrawn,
  // so its replacement is not a duplicate and the group forms.
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto r0 = cluster->StartRank(0, 3, 0, {"--mode=sweep", "--counts=5"});
  auto r1 = cluster->StartRank(1, 3, 1, {"--mode=sweep", "--counts=5"});
  ASSERT_TRUE(r0.ok() && r1.ok());
  WaitJoined(*cluster, "world", 0);
  WaitJoined(*cluster, "world", 1);
  (*r1)->Kill(SIGKILL);
  ASSERT_TRUE((*r1)->Wait(absl::Seconds(5)).ok());
  auto again = cluster->StartRank(1, 3, 1, {"--mode=sweep", "--counts=5"});
  auto r2 = cluster->StartRank(2, 3, 1, {"--mode=sweep", "--counts=5"});
  ASSERT_TRUE(again.ok() && r2.ok());
  for (Process* p : {r0->get(), again->get(), r2->get()}) {
    auto [code, out] = Finish(*p);
    EXPECT_EQ(code, 0) << out << cluster->Logs();
  }
}

TEST(ErrorsTest, KilledRankFailsItsPeersAndLeavesNoSharedMemory) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster->StartRank(r, 2, 0, {"--mode=loop", "--count=100000"}, {{"COLLSERVE_OP_TIMEOUT_S", "10"}});
    ASSERT_TRUE(p.ok());
    ranks.push_back(std::move(*p));
  }
  ASSERT_TRUE(ranks[1]->WaitForOutput("iter 2 ok", absl::Seconds(30))) << ranks[1]->Output();
  const pid_t victim = ranks[1]->pid();
  ranks[1]->Kill(SIGKILL);
  ASSERT_TRUE(ranks[1]->Wait(absl::Seconds(5)).ok());
  auto [code, out] = Finish(*ranks[0], absl::Seconds(10));
  EXPECT_EQ(code, 3);
  EXPECT_THAT(out, HasSubstr("UNAVAILABLE: rank 1 left group \"world\" (its session on host host0 ended"));
  // The sidecar removed every segment name as soon as it had mapped it.
  const std::string leaked = absl::StrCat("ls /dev/shm | grep -q '^collserve-", victim, "-'");
  EXPECT_NE(std::system(leaked.c_str()), 0) << "shared memory of the killed rank is left in /dev/shm";
}

}  // namespace
}  // namespace collserve::testing

namespace collserve::testing {
namespace {

// A completion callback that blocks (it should not) holds up only its own kind of
// completion: collectives and send/recv finish on separate SDK threads, so a recv whose
// message arrived completes while a collective's callback still runs.
TEST(SdkCompletionTest, RecvCompletesWhileACollectiveCallbackRuns) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto r0 = cluster->StartRank(0, 2, 0, {"--mode=lanes"});
  auto r1 = cluster->StartRank(1, 2, 0, {"--mode=lanes"});
  ASSERT_TRUE(r0.ok() && r1.ok());
  for (auto* p : {&*r0, &*r1}) {
    auto code = (*p)->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << (*p)->Output() << cluster->Logs();
    EXPECT_EQ(*code, 0) << (*p)->Output() << cluster->Logs();
  }
  EXPECT_NE((*r0)->Output().find("value=42"), std::string::npos) << (*r0)->Output();
  EXPECT_NE((*r0)->Output().find("big[0]=2 callback saw the recv=1"), std::string::npos) << (*r0)->Output();
}

}  // namespace
}  // namespace collserve::testing
