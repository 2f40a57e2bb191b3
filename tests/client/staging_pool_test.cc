// The SDK's staging pool (client/staging_pool.h) without a sidecar: best-fit reuse, the
// max_staging_bytes wait and its deadline, what never waits, the free limits and the
// names of dropped segments, a failed segment, and the arena's lookup.
#include "client/staging_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testing/wait_for.h"

namespace collserve::client {
namespace {

using ::collserve::testing::WaitFor;

constexpr size_t kMiB = size_t{1} << 20;

// A pool whose new segments are plain memfds (what the session registers with the sidecar);
// counts them.
struct CountingPool {
  explicit CountingPool(int64_t max_staging_bytes, int64_t window = 0)
      : pool(max_staging_bytes, window, [this](size_t bytes) {
          ++made;
          return ShmSegment::Create(bytes);
        }) {}
  std::atomic<int> made{0};
  StagingPool pool;
};

TEST(StagingPoolTest, ReusesTheSmallestFreeSegmentThatFits) {
  CountingPool p(0);
  auto big = p.pool.Acquire(3 * kMiB, true, true, absl::InfiniteFuture());
  auto small = p.pool.Acquire(10, true, true, absl::InfiniteFuture());
  ASSERT_TRUE(big.ok() && small.ok());
  EXPECT_EQ((*big)->size(), 3 * kMiB);
  EXPECT_EQ((*small)->size(), kMiB);  // rounded up to kSegmentGranularity
  EXPECT_EQ(p.pool.in_flight_collectives(), 2);
  EXPECT_EQ(p.pool.staged_bytes(), 4 * kMiB);
  const ShmSegment* small_seg = small->get();
  p.pool.Release(std::move(*big), true);
  p.pool.Release(std::move(*small), true);
  EXPECT_EQ(p.pool.in_flight_collectives(), 0);
  EXPECT_EQ(p.pool.staged_bytes(), 0u);
  auto again = p.pool.Acquire(100, true, true, absl::InfiniteFuture());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), small_seg);
  EXPECT_EQ(p.made, 2);
  p.pool.Release(std::move(*again), true);
}

TEST(StagingPoolTest, ACollectiveWaitsForRoomUntilOneIsReleased) {
  CountingPool p(2 * kMiB);
  auto held = p.pool.Acquire(2 * kMiB, true, true, absl::InfiniteFuture());
  ASSERT_TRUE(held.ok());
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    auto seg = p.pool.Acquire(kMiB, true, true, absl::Now() + absl::Seconds(60));
    EXPECT_TRUE(seg.ok());
    done = true;
    p.pool.Release(std::move(*seg), true);
  });
  ASSERT_TRUE(WaitFor([&] { return p.pool.waiting() == 1; }, absl::Seconds(30)));
  EXPECT_FALSE(done.load());
  p.pool.Release(std::move(*held), true);
  EXPECT_TRUE(WaitFor([&] { return done.load(); }, absl::Seconds(30)));
  waiter.join();
}

TEST(StagingPoolTest, PastItsDeadlineACollectiveGoesOverTheLimit) {
  CountingPool p(2 * kMiB);
  auto held = p.pool.Acquire(2 * kMiB, true, true, absl::InfiniteFuture());
  ASSERT_TRUE(held.ok());
  const absl::Time start = absl::Now();
  auto over = p.pool.Acquire(kMiB, true, true, start + absl::Milliseconds(100));
  ASSERT_TRUE(over.ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(p.pool.staged_bytes(), 3 * kMiB);
  p.pool.Release(std::move(*over), true);
  p.pool.Release(std::move(*held), true);
}

TEST(StagingPoolTest, SendsRecvsAndCompletionLanesNeverWait) {
  CountingPool p(kMiB);
  auto held = p.pool.Acquire(kMiB, true, true, absl::InfiniteFuture());
  ASSERT_TRUE(held.ok());
  // Either would wait forever here if it waited at all (the deadline is infinite).
  auto p2p = p.pool.Acquire(kMiB, false, true, absl::InfiniteFuture());
  auto on_lane = p.pool.Acquire(kMiB, true, false, absl::InfiniteFuture());
  ASSERT_TRUE(p2p.ok() && on_lane.ok());
  EXPECT_EQ(p.pool.in_flight_collectives(), 2);  // the send/recv is not one
  p.pool.Release(std::move(*p2p), false);
  p.pool.Release(std::move(*on_lane), true);
  p.pool.Release(std::move(*held), true);
  EXPECT_EQ(p.pool.in_flight_collectives(), 0);
}

TEST(StagingPoolTest, FreeSegmentsPastTheLimitAreDroppedAndNamed) {
  CountingPool p(3 * kMiB);  // free segments are kept up to max_staging_bytes
  std::vector<std::unique_ptr<ShmSegment>> held;
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i) {
    auto seg = p.pool.Acquire(kMiB, false, true, absl::InfiniteFuture());
    ASSERT_TRUE(seg.ok());
    names.push_back((*seg)->name());
    held.push_back(std::move(*seg));
  }
  for (auto& seg : held) p.pool.Release(std::move(seg), false);
  EXPECT_EQ(p.pool.free_segments(), 3u);
  std::vector<std::string> released;
  p.pool.TakeReleased(&released);
  ASSERT_EQ(released.size(), 1u);
  EXPECT_NE(std::find(names.begin(), names.end(), released[0]), names.end());
  released.clear();
  p.pool.TakeReleased(&released);  // reported once
  EXPECT_TRUE(released.empty());
}

TEST(StagingPoolTest, AFailedSegmentLeavesThePoolAsItWas) {
  StagingPool pool(0, 0, [](size_t bytes) -> absl::StatusOr<std::unique_ptr<ShmSegment>> {
    return absl::ResourceExhaustedError(absl::StrCat("no room for ", bytes, " bytes"));
  });
  auto seg = pool.Acquire(5, true, true, absl::InfiniteFuture());
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.in_flight_collectives(), 0);
  EXPECT_EQ(pool.staged_bytes(), 0u);
}

TEST(ArenaTest, FindsWholeRangesInsideABufferOnly) {
  auto arena = std::make_shared<Arena>();
  auto seg = ShmSegment::Create(kMiB);
  ASSERT_TRUE(seg.ok());
  std::string name = (*seg)->name();
  char* base;
  {
    ArenaBuffer buffer(arena, std::move(*seg), kMiB);
    base = static_cast<char*>(buffer.data());
    ArenaRef ref;
    ASSERT_TRUE(arena->Find(base + 100, 1000, &ref));
    EXPECT_EQ(ref.offset, 100u);
    EXPECT_FALSE(arena->Find(base + kMiB - 10, 11, &ref));  // runs past its end
    EXPECT_FALSE(arena->Find(base - 1, 1, &ref));
  }
  ArenaRef ref;
  EXPECT_FALSE(arena->Find(base, 1, &ref));  // destroyed
  std::vector<std::string> released;
  arena->TakeReleased(&released);
  EXPECT_EQ(released, std::vector<std::string>{name});
}

TEST(HeapBufferTest, IsAlignedAndZeroed) {
  HeapBuffer b(100);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  const char* p = static_cast<const char*>(b.data());
  EXPECT_TRUE(std::all_of(p, p + 100, [](char c) { return c == 0; }));
}

}  // namespace
}  // namespace collserve::client
