// The coordinator's diagnosis of a group from its hosts' ledgers (server/coordinator/ledger.h):
// a rank that never calls, ranks that disagree, a host that sent nothing, an idle group,
// and ages kept relative to each report's arrival.
#include "server/coordinator/ledger.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

namespace collserve::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr int kAllReduce = 1, kBroadcast = 2, kFloat32 = 1, kSum = 1;

// 4 ranks: 0 and 1 on host "a", 2 and 3 on host "b".
GroupView FourRanks() {
  GroupView v;
  v.group = "world";
  v.world_size = 4;
  v.generation = 3;
  v.state = "FORMED";
  for (int r = 0; r < 4; ++r) v.members.push_back(MemberInfo{r, r < 2 ? "a" : "b", "", "", 0, ""});
  return v;
}

RankLedger Issued(int rank, int64_t seq, int op = kAllReduce, int64_t count = 1024, absl::Duration age = absl::Seconds(2)) {
  RankLedger r;
  r.rank = rank;
  r.issued_seq = seq;
  r.op = op;
  r.dtype = kFloat32;
  r.count = count;
  r.reduce_op = kSum;
  r.issued_age = age;
  r.completed_seq = seq - 1;
  return r;
}

HostLedger Host(std::vector<RankLedger> ranks, absl::Time received, int64_t generation = 3) {
  HostLedger h;
  h.generation = generation;
  h.state = "ready";
  h.ranks = std::move(ranks);
  h.received = received;
  return h;
}

TEST(LedgerTest, ARankThatNeverCallsIsNamedWithItsHostTheOpAndTheSequenceNumber) {
  const absl::Time now = absl::Now();
  std::map<std::string, HostLedger> reports;
  reports["a"] = Host({Issued(0, 7), Issued(1, 7)}, now - absl::Seconds(1));
  // Rank 3 completed #6 but never called #7.
  RankLedger idle = Issued(3, 6, kAllReduce, 1024, absl::Seconds(30));
  idle.completed_seq = 6;
  reports["b"] = Host({Issued(2, 7, kAllReduce, 1024, absl::Seconds(5)), idle}, now);
  Diagnosis d = Diagnose(FourRanks(), reports, now);
  EXPECT_EQ(d.oldest_incomplete_seq, 7);
  EXPECT_EQ(d.oldest_incomplete_op, kAllReduce);
  EXPECT_THAT(d.missing, ElementsAre(3));
  EXPECT_THAT(d.arrived, ElementsAre(0, 1, 2));
  EXPECT_THAT(d.unknown, IsEmpty());
  EXPECT_THAT(d.disagreement, IsEmpty());
  // Host a's report is a second old: its ranks called 2 + 1 s ago, before rank 2's 5 s.
  EXPECT_EQ(d.waiting, absl::Seconds(5));
  EXPECT_EQ(d.ranks[0].progress.issued_age, absl::Seconds(3));
  EXPECT_EQ(d.ranks[0].report_age, absl::Seconds(1));
  EXPECT_EQ(d.summary,
            "all_reduce #7 of group \"world\" (generation 3): ranks [3] (host b) have not called it; ranks [0, 1, 2] "
            "have, the first 5 s ago");
}

TEST(LedgerTest, RanksThatCallItWithOtherArgumentsAreNamed) {
  const absl::Time now = absl::Now();
  std::map<std::string, HostLedger> reports;
  reports["a"] = Host({Issued(0, 2), Issued(1, 2, kAllReduce, 999)}, now);
  reports["b"] = Host({Issued(2, 2), Issued(3, 2, kBroadcast)}, now);
  Diagnosis d = Diagnose(FourRanks(), reports, now);
  EXPECT_EQ(d.oldest_incomplete_seq, 2);
  EXPECT_THAT(d.missing, IsEmpty());
  EXPECT_THAT(d.disagreement, HasSubstr("all_reduce count=1024 dtype=float32 op=SUM on ranks [0, 2]"));
  EXPECT_THAT(d.disagreement, HasSubstr("all_reduce count=999 dtype=float32 op=SUM on ranks [1]"));
  EXPECT_THAT(d.disagreement, HasSubstr("broadcast count=1024 dtype=float32 root=0 on ranks [3]"));
  EXPECT_THAT(d.summary, HasSubstr("they disagree: "));
}

TEST(LedgerTest, AHostWithoutAReportOfThisGenerationIsUnknownNotMissing) {
  const absl::Time now = absl::Now();
  std::map<std::string, HostLedger> reports;
  reports["a"] = Host({Issued(0, 0), Issued(1, 0)}, now);
  reports["b"] = Host({Issued(2, 5), Issued(3, 5)}, now, /*generation=*/2);  // the last generation's
  Diagnosis d = Diagnose(FourRanks(), reports, now);
  EXPECT_THAT(d.unknown, ElementsAre(2, 3));
  EXPECT_THAT(d.missing, IsEmpty());
  EXPECT_EQ(d.oldest_incomplete_seq, 0);
  EXPECT_THAT(d.summary, HasSubstr("no ledger from ranks [2, 3] (host b)"));
  EXPECT_FALSE(d.ranks[2].reported);
}

TEST(LedgerTest, ARankThatLeftIsNamedAsGoneNotByAnEmptyHost) {
  const absl::Time now = absl::Now();
  std::map<std::string, HostLedger> reports;
  reports["a"] = Host({Issued(0, 0), Issued(1, 0)}, now);
  RankLedger idle = Issued(3, -1);  // has called nothing
  idle.completed_seq = -1;
  reports["b"] = Host({Issued(2, 0), idle}, now);
  GroupView group = FourRanks();
  // Rank 2 left (at its op timeout): no longer a member, its host unknown to the registry.
  group.members.erase(std::remove_if(group.members.begin(), group.members.end(),
                                     [](const MemberInfo& m) { return m.rank == 2; }),
                      group.members.end());
  Diagnosis d = Diagnose(group, reports, now);
  EXPECT_THAT(d.unknown, ElementsAre(2));
  EXPECT_THAT(d.missing, ElementsAre(3));
  EXPECT_THAT(d.summary, HasSubstr("ranks [3] (host b) have not called it; ranks [0, 1] have"));
  EXPECT_THAT(d.summary, HasSubstr("ranks [2] have left the group"));
  EXPECT_THAT(d.summary, Not(HasSubstr("no ledger")));
  EXPECT_THAT(d.summary, Not(HasSubstr("(host )")));
}

TEST(LedgerTest, ADrainingHostIsNamedWithTheTimeItStarted) {
  const absl::Time now = absl::Now();
  // 2026-12-03 10:00:00 UTC.
  const int64_t since = absl::ToUnixMillis(absl::FromCivil(absl::CivilSecond(2026, 12, 3, 10, 0, 0), absl::UTCTimeZone()));
  std::map<std::string, HostLedger> reports;
  reports["a"] = Host({Issued(0, 4), Issued(1, 4)}, now);
  reports["b"] = Host({Issued(2, 4), Issued(3, 3)}, now);
  reports["b"].ranks[1].completed_seq = 3;
  reports["b"].draining_since_unix_ms = since;
  Diagnosis d = Diagnose(FourRanks(), reports, now);
  EXPECT_EQ(d.ranks[2].host_draining_since_unix_ms, since);
  EXPECT_EQ(d.ranks[0].host_draining_since_unix_ms, 0);
  EXPECT_THAT(d.summary, HasSubstr("; host b's sidecar is draining (collservectl drain) since 2026-12-03 10:00:00 UTC: "
                                   "it takes no new sessions"));
  EXPECT_THAT(d.summary, Not(HasSubstr("host a's sidecar")));
  // Named once for its two ranks, and in an idle group too.
  EXPECT_EQ(d.summary.find("host b's sidecar"), d.summary.rfind("host b's sidecar"));
  for (auto& [host, ledger] : reports) {
    for (RankLedger& r : ledger.ranks) r.completed_seq = r.issued_seq = 4;
  }
  d = Diagnose(FourRanks(), reports, now);
  EXPECT_THAT(d.summary, HasSubstr("no collective in flight"));
  EXPECT_THAT(d.summary, HasSubstr("host b's sidecar is draining (collservectl drain) since 2026-12-03 10:00:00 UTC"));
}

TEST(LedgerTest, AnIdleGroupHasNothingInFlight) {
  const absl::Time now = absl::Now();
  std::map<std::string, HostLedger> reports;
  for (const char* host : {"a", "b"}) {
    std::vector<RankLedger> ranks;
    for (int r = host[0] == 'a' ? 0 : 2, end = r + 2; r < end; ++r) {
      RankLedger done = Issued(r, 9);
      done.completed_seq = 9;
      ranks.push_back(done);
    }
    reports[host] = Host(ranks, now);
  }
  Diagnosis d = Diagnose(FourRanks(), reports, now);
  EXPECT_EQ(d.oldest_incomplete_seq, -1);
  EXPECT_THAT(d.summary, HasSubstr("no collective in flight; every reported rank completed collective #9"));
  EXPECT_EQ(Diagnose(FourRanks(), {}, now).summary,
            "group \"world\" (generation 3): no host has reported its ledger yet");
}

TEST(LedgerTest, AFailedHostIsNamedWithItsError) {
  const absl::Time now = absl::Now();
  std::map<std::string, HostLedger> reports;
  reports["a"] = Host({Issued(0, 1), Issued(1, 1)}, now);
  reports["b"] = Host({Issued(2, 0), Issued(3, 0)}, now);
  reports["b"].ranks[0].completed_seq = 0;
  reports["b"].ranks[1].completed_seq = 0;
  reports["b"].state = "failed";
  reports["b"].failure = "rank 3 of group \"world\" disconnected from host b";
  Diagnosis d = Diagnose(FourRanks(), reports, now);
  EXPECT_EQ(d.oldest_incomplete_seq, 1);
  EXPECT_THAT(d.missing, ElementsAre(2, 3));
  EXPECT_THAT(d.summary, HasSubstr("host b failed the group: rank 3 of group \"world\" disconnected from host b"));
}

}  // namespace
}  // namespace collserve::server
