// Abseil's Mutex deadlock detection, chosen by COLLSERVE_MUTEX_DEADLOCK_DETECTION.
//
// Debian's libabsl is built without NDEBUG, so in every process that links it each
// absl::Mutex Lock/Unlock also maintains Abseil's lock-ordering graph under one global
// spinlock (absl/synchronization/mutex.cc, DeadlockCheck), and a cycle in the order seen so
// far, a *potential* deadlock, aborts the process (OnDeadlockCycle::kAbort). That is about
// 30 ns more per uncontended lock on this project's VMs (45 against 14 ns, a lock/unlock
// loop) and a process-wide point of contention; and in a daemon shared by every job of a
// host, an abort on a potential deadlock is every job's outage. Abseil's own release builds
// (NDEBUG) do no such tracking. So collserve's processes follow Abseil's release default:
// the daemons (sidecar, coordinator) and the client library (at its first InitProcessGroup)
// switch it off, unless the variable asks for it; the tests ask for "abort" (tests/CMakeLists.txt),
// so that a lock-order inversion in any process they start still fails them.
//
//   COLLSERVE_MUTEX_DEADLOCK_DETECTION=ignore (default) | report | abort
//
// "report" logs a cycle once and goes on; "abort" dies on it (Abseil's debug default).
// With an Abseil built with NDEBUG the variable changes nothing (there is no detection).
//
// Thread safety: ApplyMutexDeadlockDetectionMode() is thread-safe; it changes the mode once
// per process (later calls return the first call's result), before or while other threads
// run: switching detection off under held locks is safe (Abseil then skips their release
// bookkeeping), and the process starts in "abort", so "abort" changes nothing.
#ifndef COLLSERVE_COMMON_MUTEX_MODE_H_
#define COLLSERVE_COMMON_MUTEX_MODE_H_

#include "absl/status/status.h"

namespace collserve {

inline constexpr char kMutexDeadlockDetectionEnv[] = "COLLSERVE_MUTEX_DEADLOCK_DETECTION";

// Applies COLLSERVE_MUTEX_DEADLOCK_DETECTION (see above), once per process. INVALID_ARGUMENT
// naming the variable and its values when it holds anything else (the mode is then left as
// Abseil's default).
absl::Status ApplyMutexDeadlockDetectionMode();

}  // namespace collserve

#endif  // COLLSERVE_COMMON_MUTEX_MODE_H_
