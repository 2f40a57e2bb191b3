// One conformance suite for every store::Store implementation (Ray's StoreClientTestBase,
// Gloo's per-transport lists). It uses only the synchronous methods, so it also runs against
// a store reached over gRPC.
//
// Usage, in the implementation's test file:
//   INSTANTIATE_TEST_SUITE_P(Memory, StoreConformanceTest,
//                            ::testing::Values(StoreFactory{"memory", [] { ... }}),
//                            StoreFactoryName);
// Each test calls `make` once for a fresh, empty store. Tests take well under 2 s each; the
// ones that expect a timeout wait 100-300 ms.
#ifndef COLLSERVE_TESTS_TESTING_STORE_CONFORMANCE_H_
#define COLLSERVE_TESTS_TESTING_STORE_CONFORMANCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/store.h"

namespace collserve::testing {

// Small stand-ins for absl's status matchers, which Debian's absl does not ship. Each takes
// an absl::Status or an absl::StatusOr<T>:
//   EXPECT_THAT(store->Get("k", t), StatusIs(absl::StatusCode::kDeadlineExceeded));
//   EXPECT_THAT(store->Add("n", 1), IsOkAndHolds(1));
namespace internal_status {
inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}
}  // namespace internal_status

MATCHER(IsOk, negation ? "is not OK" : "is OK") {
  const absl::Status& status = ::collserve::testing::internal_status::GetStatus(arg);
  *result_listener << "whose status is " << status;
  return status.ok();
}

MATCHER_P(StatusIs, code,
          ::absl::StrCat(negation ? "does not have" : "has", " status code ",
                         ::absl::StatusCodeToString(code))) {
  const absl::Status& status = ::collserve::testing::internal_status::GetStatus(arg);
  *result_listener << "whose status is " << status;
  return status.code() == code;
}

// `arg` is an OK StatusOr whose value matches `matcher` (a value or a matcher).
MATCHER_P(IsOkAndHolds, matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "whose status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(matcher, *arg, result_listener);
}

struct StoreFactory {
  // Test-name suffix: letters, digits and '_' only.
  std::string name;
  // Returns a new, empty store; it is destroyed at the end of the test.
  std::function<std::unique_ptr<store::Store>()> make;
  // The waits (Get, Wait) parked in `store` now, so that a test writes only once its readers
  // wait (WaitFor, never a sleep). Default: Store::GetStats().pending_waits, which the
  // in-memory and etcd stores report; a store reached over gRPC reads its server's.
  std::function<int64_t(store::Store&)> parked_waits = [](store::Store& s) { return s.GetStats().pending_waits; };
};

// Prints the name only (gtest and ctest show it in test listings).
void PrintTo(const StoreFactory& factory, std::ostream* os);

// For INSTANTIATE_TEST_SUITE_P's name generator argument.
std::string StoreFactoryName(const ::testing::TestParamInfo<StoreFactory>& info);

class StoreConformanceTest : public ::testing::TestWithParam<StoreFactory> {
 protected:
  void SetUp() override;
  void TearDown() override;
  // True once at least `waits` waits are parked in store_ (StoreFactory::parked_waits).
  std::function<bool()> Parked(int waits);

  std::unique_ptr<store::Store> store_;
};

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_STORE_CONFORMANCE_H_
