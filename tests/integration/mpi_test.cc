// The MPI backend between sidecars (issue 45): the surface suite's rank program
// (tests/integration/surface_rank.cc) with COLLSERVE_BACKEND=mpi, its ranks placed
// round-robin on 2 and 3 sidecars that mpirun started as one MPI world (loopback TCP), and
// the refusal when the sidecars are not in one. Built only with MPI.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/process.h"

namespace collserve::testing {
namespace {

struct RankResult {
  int code = -1;
  std::string output;
};

std::vector<RankResult> RunRanks(Cluster& cluster, int world_size, int sidecars, const std::vector<std::string>& args,
                                 std::map<std::string, std::string> env = {}) {
  env["COLLSERVE_BACKEND"] = "mpi";
  cluster.set_rank_binary(SurfaceRankBinary());
  std::vector<RankResult> results(static_cast<size_t>(world_size));
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < world_size; ++r) {
    auto p = cluster.StartRank(r, world_size, r % sidecars, args, env);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return results;
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < world_size; ++r) {
    auto code = ranks[static_cast<size_t>(r)]->Wait(absl::Seconds(150));
    results[static_cast<size_t>(r)].output = ranks[static_cast<size_t>(r)]->Output();
    EXPECT_TRUE(code.ok()) << "rank " << r << " hung:\n" << results[static_cast<size_t>(r)].output << cluster.Logs();
    if (code.ok()) results[static_cast<size_t>(r)].code = *code;
    if (!code.ok() || *code != 0) results[static_cast<size_t>(r)].output += cluster.Logs();
  }
  return results;
}

void ExpectAll(const std::vector<RankResult>& results, const std::string& expect) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find(expect), std::string::npos) << "rank " << r << ":\n" << results[r].output;
  }
}

// Every collective, dtype and size (ordinary and arena tensors), point-to-point and
// subgroups, with the hosts' step over MPI: 4 ranks on 2 sidecars; subgroups with 5 on 3
// (and uneven hosts). As root, tests/fault/multihost_netns_test.cc's MpiNetnsHosts runs
// the collectives and point-to-point on 2 and 3 network-namespace hosts too.
TEST(MpiSurfaceTest, EveryCollectivePointToPointAndSubgroupsOverMpi) {
  for (auto [world, sidecars] : {std::pair{4, 2}, std::pair{5, 3}}) {
    SCOPED_TRACE(absl::StrCat("world ", world, " on ", sidecars, " sidecars"));
    auto cluster = Cluster::StartUnderMpirun(COLLSERVE_MPIEXEC, sidecars);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    if (sidecars == 2) {
      ExpectAll(RunRanks(**cluster, world, sidecars, {"--mode=collectives", "--arena"}), " checked, 0 wrong");
      ExpectAll(RunRanks(**cluster, world, sidecars, {"--mode=p2p"}, {{"COLLSERVE_OP_TIMEOUT_S", "10"}}), " 0 wrong");
    }
    ExpectAll(RunRanks(**cluster, world, sidecars, {"--mode=groups"}), " 0 wrong");
  }
}

// A sidecar killed while its group's ranks loop on all_reduce over MPI: every rank fails
// within the op timeout (the killed host's with their session, the other host's when the
// coordinator takes the host as lost or at the op timeout: MPI reports no dead peer), and
// the other sidecar (mpirun runs with --enable-recovery) goes on serving.
TEST(MpiSurfaceTest, AKilledSidecarFailsEveryRankWithinTheOpTimeoutAndTheOtherServesOn) {
  auto started = Cluster::StartUnderMpirun(COLLSERVE_MPIEXEC, 2);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  const std::map<std::string, std::string> env = {{"COLLSERVE_OP_TIMEOUT_S", "10"}, {"COLLSERVE_BACKEND", "mpi"}};
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = cluster.StartRank(r, 4, r % 2, {"--mode=loop", "--count=262144"}, env);
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    ASSERT_TRUE(p->WaitForOutput("iter 3 ok", absl::Seconds(60))) << p->Output() << cluster.Logs();
  }
  const pid_t victim = cluster.MpiSidecarPid(1);
  ASSERT_GT(victim, 0);
  const absl::Time killed = absl::Now();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  for (int r = 0; r < 4; ++r) {
    auto code = ranks[static_cast<size_t>(r)]->Wait(absl::Seconds(15));
    ASSERT_TRUE(code.ok()) << "rank " << r << " got no error within the op timeout: "
                           << ranks[static_cast<size_t>(r)]->Output();
    EXPECT_EQ(*code, 3) << ranks[static_cast<size_t>(r)]->Output();
    const std::string out = ranks[static_cast<size_t>(r)]->Output();
    EXPECT_TRUE(out.find("UNAVAILABLE") != std::string::npos || out.find("DEADLINE_EXCEEDED") != std::string::npos)
        << out;
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(13)) << "the 10 s op timeout and a little";
  std::printf("failed %.1f s after the kill; rank 0 (the other host): %s\n",
              absl::ToDoubleSeconds(absl::Now() - killed), ranks[0]->Output().c_str());
  // Sidecar 0 serves on: a new group of two ranks on it.
  ASSERT_GT(cluster.MpiSidecarPid(0), 0) << "sidecar 0 died with sidecar 1:\n" << cluster.Logs();
  std::vector<std::unique_ptr<Process>> after;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster.StartRank(r, 2, 0, {"--mode=sweep", "--group=after", "--counts=1,1000"}, env);
    ASSERT_TRUE(p.ok()) << p.status();
    after.push_back(std::move(*p));
  }
  for (auto& p : after) {
    auto code = p->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << p->Output();
    EXPECT_EQ(*code, 0) << p->Output() << cluster.Logs();
  }
}

// Sidecars that were not started as an MPI world refuse a group of several hosts that asks
// for mpi at its connect, naming why; a group on one host needs no transport and runs.
TEST(MpiSurfaceTest, SidecarsWithoutAnMpiWorldRefuseAnMpiGroupAcrossHosts) {
  auto cluster = Cluster::Start(2);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto results = RunRanks(**cluster, 2, 2, {"--mode=examples"}, {{"COLLSERVE_INIT_TIMEOUT_S", "20"}});
  for (const RankResult& r : results) {
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("FAILED_PRECONDITION"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("mpirun or srun"), std::string::npos) << r.output;
  }
  ExpectAll(RunRanks(**cluster, 2, 1, {"--mode=examples"}), "examples done: 0 wrong");
}

// The backend's desync check across hosts: the ranks of host 0 ask for mpi, those of host 1
// for gloo. Every rank fails at init at once (not at the 60 s init timeout) with
// INVALID_ARGUMENT naming a rank that asked for the other backend, its host and both
// backends (the coordinator compares Member.backend); the sidecars serve on.
TEST(MpiSurfaceTest, RanksAskingForDifferentBackendsAcrossHostsFailNamingTheRank) {
  auto cluster = Cluster::Start(2);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  (*cluster)->set_rank_binary(SurfaceRankBinary());
  const absl::Time start = absl::Now();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = (*cluster)->StartRank(r, 4, r % 2, {"--mode=examples"},
                                   {{"COLLSERVE_BACKEND", r % 2 == 0 ? "mpi" : "gloo"}, {"COLLSERVE_INIT_TIMEOUT_S", "60"}});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {
    auto code = p->Wait(absl::Seconds(50));
    ASSERT_TRUE(code.ok()) << "a rank waited for the init timeout:\n" << p->Output();
    EXPECT_NE(*code, 0) << p->Output();
    EXPECT_NE(p->Output().find("INVALID_ARGUMENT"), std::string::npos) << p->Output();
    EXPECT_NE(p->Output().find("backend desync in group"), std::string::npos) << p->Output();
    const bool named = p->Output().find("(host host1) asked for backend gloo") != std::string::npos ||
                       p->Output().find("(host host0) asked for backend mpi") != std::string::npos;
    EXPECT_TRUE(named) << p->Output();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(40));
  // One backend for all: the group forms and runs.
  ExpectAll(RunRanks(**cluster, 2, 1, {"--mode=examples"}), "examples done: 0 wrong");
}

// A sidecar asked to join an MPI world it was not started in refuses to start, naming why.
TEST(MpiSurfaceTest, ASidecarWithMpiOutsideAnMpiLauncherRefusesToStart) {
  auto cluster = Cluster::Start(0);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto sidecar = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", (*cluster)->coordinator_address()),
                                 absl::StrCat("--unix_socket=", (*cluster)->dir(), "/lone.sock"), "--mpi"},
                                {}, absl::StrCat((*cluster)->dir(), "/lone.log"));
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  auto code = (*sidecar)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  EXPECT_NE((*sidecar)->Output().find("not started by mpirun or srun"), std::string::npos) << (*sidecar)->Output();
}

}  // namespace
}  // namespace collserve::testing
