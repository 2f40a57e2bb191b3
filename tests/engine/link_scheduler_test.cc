// engine::LinkScheduler, the host-wide scheduler of steps between hosts, on its own: which
// class proposes pieces, which waits for which, and the bound on a wait; the pure cutting
// and agreement functions. No network (the engine test runs it between two hosts).
#include "engine/link_scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "tests/testing/wait_for.h"

namespace collserve::engine {
namespace {

using collserve::testing::WaitFor;

constexpr int kLatencyCritical = 0, kDefault = 1, kBulk = 2;

TEST(LinkSchedulerTest, AgreedPieceBytesIsTheSmallestProposalRaisedToTheMinimum) {
  EXPECT_EQ(AgreedPieceBytes({}), 0u);
  EXPECT_EQ(AgreedPieceBytes({0, 0, -1}), 0u);  // nobody proposed: whole
  EXPECT_EQ(AgreedPieceBytes({0, 1 << 20, 512 << 10, 0}), size_t{512} << 10);
  // A host's proposal is a peer's bytes: one of 1 byte cannot make a transfer crawl.
  EXPECT_EQ(AgreedPieceBytes({1, 1 << 20}), kMinPieceBytes);
}

TEST(LinkSchedulerTest, APieceIsWholeElementsAndAtLeastOne) {
  EXPECT_EQ(ElementsPerPiece(10, 4, 0), 10u);   // not cut
  EXPECT_EQ(ElementsPerPiece(10, 4, 40), 10u);  // fits in one piece
  EXPECT_EQ(ElementsPerPiece(10, 4, 400), 10u);
  EXPECT_EQ(ElementsPerPiece(10, 4, 8), 2u);
  EXPECT_EQ(ElementsPerPiece(10, 4, 14), 3u);  // rounded down: pieces of 3, 3, 3 and 1
  EXPECT_EQ(ElementsPerPiece(3, 8, 5), 1u);    // never below one element
  EXPECT_EQ(ElementsPerPiece(0, 4, 8), 0u);
}

TEST(LinkSchedulerTest, ALowerClassIsCutOnlyWhileABetterOneIsOrWasRecentlyBusy) {
  absl::Time now = absl::UnixEpoch();
  LinkSchedulerOptions o;
  o.piece_bytes = 256 << 10;
  o.recent = absl::Seconds(2);
  LinkScheduler link(o, [&now] { return now; });
  for (int c : {kLatencyCritical, kDefault, kBulk}) EXPECT_EQ(link.ProposedPieceBytes(c), 0u) << c;
  {
    LinkScheduler::Active lc = link.Begin(kLatencyCritical);
    EXPECT_EQ(link.ProposedPieceBytes(kLatencyCritical), 0u);  // never for its own class
    EXPECT_EQ(link.ProposedPieceBytes(kDefault), o.piece_bytes);
    EXPECT_EQ(link.ProposedPieceBytes(kBulk), o.piece_bytes);
  }
  now += absl::Seconds(1);
  EXPECT_EQ(link.ProposedPieceBytes(kBulk), o.piece_bytes);  // ended 1 s ago: still present
  now += absl::Seconds(2);
  EXPECT_EQ(link.ProposedPieceBytes(kBulk), 0u);
  {
    LinkScheduler::Active def = link.Begin(kDefault);
    EXPECT_EQ(link.ProposedPieceBytes(kLatencyCritical), 0u);  // a worse class cuts nobody
    EXPECT_EQ(link.ProposedPieceBytes(kDefault), 0u);          // nor does an equal one
    EXPECT_EQ(link.ProposedPieceBytes(kBulk), o.piece_bytes);
  }
  o.piece_bytes = 0;  // off
  LinkScheduler off(o, [&now] { return now; });
  LinkScheduler::Active lc = off.Begin(kLatencyCritical);
  EXPECT_EQ(off.ProposedPieceBytes(kBulk), 0u);
}

TEST(LinkSchedulerTest, APieceWaitsUntilTheBetterClassEnds) {
  LinkSchedulerOptions o;
  o.max_wait = absl::Seconds(60);
  LinkScheduler link(o);
  LinkScheduler::Active lc = link.Begin(kLatencyCritical);
  EXPECT_EQ(link.AwaitTurn(kLatencyCritical), absl::ZeroDuration());  // equal: never waits
  std::atomic<bool> done{false};
  absl::Duration waited;
  std::thread bulk([&] {
    waited = link.AwaitTurn(kBulk);
    done = true;
  });
  ASSERT_TRUE(WaitFor([&] { return link.Waiting() == 1; }, absl::Seconds(10)));
  EXPECT_FALSE(done.load());  // still waiting: the better class is running
  const absl::Time ended = absl::Now();
  lc.End();
  bulk.join();
  EXPECT_TRUE(done.load());
  EXPECT_GT(waited, absl::ZeroDuration());
  EXPECT_LT(absl::Now() - ended, absl::Seconds(10));
  const LinkScheduler::Counters c = link.CountersOf(kBulk);
  EXPECT_EQ(c.waits, 1u);
  EXPECT_EQ(c.waited, waited);
  EXPECT_EQ(link.AwaitTurn(kBulk), absl::ZeroDuration());  // nobody better running now
  lc.End();                                                // idempotent
}

TEST(LinkSchedulerTest, NoPieceWaitsLongerThanMaxWait) {
  LinkSchedulerOptions o;
  o.max_wait = absl::Milliseconds(50);
  LinkScheduler link(o);
  LinkScheduler::Active lc = link.Begin(kLatencyCritical);  // never ends during the wait
  const absl::Time start = absl::Now();
  const absl::Duration waited = link.AwaitTurn(kBulk);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
  EXPECT_GE(waited, absl::Milliseconds(45));
  EXPECT_LT(waited, absl::Seconds(10));
}

TEST(LinkSchedulerTest, ActivesOfOneClassCountUntilTheLastEnds) {
  LinkSchedulerOptions o;
  o.max_wait = absl::Milliseconds(1);
  LinkScheduler link(o);
  LinkScheduler::Active a = link.Begin(kDefault);
  LinkScheduler::Active b = link.Begin(kDefault);
  a.End();
  EXPECT_GT(link.AwaitTurn(kBulk), absl::ZeroDuration());  // b still running
  LinkScheduler::Active moved = std::move(b);              // a move hands it over
  b.End();                                                 // the moved-from one ends nothing
  EXPECT_GT(link.AwaitTurn(kBulk), absl::ZeroDuration());
  moved.End();
  EXPECT_EQ(link.AwaitTurn(kBulk), absl::ZeroDuration());
  // Out-of-range classes are clamped, not indexed out of bounds.
  LinkScheduler::Active odd = link.Begin(-5);
  EXPECT_GT(link.AwaitTurn(99), absl::ZeroDuration());
}

}  // namespace
}  // namespace collserve::engine
