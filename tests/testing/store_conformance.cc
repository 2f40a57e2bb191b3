// The store::Store conformance suite; see store_conformance.h.
#include "tests/testing/store_conformance.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {

void PrintTo(const StoreFactory& factory, std::ostream* os) { *os << factory.name; }

std::string StoreFactoryName(const ::testing::TestParamInfo<StoreFactory>& info) {
  return info.param.name;
}

void StoreConformanceTest::SetUp() {
  store_ = GetParam().make();
  ASSERT_NE(store_, nullptr);
}

void StoreConformanceTest::TearDown() { store_.reset(); }

std::function<bool()> StoreConformanceTest::Parked(int waits) {
  return [this, waits] { return GetParam().parked_waits(*store_) >= waits; };
}

// Files that link this suite without instantiating it are not an error.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(StoreConformanceTest);

namespace {

using ::absl::StatusCode;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// For waits expected to time out: short, so the suite stays fast.
constexpr absl::Duration kShortTimeout = absl::Milliseconds(150);
// For waits expected to succeed: only reached if the store is broken.
constexpr absl::Duration kLongTimeout = absl::Seconds(5);
// Runs `fn` on a thread once `ready` holds (the reader is blocked: the test's
// Parked(n)), or after kLongTimeout if it never does; joins on destruction.
class DelayedWriter {
 public:
  template <typename Fn>
  DelayedWriter(std::function<bool()> ready, Fn fn)
      : thread_([ready = std::move(ready), fn = std::move(fn)]() mutable {
          EXPECT_TRUE(WaitFor(ready, kLongTimeout)) << "the reader never parked in the store";
          fn();
        }) {}
  ~DelayedWriter() { thread_.join(); }

 private:
  std::thread thread_;
};

// ---- Set / Get -----------------------------------------------------------------------

TEST_P(StoreConformanceTest, SetThenGetReturnsTheValue) {
  ASSERT_THAT(store_->Set("k", "v"), IsOk());
  EXPECT_THAT(store_->Get("k", kShortTimeout), IsOkAndHolds("v"));
}

TEST_P(StoreConformanceTest, SetReplacesTheOldValue) {
  ASSERT_THAT(store_->Set("k", "old"), IsOk());
  ASSERT_THAT(store_->Set("k", "new"), IsOk());
  EXPECT_THAT(store_->Get("k", kShortTimeout), IsOkAndHolds("new"));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(1));
}

TEST_P(StoreConformanceTest, EmptyValueRoundTrips) {
  ASSERT_THAT(store_->Set("k", ""), IsOk());
  EXPECT_THAT(store_->Get("k", kShortTimeout), IsOkAndHolds(""));
  EXPECT_THAT(store_->Check({"k"}), IsOkAndHolds(true));
}

TEST_P(StoreConformanceTest, BinaryKeysAndValuesWithNulsRoundTrip) {
  const std::string key("a\0b\xff", 4);
  std::string value;
  for (int i = 0; i < 256; ++i) value.push_back(static_cast<char>(i));
  value += std::string("\0\0\0", 3);
  ASSERT_THAT(store_->Set(key, value), IsOk());
  EXPECT_THAT(store_->Get(key, kShortTimeout), IsOkAndHolds(value));
  // The NUL is part of the key: its prefix is a different key.
  EXPECT_THAT(store_->Check({"a"}), IsOkAndHolds(false));
}

TEST_P(StoreConformanceTest, SetWithEmptyKeyIsInvalidArgument) {
  EXPECT_THAT(store_->Set("", "v"), StatusIs(StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(0));
}

TEST_P(StoreConformanceTest, GetOfMissingKeyTimesOut) {
  const absl::Time start = absl::Now();
  EXPECT_THAT(store_->Get("absent", kShortTimeout), StatusIs(StatusCode::kDeadlineExceeded));
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, kShortTimeout - absl::Milliseconds(5));
  EXPECT_LT(elapsed, kLongTimeout);
}

TEST_P(StoreConformanceTest, GetWithZeroTimeoutChecksOnce) {
  EXPECT_THAT(store_->Get("absent", absl::ZeroDuration()), StatusIs(StatusCode::kDeadlineExceeded));
  ASSERT_THAT(store_->Set("present", "v"), IsOk());
  EXPECT_THAT(store_->Get("present", absl::ZeroDuration()), IsOkAndHolds("v"));
}

TEST_P(StoreConformanceTest, GetWaitsForKeySetByAnotherThread) {
  DelayedWriter writer(Parked(1), [this] { EXPECT_THAT(store_->Set("late", "arrived"), IsOk()); });
  EXPECT_THAT(store_->Get("late", kLongTimeout), IsOkAndHolds("arrived"));
}

TEST_P(StoreConformanceTest, GetOfDeletedKeyTimesOut) {
  ASSERT_THAT(store_->Set("k", "v"), IsOk());
  ASSERT_THAT(store_->DeleteKey("k"), IsOkAndHolds(true));
  EXPECT_THAT(store_->Get("k", kShortTimeout), StatusIs(StatusCode::kDeadlineExceeded));
}

// ---- Add -----------------------------------------------------------------------------

TEST_P(StoreConformanceTest, AddToMissingKeyStartsFromZero) {
  EXPECT_THAT(store_->Add("n", 5), IsOkAndHolds(5));
}

TEST_P(StoreConformanceTest, AddOfZeroCreatesTheCounter) {
  // torch's store-based barrier polls with add(key, 0).
  EXPECT_THAT(store_->Add("n", 0), IsOkAndHolds(0));
  EXPECT_THAT(store_->Get("n", kShortTimeout), IsOkAndHolds("0"));
}

TEST_P(StoreConformanceTest, AddAccumulatesAndStoresAsciiDecimal) {
  ASSERT_THAT(store_->Add("n", 1), IsOkAndHolds(1));
  ASSERT_THAT(store_->Add("n", 2), IsOkAndHolds(3));
  EXPECT_THAT(store_->Get("n", kShortTimeout), IsOkAndHolds("3"));
}

TEST_P(StoreConformanceTest, AddNegativeDeltaGoesBelowZero) {
  ASSERT_THAT(store_->Add("n", 5), IsOkAndHolds(5));
  ASSERT_THAT(store_->Add("n", -2), IsOkAndHolds(3));
  ASSERT_THAT(store_->Add("n", -10), IsOkAndHolds(-7));
  EXPECT_THAT(store_->Get("n", kShortTimeout), IsOkAndHolds("-7"));
}

TEST_P(StoreConformanceTest, AddOnValueSetAsDecimalTextWorks) {
  ASSERT_THAT(store_->Set("n", "41"), IsOk());
  EXPECT_THAT(store_->Add("n", 1), IsOkAndHolds(42));
}

TEST_P(StoreConformanceTest, AddOnNonIntegerValueIsInvalidArgument) {
  ASSERT_THAT(store_->Set("text", "hello"), IsOk());
  EXPECT_THAT(store_->Add("text", 1), StatusIs(StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->Get("text", kShortTimeout), IsOkAndHolds("hello"));
  ASSERT_THAT(store_->Set("empty", ""), IsOk());
  EXPECT_THAT(store_->Add("empty", 1), StatusIs(StatusCode::kInvalidArgument));
}

TEST_P(StoreConformanceTest, AddThatOverflowsIsInvalidArgument) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  ASSERT_THAT(store_->Add("n", max), IsOkAndHolds(max));
  EXPECT_THAT(store_->Add("n", 1), StatusIs(StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->Get("n", kShortTimeout), IsOkAndHolds(absl::StrCat(max)));
  const int64_t min = std::numeric_limits<int64_t>::min();
  ASSERT_THAT(store_->Add("m", min), IsOkAndHolds(min));
  EXPECT_THAT(store_->Add("m", -1), StatusIs(StatusCode::kInvalidArgument));
}

TEST_P(StoreConformanceTest, AddWithEmptyKeyIsInvalidArgument) {
  EXPECT_THAT(store_->Add("", 1), StatusIs(StatusCode::kInvalidArgument));
}

// ---- CompareSet ----------------------------------------------------------------------

TEST_P(StoreConformanceTest, CompareSetOnMissingKeyWithEmptyExpectedStoresDesired) {
  EXPECT_THAT(store_->CompareSet("k", "", "first"), IsOkAndHolds("first"));
  EXPECT_THAT(store_->Get("k", kShortTimeout), IsOkAndHolds("first"));
}

TEST_P(StoreConformanceTest, CompareSetOnMissingKeyWithOtherExpectedReturnsExpected) {
  // torch's documented "lie": the reply is `expected`, and nothing is stored.
  EXPECT_THAT(store_->CompareSet("k", "wrong_old_value", "new_value"),
              IsOkAndHolds("wrong_old_value"));
  EXPECT_THAT(store_->Check({"k"}), IsOkAndHolds(false));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(0));
}

TEST_P(StoreConformanceTest, CompareSetWithMatchingExpectedStoresDesired) {
  ASSERT_THAT(store_->Set("k", "A"), IsOk());
  EXPECT_THAT(store_->CompareSet("k", "A", "B"), IsOkAndHolds("B"));
  EXPECT_THAT(store_->Get("k", kShortTimeout), IsOkAndHolds("B"));
}

TEST_P(StoreConformanceTest, CompareSetWithStaleExpectedReturnsCurrentValue) {
  ASSERT_THAT(store_->Set("k", "B"), IsOk());
  EXPECT_THAT(store_->CompareSet("k", "X", "C"), IsOkAndHolds("B"));
  EXPECT_THAT(store_->Get("k", kShortTimeout), IsOkAndHolds("B"));
}

TEST_P(StoreConformanceTest, CompareSetOnExistingKeyWithEmptyExpectedDoesNotStore) {
  ASSERT_THAT(store_->Set("k", "v"), IsOk());
  EXPECT_THAT(store_->CompareSet("k", "", "other"), IsOkAndHolds("v"));
}

TEST_P(StoreConformanceTest, CompareSetWithEmptyCurrentAndEmptyExpectedStores) {
  ASSERT_THAT(store_->Set("k", ""), IsOk());
  EXPECT_THAT(store_->CompareSet("k", "", "filled"), IsOkAndHolds("filled"));
}

TEST_P(StoreConformanceTest, CompareSetThatStoresWakesWaiters) {
  DelayedWriter writer(
      Parked(1), [this] { EXPECT_THAT(store_->CompareSet("k", "", "won"), IsOkAndHolds("won")); });
  EXPECT_THAT(store_->Get("k", kLongTimeout), IsOkAndHolds("won"));
}

// ---- Check / Wait --------------------------------------------------------------------

TEST_P(StoreConformanceTest, CheckOfEmptyListIsTrue) {
  EXPECT_THAT(store_->Check({}), IsOkAndHolds(true));
}

TEST_P(StoreConformanceTest, CheckIsTrueOnlyWhenEveryKeyExists) {
  ASSERT_THAT(store_->Set("a", "1"), IsOk());
  EXPECT_THAT(store_->Check({"a"}), IsOkAndHolds(true));
  EXPECT_THAT(store_->Check({"a", "b"}), IsOkAndHolds(false));
  ASSERT_THAT(store_->Set("b", "2"), IsOk());
  EXPECT_THAT(store_->Check({"a", "b"}), IsOkAndHolds(true));
}

TEST_P(StoreConformanceTest, WaitOnEmptyListReturnsAtOnce) {
  EXPECT_THAT(store_->Wait({}, kShortTimeout), IsOk());
}

TEST_P(StoreConformanceTest, WaitOnExistingKeysReturnsAtOnce) {
  ASSERT_THAT(store_->Set("a", "1"), IsOk());
  ASSERT_THAT(store_->Set("b", "2"), IsOk());
  EXPECT_THAT(store_->Wait({"a", "b"}, kShortTimeout), IsOk());
  EXPECT_THAT(store_->Wait({"a", "b"}, absl::ZeroDuration()), IsOk());
}

TEST_P(StoreConformanceTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  ASSERT_THAT(store_->Set("present-key", "1"), IsOk());
  const absl::Status status = store_->Wait({"present-key", "absent-key"}, kShortTimeout);
  EXPECT_THAT(status, StatusIs(StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(status.message()), HasSubstr("absent-key"));
  EXPECT_THAT(std::string(status.message()), Not(HasSubstr("present-key")));
}

TEST_P(StoreConformanceTest, WaitIsWokenBySetFromAnotherThread) {
  ASSERT_THAT(store_->Set("a", "1"), IsOk());
  DelayedWriter writer(Parked(1), [this] {
    EXPECT_THAT(store_->Set("b", "2"), IsOk());
    EXPECT_THAT(store_->Set("c", "3"), IsOk());
  });
  EXPECT_THAT(store_->Wait({"a", "b", "c"}, kLongTimeout), IsOk());
}

TEST_P(StoreConformanceTest, WaitIsWokenByAdd) {
  DelayedWriter writer(Parked(1), [this] { EXPECT_THAT(store_->Add("n", 1), IsOkAndHolds(1)); });
  EXPECT_THAT(store_->Wait({"n"}, kLongTimeout), IsOk());
}

TEST_P(StoreConformanceTest, WaitWithEmptyKeyIsInvalidArgument) {
  EXPECT_THAT(store_->Wait({"a", ""}, kShortTimeout), StatusIs(StatusCode::kInvalidArgument));
}

// ---- DeleteKey / NumKeys -------------------------------------------------------------

TEST_P(StoreConformanceTest, DeleteKeyReportsWhetherTheKeyExisted) {
  ASSERT_THAT(store_->Set("k", "v"), IsOk());
  EXPECT_THAT(store_->DeleteKey("k"), IsOkAndHolds(true));
  EXPECT_THAT(store_->Check({"k"}), IsOkAndHolds(false));
  EXPECT_THAT(store_->DeleteKey("k"), IsOkAndHolds(false));
  EXPECT_THAT(store_->DeleteKey("never"), IsOkAndHolds(false));
}

TEST_P(StoreConformanceTest, DeletedCounterRestartsFromZero) {
  ASSERT_THAT(store_->Add("n", 7), IsOkAndHolds(7));
  ASSERT_THAT(store_->DeleteKey("n"), IsOkAndHolds(true));
  EXPECT_THAT(store_->Add("n", 1), IsOkAndHolds(1));
}

TEST_P(StoreConformanceTest, NumKeysCountsAllKeysOrOnePrefix) {
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(0));
  ASSERT_THAT(store_->Set("job1/a", "1"), IsOk());
  ASSERT_THAT(store_->Set("job1/b", "1"), IsOk());
  ASSERT_THAT(store_->Set("job10/a", "1"), IsOk());
  ASSERT_THAT(store_->Set("job2/a", "1"), IsOk());
  ASSERT_THAT(store_->Set("job", "1"), IsOk());
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(5));
  EXPECT_THAT(store_->NumKeys("job1/"), IsOkAndHolds(2));
  EXPECT_THAT(store_->NumKeys("job1"), IsOkAndHolds(3));
  EXPECT_THAT(store_->NumKeys("job"), IsOkAndHolds(5));
  EXPECT_THAT(store_->NumKeys("job3/"), IsOkAndHolds(0));
  EXPECT_THAT(store_->NumKeys("zzz"), IsOkAndHolds(0));
  ASSERT_THAT(store_->DeleteKey("job1/a"), IsOkAndHolds(true));
  EXPECT_THAT(store_->NumKeys("job1/"), IsOkAndHolds(1));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(4));
}

// ---- MultiGet / MultiSet -------------------------------------------------------------

TEST_P(StoreConformanceTest, MultiGetReturnsValuesInRequestOrder) {
  ASSERT_THAT(store_->Set("a", "1"), IsOk());
  ASSERT_THAT(store_->Set("b", "2"), IsOk());
  ASSERT_THAT(store_->Set("c", "3"), IsOk());
  EXPECT_THAT(store_->MultiGet({"c", "a", "b", "a"}, kShortTimeout),
              IsOkAndHolds(ElementsAre("3", "1", "2", "1")));
}

TEST_P(StoreConformanceTest, MultiGetOfEmptyListIsEmpty) {
  EXPECT_THAT(store_->MultiGet({}, kShortTimeout), IsOkAndHolds(IsEmpty()));
}

TEST_P(StoreConformanceTest, MultiGetTimesOutWhenAnyKeyIsMissing) {
  ASSERT_THAT(store_->Set("a", "1"), IsOk());
  EXPECT_THAT(store_->MultiGet({"a", "missing"}, kShortTimeout),
              StatusIs(StatusCode::kDeadlineExceeded));
}

TEST_P(StoreConformanceTest, MultiGetWaitsForKeysSetByAnotherThread) {
  ASSERT_THAT(store_->Set("a", "1"), IsOk());
  DelayedWriter writer(Parked(1), [this] { EXPECT_THAT(store_->Set("b", "2"), IsOk()); });
  EXPECT_THAT(store_->MultiGet({"a", "b"}, kLongTimeout), IsOkAndHolds(ElementsAre("1", "2")));
}

TEST_P(StoreConformanceTest, MultiSetSetsEveryPair) {
  ASSERT_THAT(store_->Set("b", "old"), IsOk());
  ASSERT_THAT(store_->MultiSet({"a", "b", "c"}, {"1", "2", ""}), IsOk());
  EXPECT_THAT(store_->MultiGet({"a", "b", "c"}, kShortTimeout),
              IsOkAndHolds(ElementsAre("1", "2", "")));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(3));
}

TEST_P(StoreConformanceTest, MultiSetWithSizeMismatchIsInvalidArgumentAndStoresNothing) {
  EXPECT_THAT(store_->MultiSet({"a", "b"}, {"1"}), StatusIs(StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(0));
}

TEST_P(StoreConformanceTest, MultiSetWithEmptyKeyIsInvalidArgumentAndStoresNothing) {
  EXPECT_THAT(store_->MultiSet({"a", ""}, {"1", "2"}), StatusIs(StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->NumKeys(""), IsOkAndHolds(0));
}

TEST_P(StoreConformanceTest, MultiSetOfNothingSucceeds) {
  EXPECT_THAT(store_->MultiSet({}, {}), IsOk());
}

TEST_P(StoreConformanceTest, MultiSetWakesAWaiterOnAllItsKeys) {
  DelayedWriter writer(Parked(1), [this] { EXPECT_THAT(store_->MultiSet({"x", "y"}, {"1", "2"}), IsOk()); });
  EXPECT_THAT(store_->Wait({"x", "y"}, kLongTimeout), IsOk());
}

// ---- Append --------------------------------------------------------------------------

TEST_P(StoreConformanceTest, AppendCreatesThenAppends) {
  ASSERT_THAT(store_->Append("log", "ab"), IsOk());
  EXPECT_THAT(store_->Get("log", kShortTimeout), IsOkAndHolds("ab"));
  ASSERT_THAT(store_->Append("log", std::string("\0c", 2)), IsOk());
  ASSERT_THAT(store_->Append("log", ""), IsOk());
  EXPECT_THAT(store_->Get("log", kShortTimeout), IsOkAndHolds(std::string("ab\0c", 4)));
}

TEST_P(StoreConformanceTest, AppendWakesWaiters) {
  DelayedWriter writer(Parked(1), [this] { EXPECT_THAT(store_->Append("log", "x"), IsOk()); });
  EXPECT_THAT(store_->Get("log", kLongTimeout), IsOkAndHolds("x"));
}

// ---- concurrency ---------------------------------------------------------------------

constexpr int kThreads = 8;

TEST_P(StoreConformanceTest, ConcurrentAddsOnOneCounterAreNotLost) {
  constexpr int kAddsPerThread = 200;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kAddsPerThread; ++i) {
        if (!store_->Add("counter", 1).ok()) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_THAT(store_->Get("counter", kShortTimeout),
              IsOkAndHolds(absl::StrCat(kThreads * kAddsPerThread)));
}

TEST_P(StoreConformanceTest, ConcurrentRanksRendezvousThroughSetAndWait) {
  // Each "rank" publishes its key for the round, then waits for everyone's (a store-based
  // barrier), then reads a peer's value.
  constexpr int kRounds = 10;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kThreads; ++rank) {
    threads.emplace_back([this, rank] {
      for (int round = 0; round < kRounds; ++round) {
        std::vector<std::string> keys;
        for (int peer = 0; peer < kThreads; ++peer) {
          keys.push_back(absl::StrCat("round/", round, "/rank/", peer));
        }
        ASSERT_THAT(store_->Set(keys[rank], absl::StrCat(rank * 100 + round)), IsOk());
        ASSERT_THAT(store_->Wait(keys, kLongTimeout), IsOk());
        const int peer = (rank + 1) % kThreads;
        EXPECT_THAT(store_->Get(keys[peer], kLongTimeout),
                    IsOkAndHolds(absl::StrCat(peer * 100 + round)));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(store_->NumKeys("round/"), IsOkAndHolds(kThreads * kRounds));
}

TEST_P(StoreConformanceTest, ConcurrentCompareSetElectsExactlyOneWinner) {
  std::vector<std::thread> threads;
  std::vector<std::string> answers(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &answers] {
      absl::StatusOr<std::string> answer = store_->CompareSet("leader", "", absl::StrCat(t));
      ASSERT_THAT(answer, IsOk());
      answers[t] = *answer;
    });
  }
  for (std::thread& thread : threads) thread.join();
  absl::StatusOr<std::string> leader = store_->Get("leader", kShortTimeout);
  ASSERT_THAT(leader, IsOk());
  for (const std::string& answer : answers) EXPECT_EQ(answer, *leader);
}

TEST_P(StoreConformanceTest, ManyWaitersOnOneKeyAreAllWoken) {
  std::vector<std::thread> threads;
  std::atomic<int> woken{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      if (store_->Get("go", kLongTimeout).ok()) woken.fetch_add(1);
    });
  }
  ASSERT_TRUE(WaitFor(Parked(kThreads), kLongTimeout));
  ASSERT_THAT(store_->Set("go", "1"), IsOk());
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(woken.load(), kThreads);
}

}  // namespace
}  // namespace collserve::testing
