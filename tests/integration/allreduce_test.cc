// all_reduce through real processes on loopback: a coordinator, 1-3 sidecars ("hosts")
// and 1-5 rank processes, every dtype x ReduceOp x count checked against a reference.
#include <gtest/gtest.h>

#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/process.h"

namespace collserve::testing {
namespace {

struct Config {
  int world_size;
  int sidecars;
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << "world_size=" << c.world_size << " sidecars=" << c.sidecars;
}

class AllReduceSweepTest : public ::testing::TestWithParam<Config> {};

TEST_P(AllReduceSweepTest, EveryDtypeOpAndCountMatchesReference) {
  const Config cfg = GetParam();
  auto cluster = Cluster::Start(cfg.sidecars);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < cfg.world_size; ++r) {
    // Round-robin placement: a host's ranks are not contiguous.
    auto p = (*cluster)->StartRank(r, cfg.world_size, r % cfg.sidecars, {"--mode=sweep"});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < cfg.world_size; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(150));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output() << (*cluster)->Logs();
    EXPECT_EQ(*code, 0) << "rank " << r << ":\n" << ranks[r]->Output() << (*cluster)->Logs();
    // 26 dtype x op pairs x 5 counts, all checked.
    EXPECT_NE(ranks[r]->Output().find("sweep done: 130 collectives, 0 wrong elements"), std::string::npos)
        << ranks[r]->Output();
  }
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

INSTANTIATE_TEST_SUITE_P(WorldSizesAndHosts, AllReduceSweepTest, ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return absl::StrCat("world", info.param.world_size, "_hosts", info.param.sidecars);
                         });

}  // namespace
}  // namespace collserve::testing
