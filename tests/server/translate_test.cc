// The sidecar's reading of the coordinator's join answer (server/sidecar/translate.h):
// both forms give the same membership, and an index outside the hosts is refused.
#include "server/sidecar/translate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace collserve::server {
namespace {

namespace pb = collserve::v1;
using ::testing::HasSubstr;

TEST(TranslateTest, CompactAndMembersAnswersGiveTheSameMembership) {
  pb::JoinResponse members;
  pb::JoinResponse compact;
  members.set_generation(3);
  compact.set_generation(3);
  compact.set_rendezvous_id(0xc0ffee12345678u);
  for (int h = 0; h < 2; ++h) {
    pb::MemberHost* host = compact.add_hosts();
    host->set_host_id("h" + std::to_string(h));
    host->set_host_address("10.0.0." + std::to_string(h));
  }
  for (int rank = 0; rank < 5; ++rank) {
    const int h = rank < 3 ? 0 : 1;
    pb::Member* m = members.add_members();
    m->set_rank(rank);
    m->set_host_id("h" + std::to_string(h));
    m->set_host_address("10.0.0." + std::to_string(h));
    compact.add_rank_host(h);
  }
  absl::StatusOr<engine::Membership> a = FromProto(members);
  absl::StatusOr<engine::Membership> b = FromProto(compact);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->generation, 3);
  EXPECT_EQ(b->rendezvous_id, 0xc0ffee12345678u);
  EXPECT_EQ(a->rendezvous_id, 0u);
  ASSERT_EQ(a->members.size(), 5u);
  ASSERT_EQ(b->members.size(), 5u);
  for (int rank = 0; rank < 5; ++rank) {
    EXPECT_EQ(b->members[rank].rank, a->members[rank].rank);
    EXPECT_EQ(b->members[rank].host_id, a->members[rank].host_id);
    EXPECT_EQ(b->members[rank].host_address, a->members[rank].host_address);
  }
}

TEST(TranslateTest, PriorityClassesMapToThePoolsClasses) {
  EXPECT_EQ(PoolPriority(pb::PRIORITY_CLASS_LATENCY_CRITICAL), 0);
  EXPECT_EQ(PoolPriority(pb::PRIORITY_CLASS_DEFAULT), 1);
  EXPECT_EQ(PoolPriority(pb::PRIORITY_CLASS_UNSPECIFIED), 1);
  EXPECT_EQ(PoolPriority(pb::PRIORITY_CLASS_BULK), 2);
  EXPECT_EQ(PoolPriority(static_cast<pb::PriorityClass>(9)), 1);
}

TEST(TranslateTest, AHostIndexOutsideTheHostsIsInvalidArgument) {
  for (int bad : {-1, 1, 1 << 30}) {
    pb::JoinResponse r;
    r.add_hosts()->set_host_id("h0");
    r.add_rank_host(0);
    r.add_rank_host(bad);
    absl::StatusOr<engine::Membership> m = FromProto(r);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("puts rank 1 on host #"));
  }
}

}  // namespace
}  // namespace collserve::server
