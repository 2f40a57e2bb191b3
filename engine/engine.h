// The collective engine of one host: the groups its local ranks attach to, keyed by (job,
// group name). The sidecar's RPC layer owns one Engine and turns each Session stream into
// Attach / Group::Submit / Group::OnSessionClosed calls; tests run several Engines (one per
// simulated host) in one process.
//
// The engine has no gRPC, protobuf or prometheus types (tests/layering_test.sh checks it):
// it reaches the coordinator through CoordinatorLink, the clients through Session, and
// reports metrics through EngineObserver (engine/interfaces.h).
#ifndef COLLSERVE_ENGINE_ENGINE_H_
#define COLLSERVE_ENGINE_ENGINE_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "backends/local_ops.h"
#include "backends/registry.h"
#include "engine/group.h"
#include "engine/hierarchical.h"
#include "engine/interfaces.h"
#include "engine/link_scheduler.h"
#include "engine/stages.h"
#include "engine/types.h"

namespace collserve::engine {

struct EngineOptions {
  // This host's unique id in group memberships. Required.
  std::string host_id;
  // Address the backends bind to and advertise to other hosts.
  std::string hostname = "127.0.0.1";
  // Threads for the intra-host data path, the calling executor included; <= 0 = the
  // number of cores (at most 8).
  int data_threads = 0;
  AlgorithmOptions algorithms;
  // Gloo's ring: the largest piece (0 = Gloo's default, 1 MiB).
  size_t ring_segment_bytes = 8 << 20;
  // CUDA tensors (backends/device.h; must outlive the engine); null: refused with
  // FAILED_PRECONDITION naming device_unavailable.
  backends::DeviceRuntime* device = nullptr;
  std::string device_unavailable = "the sidecar has no CUDA runtime";
  // How often each group's ledger (Group::Progress) is published to the coordinator
  // (CoordinatorLink::ReportProgress), when it changed; <= 0 = never. Default 1 s: a rank
  // that never calls is in the coordinator's diagnosis within about a second of the others.
  absl::Duration progress_interval = absl::Seconds(1);
  // The flight recorder (common/flight_record.h): the last `flight_recorder_entries`
  // collectives of each group (0 = none kept). A collective that takes longer than
  // `flight_recorder_log_threshold` from its first rank's arrival to its completion, or
  // that fails its group, has the group's records handed to EngineObserver::OnFlightRecorderDump
  // (the sidecar logs them as JSON); <= 0 = never.
  int flight_recorder_entries = 128;
  absl::Duration flight_recorder_log_threshold = absl::Seconds(30);
  // A collective whose last rank called it at least this long after its first is counted
  // as a straggler on the last rank's host (EngineObserver::OnStraggler).
  absl::Duration straggler_threshold = absl::Milliseconds(100);
  // Each group (one host or many) is watched at the coordinator while it runs (Registry.
  // WatchGroup), which is also this host's lease on it: the coordinator holds a watch at
  // most this long, and the host renews it at once. A host silent for this plus the
  // coordinator's --lease_grace is taken as lost, and the generation ends for every member.
  absl::Duration lease_renewal = absl::Seconds(2);
  // Fault injection for tests (the sidecar's --testing_fail_after_data_step): collective
  // `fail_after_data_step_seq` of group `fail_after_data_step_group` (each generation) fails with UNAVAILABLE
  // on this host after its data step ran, as when the link breaks between another host's
  // completion and this one's. Empty group = never.
  std::string fail_after_data_step_group;
  int64_t fail_after_data_step_seq = -1;
  // Bytes of inline requests (remote sessions' tensors carried in the messages: input and
  // result) the engine holds at once, every session together (InlineBudget); a request past
  // it fails with RESOURCE_EXHAUSTED naming the limit. <= 0 = no limit. Each job's share
  // under it is its policy's (AttachRequest::max_inline_bytes).
  int64_t max_inline_bytes = int64_t{4} << 30;
  // The data path's bulk lane (backends::ThreadPool): bulk-class jobs' chunks and executors
  // run on threads this much nicer than the sidecar (at most 19); 0 = no lane, every class
  // on the same threads at the sidecar's priority.
  int bulk_nice = 10;
  // The marks of each priority class's connections between hosts, indexed by the class
  // (backends::PoolTenant: latency-critical, default, bulk): a job's groups mark their
  // backend's connections with their job's class's once connected (a failure is logged, the
  // group goes on unmarked). Unmarked by default.
  std::array<TrafficMark, 3> traffic_marks;
  // The host's scheduler of steps between hosts (LinkScheduler): while a better class has
  // collectives between hosts on this host, a lower class's all_reduce and broadcast between
  // hosts go in pieces of link.piece_bytes, each waiting its turn (at most link.max_wait).
  // piece_bytes 0: off.
  LinkSchedulerOptions link;
};

// Thread-safe.
class Engine {
 public:
  // `coordinator`, `backends` and `observer` (may be null) must outlive the engine.
  // INVALID_ARGUMENT for a bad option (no host_id, unknown all_reduce algorithm).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(EngineOptions options, CoordinatorLink* coordinator,
                                                        const backends::BackendRegistry* backends,
                                                        EngineObserver* observer);
  ~Engine();  // Shutdown()

  // Attaches `session` as `request.rank` of its group (created on first use) and starts the
  // rank's rendezvous. The session then gets OnAttached once the group formed and its
  // backend connected, or Close with the error (DEADLINE_EXCEEDED naming the missing ranks,
  // UNAVAILABLE, ...). Errors returned at once: INVALID_ARGUMENT (empty group, rank outside
  // [0, world_size), world_size differs from the group's, unknown backend), NOT_FOUND (a
  // backend that is not built in), ALREADY_EXISTS (rank already attached here),
  // FAILED_PRECONDITION (the group failed on this host and still has ranks), UNAVAILABLE
  // (shutting down). Shared memory is offered only when the probe segment holds the nonce.
  absl::StatusOr<std::shared_ptr<Group>> Attach(const AttachRequest& request, std::shared_ptr<Session> session);

  // Fails every group with UNAVAILABLE, closes every session and joins every thread.
  // Idempotent.
  void Shutdown();

  // Makes the reporter publish every formed group's ledger at its next tick (within
  // EngineOptions::progress_interval) even where it did not change: for a change in what
  // the CoordinatorLink adds to each report (the sidecar's drain). Thread-safe.
  void RepublishProgress() { republish_.store(true); }

  const std::string& host_id() const { return options_.host_id; }

  // What this host's engine is doing now, for metrics (every group together).
  struct Stats {
    int64_t groups = 0;
    int64_t ranks = 0;       // local ranks attached (sessions)
    int64_t in_flight = 0;   // local ranks' collectives submitted and not yet answered
    absl::Duration oldest;   // how long the oldest of those has waited (0 when none)
    int64_t mapped_bytes = 0;  // shared memory the local ranks registered, mapped here
    int64_t inline_bytes = 0;  // inline requests' bytes held (InlineBudget, JobInlineBudgets)
  };
  Stats GetStats();
  // The same for the groups of one job ("" = "default"): what its sessions hold on this host
  // (the sidecar's per-job quotas). Thread-safe.
  Stats JobStats(const std::string& job);
  // Each job's use of this host's data-path threads since the engine started (the pool's
  // scheduling between jobs: backends::ThreadPool), for per-job metrics. Thread-safe.
  std::vector<backends::ThreadPool::TenantUsage> DataPathUsage() { return pool_->Usage(); }
  // Each job's collectives on this host since the engine started: how many, their local
  // ranks' bytes, and the time they spent in each stage of the data plane (engine/stages.h),
  // for per-job metrics. Thread-safe.
  std::vector<JobStageTable::Usage> JobStages() const { return job_stages_.Snapshot(); }
  // The host's scheduler of steps between hosts (EngineOptions::link): its counters per
  // class for metrics, its waiters for tests. Thread-safe.
  LinkScheduler& link() { return link_; }
  // Every group with local ranks attached (current and earlier generations), as its ledger
  // would report it (Group::Progress: job, group, generation, state, its local ranks), for
  // a drain's report. Thread-safe.
  std::vector<GroupProgress> Attached();

 private:
  Engine(EngineOptions options, CoordinatorLink* coordinator, const backends::BackendRegistry* backends,
         EngineObserver* observer);
  std::shared_ptr<Group> GetOrCreate(const GroupParams& params);
  // Moves `group` out of the (job, name) slot into retired_, where it lives on for its
  // remaining local ranks (an earlier generation, AttachRequest::generation).
  void Retire(const std::shared_ptr<Group>& group);
  // Drops an emptied group (from its slot or retired_) for the janitor to destroy.
  void Remove(Group* group);
  // The current and retired groups.
  std::vector<std::shared_ptr<Group>> AllGroups();
  // GetStats over the groups of `job` ("": every group).
  Stats StatsOf(const std::string& job);
  // Destroys removed groups (joining their executors) off the callers' threads.
  void JanitorMain();
  // Publishes the groups' ledgers every options_.progress_interval until Shutdown.
  void ReporterMain();

  const EngineOptions options_;
  CoordinatorLink* const coordinator_;
  const backends::BackendRegistry* const backends_;
  EngineObserver* const observer_;
  std::unique_ptr<backends::ThreadPool> pool_;  // outlives the groups (declared before them)
  InlineBudget inline_budget_;                  // the same
  JobInlineBudgets job_inline_budgets_;         // the same; each job's, under inline_budget_
  JobStageTable job_stages_;                    // outlives the groups too
  LinkScheduler link_;                          // the same

  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Group>> retired_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Group>> graveyard_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::mutex janitor_mu_;
  std::condition_variable janitor_cv_;
  std::thread janitor_;
  absl::Notification stop_reporter_;
  std::atomic<bool> republish_{false};  // RepublishProgress: clear the reporter's published versions
  std::thread reporter_;
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_ENGINE_H_
