// The group's control-plane decisions (engine/control.h) on their own: what each answer of
// the coordinator's watch of a generation means for this host's group. No coordinator, no
// threads: DecideWatch is pure.
#include "engine/control.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace collserve::engine {
namespace {

using ::testing::HasSubstr;
using Next = WatchOutcome::Next;

// Generation 7 of 6 ranks: 0-1 on host a (this one), 2-3 on host b, 4-5 on host c.
Topology ThreeHosts(const std::string& me = "a") {
  Membership m;
  m.generation = 7;
  const char* hosts[] = {"a", "a", "b", "b", "c", "c"};
  for (int r = 0; r < 6; ++r) m.members.push_back(Member{r, hosts[r], std::string(hosts[r]) + ":1"});
  auto t = Topology::FromMembership(m, 6, me);
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

GroupEvents Events(const std::string& state, std::vector<Departure> departures = {}, int64_t generation = 7) {
  GroupEvents e;
  e.generation = generation;
  e.state = state;
  e.departures = std::move(departures);
  return e;
}

Departure Left(int rank, const std::string& reason) { return Departure{rank, "", reason, false}; }
Departure Lost(int rank, const std::string& reason) { return Departure{rank, "", reason, true}; }

TEST(DecideWatchTest, AnUnreachableCoordinatorIsAskedAgainLater) {
  const WatchOutcome out = DecideWatch(absl::UnavailableError("connection refused"), ThreeHosts(), "g", 2, false, {});
  EXPECT_EQ(out.next, Next::kLater);
  EXPECT_TRUE(out.failure.ok());
  EXPECT_EQ(out.known, 2);
  EXPECT_FALSE(out.with_members);
  EXPECT_TRUE(out.shut_hosts.empty());
  EXPECT_TRUE(out.left.empty());
}

TEST(DecideWatchTest, ARestartedCoordinatorIsAskedAtOnceWithTheMembershipThenLater) {
  WatchOutcome out = DecideWatch(absl::NotFoundError("no such generation"), ThreeHosts(), "g", 0, false, {});
  EXPECT_EQ(out.next, Next::kNow);
  EXPECT_TRUE(out.with_members);
  EXPECT_TRUE(out.failure.ok());
  // Still not found with the membership: it could not adopt it; try later, with it again.
  out = DecideWatch(absl::NotFoundError("no such generation"), ThreeHosts(), "g", 0, true, {});
  EXPECT_EQ(out.next, Next::kLater);
  EXPECT_TRUE(out.with_members);
  // An answer of the generation: the membership is not sent any more.
  out = DecideWatch(Events("FORMED"), ThreeHosts(), "g", 0, true, {});
  EXPECT_EQ(out.next, Next::kNow);
  EXPECT_FALSE(out.with_members);
}

TEST(DecideWatchTest, ACoordinatorWithoutWatchesIsNotAskedAgain) {
  EXPECT_EQ(DecideWatch(absl::UnimplementedError("WatchGroup"), ThreeHosts(), "g", 0, false, {}).next, Next::kNone);
}

TEST(DecideWatchTest, AnAnswerForAnotherGenerationChangesNothing) {
  const WatchOutcome out = DecideWatch(Events("FORMED", {Lost(2, "lease expired")}, 8), ThreeHosts(), "g", 0, false, {});
  EXPECT_EQ(out.next, Next::kLater);
  EXPECT_TRUE(out.failure.ok());
  EXPECT_EQ(out.known, 0);
  EXPECT_TRUE(out.shut_hosts.empty());
}

TEST(DecideWatchTest, RemoteRanksThatLeftAreReportedOnceEach) {
  const std::vector<Departure> departures = {
      Left(1, "local rank: its own host says so in band"),  // this host's rank: not reported here
      Left(3, "rank 3 called destroy_process_group"),
      Left(99, "a rank of no generation"),  // hostile or stale: ignored
      Left(4, "session closed"),
      Left(3, "again"),  // once only
  };
  WatchOutcome out = DecideWatch(Events("FORMED", departures), ThreeHosts(), "g", 0, false, /*remote_departed=*/{4});
  EXPECT_EQ(out.next, Next::kNow);
  EXPECT_TRUE(out.failure.ok());
  EXPECT_EQ(out.known, 5);
  ASSERT_EQ(out.left.size(), 1u);  // 4 was reported before
  EXPECT_EQ(out.left[0].first, 3);
  EXPECT_EQ(out.left[0].second,
            "rank 3 left group \"g\" (the coordinator: rank 3 called destroy_process_group)");
  EXPECT_TRUE(out.shut_hosts.empty());
  // The next answer repeats every departure: only those past `known` count.
  out = DecideWatch(Events("BROKEN", departures), ThreeHosts(), "g", 5, false, {3, 4});
  EXPECT_TRUE(out.left.empty());
  EXPECT_EQ(out.next, Next::kNow);
}

TEST(DecideWatchTest, ALostHostEndsTheGenerationAndItsConnectionsAreShutDown) {
  const WatchOutcome out = DecideWatch(
      Events("BROKEN", {Left(5, "session closed"), Lost(2, "lease expired"), Lost(3, "lease expired")}),
      ThreeHosts(), "g", 0, false, {});
  EXPECT_EQ(out.next, Next::kNone);
  EXPECT_EQ(out.failure.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(out.failure.message(),
            "generation 7 of group \"g\" is over (BROKEN at the coordinator): ranks [2, 3] were lost with their "
            "host (lease expired); re-form the group (reconfigure) to go on");
  EXPECT_EQ(out.shut_hosts, std::vector<int>{1});  // host b only
  ASSERT_EQ(out.left.size(), 1u);                  // rank 5's point-to-point still fails by name
  EXPECT_EQ(out.left[0].first, 5);
  EXPECT_EQ(out.known, 3);
}

TEST(DecideWatchTest, AHostTakenAsLostItselfShutsOnlyTheOthers) {
  const WatchOutcome out =
      DecideWatch(Events("BROKEN", {Lost(0, "lease expired"), Lost(4, "lease expired")}), ThreeHosts(), "g", 0,
                  false, {});
  EXPECT_THAT(out.failure.message(), HasSubstr("ranks [0, 4] are taken as lost with this host (lease expired)"));
  EXPECT_EQ(out.shut_hosts, std::vector<int>{2});  // host c; never this host's own
}

TEST(DecideWatchTest, AGenerationTheCoordinatorHasDoneWithFailsTheGroupAndShutsEveryOtherHost) {
  const std::pair<const char*, const char*> cases[] = {
      {"SUPERSEDED", "a later generation of the group formed or forms there"},
      {"DELETED", "an operator deleted the group (collservectl delete-group)"},
      {"ENDED", "every rank left it (or its hosts were lost)"},
  };
  for (const auto& [state, why] : cases) {
    const WatchOutcome out = DecideWatch(Events(state, {Left(3, "x")}), ThreeHosts("b"), "g", 0, false, {});
    EXPECT_EQ(out.next, Next::kNone) << state;
    EXPECT_EQ(out.failure.code(), absl::StatusCode::kUnavailable) << state;
    EXPECT_EQ(out.failure.message(), absl::StrCat("generation 7 of group \"g\" is over (", state,
                                                  " at the coordinator: ", why,
                                                  "); re-form the group (reconfigure) to go on"));
    EXPECT_EQ(out.shut_hosts, (std::vector<int>{0, 2})) << state;  // this is host b (index 1)
    EXPECT_TRUE(out.left.empty()) << state;
    EXPECT_EQ(out.known, 0) << state;
  }
}

}  // namespace
}  // namespace collserve::engine
