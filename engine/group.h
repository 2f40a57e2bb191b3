// One group as seen by one host's engine: its local ranks' sessions, the membership learned
// from the coordinator, the backend communicator among the group's hosts, and the executor
// thread that runs the group's collectives in seq order.
//
// Lifecycle: kJoining (local ranks attach and rendezvous at the coordinator) -> kConnecting
// (the executor connects the backend) -> kReady (collectives run) -> kFailed (any error
// that leaves the generation unusable: a backend error, a timeout, a rank leaving a group
// that spans hosts; every pending and later request gets the failure). A rank that leaves
// a one-host group does not fail it: the others' point-to-point ops go on, and every
// collective fails naming the rank that left (OnSessionClosed). A group is removed once its last local rank
// left (EngineEnv::on_empty).
#ifndef COLLSERVE_ENGINE_GROUP_H_
#define COLLSERVE_ENGINE_GROUP_H_

#include <array>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/local_ops.h"
#include "backends/registry.h"
#include "engine/buffers.h"
#include "engine/collective_args.h"
#include "engine/hierarchical.h"
#include "engine/interfaces.h"
#include "engine/link_scheduler.h"
#include "engine/p2p.h"
#include "engine/stages.h"
#include "engine/submission.h"
#include "engine/topology.h"
#include "engine/types.h"

namespace collserve::engine {

// What a Group needs from its engine. Every pointer outlives the group.
class Group;

struct GroupEnv {
  std::string host_id;
  // Address the backend binds to and advertises to other hosts.
  std::string hostname;
  CoordinatorLink* coordinator = nullptr;
  const backends::BackendRegistry* backends = nullptr;
  EngineObserver* observer = nullptr;  // may be null
  // Threads for the intra-host data path (reductions and copies); shared by every group.
  backends::ThreadPool* pool = nullptr;
  // The job's budget for inline requests' bytes (JobInlineBudgets: its policy's share, under
  // the host's EngineOptions::max_inline_bytes); null: not counted.
  InlineBudget* inline_budget = nullptr;
  // The job's stage counters on this host (JobStageTable::For); null: not counted.
  JobStageCounters* job_stages = nullptr;
  AlgorithmOptions algorithms;
  // Gloo's ring: the largest piece (0 = Gloo's default).
  size_t ring_segment_bytes = 0;
  // CUDA tensors of local clients (backends/device.h); null = refused with
  // FAILED_PRECONDITION naming device_unavailable.
  backends::DeviceRuntime* device = nullptr;
  std::string device_unavailable;
  // The flight recorder and straggler signal (EngineOptions' fields of the same names).
  int flight_recorder_entries = 128;
  absl::Duration flight_recorder_log_threshold = absl::Seconds(30);
  absl::Duration straggler_threshold = absl::Milliseconds(100);
  // How long the coordinator may hold one watch of a generation (EngineOptions::lease_renewal).
  absl::Duration lease_renewal = absl::Seconds(2);
  // EngineOptions::traffic_marks, by priority class.
  std::array<TrafficMark, 3> traffic_marks;
  // The host's scheduler of steps between hosts (the engine's); null: transfers go whole.
  LinkScheduler* link = nullptr;
  // EngineOptions::fail_after_data_step_group/_seq (tests only).
  std::string fail_after_data_step_group;
  int64_t fail_after_data_step_seq = -1;
  // Called (once, with the group's lock held: must not block) when the group has no local
  // ranks left; the engine drops it.
  std::function<void(Group* group)> on_empty;
};

struct GroupParams {
  std::string job;
  std::string name;
  int world_size = 0;
  absl::Duration init_timeout;
  absl::Duration op_timeout;
  std::string backend;  // resolved name ("gloo", "nccl")
  int64_t generation = 0;  // the generation asked for (AttachRequest::generation); 0 = any
  int priority = 1;        // AttachRequest::priority, share_weight and max_data_threads
  int share_weight = 1;
  int max_data_threads = 0;
  InlineBudget* inline_budget = nullptr;  // the job's (Engine's JobInlineBudgets), for GroupEnv
};

// Thread-safe. Created on the first attach of one of its ranks on this host.
class Group : public std::enable_shared_from_this<Group> {
 public:
  Group(GroupEnv env, GroupParams params);
  ~Group();  // stops and joins the executor

  const GroupParams& params() const { return params_; }
  // The generation this group is: the formed one, else the one asked for (0 = not known yet).
  int64_t Generation();

  // Registers a local rank's session and starts its rendezvous at the coordinator.
  // INVALID_ARGUMENT (world_size differs from the group's), ALREADY_EXISTS (rank already
  // attached here), FAILED_PRECONDITION (the group failed; re-attach after every local rank
  // left), ABORTED (the group has just been emptied and is going away: create a new one).
  // `credential`: the rank's (AttachRequest::credential); its join carries it, and the
  // first one attached is the group's for its other coordinator calls.
  // `peer_reads` (with shared_memory): the rank's client reads results out of a peer's
  // segment when its completion says so (Completion.peer_rank) and answers OnReadDone.
  absl::Status Attach(int rank, int world_size, std::shared_ptr<Session> session, bool shared_memory,
                      const std::string& credential, bool peer_reads = false);

  // Whether this host's ranks are leaving the group: one has left (a rank that attaches
  // again belongs to the next generation), it failed, or it stops. Attach then refuses
  // with FAILED_PRECONDITION; Engine::Attach holds the attaching rank in AwaitEmptied and
  // makes a fresh group once this one is empty.
  bool Leaving();
  // Waits until every local rank has left (the group is empty and going away) or
  // `deadline`; returns whether it emptied. Thread-safe.
  bool AwaitEmptied(absl::Time deadline);

  // A request from a local rank. Completes (possibly with an error) through the rank's
  // session. Never blocks on the data path. A non-OK `refused` (the sidecar's per-job quota:
  // RESOURCE_EXHAUSTED) fails the request with that error while keeping the group's sequence
  // whole: a collective fails on every rank of the group (the refused rank gets `refused`'s
  // code and message) and the group stays usable.
  void Submit(int rank, Request request, absl::Status refused = absl::OkStatus());

  // Adds a shared-memory segment `rank`'s client registered (its descriptor, mapped by the
  // RPC layer); later requests of that rank may name it. FAILED_PRECONDITION if the rank is
  // not attached here or may not use shared memory; RESOURCE_EXHAUSTED past the limit.
  absl::Status AddSegment(int rank, std::shared_ptr<ShmSegment> segment);

  // The rank's session ended (client closed it or died).
  void OnSessionClosed(int rank);

  // A read-only descriptor (the caller's to close) of segment `name` that local rank
  // `owner` registered, for local rank `asker`'s client to map: what Completion.peer_segment
  // names. Only between ranks of this group attached here: PERMISSION_DENIED when either
  // is not (or `asker` did not ask for peer reads); NOT_FOUND when `owner` has no such
  // segment (released) or the sidecar kept no descriptor of it (ShmSegment::FromFd);
  // UNAVAILABLE when dup fails (out of descriptors). Thread-safe.
  absl::StatusOr<int> OpenPeerSegment(int asker, int owner, const std::string& name);

  // Local rank `rank`'s client has copied the result of its request `seq` out of the
  // peer segment its completion named: the owner's completion, held until every reader is
  // done, may go. A seq with no read outstanding is ignored (hostile or late). Thread-safe.
  void OnReadDone(int rank, int64_t seq);

  // The group's ledger on this host now (GroupProgress), and the credential to publish it
  // with. `version` counts its changes (a submission or completion of a local rank's
  // collective, a state change), so a reporter can skip unchanged groups.
  GroupProgress Progress(std::string* credential, uint64_t* version);

  // Its local ranks attached here (`*ranks`), their collectives submitted and not yet
  // answered (`*in_flight`), the earliest submission among those (`*oldest`, left as is
  // when there is none), and the bytes of the shared memory segments they registered
  // (`*mapped_bytes`).
  void InFlight(int64_t* ranks, int64_t* in_flight, absl::Time* oldest, int64_t* mapped_bytes);

  // Shutdown: fails everything with UNAVAILABLE and closes every session.
  void Stop();

  // Restarts the coordinator's watch of this generation if one ended in an error (the
  // coordinator unreachable or restarted) at least a second ago. The engine calls it about
  // every second; cheap when there is nothing to do.
  void MaybeRewatch() ABSL_LOCKS_EXCLUDED(mu_);

  // Completes the held owners' completions (peer reads) whose readers did not all answer
  // by the op deadline. The engine calls it about every second.
  void ExpireHeldCompletions() ABSL_LOCKS_EXCLUDED(mu_);

  // After this host shut its connections to a peer down because the generation is over
  // (OnWatched), a collective the transport still holds more than kStrandedAfter later is
  // answered here with the group's failure, without waiting for the transport to return:
  // a failed Gloo connection wakes the operations in the lists it signals, and, as far as
  // its source shows, not an unbound send it was still writing nor a receive whose payload
  // it was reading; such a call would otherwise wait for the op timeout. The executor
  // answers none of those ranks again when the transport returns; it cannot write their
  // results any more (its peer's connection is gone). The engine calls it about every second.
  void AnswerStrandedCollective() ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr absl::Duration kStrandedAfter = absl::Seconds(1);

 private:
  struct LocalRank {
    std::shared_ptr<Session> session;
    bool shared_memory = false;
    bool peer_reads = false;  // its client reads peers' segments (AttachRequest::peer_reads)
    bool joined = false;
    std::function<void()> cancel_join;  // until the join completes
    int64_t next_seq = 0;
    std::deque<Submission> queue;  // collectives, in issue order
    SegmentTable segments;
    // CUDA IPC mappings and events this rank named, by handle (at most kMaxDeviceHandles
    // each; the runtime shares one mapping per handle between ranks and groups).
    std::map<std::string, std::shared_ptr<backends::DeviceMapping>> device_memory;
    std::map<std::string, std::shared_ptr<backends::DeviceEvent>> device_events;
    // The ledger (RankProgress): collectives queued so far (the next one's position), the
    // last one queued, and the last one answered.
    int64_t collectives = 0;
    Request last_issued;
    absl::Time issued_at;
    int64_t completed_seq = -1;
    absl::Time completed_at;
    absl::StatusCode completed_code = absl::StatusCode::kOk;
  };
  enum class State { kJoining, kConnecting, kReady, kFailed };

  // The coordinator answered `rank`'s join.
  void OnJoined(int rank, const absl::StatusOr<Membership>& result);

  // The coordinator's watch of this generation (every group, once ready): the
  // departures it reports and this host's lease on the group (CoordinatorLink::WatchGroup).
  // A remote rank that left: sends to it fail at once (recvs from it fail when its own host
  // says so in band, after its earlier messages; its collectives fail through the argument
  // exchange). A host lost: the generation is over; the group
  // fails at once with an error naming the lost ranks, and the backend's connections to
  // that host are shut down so that no collective waits for it until its timeout.
  void Watch() ABSL_LOCKS_EXCLUDED(mu_);
  void OnWatched(uint64_t id, absl::StatusOr<GroupEvents> events) ABSL_LOCKS_EXCLUDED(mu_);

  // A store for the backend's rendezvous in the job's namespace, with the group's credential.
  std::unique_ptr<backends::RendezvousStore> RendezvousStore();

  // Executor thread (executor.cc).
  void ExecutorMain();
  // Connects the backend among the group's hosts; null with one host.
  absl::StatusOr<std::unique_ptr<backends::Communicator>> Connect();
  // The data plane (data_plane.cc; engine/stages.h draws the stages). Runs the
  // collectives at position `seq` of every local rank (absent: local ranks that did not call
  // a MONITORED_BARRIER in time) through agree, execute and complete, and adds their stage
  // times to the job's counters. `ahead`: the local ranks' arguments of the collectives
  // queued after this one (ahead[d] for seq + 1 + d, every local rank's), at most
  // LookaheadDepth(); they ride with this collective's argument exchange. `queued_since`:
  // the last local rank's submission (the queued stage ends now).
  void RunCollective(int64_t seq, std::map<int, Submission>& subs, const std::vector<int>& absent,
                     const std::vector<std::vector<RankArgs>>& ahead, absl::Time queued_since);
  // One collective on its way through the stages (executor thread).
  struct Running {
    int64_t seq = 0;
    std::map<int, Submission>* subs = nullptr;  // this host's ranks' requests, by local rank
    absl::Time started;                          // when the executor took it up
    absl::Time deadline = absl::InfiniteFuture();  // the earliest of its requests' deadlines
    absl::Duration timeout;                      // what is left of it (a monitored_barrier: more)
    std::vector<RankArgs> all;                   // every rank's arguments, once agreed
    bool agreed = false;                         // `all` is set
    std::vector<RankSplits> splits;              // ops with NeedsSplits
    size_t stride = 0;                           // of each host's message in exchange_recv_
    StageTimes times{};
    uint64_t bytes = 0;                          // the local ranks' bytes (larger of input and output)
  };
  // agree: every rank's arguments (exchanged, or prefetched by an earlier exchange) and the
  // checks before any byte moves. Returns whether the data step runs; when it does not, the
  // collective has been answered (a disagreement or ranks that left: the group stays
  // usable) or the group failed (the exchange broke, a monitored_barrier's rank missed it).
  bool AgreeStage(Running& run, const std::vector<int>& absent, const std::vector<std::vector<RankArgs>>& ahead);
  // The error a failed argument exchange answers with: a monitored_barrier's timeout names
  // the other hosts' ranks; anything else blames a host (OnBackendError) and carries the
  // coordinator's diagnosis (DiagnosisSuffix). Blocks (the diagnosis); no lock held.
  absl::Status ExchangeError(const Running& run, absl::Status s);
  // plan and execute: the data step on the chosen path (ChooseDataPath); `*algorithm` says
  // how it ran. The error names the op, its seq and the group, and why the group failed
  // meanwhile where the coordinator said so (FailedMeanwhileSuffix).
  absl::Status ExecuteStage(Running& run, const char** algorithm);
  // complete: records the collective (ledger, flight recorder) and answers every rank, a
  // peer-read result's owner once its readers are done (PlanCompletion, held_); a failed
  // data step fails the group.
  void CompleteStage(Running& run, const absl::Status& status, const char* algorithm) ABSL_LOCKS_EXCLUDED(mu_);
  // Records the collective and answers every rank with `status`; `fails_group`: the group
  // fails too.
  void AnswerAll(Running& run, const absl::Status& status, bool fails_group) ABSL_LOCKS_EXCLUDED(mu_);
  // Every rank's arguments, from every host (one all-gather), sorted by rank. With several
  // hosts each host's message also carries the arguments of the collectives its ranks
  // queued after this one (`ahead`) and Hierarchical::kFusedBytes of `payload` (a small
  // all_reduce's partial result); afterwards exchange_recv_ holds every host's message
  // (stride: the returned *stride, payload at payload_offset_ of each), and prefetched_
  // the agreed-upon arguments of the next collectives that every rank of every host had
  // queued (so that they need no exchange of their own).
  absl::StatusOr<std::vector<RankArgs>> ExchangeArgs(std::vector<RankArgs> mine,
                                                     const std::vector<std::vector<RankArgs>>& ahead,
                                                     const char* payload, size_t* stride, absl::Duration timeout);
  // How many queued collectives' arguments ride with one exchange: up to 7, fewer for
  // groups with many local ranks (at most 16 KiB of arguments per host's message). The same
  // on every host (it depends only on the topology).
  int LookaheadDepth() const;
  // Every rank's splits across hosts (ops with NeedsSplits), indexed by rank.
  absl::StatusOr<std::vector<RankSplits>> ExchangeSplits(const std::map<int, Submission>& subs,
                                                         absl::Duration timeout);

  // CUDA tensors (device_step.cc). Resolves a request that names CUDA tensors: the rank's
  // session must be local, the sidecar must have CUDA, the op one the GPU path runs; maps
  // its memory (checking the tensor lies inside the allocation) and opens its events.
  absl::Status ResolveDeviceBuffers(LocalRank& local, Submission& sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The data step of an agreed op on CUDA tensors: queued on the group's stream (the local
  // step with CUDA kernels and copies, NCCL across hosts or for a lone local rank), the
  // clients' done events recorded after it. Executor thread.
  // `splits`: every rank's sizes (ops with NeedsSplits; all_to_all, gather and scatter use them).
  absl::Status RunOnDevice(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                           std::map<int, Submission>& subs, absl::Duration timeout, const char** algorithm);
  // Its parts. The group's stream on the GPU of `subs` (made on first use): INVALID_ARGUMENT
  // when the local ranks use different GPUs, or another GPU than before.
  absl::StatusOr<backends::DeviceStream*> DeviceStreamFor(const std::map<int, Submission>& subs);
  // The group's communicator for CUDA tensors among its hosts (the group's backend if it
  // serves CUDA, else the default for CUDA: NCCL), connected on first use within
  // min(timeout, init timeout): FAILED_PRECONDITION (no such backend), else its error.
  absl::StatusOr<backends::Communicator*> DeviceCommunicator(int device, absl::Duration timeout);
  // Records the clients' done events after the op and hands the stream what it must keep
  // alive until the GPU is done, with the ranks' op timeout (DeviceStream::EndOp).
  absl::Status EndDeviceOp(std::map<int, Submission>& subs, backends::DeviceStream& ds, backends::Communicator* comm,
                           absl::Duration timeout);
  // Ends the GPU side when the executor stops: aborts NCCL if the group failed, then waits
  // (bounded) for the stream and drops it and the communicator. Executor thread.
  void StopDevice(bool failed);

  // "ranks called it from different places: at <site> on ranks [..] but at <site> on ranks
  // [..] ..." for a CallSiteDisagreement: the sites' text from the local requests and, with
  // several hosts, from one more all-gather among them (every host found the same
  // disagreement, so every host takes part). Executor thread.
  std::string DescribeCallSites(const std::map<int64_t, std::vector<int64_t>>& sites,
                                const std::map<int, Submission>& subs, absl::Duration timeout);
  // What explains a failed exchange, for an error message: FailedMeanwhileSuffix alone when
  // the group failed meanwhile (the coordinator ended the generation); otherwise its
  // departures (if any) followed by "; the coordinator's ledger: <its diagnosis of this
  // group>" (left out when it has none within kDiagnosisTimeout). Both waits end by
  // `explain_by` (the collective's deadline + kExplainSlack: every rank's error within its op
  // timeout + 1 s, though the coordinator is cut off too). Blocks; executor thread, no lock
  // held.
  std::string DiagnosisSuffix(const absl::Status& error, absl::Time explain_by) ABSL_LOCKS_EXCLUDED(mu_);
  // Why a collective across hosts failed in the backend, as the coordinator told this host:
  // " (the group had failed meanwhile: <why>)" when the group failed while the executor ran
  // it (the coordinator ended the generation), "; rank R left group ... (the coordinator:
  // ...)" when ranks of other hosts left (their host ends the generation when one leaves
  // with a collective queued, and its connections close), else "". The word usually comes
  // within milliseconds of the backend error (the leaver's sidecar tells the coordinator,
  // which answers this host's watch at once), so it waits up to kExplainWait for it.
  // Only for `error`s other than DEADLINE_EXCEEDED: after a timeout, ranks that leave are
  // a consequence (they gave up too), not the cause, which the ledger's diagnosis names.
  // Waits no later than `explain_by`. Blocks; executor thread, no lock held.
  std::string FailedMeanwhileSuffix(const absl::Status& error, absl::Time explain_by) ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr absl::Duration kDiagnosisTimeout = absl::Seconds(3);
  static constexpr absl::Duration kExplainWait = absl::Seconds(1);
  // How long past a collective's deadline explaining its failure may take.
  static constexpr absl::Duration kExplainSlack = absl::Milliseconds(600);

  // The host a backend error between hosts blames (OnBackendError): the group's only other
  // host, else the one other host whose backend address `message` names; "unknown"
  // otherwise. Executor thread.
  std::string BlamedHost(absl::string_view message) const;

  // The ledger and the flight recorder: the executor answered collective `seq` of these
  // local ranks with `status`; it took it up at `started`. `all`: every rank's exchanged
  // arguments (their arrival times), null when the exchange failed; `algorithm`: how the
  // data step ran ("" when it did not). `fails_group`: the status fails the group (its
  // records are then dumped, as for a collective slower than the log threshold).
  void RecordCompletedLocked(int64_t seq, const std::map<int, Submission>& subs, const absl::Status& status,
                             const std::vector<RankArgs>* all, const char* algorithm, absl::Time started,
                             bool fails_group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Queues `sub`'s answer (Complete) with `status`, sent once mu_ is released (AnswerLock).
  void AnswerLocked(Submission sub, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // mu_, held for its scope; on leaving it, the answers queued meanwhile (AnswerLocked) are
  // sent with the lock released. Each rank's answers go in the order they were queued (a
  // session's collectives complete in issue order): one thread at a time sends a given
  // rank's answers, and a thread that queues answers for a rank another thread is sending
  // leaves them to that thread; other ranks' answers it sends itself. Answering under mu_
  // made every rank that an answer woke (and that issued its next request at once) wait for
  // the lock, and the executor wait for a core while it held it. Every lock of mu_ is one of
  // these, so that no queued answer is left unsent.
  class ABSL_SCOPED_LOCKABLE AnswerLock {
   public:
    explicit AnswerLock(Group* group) ABSL_EXCLUSIVE_LOCK_FUNCTION(group->mu_);
    ~AnswerLock() ABSL_UNLOCK_FUNCTION();
    AnswerLock(const AnswerLock&) = delete;
    AnswerLock& operator=(const AnswerLock&) = delete;

   private:
    Group* const group_;
  };

  // Fails the group: every queued submission and every later one gets `status`.
  void FailLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `sub` (a request that arrived after the group failed) without running it:
  // with the leave of a rank it needed, when one is known, else with failure_.
  void RefuseFailedLocked(Submission sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Fail(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  void MaybeEmptyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // One host, CPU: a BROADCAST whose root's tensor, or an ALL_REDUCE where some rank's
  // tensor (the owner's), is in a segment the sidecar kept a descriptor of: marks the
  // other ranks that read the result out of that segment themselves
  // (Submission::peer_rank): their clients asked for peer reads and stage through a
  // segment of their own (arena tensors are filled by the sidecar with no client copy at
  // all). The all-reduce then writes its result once, into the owner's tensor, instead of
  // once per rank. Executor thread.
  void PlanPeerReads(const RankArgs& a, std::map<int, Submission>& subs);
  // Waits until every submission whose client writes its input after the request
  // (Submission::fill) has written all of it, unless `needed` is false and every other rank
  // reads it out of the segment itself (PlanPeerReads). Polls the count (sleeps of 20 us to
  // 1 ms). DEADLINE_EXCEEDED at `deadline`, naming the rank and the bytes written. Executor
  // thread, no lock held.
  absl::Status AwaitFilled(const std::map<int, Submission>& subs, bool needed, absl::Time deadline);

  // An owner's completion held until its peer readers have copied out of its segment.
  struct HeldCompletion {
    Submission owner;
    std::map<int, int64_t> readers;  // local rank -> the seq of its request, still reading
    absl::Time deadline;             // the owner's op deadline: completed then regardless
  };
  // Completes the held ones with no reader left (`now` past a deadline: all of those).
  void ReleaseHeldLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const GroupEnv env_;
  const GroupParams params_;

  absl::Mutex mu_;
  // Answers queued under mu_ (AnswerLocked), and the local ranks whose answers a thread is
  // sending (AnswerLock). Their own lock, taken inside mu_ or alone: a sending thread never
  // takes mu_ again, so a rank that an answer woke does not contend with it there.
  struct Answer {
    Submission sub;
    absl::Status status;
  };
  // Moves the queued answers of ranks no thread is sending to `batch` (in order) and marks
  // those ranks as being sent.
  void TakeSendableLocked(std::vector<Answer>* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(answers_mu_);
  // Whether the queued answers wait for those of the records the executor checks next
  // (HoldRecordAnswers, stages.h).
  bool HoldAnswersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, answers_mu_);
  // Sends `batch` (taken by TakeSendableLocked; no lock held): each session's answers with
  // one Session::OnCompletions, then tells the observer.
  void SendAnswers(const std::vector<Answer>& batch) ABSL_LOCKS_EXCLUDED(mu_, answers_mu_);
  absl::Mutex answers_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<Answer> answers_ ABSL_GUARDED_BY(answers_mu_);
  std::set<int> sending_ ABSL_GUARDED_BY(answers_mu_);
  // The credential of the group's coordinator calls other than a join (AttachRequest::credential).
  std::string credential_ ABSL_GUARDED_BY(mu_);
  State state_ ABSL_GUARDED_BY(mu_) = State::kJoining;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::map<int, LocalRank> locals_ ABSL_GUARDED_BY(mu_);
  std::vector<HeldCompletion> held_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool emptied_ ABSL_GUARDED_BY(mu_) = false;
  bool attached_ ABSL_GUARDED_BY(mu_) = false;  // Attached was sent to the local sessions
  uint64_t submissions_ ABSL_GUARDED_BY(mu_) = 0;  // wakes the executor to recompute its deadline
  // When the waiting executor wakes up on its own (the earliest deadline of the queued
  // submissions); a submission due later does not wake it before it is ready.
  absl::Time executor_wakes_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  uint64_t progress_version_ ABSL_GUARDED_BY(mu_) = 0;  // Progress()'s version
  // The flight recorder: the last env_.flight_recorder_entries collectives, oldest first.
  std::deque<FlightRecord> flight_ ABSL_GUARDED_BY(mu_);
  // The earliest submission of the collective the executor runs now (InfiniteFuture: none).
  absl::Time running_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // That collective's local ranks: what answering it early takes (AnswerStrandedCollective).
  struct RunningRank {
    int rank = -1;
    std::shared_ptr<Session> session;
    int64_t seq = 0;
    CollectiveOp op = CollectiveOp::kUnspecified;
    absl::Time submitted;
  };
  std::vector<RunningRank> running_ ABSL_GUARDED_BY(mu_);
  // Its ranks were answered early: the stages answer none of them again.
  bool running_answered_ ABSL_GUARDED_BY(mu_) = false;
  // Answers to records of collectives the ranks run themselves (Request::in_rank) are held
  // back while the executor checks more of them (HoldRecordAnswers, stages.h):
  // holding_records_ is set while the executor runs records that wait for nothing, and
  // next_prefetched_ says whether the next seq's arguments were prefetched.
  bool holding_records_ ABSL_GUARDED_BY(mu_) = false;
  bool next_prefetched_ ABSL_GUARDED_BY(mu_) = false;
  // When OnWatched shut the connections to a peer down (the generation is over).
  absl::Time peers_shut_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool formed_ ABSL_GUARDED_BY(mu_) = false;  // topology_ is set (written once, then read freely)
  // Local ranks that left this generation of a one-host group (OnSessionClosed), and the
  // error every collective gets since the first left.
  std::set<int> departed_ ABSL_GUARDED_BY(mu_);
  // Ranks of other hosts that left, as the coordinator reported them (OnWatched): their
  // point-to-point fails here; their collectives fail through their own host's exchange.
  std::set<int> remote_departed_ ABSL_GUARDED_BY(mu_);
  // What the coordinator said of each (the message their point-to-point fails with).
  std::map<int, std::string> remote_left_ ABSL_GUARDED_BY(mu_);
  absl::Status collectives_failure_ ABSL_GUARDED_BY(mu_);
  // The watch (Watch): its id (a later one makes earlier answers stale), whether one is
  // waiting, how to cancel it, the departures already seen, and when to retry after an error.
  uint64_t watch_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool watching_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> cancel_watch_ ABSL_GUARDED_BY(mu_);
  int watch_known_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time rewatch_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // The last watch was answered NOT_FOUND (the coordinator restarted): the next one carries
  // the membership, for adoption (CoordinatorLink::WatchParams::members).
  bool watch_with_members_ ABSL_GUARDED_BY(mu_) = false;

  // Fixed once formed_ (before the executor starts); read without the lock afterwards.
  Topology topology_;
  // Created with the executor; p2p_ before comm_, so that the communicator (whose cancelled
  // receives may still write p2p_'s buffers) is destroyed first.
  std::unique_ptr<PointToPoint> p2p_;
  // Executor and p2p threads; set and reset under mu_ (OnWatched uses it under mu_).
  std::unique_ptr<backends::Communicator> comm_;
  std::unique_ptr<Hierarchical> algorithms_;      // executor thread only
  // Executor thread only: the argument exchange's buffers, reused by every collective.
  std::vector<char> exchange_send_, exchange_recv_;
  size_t payload_offset_ = 0;  // of the fused payload in each host's message
  std::vector<char> fused_partial_;
  // Every rank's arguments (sorted by rank) of the next collectives, learned from an earlier
  // exchange's lookahead: front() is the next seq's. Such a collective skips its exchange.
  std::deque<std::vector<RankArgs>> prefetched_;
  // CUDA tensors, executor thread only: the group's stream (on the GPU of its local ranks)
  // and the NCCL communicator among its hosts, created at the first CUDA collective.
  std::unique_ptr<backends::DeviceStream> device_stream_;
  std::unique_ptr<backends::Communicator> device_comm_;
  std::thread executor_;
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_GROUP_H_
