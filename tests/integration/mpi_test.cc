// The MPI backend between sidecars (issue 45): the surface suite's rank program
// (tests/integration/surface_rank.cc) with COLLSERVE_BACKEND=mpi, its ranks placed
// round-robin on 2 and 3 sidecars that mpirun started as one MPI world (loopback TCP), and
// the refusal when the sidecars are not in one. Built only with MPI.
#include <gtest/gtest.h>

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
// subgroups, with the hosts' step over MPI: 4 ranks on 2 sidecars, 5 on 3.
TEST(MpiSurfaceTest, EveryCollectivePointToPointAndSubgroupsOverMpi) {
  for (auto [world, sidecars] : {std::pair{4, 2}, std::pair{5, 3}}) {
    SCOPED_TRACE(absl::StrCat("world ", world, " on ", sidecars, " sidecars"));
    auto cluster = Cluster::StartUnderMpirun(COLLSERVE_MPIEXEC, sidecars);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    ExpectAll(RunRanks(**cluster, world, sidecars, {"--mode=collectives", "--arena"}), " checked, 0 wrong");
    ExpectAll(RunRanks(**cluster, world, sidecars, {"--mode=p2p"}, {{"COLLSERVE_OP_TIMEOUT_S", "10"}}), " 0 wrong");
    ExpectAll(RunRanks(**cluster, world, sidecars, {"--mode=groups"}), " 0 wrong");
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
