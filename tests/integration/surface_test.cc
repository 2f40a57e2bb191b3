// The torch.distributed collective surface through real processes on loopback: a
// coordinator, 1-3 sidecars ("hosts") and 2-5 rank processes (tests/integration/
// surface_rank.cc), ranks placed round-robin so a host's ranks are not contiguous.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
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

void PrintTo(const Config& c, std::ostream* os) { *os << "world_size=" << c.world_size << " sidecars=" << c.sidecars; }

struct RankResult {
  int code = -1;
  std::string output;
};

// Runs every rank with `args` and returns their exit codes and output.
std::vector<RankResult> RunRanks(const Config& cfg, const std::vector<std::string>& args,
                                 const std::map<std::string, std::string>& env = {},
                                 absl::Duration limit = absl::Seconds(150),
                                 const std::vector<std::string>& sidecar_flags = {}) {
  std::vector<RankResult> results(cfg.world_size);
  auto cluster = Cluster::Start(cfg.sidecars, {}, sidecar_flags);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return results;
  (*cluster)->set_rank_binary(SurfaceRankBinary());
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < cfg.world_size; ++r) {
    auto p = (*cluster)->StartRank(r, cfg.world_size, r % cfg.sidecars, args, env);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return results;
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < cfg.world_size; ++r) {
    auto code = ranks[r]->Wait(limit);
    results[r].output = ranks[r]->Output();
    EXPECT_TRUE(code.ok()) << "rank " << r << " hung:\n" << results[r].output << (*cluster)->Logs();
    if (code.ok()) results[r].code = *code;
    if (!code.ok() || *code != 0) results[r].output += (*cluster)->Logs();
  }
  return results;
}

void ExpectAll(const std::vector<RankResult>& results, const std::string& expect) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find(expect), std::string::npos) << "rank " << r << ":\n" << results[r].output;
  }
}

std::vector<Config> Configs() {
  std::vector<Config> out;
  for (int ws = 2; ws <= 5; ++ws) {
    for (int sc = 1; sc <= 3; ++sc) {
      if (sc <= ws) out.push_back({ws, sc});
    }
  }
  return out;
}

std::string ConfigName(const ::testing::TestParamInfo<Config>& info) {
  return absl::StrCat("world", info.param.world_size, "_hosts", info.param.sidecars);
}

class SurfaceTest : public ::testing::TestWithParam<Config> {};

TEST_P(SurfaceTest, EveryCollectiveEveryDtypeUnevenAndZeroSizes) {
  const Config& cfg = GetParam();
  const auto results = RunRanks(cfg, {"--mode=collectives"});
  ExpectAll(results, " checked, 0 wrong");
  // Per dtype and size (0, 1, 37): all_reduce and reduce for each valid op, a broadcast,
  // gather and scatter per root, three all_gathers (list, into a tensor, in place), two
  // reduce_scatters, three all_to_alls.
  int expected = 2;  // the two barriers
  for (int ops : {6, 6, 8, 8, 6, 6, 8, 8, 7}) {  // valid ReduceOps of the 9 dtypes, in kAllDtypes order
    expected += 3 * (2 * ops + 3 * cfg.world_size + 8);
  }
  for (const RankResult& r : results) {
    EXPECT_NE(r.output.find(absl::StrCat("collectives done: ", expected, " checked")), std::string::npos) << r.output;
  }
}

// The same checks with every other tensor in the group's shared-memory arena (no copy
// between rank and sidecar), in one host and across two and three.
TEST(SurfaceArenaTest, EveryCollectiveWithArenaAndOrdinaryTensors) {
  for (Config cfg : {Config{4, 1}, Config{4, 2}, Config{5, 3}}) {
    SCOPED_TRACE(::testing::PrintToString(cfg));
    const auto results = RunRanks(cfg, {"--mode=collectives", "--arena"});
    ExpectAll(results, " checked, 0 wrong");
    for (const RankResult& r : results) EXPECT_NE(r.output.find("arena tensors: "), std::string::npos) << r.output;
  }
}

// Large broadcasts of ordinary tensors, whose roots send the request before copying the
// tensor (the pipelined broadcast): on one host the readers follow the root's copy; across
// hosts the root's sidecar waits for it before sending the bytes on. 8 MiB each (1 MiB
// pieces); under a sanitizer (TSan: 120 s for this test at 8 MiB) just above the pipelined
// broadcast's 1 MiB threshold (pieces of a quarter of it, the last one short).
TEST(SurfaceBroadcastTest, LargeOrdinaryTensorsFromEveryRootOnOneHostAndAcrossHosts) {
  const int64_t bytes = UnderSanitizer(int64_t{8} << 20, (int64_t{1} << 20) + 4096);  // kPipelinedBroadcastMinBytes: 1 MiB
  for (Config cfg : {Config{4, 1}, Config{4, 2}}) {
    SCOPED_TRACE(::testing::PrintToString(cfg));
    ExpectAll(RunRanks(cfg, {"--mode=big_broadcast", absl::StrCat("--big_broadcast_bytes=", bytes)}),
              absl::StrCat("big_broadcast done: ", 8 * cfg.world_size, " checked, 0 wrong"));
  }
}

// Every all_reduce algorithm across hosts, forced by the sidecar flag, gives the same
// checked results (every dtype and ReduceOp, PREMUL_SUM and AVG included); the ring with
// 1 KiB pieces runs many pieces per call.
TEST(SurfaceAlgorithmTest, EveryAllReduceAlgorithmAcrossHosts) {
  for (const std::vector<std::string>& flags :
       std::vector<std::vector<std::string>>{{"--allreduce_algorithm=direct"},
                                             {"--allreduce_algorithm=bcube"},
                                             {"--allreduce_algorithm=ring", "--ring_segment_bytes=1024"}}) {
    SCOPED_TRACE(flags[0]);
    const auto results =
        RunRanks({5, 3}, {"--mode=collectives", "--arena"}, {}, absl::Seconds(150), flags);
    ExpectAll(results, " checked, 0 wrong");
  }
}

TEST_P(SurfaceTest, ReferenceTextExamples) { ExpectAll(RunRanks(GetParam(), {"--mode=examples"}), "examples done: 0 wrong"); }

TEST_P(SurfaceTest, PointToPoint) {
  ExpectAll(RunRanks(GetParam(), {"--mode=p2p"}, {{"COLLSERVE_OP_TIMEOUT_S", "3"}}), " 0 wrong");
}

TEST_P(SurfaceTest, SubgroupsRunIndependently) { ExpectAll(RunRanks(GetParam(), {"--mode=groups"}), " 0 wrong"); }

INSTANTIATE_TEST_SUITE_P(WorldSizesAndHosts, SurfaceTest, ::testing::ValuesIn(Configs()), ConfigName);

// Desync detection: one test per mismatch kind, within one host and across three; every
// rank gets INVALID_ARGUMENT naming who called what, within the op timeout, and the group
// stays usable.
struct DesyncCase {
  std::string kind;
  int sidecars;
  std::string expect;  // in every rank's message
};

void PrintTo(const DesyncCase& c, std::ostream* os) { *os << c.kind << " over " << c.sidecars << " sidecars"; }

class DesyncTest : public ::testing::TestWithParam<DesyncCase> {};

TEST_P(DesyncTest, EveryRankGetsTheDisagreement) {
  const DesyncCase& c = GetParam();
  const absl::Time start = absl::Now();
  auto results = RunRanks({4, c.sidecars}, {"--mode=desync", absl::StrCat("--kind=", c.kind)},
                          {{"COLLSERVE_OP_TIMEOUT_S", "10"}}, absl::Seconds(60));
  // Far below a wait for the 10 s op timeout on each of the program's calls; TSan on a loaded
  // CI machine took 31-41 s.
  EXPECT_LT(absl::Now() - start, UnderTsan(absl::Seconds(45), absl::Seconds(120)));
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].code, 0) << results[r].output;
    EXPECT_NE(results[r].output.find("status: INVALID_ARGUMENT"), std::string::npos) << results[r].output;
    EXPECT_NE(results[r].output.find(c.expect), std::string::npos) << results[r].output;
    EXPECT_NE(results[r].output.find("after: OK:  sum=4"), std::string::npos) << results[r].output;
  }
}

std::vector<DesyncCase> DesyncCases() {
  std::vector<DesyncCase> out;
  for (int sc : {1, 3}) {
    out.push_back({"op", sc, "op=all_reduce on ranks [0, 1, 2] but op=broadcast on ranks [3]"});
    out.push_back({"root", sc, "root=0 on ranks [0, 1, 2] but root=1 on ranks [3]"});
    out.push_back({"dtype", sc, "dtype=float32 on ranks [0, 1, 2] but dtype=float64 on ranks [3]"});
    out.push_back({"reduce_op", sc, "reduce_op=SUM on ranks [0, 1, 2] but reduce_op=MAX on ranks [3]"});
    out.push_back({"count", sc, "count=7 on ranks [3] but count=16 on ranks [0, 1, 2]"});
    out.push_back({"splits", sc, "rank 0 sends 1 elements to rank 3, but rank 3 expects 2 from rank 0"});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Kinds, DesyncTest, ::testing::ValuesIn(DesyncCases()),
                         [](const ::testing::TestParamInfo<DesyncCase>& info) {
                           return absl::StrCat(info.param.kind, "_hosts", info.param.sidecars);
                         });

// monitored_barrier names the ranks that did not arrive, on one host and across hosts.
TEST(MonitoredBarrierTest, NamesEveryMissingRankWithWaitAllRanks) {
  for (int sc : {1, 2}) {
    auto results = RunRanks({4, sc}, {"--mode=monitored", "--timeout_ms=1500", "--skip=2", "--wait_all_ranks"},
                            {}, absl::Seconds(60));
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(results[r].code, 0) << results[r].output;
      EXPECT_NE(results[r].output.find("DEADLINE_EXCEEDED"), std::string::npos) << results[r].output;
      EXPECT_NE(results[r].output.find("ranks 2, 3 failed to pass monitored_barrier"), std::string::npos)
          << "sidecars=" << sc << " rank " << r << ":\n" << results[r].output;
    }
  }
}

TEST(MonitoredBarrierTest, NamesTheFirstMissingRankByDefault) {
  auto results = RunRanks({3, 1}, {"--mode=monitored", "--timeout_ms=1000", "--skip=2", "--nowait_all_ranks"}, {},
                          absl::Seconds(60));
  EXPECT_NE(results[0].output.find("rank 1 failed to pass monitored_barrier within 1s"), std::string::npos)
      << results[0].output;
}

}  // namespace
}  // namespace collserve::testing
