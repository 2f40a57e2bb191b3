// The data plane of a group: every collective runs through the same named stages on its
// group's executor thread (engine/executor.cc), one collective at a time in seq order:
//
//   queued    every local rank has submitted it; it waits for the executor (the group's
//             previous collective) — from the last local rank's submission to its start;
//   gather    the executor takes the next collective of every local rank (GatherVerdict:
//             who is missing at the deadline);
//   agree     every rank's arguments from every host (one exchange between the hosts, or
//             prefetched by an earlier one), then what must hold before any byte moves:
//             Disagreement (collective_args.h) and CheckArrivals here;
//   plan      how the data step runs (ChooseDataPath) and, on one host, who reads a peer's
//             result instead of getting a copy (Group::PlanPeerReads);
//   execute   the data step: local reductions and copies on the host's data-path pool
//             (backends::ThreadPool, scheduled between jobs by class and fair share), the
//             backend between hosts (Hierarchical), or the GPU (device_step.cc);
//   complete  each rank answered (PlanCompletion: a peer-read result's owner waits for its
//             readers; HoldRecordAnswers: the answers of records checked back to back go
//             together), the ledger and the flight recorder written.
//
// This file holds each stage's decisions as pure functions (no lock, no I/O, no clock):
// tests/engine/stages_test.cc tests each on its own. StageTimes and JobStageTable measure
// the time collectives spend in each stage, per job, for the sidecar's metrics
// (collserve_job_stage_seconds_total).
#ifndef COLLSERVE_ENGINE_STAGES_H_
#define COLLSERVE_ENGINE_STAGES_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/collective_args.h"
#include "engine/submission.h"
#include "engine/types.h"

namespace collserve::engine {

// The stages a collective's time is counted in (gather and plan take no measurable time:
// theirs is counted in queued and execute).
enum class Stage { kQueued = 0, kAgree = 1, kExecute = 2, kComplete = 3 };
inline constexpr int kNumStages = 4;
// "queued", "agree", "execute", "complete" (the metrics' stage label).
const char* StageName(Stage stage);

// Seconds one collective spent in each stage, indexed by Stage.
using StageTimes = std::array<absl::Duration, kNumStages>;

// A queued request's arguments as the exchange carries them, with its arrival time.
RankArgs ArgsOfSubmission(int rank, const Submission& sub);

// gather: what to do once the executor stops waiting for the local ranks' next collective.
struct GatherVerdict {
  // Non-OK: the group fails with it (DEADLINE_EXCEEDED: local ranks did not call a
  // collective that others called, within its deadline; the message names both lists).
  absl::Status error;
  // Local ranks that take part absent (a monitored_barrier goes on without its missing
  // ranks, so that every host learns who is missing).
  std::vector<int> absent;
};

// `fronts`: each local rank's first queued collective, by local rank (null: it has none).
// With every rank's present: run it, nobody absent. Otherwise (called at the earliest
// deadline of those queued): a monitored_barrier runs with the missing ranks absent; any
// other op is an error "<op> #<seq> of group "<group>" timed out on host <host> after
// <its timeout>: local ranks [..] did not call it (local ranks [..] did)". `fronts` must
// hold at least one non-null entry. Pure.
GatherVerdict DecideGather(int64_t seq, const std::string& group, const std::string& host_id,
                           const std::map<int, const Submission*>& fronts);

// agree: what the ranks' arrivals say once their arguments agree. kRun: every rank came.
// kRanksLeft: ranks that left the group (their host reported them absent): the collective
// fails UNAVAILABLE naming them, nothing moved and the group stays usable (point-to-point
// goes on). kBarrierMissed: a monitored_barrier's missing ranks (the first only unless
// wait_all_ranks): DEADLINE_EXCEEDED naming them and the barrier's timeout; the group fails.
struct Agreement {
  enum class Kind { kRun, kRanksLeft, kBarrierMissed };
  Kind kind = Kind::kRun;
  absl::Status error;  // OK with kRun
};

// `args`: this host's first local rank's request (op, timeout_ms, wait_all_ranks); `all`:
// every rank's exchanged arguments (RankArgs::arrived = 0 for an absent rank). Pure.
Agreement CheckArrivals(int64_t seq, const std::string& group, const Request& args,
                        const std::vector<RankArgs>& all);

// The error one rank's collective completes with when the ranks disagree (`disagreement`:
// Disagreement's, SizeDisagreement's or the call sites' text): INVALID_ARGUMENT "<op> #<seq>
// of group "<group>": ranks disagree: <disagreement>", plus "; this rank's request: <why>"
// when the rank's own request was invalid; a request a quota refused (RESOURCE_EXHAUSTED)
// keeps its code on its rank. Pure.
absl::Status DisagreementError(int64_t seq, const std::string& group, CollectiveOp op,
                               const std::string& disagreement, const absl::Status& own_error);

// plan: how the data step of an agreed collective runs. kDevice: CUDA tensors (the GPU
// path); kFused: a small all_reduce between hosts whose partial results rode with the
// argument exchange (Hierarchical::Fused): only the final reduction is left; kHost: host
// memory, local reductions and copies and, with several hosts, the backend between them.
// kInRank: records of collectives the ranks run with NCCL themselves (RankArgs::device 2):
// no data step.
enum class DataPath { kDevice, kFused, kHost, kInRank };
// `first`: rank 0's exchanged arguments; `fused`: Hierarchical::Fused(first). Pure.
DataPath ChooseDataPath(const RankArgs& first, bool several_hosts, bool fused);

// complete: who is answered now. A successful collective some of whose ranks read their
// result out of a peer's segment (Submission::peer_rank) holds the owner's answer (its
// segment must stay as it is) until every reader still attached has copied it out.
struct CompletionPlan {
  int owner = -1;                  // local rank whose answer waits; -1: none
  std::map<int, int64_t> readers;  // local rank -> the seq of its request, still reading
};
// `attached(rank)`: whether local rank `rank` is still attached (a reader gone meanwhile
// reads nothing). Pure (given `attached`).
CompletionPlan PlanCompletion(const std::map<int, Submission>& subs, bool ok,
                              const std::function<bool(int)>& attached);

// complete: a record of a collective the rank runs itself (Request::in_rank) that the
// executor checks without waiting for anything: a valid one on one host, or one whose
// arguments an earlier exchange prefetched and that has no splits to exchange. Pure.
bool RecordWaitsForNothing(const Submission& sub, int num_hosts, bool prefetched);

// complete: whether the answers queued so far wait for those of the records the executor
// checks next, so that a session's answers of records checked back to back go with one
// system call (Session::OnCompletions), as their records came. They wait while the executor
// runs records that wait for nothing (`holding`, which it sets when it takes such records of
// every local rank), the group is usable (`group_ok`: not failed or stopping, no local rank
// left), fewer than kMaxHeldAnswersPerRank per local rank are queued (`queued` answers of
// `local_ranks` ranks), and it runs one now (`running`) or every local rank's next request
// (`fronts`, one per local rank, null when none is queued; their arguments prefetched:
// `next_prefetched`) is such a record, which it takes at once. Anything else (an empty queue,
// another request, a failure) lets them go. Pure.
inline constexpr size_t kMaxHeldAnswersPerRank = 16;
bool HoldRecordAnswers(bool holding, bool group_ok, size_t queued, size_t local_ranks, bool running,
                       const std::vector<const Submission*>& fronts, int num_hosts, bool next_prefetched);

// Per-job counters of one host's collectives and their stage times. Thread-safe (atomics).
struct JobStageCounters {
  std::atomic<uint64_t> collectives{0};  // collectives completed (each once per host)
  std::atomic<uint64_t> bytes{0};        // their local ranks' bytes (the larger of input and output)
  std::array<std::atomic<int64_t>, kNumStages> ns{};  // nanoseconds in each stage, summed
  std::atomic<int> priority{1};          // the job's class (PoolTenant::kDefault), as last attached

  // Adds one collective.
  void Add(const StageTimes& times, uint64_t bytes);
};

// The counters of every job that ran collectives on this host, by job name; at most
// kMaxJobs names, later ones counted under "(others)". Thread-safe.
class JobStageTable {
 public:
  static constexpr size_t kMaxJobs = 4096;
  // The counters of `job` (kept for the table's life), its class set to `priority`.
  JobStageCounters* For(const std::string& job, int priority);
  struct Usage {
    std::string job;
    int priority = 1;
    uint64_t collectives = 0, bytes = 0;
    StageTimes times{};
  };
  std::vector<Usage> Snapshot() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobStageCounters>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_STAGES_H_
