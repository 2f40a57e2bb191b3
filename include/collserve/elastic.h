// Re-forming a group in place after it lost members, without restarting the process: the
// C++ form of the Python SDK's collserve.reconfigure(), should_reconfigure() and
// COLLSERVE_ELASTIC_JOIN=1 (python/collserve/distributed_c10d.py). Both use the same
// protocol and the same keys in the job's store, so C++ and Python ranks of one job
// re-form together.
//
// The protocol (a quorum in the spirit of torchft's Manager): the members of generation g
// of group G append their rank to the store key
// "collserve/reconfigure/<run_id>/<G>/<g+1>/members", where ranks waiting to join (a
// restarted rank) also append an id "j<RANK>.<pid>.<n>". The list is closed by
// compare_set of ".../<g+1>/closed" (so every rank reads the same list) once every member
// of generation g is on it, else once the join window passed with at least
// min_world_size on it. The closed list, current members by rank and then joiners in the
// order they came, forms the next generation of group G at the coordinator (the same
// name: InitOptions::generation is the old group's ProcessGroup::generation() + 1, which
// the members also write to ".../<g+1>/registry" for the joiners) through the sidecar,
// like InitProcessGroup. Generation 1 is the group InitProcessGroup formed. (g counts
// re-formations of this launch; the coordinator's generation of the name may be higher
// when the name was formed before.)
//
// Which collectives every survivor completed: a partition can complete a collective on
// some members and fail it on others (one host finished its data step, another's link
// broke first). Before appending itself, each member writes its
// ProcessGroup::last_completed_seq() to ".../<g+1>/completed/<old rank>"; every member of
// the closed list reads those of the list's old members, and the smallest is
// ElasticGroup::last_common_seq: the collectives 0..last_common_seq of the old generation
// completed on every survivor, so the survivors redo the step from there (Python:
// reconfigure()'s .last_common_seq). Exactly-once agreement on a collective's outcome is
// impossible in general (two generals); this tells each survivor what the others saw.
//
// Ranks known to be gone are not waited for: the list also closes once every member of
// generation g is on it or has left generation g at the coordinator (GroupMembership: its
// session ended, it exited or died, or its host was lost), so a re-formation after a rank
// died takes about the time the survivors need to notice, not the join window. A rank that
// is alive but does not come (hung, or cut off without its host being lost yet) is still
// waited for up to the join window.
//
// Thread safety: each function may be called from any thread, but not concurrently with
// other calls on the group it is given.
#ifndef COLLSERVE_ELASTIC_H_
#define COLLSERVE_ELASTIC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collserve/client.h"

namespace collserve::client {

struct ReconfigureOptions {
  // How long the members wait for each other (and for joiners) before closing the list
  // without the ones that did not come. Seconds as in the Python SDK (default 5 s).
  absl::Duration join_window = absl::Seconds(5);
  // Fewest ranks the new generation may have; fewer is an error.
  int min_world_size = 1;
  // Bound on the whole call: agreeing, admission of a late rank, and forming the new
  // group; 0 = the InitOptions' init_timeout.
  absl::Duration timeout = absl::ZeroDuration();
  // Separates the member lists of different launches of one job in a durable store.
  // Empty = the environment's COLLSERVE_RUN_ID (set by `collserve launch`), else "".
  std::string run_id;
};

// A group and the generation it is of (1: the one InitProcessGroup formed).
struct ElasticGroup {
  std::unique_ptr<ProcessGroup> group;
  int64_t generation = 1;
  // Set by Reconfigure: the last collective seq of the previous generation that every
  // member of the new one that was in it completed (the smallest of their
  // ProcessGroup::last_completed_seq()); -1 when none completed any, or for a joiner
  // (InitProcessGroup, JoinRunningGroup, or a member admitted late as a joiner).
  int64_t last_common_seq = -1;
};

// The coordinator's view of a group's membership (Registry.Describe), for closing a member
// list without waiting out the join window for ranks that are gone.
class GroupMembership {
 public:
  // A client of the coordinator at `coordinator_address` for the job options.job, with
  // options.tls and options.token (connect_timeout bounds the connection; every call has its
  // own 5 s deadline). Errors: INVALID_ARGUMENT (empty address, bad TLS files), UNAVAILABLE
  // (not reachable within connect_timeout).
  static absl::StatusOr<std::unique_ptr<GroupMembership>> Connect(const std::string& coordinator_address,
                                                                  const StoreClientOptions& options);
  virtual ~GroupMembership() = default;
  // The ranks in [0, world_size) that have left generation `generation` of `group` (their
  // session ended, or their host was lost), ascending. Empty when the coordinator is at
  // another generation of the name or has none (nothing is known of `generation` then).
  // Errors: PERMISSION_DENIED (the token is not the job's), UNAVAILABLE or
  // DEADLINE_EXCEEDED (the coordinator did not answer within 5 s). Blocks; thread-safe.
  virtual absl::StatusOr<std::vector<int>> LeftRanks(const std::string& group, int64_t generation,
                                                     int world_size) = 0;
};

// Re-forms `current` (generation `current.generation` of group `init.group`, which lost a
// member: a collective failed with UNAVAILABLE or DEADLINE_EXCEEDED) among the members
// that call Reconfigure within the join window, plus waiting joiners. Every member calls
// it. Destroys `current.group` (its session ends; the sidecar drops its executor and
// backend context) before forming the next generation of the same name, with
// this process as rank: its position in the closed list (ranks renumbered: members in the
// order of their old ranks, then joiners). A member that calls after the list closed (it
// was taken for lost, e.g. cut off while the others re-formed) waits to be admitted to
// the following generation as a joiner. `init` is what the current group was formed with
// (rank and world_size are ignored). Returns the new group and its generation.
// Errors: FAILED_PRECONDITION (no coordinator address in `init`: the protocol needs the
// store), ABORTED (fewer than options.min_world_size ranks joined; names them),
// DEADLINE_EXCEEDED (no quorum, no admission, or the new group did not form within the
// timeout), DATA_LOSS (a member's completed seq in the store is not a number), and
// InitProcessGroup's errors.
absl::StatusOr<ElasticGroup> Reconfigure(ElasticGroup current, const InitOptions& init,
                                         const ReconfigureOptions& options = {});

// Whether ranks wait to join `current` (restarted ranks, JoinRunningGroup): rank 0 looks
// in the store and broadcasts the answer, so every rank gets the same one. A collective:
// every rank calls it at the same point (e.g. each epoch's start), and all call
// Reconfigure when it is true. Errors: the broadcast's, or the store's on rank 0.
absl::StatusOr<bool> ShouldReconfigure(const ElasticGroup& current, const InitOptions& init,
                                       const ReconfigureOptions& options = {});

// For a process started to join a running job (the Python SDK's COLLSERVE_ELASTIC_JOIN=1,
// e.g. a rank the launcher restarted): waits until the running members admit it (they
// call Reconfigure when ShouldReconfigure says so), moving on to the next generation if
// it came too late for one, then forms the group it was admitted to. `init.rank` only
// names the joiner in its id. Errors: FAILED_PRECONDITION (no coordinator address),
// DEADLINE_EXCEEDED (not admitted within the timeout), InitProcessGroup's errors.
absl::StatusOr<ElasticGroup> JoinRunningGroup(const InitOptions& init, const ReconfigureOptions& options = {});

}  // namespace collserve::client

#endif  // COLLSERVE_ELASTIC_H_
