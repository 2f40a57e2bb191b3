// all_reduce through real processes on loopback: a coordinator, 1-3 sidecars ("hosts")
// and 1-5 rank processes, every dtype x ReduceOp x count checked against a reference.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/process.h"
#include "tests/testing/sanitizers.h"

namespace collserve::testing {
namespace {

struct Config {
  int world_size;
  int sidecars;
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << "world_size=" << c.world_size << " sidecars=" << c.sidecars;
}

// Under a sanitizer the sweeps' largest count is 1/8 of Release's (the 1M-element all_reduces
// were 80-150 s a test under TSan, most of it page faults on its shadow of the copied buffers,
// and ASan's shadow costs alike on a loaded machine), and the sidecars' algorithm thresholds
// and ring pieces are 1/8 too: every dtype at every count takes the algorithm (direct, ring)
// and the number of ring pieces it takes in Release.
constexpr const char* kSweepCounts = UnderSanitizer("0,1,7,1000,1048576", "0,1,7,1000,131072");
constexpr const char* kMixedSweepCounts = UnderSanitizer("0,7,1048576", "0,7,131072");

std::vector<std::string> SweepSidecarFlags() {
  if (!kSanitized) return {};
  return {"--direct_max_bytes=131072", "--ring_min_bytes=131072", "--ring_segment_bytes=1048576"};
}

// Runs one rank process per rank (round-robin over the sidecars, so a host's ranks are
// not contiguous) with `args`, and expects every rank to exit 0 printing `expect`.
void RunRanksAndExpect(const Config& cfg, const std::vector<std::string>& args, const std::string& expect) {
  auto cluster = Cluster::Start(cfg.sidecars, {}, SweepSidecarFlags());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < cfg.world_size; ++r) {
    auto p = (*cluster)->StartRank(r, cfg.world_size, r % cfg.sidecars, args);
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < cfg.world_size; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(150));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output() << (*cluster)->Logs();
    EXPECT_EQ(*code, 0) << "rank " << r << ":\n" << ranks[r]->Output() << (*cluster)->Logs();
    EXPECT_NE(ranks[r]->Output().find(expect), std::string::npos) << ranks[r]->Output();
  }
}

class AllReduceSweepTest : public ::testing::TestWithParam<Config> {};

TEST_P(AllReduceSweepTest, EveryDtypeOpAndCountMatchesReference) {
  // 26 dtype x op pairs x 5 counts, all checked.
  RunRanksAndExpect(GetParam(), {"--mode=sweep", absl::StrCat("--counts=", kSweepCounts)},
                    "sweep done: 130 collectives, 0 wrong elements");
}

std::vector<Config> AllConfigs() {
  std::vector<Config> out;
  for (int ws = 1; ws <= 5; ++ws) {
    for (int sc = 1; sc <= 3; ++sc) {
      if (sc <= ws) out.push_back({ws, sc});
    }
  }
  return out;
}

class BroadcastBarrierTest : public ::testing::TestWithParam<Config> {};

TEST_P(BroadcastBarrierTest, EveryDtypeRootAndCountThenBarriers) {
  // 4 dtypes x 5 counts broadcasts + 3 barriers.
  RunRanksAndExpect(GetParam(), {"--mode=surface"}, "surface done: 23 checked, 0 wrong");
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndHosts, BroadcastBarrierTest, ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return absl::StrCat("world", info.param.world_size, "_hosts", info.param.sidecars);
                         });

INSTANTIATE_TEST_SUITE_P(WorldSizesAndHosts, AllReduceSweepTest, ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return absl::StrCat("world", info.param.world_size, "_hosts", info.param.sidecars);
                         });

}  // namespace
}  // namespace collserve::testing

namespace collserve::testing {
namespace {

// Four ranks on two hosts (ranks 0, 1 on the first) run the sweep with the environment
// `env_of(rank)` adds; every rank must get every result right.
void RunMixedSweep(const std::function<std::map<std::string, std::string>(const Cluster&, int)>& env_of) {
  auto cluster = Cluster::Start(2, {}, SweepSidecarFlags());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = (*cluster)->StartRank(r, 4, r / 2, {"--mode=sweep", absl::StrCat("--counts=", kMixedSweepCounts)}, env_of(**cluster, r));
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < 4; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    EXPECT_EQ(*code, 0) << ranks[r]->Output() << (*cluster)->Logs();
    EXPECT_NE(ranks[r]->Output().find("sweep done: 78 collectives, 0 wrong elements"), std::string::npos)
        << ranks[r]->Output();
    EXPECT_EQ(ranks[r]->Output().find("no ops channel"), std::string::npos) << ranks[r]->Output();
  }
}

// Clients that do not share /dev/shm with their sidecar (another host, or shared memory
// turned off) send tensors inline over the sidecar's TCP port; mixed with local clients.
TEST(AllReduceRemoteClientTest, InlineClientsOverTcpMixWithSharedMemoryClients) {
  RunMixedSweep([](const Cluster& cluster, int r) -> std::map<std::string, std::string> {
    if (r % 2 == 0) return {};
    return {{"COLLSERVE_SIDECAR", cluster.sidecar_tcp_address(r / 2)}, {"COLLSERVE_SHARED_MEMORY", "0"}};
  });
}

// Ranks whose requests go over the ops channel (the default with shared memory) and ranks
// that keep them on the session's stream (COLLSERVE_OPS_CHANNEL=0) in one group.
TEST(AllReduceOpsChannelTest, RanksWithAndWithoutTheOpsChannelMix) {
  RunMixedSweep([](const Cluster&, int r) -> std::map<std::string, std::string> {
    if (r % 2 == 0) return {};
    return {{"COLLSERVE_OPS_CHANNEL", "0"}};
  });
}

// One GPU per rank (COLLSERVE_CUDA_PATH=nccl, docs/gpu.md): three ranks on two hosts run every
// CUDA call of the SDK with NCCL in their own processes, here over the store-backed stand-in
// for NCCL (tests/testing/store_rank_comm.h; host memory): the communicator is made once per
// group with its unique id through the coordinator's store, and every element is checked.
TEST(RankNcclTest, EveryCudaCallRunsInTheRanksWithTheUniqueIdFromTheStore) {
  auto cluster = Cluster::Start(2, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    auto p = (*cluster)->StartRank(r, 3, r / 2, {"--mode=rank_nccl"});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < 3; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    EXPECT_EQ(*code, 0) << ranks[r]->Output() << (*cluster)->Logs();
    EXPECT_NE(ranks[r]->Output().find("rank_nccl: OK"), std::string::npos) << ranks[r]->Output();

    if (r < 2) {
      // Rank 2 left: the others aborted their communicator on the sidecar's word.
      EXPECT_NE(ranks[r]->Output().find("after the last rank left: ABORTED: all_reduce on CUDA tensors "
                                        "(COLLSERVE_CUDA_PATH=nccl): aborted: rank 2 left the group"),
                std::string::npos)
          << ranks[r]->Output();
    }
    // NCCL has no receive from any source: refused, naming the fix.
    EXPECT_NE(ranks[r]->Output().find("recv from any source: INVALID_ARGUMENT: recv from any source on CUDA tensors "
                                      "with COLLSERVE_CUDA_PATH=nccl"),
              std::string::npos)
        << ranks[r]->Output();
  }
}

}  // namespace
}  // namespace collserve::testing
