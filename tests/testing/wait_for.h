// WaitFor: the one way tests wait for something to happen (docs/testing.md). A test never
// sleeps to order events; it waits, with a deadline, for a condition it can observe: a
// port file, a line of output, a counter, a test hook such as TEST_PendingJoins().
#ifndef COLLSERVE_TESTS_TESTING_WAIT_FOR_H_
#define COLLSERVE_TESTS_TESTING_WAIT_FOR_H_

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace collserve::testing {

// Calls `condition` (any callable returning something testable as bool) until it holds or
// `timeout` has passed, pausing `poll` between calls; checks once more at the deadline.
// Returns whether it held. Blocks the calling thread for at most timeout + poll + the time of
// one call; thread-safe if `condition` is.
template <typename Condition>
bool WaitFor(Condition&& condition, absl::Duration timeout, absl::Duration poll = absl::Milliseconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(std::min(poll, deadline - absl::Now() + absl::Milliseconds(1)));
  }
}

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_WAIT_FOR_H_
