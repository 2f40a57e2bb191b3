// all_reduce through real processes on loopback: a coordinator, 1-3 sidecars ("hosts")
// and 1-5 rank processes, every dtype x ReduceOp x count checked against a reference.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <csignal>

#include <filesystem>
#include <fstream>
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

// Runs ranks 0-2 of group "world" with rank_main's `args` and `env` on the cluster's two hosts
// (ranks 0 and 1 on host0), waits for each (at most `timeout`: ASSERT that none hung) and
// expects each to exit 0; their outputs, by rank, in *outputs.
void RunThreeRanks(Cluster& cluster, const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                   absl::Duration timeout, std::vector<std::string>* outputs) {
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    auto p = cluster.StartRank(r, 3, r / 2, args, env);
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < 3; ++r) {
    auto code = ranks[r]->Wait(timeout);
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    EXPECT_EQ(*code, 0) << ranks[r]->Output() << cluster.Logs();
    outputs->push_back(ranks[r]->Output());
  }
}

// COLLSERVE_NCCL_RECORDS=0: the same calls run with no records (the sidecars see none of
// them: the ranks' last_completed_seq stays -1), and the leaver still ends the others'
// communicators.
TEST(RankNcclTest, WithoutRecordsEveryCallStillRuns) {
  auto cluster = Cluster::Start(2, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> outs;
  RunThreeRanks(**cluster, {"--mode=rank_nccl"}, {{"COLLSERVE_NCCL_RECORDS", "0"}}, absl::Seconds(120), &outs);
  ASSERT_FALSE(HasFatalFailure());
  for (const std::string& out : outs) EXPECT_NE(out.find("rank_nccl: OK"), std::string::npos) << out;
}

// The records of a rank's NCCL collectives go to the sidecar from a thread of their own
// (the training thread only queues them); an all_reduce of host memory right after a burst
// of them, which the training thread writes itself, still takes its turn in the group's
// order (the records queued before it are written first; the sidecar refuses a seq out of
// order): every host all_reduce right, every record answered.
TEST(RankNcclTest, AHostCollectiveAfterABurstOfRecordsTakesItsTurn) {
  auto cluster = Cluster::Start(2, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> outs;
  RunThreeRanks(**cluster, {"--mode=rank_nccl_burst"}, {}, absl::Seconds(120), &outs);
  ASSERT_FALSE(HasFatalFailure());
  for (const std::string& out : outs) EXPECT_NE(out.find("rank_nccl_burst: OK"), std::string::npos) << out;
}

// COLLSERVE_CUDA_PATH=nccl when host1's sidecar dies: rank 2 (its session ended) and ranks 0
// and 1 (the coordinator's word that rank 2's host is lost) end their communicators once what
// they queued drained, not at once, and their next calls fail naming why.
TEST(RankNcclTest, ALostSidecarEndsEveryRanksCommunicatorOnceDrained) {
  auto cluster = Cluster::Start(2, {kMeasuredLeaseGraceFlag});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    auto p = (*cluster)->StartRank(r, 3, r / 2, {"--mode=rank_nccl_lost_sidecar"}, {});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ranks[r]->WaitForOutput("ready", absl::Seconds(60))) << ranks[r]->Output();
  }
  (*cluster)->sidecar(1).Kill(SIGKILL);
  for (int r = 0; r < 3; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(90));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    const std::string out = ranks[r]->Output();
    EXPECT_EQ(*code, 0) << out;
    EXPECT_NE(out.find("all_reduce: OK"), std::string::npos) << out;
    // Rank 2's session ended; ranks 0 and 1 heard from the coordinator once host1's lease ran
    // out (--lease_grace).
    EXPECT_NE(out.find(r == 2 ? "aborted (when drained, within 10s): ABORTED: aborted: session with the sidecar ended"
                              : "aborted (when drained, within 10s): ABORTED: aborted: the group failed: generation 1 "
                                "of group \"world\" is over"),
              std::string::npos)
        << out;
    if (r < 2) {
      EXPECT_NE(out.find("ranks [2] were lost with their host"), std::string::npos) << out;
    }
    // Rank 2's record cannot be sent any more: its session's error comes first.
    EXPECT_NE(out.find(r == 2 ? "next call: UNAVAILABLE: all_reduce on CUDA tensors (COLLSERVE_CUDA_PATH=nccl): "
                                "session with the sidecar ended"
                              : "next call: ABORTED: all_reduce on CUDA tensors (COLLSERVE_CUDA_PATH=nccl): aborted: "),
              std::string::npos)
        << out;
  }
}

// COLLSERVE_CUDA_PATH=nccl keeps the service's desync detection: each collective's record
// (collserve.v1.Collective.in_rank) goes through the sidecars' argument checks, and when
// rank 0 calls broadcast where the others call all_reduce, every rank aborts its
// communicator with the sidecars' reason, which its next call names.
TEST(RankNcclTest, ADisagreementAbortsEveryRanksCommunicatorNamingTheCalls) {
  auto cluster = Cluster::Start(2, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> outs;
  RunThreeRanks(**cluster, {"--mode=rank_nccl_desync"}, {}, absl::Seconds(60), &outs);
  ASSERT_FALSE(HasFatalFailure());
  for (int r = 0; r < 3; ++r) {
    const std::string& out = outs[r];
    EXPECT_NE(out.find("agreed all_reduce: OK"), std::string::npos) << out;
    EXPECT_NE(out.find(absl::StrCat("aborted (at once): ABORTED: aborted: the sidecar's check of this rank's ",
                                    r == 0 ? "broadcast" : "all_reduce", " (collective #1): ")),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("#1 of group \"world\": ranks disagree: op=all_reduce on ranks [1, 2] but op=broadcast on "
                       "ranks [0]"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("next call: ABORTED: all_reduce on CUDA tensors (COLLSERVE_CUDA_PATH=nccl): aborted: the "
                       "sidecar's check of "),
              std::string::npos)
        << out;
  }
}

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
  // The job may have one request in flight per sidecar (max_inflight_collectives): the
  // records of the ranks' NCCL collectives do not count (host0's two ranks have one each
  // in flight at every collective), so none is refused.
  char dir[] = "/tmp/collserve-rank-nccl-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  struct RemoveDir {
    std::string path;
    ~RemoveDir() { std::filesystem::remove_all(path); }
  } remove_dir{dir};  // after the cluster and the ranks (declared later, ended first)
  const std::string policies = absl::StrCat(dir, "/policies.json");
  {
    std::ofstream f(policies);
    f << R"({"jobs": {"default": {"max_inflight_collectives": 1}}})";
  }
  // The sidecars mark the default class DSCP 10 (AF11): the ranks' communicators get it as
  // their traffic class (10 << 2).
  auto cluster = Cluster::Start(2, {absl::StrCat("--job_policies_file=", policies)}, {"--traffic_dscp=46,10,8"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> outs;
  RunThreeRanks(**cluster, {"--mode=rank_nccl"}, {}, absl::Seconds(120), &outs);
  ASSERT_FALSE(HasFatalFailure());
  for (int r = 0; r < 3; ++r) {
    const std::string& out = outs[r];
    EXPECT_NE(out.find("rank_nccl: OK"), std::string::npos) << out;
    EXPECT_NE(out.find("communicator: traffic_class=40 name=collserve/default/world/1"), std::string::npos) << out;

    if (r < 2) {
      // Rank 2 left: the others aborted their communicator on the sidecar's word, once what
      // it had queued drained (at most 10 s), and later calls fail at once.
      EXPECT_NE(out.find("aborted (when drained, within 10s): ABORTED: aborted: rank 2 left the group"),
                std::string::npos)
          << out;
      EXPECT_NE(out.find("after the last rank left: ABORTED: all_reduce on CUDA tensors "
                                        "(COLLSERVE_CUDA_PATH=nccl): aborted: rank 2 left the group"),
                std::string::npos)
          << out;
    }
    // NCCL has no receive from any source: refused, naming the fix.
    EXPECT_NE(out.find("recv from any source: INVALID_ARGUMENT: recv from any source on CUDA tensors "
                                      "with COLLSERVE_CUDA_PATH=nccl"),
              std::string::npos)
        << out;
  }
}

}  // namespace
}  // namespace collserve::testing
