// What the engine needs from the process it runs in, as interfaces: the client sessions it
// answers (Session), the coordinator it rendezvouses through (CoordinatorLink) and where
// its metrics go (EngineObserver). The sidecar implements them over gRPC and prometheus
// (server/sidecar/); tests implement them in memory (tests/engine/).
#ifndef COLLSERVE_ENGINE_INTERFACES_H_
#define COLLSERVE_ENGINE_INTERFACES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/rendezvous_store.h"
#include "engine/types.h"

namespace collserve::engine {

// One rank's session: the engine's way back to the client. Thread-safe; no call blocks
// (implementations queue). After the session ended (Close, or the client went away) every
// call is a no-op.
class Session {
 public:
  virtual ~Session() = default;
  // The group is ready: sent once, before any completion.
  virtual void OnAttached(const AttachedInfo& info) = 0;
  // One request's answer; completions of one session are queued in the order given. An
  // inline result's bytes stay counted in the inline budgets while the session holds
  // `completion.inline_charge`: keep it until the answer is written to the client (a client
  // that reads nothing then holds its budget), or drop it once the bytes are copied out.
  virtual void OnCompletion(Completion completion) = 0;
  // Several answers at once, in order, as OnCompletion one by one (which the default does);
  // a session may send them together (the sidecar's ops channel: one system call).
  virtual void OnCompletions(std::vector<Completion> completions) {
    for (Completion& c : completions) OnCompletion(std::move(c));
  }
  // Ends the session with `status` once queued messages are out. Idempotent.
  virtual void Close(const absl::Status& status) = 0;
  // Something happened to the group that the rank may need to hear without a request of its
  // own in flight (collserve.v1.GroupEvent): `left_rank` >= 0: that rank left; else the
  // group failed. `why` says what. Default: nothing (the rank learns it at its next request).
  virtual void OnGroupEvent(int left_rank, const absl::Status& why) {}
};

// The coordinator as the engine sees it. Thread-safe.
class CoordinatorLink {
 public:
  virtual ~CoordinatorLink() = default;
  struct JoinParams {
    std::string job;
    std::string group;
    int world_size = 0;
    int rank = 0;
    absl::Duration timeout;  // the rendezvous deadline (the group's init timeout)
    std::string credential;  // the joining rank's (AttachRequest::credential)
    int64_t generation = 0;  // AttachRequest::generation (0 = the one forming, or the next)
    // The group's backend between hosts, resolved ("gloo", "mpi", ...): Member.backend, which
    // the coordinator checks is the same for every rank.
    std::string backend;
  };
  // Starts the rendezvous of local rank `params.rank` at the coordinator; `done` runs once,
  // on any thread, with the membership of the formed generation or the error
  // (DEADLINE_EXCEEDED naming the missing ranks, UNAVAILABLE, ...). Returns a function
  // that withdraws the join (the coordinator then drops the rank from the forming group;
  // `done` still runs, with CANCELLED); calling it after `done` is harmless.
  virtual std::function<void()> Join(const JoinParams& params,
                                     std::function<void(absl::StatusOr<Membership>)> done) = 0;
  // Tells the coordinator that `rank` left generation `generation` of `group` (0 = the
  // current one; fire and forget; never blocks), with `credential`, a credential one of the
  // group's local ranks attached with.
  virtual void Leave(const std::string& job, const std::string& group, int rank, int64_t generation,
                     const std::string& credential) = 0;
  // A store in `job`'s namespace for the backends' rendezvous (addresses, unique ids).
  // Never null: an unreachable coordinator gives a store whose calls fail.
  // Its calls carry `credential` (as Leave's).
  virtual std::unique_ptr<backends::RendezvousStore> RendezvousStoreFor(const std::string& job,
                                                                        const std::string& credential) = 0;
  // Publishes one group's ledger on this host (fire and forget: never blocks, failures are
  // dropped; the next report replaces it). Default: nowhere.
  virtual void ReportProgress(const GroupProgress& progress, const std::string& credential) {}
  // Watches generation `generation` of `group` at the coordinator, as a member host, and
  // renews this host's lease on it (Registry.WatchGroup): `done` runs once, on any thread
  // (possibly inline: call without locks `done` takes), with every departure of the
  // generation once there are more than `known`, or with the same list after about `wait`;
  // or with NOT_FOUND (the coordinator does not know the generation: it ended, or the
  // coordinator restarted), UNAVAILABLE / DEADLINE_EXCEEDED (unreachable), CANCELLED (the
  // returned function was called). Default: UNIMPLEMENTED, inline (no watch, no lease).
  struct WatchParams {
    std::string job;
    std::string group;
    int64_t generation = 0;
    int known = 0;
    absl::Duration wait;
    std::string credential;
    // The generation's membership as this host knows it (every rank), so that a coordinator
    // that restarted after it formed can adopt it. Empty unless the last watch was answered
    // NOT_FOUND: a host re-watches about every second, and sending every rank each time
    // would cost the coordinator O(hosts x world_size) a second.
    std::vector<Member> members;
  };
  virtual std::function<void()> WatchGroup(const WatchParams& params,
                                           std::function<void(absl::StatusOr<GroupEvents>)> done) {
    (void)params;
    done(absl::UnimplementedError("no watch"));
    return [] {};
  }
  // The coordinator's diagnosis of `group` from every host's ledger (one line naming the
  // oldest incomplete collective, who has and has not called it, and any disagreement),
  // within `timeout`. For error messages; blocks. Default: UNIMPLEMENTED.
  virtual absl::StatusOr<std::string> Diagnose(const std::string& job, const std::string& group,
                                               const std::string& credential, absl::Duration timeout) {
    return absl::UnimplementedError("no diagnosis");
  }
};

// How tensor bytes reached the engine (collserve_tensor_bytes_total's path label).
enum class BytePath { kArena, kStaged, kInline };

// Where the engine reports what it did. Thread-safe; calls must not block (they are made
// on the data path, some with a group's lock held). Every method has a no-op default.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // One local rank's request completed with `status` (op: a CollectiveOp value, unchecked),
  // `latency` after the sidecar received it.
  // `bytes`: the larger of the rank's input and output; `algorithm`: how it ran (a string
  // literal of the engine's, "" when it failed or did not say).
  virtual void OnCompleted(CollectiveOp op, const absl::Status& status, absl::Duration latency, uint64_t bytes,
                           const char* algorithm) {}
  // The number of groups on this host changed by `delta` (+1 created, -1 dropped).
  virtual void OnGroups(int delta) {}
  // Group `group` of job `job` has no generation left on this host (its last ranks left or
  // it was dropped): what the observer keeps per group (OnArrivalSkew's and OnStraggler's
  // series) can go. A later group of the same name starts afresh. Any thread, no lock held.
  virtual void OnGroupEnded(const std::string& job, const std::string& group) {}
  // A local rank registered a shared-memory segment of `bytes` (a staging segment or a
  // shared buffer, now mapped by this process). A training loop registers none once its
  // first steps have made the segments its steps reuse. Any thread, group lock held.
  virtual void OnSegmentRegistered(uint64_t bytes) {}
  // `bytes` of a local rank's tensors (inputs and outputs) entered a collective via `path`.
  virtual void OnTensorBytes(BytePath path, uint64_t bytes) {}
  // A group exchanged its ranks' arguments with its other hosts (one round between hosts,
  // before a collective's data step; collectives whose arguments rode with an earlier
  // exchange have none). Called on the group's executor thread.
  virtual void OnArgumentExchange() {}
  // A collective's arrival skew: its last rank's arrival minus its first's, over every rank
  // of the group. Reported by one host per group (the host of the group's rank 0), so that
  // each collective counts once. `job`, `group`: the group's job and name. Executor thread.
  virtual void OnArrivalSkew(const std::string& job, const std::string& group, absl::Duration skew) {}
  // The backend between hosts (Gloo, NCCL) failed a collective of a group on this host;
  // `peer_host` is the other host it blames (the only other host of the group, or the one
  // whose address the backend's error names), or "unknown". Executor thread.
  virtual void OnBackendError(const std::string& peer_host) {}
  // A local rank's collective completed successfully: `bytes` is its size in nccl-tests'
  // terms (the larger of its input and output, bytes), `bus_bytes` that size times
  // nccl-tests' bus bandwidth factor for `op` over the group's world size (all_reduce
  // 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather, scatter (n-1)/n; broadcast,
  // reduce 1; see nccl-tests' doc/PERFORMANCE.md). Divided by the collective's duration they
  // give its algbw and busbw. Executor thread, group lock held.
  virtual void OnCollectiveBytes(CollectiveOp op, uint64_t bytes, double bus_bytes) {}
  // A collective's last rank is on this host and called it at least the straggler
  // threshold (EngineOptions::straggler_threshold) after the first rank, in group `group` of
  // job `job`. Executor thread.
  virtual void OnStraggler(const std::string& job, const std::string& group) {}
  // The flight recorder of group `group` of `job` (generation `generation`; `records` oldest
  // first) because of `reason` (a collective slower than the log threshold, or one that
  // failed the group). Rare: at most once per slow or failing collective. Called with the
  // group's lock held.
  virtual void OnFlightRecorderDump(const std::string& job, const std::string& group, int64_t generation,
                                    const std::string& reason, const std::vector<FlightRecord>& records) {}
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_INTERFACES_H_
