// A group's control plane toward the coordinator, its decisions as pure functions (no lock,
// no I/O, no clock), as engine/stages.h holds the data plane's: tests/engine/control_test.cc
// tests each on its own, and Group (engine/group_control.cc) applies them under its lock.
//
// The watch: once its generation formed, each host's group holds one long-poll of the
// generation at the coordinator (CoordinatorLink::WatchGroup; each answer renews this host's
// lease on it) and learns from its answers which ranks of other hosts left, which hosts were
// lost (their sidecars stopped renewing their leases) and when the generation is over.
#ifndef COLLSERVE_ENGINE_CONTROL_H_
#define COLLSERVE_ENGINE_CONTROL_H_

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/topology.h"
#include "engine/types.h"

namespace collserve::engine {

// What one answer of the watch means for the group.
struct WatchOutcome {
  // What to do about the next watch: none (the generation is over, or the coordinator has
  // no watches), now, or in a second (the coordinator was unreachable, or answered for
  // another generation).
  enum class Next { kNone, kNow, kLater };
  Next next = Next::kNone;
  // The next watch carries the generation's membership, for a coordinator that restarted
  // and forgot it to adopt (CoordinatorLink::WatchParams::members).
  bool with_members = false;
  // Non-OK: the generation is over and the group fails with it (UNAVAILABLE naming why:
  // superseded, deleted, ended, or the lost ranks and their host's reason).
  absl::Status failure;
  // Host indexes whose backend connections this host shuts down, so that a collective in
  // flight fails now instead of at its timeout (never this host's own index).
  std::vector<int> shut_hosts;
  // Remote ranks that left (not lost with their host), each with the message their
  // point-to-point operations fail with; only ranks not in the caller's `remote_departed`.
  std::vector<std::pair<int, std::string>> left;
  // How many of the generation's departures have been taken into account (the next watch's
  // `known`).
  int known = 0;
};

// The outcome of a watch answer `events` for group `group` of `topology` (this host's view
// of the formed generation). `known`: departures already taken into account; `with_members`:
// the watch carried the membership; `remote_departed`: remote ranks already reported as left.
// Departures with a rank outside the generation are ignored (the coordinator's bytes are
// checked like any peer's). Pure.
WatchOutcome DecideWatch(const absl::StatusOr<GroupEvents>& events, const Topology& topology,
                         const std::string& group, int known, bool with_members,
                         const std::set<int>& remote_departed);

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_CONTROL_H_
