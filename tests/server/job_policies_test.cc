// The per-job quotas: the coordinator's --job_policies_file (LoadJobPolicies, PolicyFor)
// and the sidecar's accounting (JobQuotas). tests/python/test_security.py's quota test runs
// them end to end with real daemons.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "server/coordinator/job_policies.h"
#include "server/sidecar/job_quotas.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

class JobPoliciesTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& text) {
    std::string path = ::testing::TempDir() + "/policies-" + std::to_string(n_++) + ".json";
    std::ofstream(path) << text;
    written_.push_back(path);
    return path;
  }
  void TearDown() override {
    for (const std::string& p : written_) std::remove(p.c_str());
  }
  int n_ = 0;
  std::vector<std::string> written_;
};

TEST_F(JobPoliciesTest, AJobGetsItsOwnEntryElseTheDefault) {
  auto p = LoadJobPolicies(Write(R"({"default_policy": {"max_sessions": 64},
                                     "jobs": {"train": {"max_sessions": 8, "max_segment_bytes": "1073741824"}}})"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(PolicyFor(*p, "train").max_sessions(), 8);
  EXPECT_EQ(PolicyFor(*p, "train").max_segment_bytes(), int64_t{1} << 30);
  EXPECT_EQ(PolicyFor(*p, "other").max_sessions(), 64);
  EXPECT_EQ(PolicyFor(*p, "other").max_segment_bytes(), 0);
  EXPECT_EQ(PolicyFor(pb::JobPolicies(), "train").max_sessions(), 0);  // no file: no limits
}

TEST_F(JobPoliciesTest, ClassesAndWeightsAreReadByName) {
  auto p = LoadJobPolicies(Write(R"({"jobs": {"serve": {"priority_class": "PRIORITY_CLASS_LATENCY_CRITICAL",
                                                         "share_weight": 4, "max_inline_bytes": 1048576},
                                              "train": {"priority_class": "PRIORITY_CLASS_BULK",
                                                        "max_data_threads": 2}}})"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(PolicyFor(*p, "serve").priority_class(), pb::PRIORITY_CLASS_LATENCY_CRITICAL);
  EXPECT_EQ(PolicyFor(*p, "serve").share_weight(), 4);
  EXPECT_EQ(PolicyFor(*p, "train").priority_class(), pb::PRIORITY_CLASS_BULK);
  EXPECT_EQ(PolicyFor(*p, "train").max_data_threads(), 2);
  EXPECT_EQ(PolicyFor(*p, "serve").max_data_threads(), 0);
  EXPECT_EQ(PolicyFor(*p, "serve").max_inline_bytes(), 1 << 20);
  EXPECT_EQ(PolicyFor(*p, "other").priority_class(), pb::PRIORITY_CLASS_UNSPECIFIED);
}

TEST_F(JobPoliciesTest, AMisspeltLimitANegativeOneAndBrokenJsonAreRefusedNamingTheFile) {
  for (const std::string& text : {std::string(R"({"jobs": {"a": {"max_session": 2}}})"),
                                  std::string(R"({"jobs": {"a": {"max_sessions": -1}}})"),
                                  std::string(R"({"default_policy": {"max_segment_bytes": "-5"}})"),
                                  std::string(R"({"jobs": {"a": {"max_inflight_collectives": -3}}})"),
                                  std::string(R"({"jobs": {"a": {"priority_class": "PRIORITY_CLASS_URGENT"}}})"),
                                  std::string(R"({"jobs": {"a": {"priority_class": 7}}})"),
                                  std::string(R"({"jobs": {"a": {"share_weight": 1001}}})"),
                                  std::string(R"({"default_policy": {"share_weight": -1}})"),
                                  std::string(R"({"jobs": {"a": {"max_data_threads": 1025}}})"),
                                  std::string(R"({"jobs": {"a": {"max_data_threads": -2}}})"),
                                  std::string(R"({"jobs": {"a": {"max_inline_bytes": "-1"}}})"),
                                  std::string(R"({"jobs": {"": {"max_sessions": 1}}})"), std::string("{not json")}) {
    const std::string path = Write(text);
    auto p = LoadJobPolicies(path);
    ASSERT_FALSE(p.ok()) << text;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_TRUE(absl::StrContains(p.status().message(), path)) << p.status();
  }
  auto missing = LoadJobPolicies(::testing::TempDir() + "/no-such-policies.json");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
}

TEST(JobQuotasTest, SessionsPastTheLimitAreRefusedAndReleasedOnesMakeRoom) {
  JobQuotas quotas("host0");
  pb::JobPolicy two;
  two.set_max_sessions(2);
  EXPECT_TRUE(quotas.ReserveSession("a", two).ok());
  EXPECT_TRUE(quotas.ReserveSession("a", two).ok());
  absl::Status third = quotas.ReserveSession("a", two);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(third.message(), "max_sessions 2")) << third;
  EXPECT_TRUE(absl::StrContains(third.message(), "host0")) << third;
  // Another job, and the default job under its empty name, are counted apart.
  EXPECT_TRUE(quotas.ReserveSession("b", two).ok());
  EXPECT_TRUE(quotas.ReserveSession("", two).ok());
  EXPECT_EQ(quotas.Sessions("default"), 1);
  quotas.ReleaseSession("a");
  EXPECT_EQ(quotas.Sessions("a"), 1);
  EXPECT_TRUE(quotas.ReserveSession("a", two).ok());
  // No limit.
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(quotas.ReserveSession("c", pb::JobPolicy()).ok());
  // A release of a job with none counted is ignored.
  quotas.ReleaseSession("nobody");
  EXPECT_EQ(quotas.Sessions("nobody"), 0);
}

TEST(JobQuotasTest, ASegmentPastTheByteLimitIsRefusedWithoutOverflow) {
  JobQuotas quotas("host0");
  pb::JobPolicy limit;
  limit.set_max_segment_bytes(3000000);
  EXPECT_TRUE(quotas.AdmitSegment("a", limit, 0, 3000000).ok());
  EXPECT_TRUE(quotas.AdmitSegment("a", limit, 2097152, 902848).ok());
  absl::Status over = quotas.AdmitSegment("a", limit, 2097152, 4194304);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.message(), "max_segment_bytes 3000000")) << over;
  EXPECT_FALSE(quotas.AdmitSegment("a", limit, 1, INT64_MAX).ok());
  EXPECT_FALSE(quotas.AdmitSegment("a", limit, INT64_MAX, 1).ok());
  EXPECT_TRUE(quotas.AdmitSegment("a", pb::JobPolicy(), INT64_MAX, INT64_MAX).ok());  // no limit
}

TEST(JobQuotasTest, RequestsPastTheInFlightLimitAreRefusedAndCountUntilReleased) {
  JobQuotas quotas("host0");
  pb::JobPolicy limit;
  limit.set_max_inflight_collectives(2);
  EXPECT_TRUE(quotas.AdmitCollective("a", limit, 1).ok());
  EXPECT_TRUE(quotas.AdmitCollective("a", limit, 2).ok());
  absl::Status over = quotas.AdmitCollective("a", limit, 3);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.message(), "max_inflight_collectives 2")) << over;
  EXPECT_TRUE(absl::StrContains(over.message(), "job \"a\" has 2 requests in flight on sidecar host0")) << over;
  EXPECT_TRUE(absl::StrContains(over.message(), "request #3")) << over;
  EXPECT_EQ(quotas.InFlight("a"), 3);  // the refused one counts until it completes
  EXPECT_TRUE(quotas.AdmitCollective("b", limit, 1).ok());  // another job has its own count
  quotas.ReleaseCollectives("a", 2);
  EXPECT_TRUE(quotas.AdmitCollective("a", limit, 4).ok());  // 1 before it
  quotas.ReleaseCollectives("a", 100);  // more than counted: none left
  EXPECT_EQ(quotas.InFlight("a"), 0);
  EXPECT_EQ(quotas.InFlight("b"), 1);
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(quotas.AdmitCollective("c", pb::JobPolicy(), i).ok());  // no limit
}

}  // namespace
}  // namespace collserve::server
