// SessionProcessGroup: the SDK's ProcessGroup over one collserve.v1.Collectives/Session
// stream to the host's sidecar. Internal to the SDK (collserve/client.h is the public face;
// InitProcessGroup makes these).
//
// One stream per (group, rank). Requests are written in issue order with consecutive seq
// numbers; a reader thread hands each Completion to a lane thread (one for collectives, one
// for send/recv) that copies its result out and completes the Work. Tensor bytes go through
// shared-memory segments (sealed memfds created here, passed to the sidecar as descriptors
// over the unix socket's fd channel, common/fd_channel.h) on a unix-socket session, inline
// in the messages otherwise. With shared memory, requests and completions go over the ops
// channel (common/ops_channel.h: the descriptor channel in ops mode, one datagram per
// message; its own reader thread) and the stream carries only attach and the session's end.
//
// The parts, each in a file of its own:
//   process_group.cc          the calls: each becomes a Request (request_builder.h), checked,
//                             staged and sent (Issue, IssueCuda); InitProcessGroup;
//   session_process_group.cc  the session: attach, writing requests (Enqueue), reading and
//                             dispatching completions to the lanes, finishing them;
//   request_builder.h         what a call becomes (pure), staging_pool.h the segments,
//   peer_reads.h              results read out of a peer's segment, completion_lane.h the
//                             lanes, cuda_tensors.h CUDA IPC exports and events.
//
// Thread-safe: every public method may be called from any thread (calls are numbered in
// the order they take write_mu_).
#ifndef COLLSERVE_CLIENT_SESSION_PROCESS_GROUP_H_
#define COLLSERVE_CLIENT_SESSION_PROCESS_GROUP_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/completion_lane.h"
#include "client/cuda_tensors.h"
#include "client/peer_reads.h"
#include "client/rank_comm.h"
#include "client/request_builder.h"
#include "client/staging_pool.h"
#include "client/work_impl.h"
#include "collserve/client.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "common/shm.h"

namespace collserve::client {

// Past the op deadline the sidecar must have answered; this much later Work::Wait gives up.
inline constexpr absl::Duration kClientGrace = absl::Seconds(10);
// The largest gRPC message of a session (bytes): inline tensors of a remote session.
inline constexpr int64_t kMaxMessageBytes = 1 << 30;
// A pipelined broadcast's root publishes its copy's progress every quarter of the tensor,
// at least kFillPieceMinBytes and at most kFillPieceBytes (1 MiB: bench/membw.cc's
// BM_PipelinedHeapBroadcast hides the root's copy of 64 MiB under the readers' with it).
inline constexpr size_t kFillPieceBytes = size_t{1} << 20;
inline constexpr size_t kFillPieceMinBytes = size_t{256} << 10;

// The calling thread's call site (ScopedCallSite, SetCallSite): what its next collective
// carries (Collective.call_site).
std::string& CallSiteOfThisThread();

class SessionProcessGroup : public ProcessGroup {
 public:
  explicit SessionProcessGroup(InitOptions options)
      : options_(std::move(options)), op_timeout_ms_(absl::ToInt64Milliseconds(options_.op_timeout)) {
    for (int r = 0; r < options_.world_size; ++r) ranks_.push_back(r);
  }
  ~SessionProcessGroup() override;

  // Opens the session: connects to the sidecar (InitOptions::sidecar_address), attaches and
  // waits for the group to form (bounded by init_timeout, plus kClientGrace if the sidecar
  // does not answer at all), then opens the shared-memory and ops channels when the sidecar
  // offers them. The sidecar's attach errors (gRPC status mapped to absl); UNAVAILABLE when
  // no sidecar is reachable. Call once, before any other method.
  absl::Status Init();

  int GetRank() const override { return options_.rank; }
  int GetWorldSize() const override { return options_.world_size; }
  const std::string& group_name() const override { return options_.group; }
  int num_hosts() const override { return num_hosts_; }
  int64_t generation() const override { return generation_; }
  uint64_t rendezvous_id() const override { return rendezvous_id_; }
  int local_world_size() const override { return local_world_size_; }
  int64_t last_completed_seq() const override {
    absl::MutexLock lock(&completed_mu_);
    return last_completed_seq_;
  }

  absl::Status SetOpTimeout(absl::Duration timeout) override;

  // The collectives and point-to-point calls (collserve/client.h documents each): built
  // into a Request, checked, and sent by Issue (process_group.cc).
  std::shared_ptr<Work> AllReduce(void* data, int64_t count, DataType dtype, ReduceOpArg op) override;
  std::shared_ptr<Work> Broadcast(void* data, int64_t count, DataType dtype, int root) override;
  std::shared_ptr<Work> Reduce(void* data, int64_t count, DataType dtype, ReduceOpArg op, int dst) override;
  std::shared_ptr<Work> Barrier() override;
  std::shared_ptr<Work> MonitoredBarrier(absl::Duration timeout, bool wait_all_ranks) override;
  std::shared_ptr<Work> AllGather(const std::vector<void*>& outputs, const std::vector<int64_t>& counts,
                                  const void* input, int64_t count, DataType dtype) override;
  std::shared_ptr<Work> AllGatherIntoTensor(void* output, const void* input, int64_t count, DataType dtype) override;
  std::shared_ptr<Work> Gather(const void* input, int64_t count, const std::vector<void*>& outputs,
                               const std::vector<int64_t>& counts, DataType dtype, int dst) override;
  std::shared_ptr<Work> Scatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                const std::vector<int64_t>& counts, DataType dtype, int src) override;
  std::shared_ptr<Work> ReduceScatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                      const std::vector<int64_t>& counts, DataType dtype, ReduceOpArg op) override;
  std::shared_ptr<Work> ReduceScatterTensor(void* output, const void* input, int64_t count, DataType dtype,
                                            ReduceOpArg op) override;
  std::shared_ptr<Work> AllToAll(const std::vector<void*>& outputs, const std::vector<int64_t>& output_counts,
                                 const std::vector<const void*>& inputs, const std::vector<int64_t>& input_counts,
                                 DataType dtype) override;
  std::shared_ptr<Work> AllToAllSingle(void* output, int64_t output_count, const void* input, int64_t count,
                                       const std::vector<int64_t>& output_splits,
                                       const std::vector<int64_t>& input_splits, DataType dtype) override;
  std::shared_ptr<Work> Send(const void* data, int64_t count, DataType dtype, int dst, int64_t tag) override;
  std::shared_ptr<Work> Recv(void* data, int64_t count, DataType dtype, int src, int64_t tag) override;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> NewGroup(std::vector<int> ranks) override;
  const std::vector<int>& GetProcessGroupRanks() const override { return ranks_; }

  // CUDA tensors (docs/gpu.md), through IssueCuda.
  std::shared_ptr<Work> AllReduceCuda(void* data, int64_t count, DataType dtype, ReduceOpArg op,
                                      void* stream) override;
  std::shared_ptr<Work> BroadcastCuda(void* data, int64_t count, DataType dtype, int root, void* stream) override;
  std::shared_ptr<Work> AllGatherIntoTensorCuda(void* output, const void* input, int64_t count, DataType dtype,
                                                void* stream) override;
  std::shared_ptr<Work> AllToAllSingleCuda(void* output, int64_t output_count, const void* input, int64_t count,
                                           const std::vector<int64_t>& output_splits,
                                           const std::vector<int64_t>& input_splits, DataType dtype,
                                           void* stream) override;
  std::shared_ptr<Work> GatherCuda(void* output, const void* input, int64_t count, const std::vector<int64_t>& counts,
                                   DataType dtype, int dst, void* stream) override;
  std::shared_ptr<Work> ScatterCuda(void* output, int64_t count, const void* input, const std::vector<int64_t>& counts,
                                    DataType dtype, int src, void* stream) override;
  std::shared_ptr<Work> SendCuda(const void* data, int64_t count, DataType dtype, int dst, int64_t tag,
                                 void* stream) override;
  std::vector<std::shared_ptr<Work>> BatchIsendIrecv(const std::vector<P2POp>& ops) override;
  std::shared_ptr<Work> RecvCuda(void* data, int64_t count, DataType dtype, int src, int64_t tag,
                                 void* stream) override;
  std::shared_ptr<Work> ReduceScatterTensorCuda(void* output, const void* input, int64_t count, DataType dtype,
                                                ReduceOpArg op, void* stream) override;

  absl::StatusOr<std::shared_ptr<SharedBuffer>> AllocateShared(size_t bytes) override;
  StoreClient* store() override;

 private:
  struct Pending {
    std::shared_ptr<WorkImpl> work;
    std::vector<std::pair<void*, size_t>> outputs;  // filled in order from the result
    size_t out_offset = 0;  // of the result in the segment
    size_t out_bytes = 0;   // of the result
    std::unique_ptr<ShmSegment> segment;
    bool collective = false;  // a collective's segment (StagingPool::Acquire's `collective`)
    bool p2p = false;         // send/recv: completes on the point-to-point lane
    int64_t collective_seq = -1;  // the group's seq of a collective (not send/recv): last_completed_seq
    const char* record = nullptr;  // a record (SendRecord): the op's name
    // Set when the issuing thread writes the input into `segment` after sending the request
    // (Buffer.fill_offset); notified once it is all there. The op completes and the segment
    // is released only after that.
    std::shared_ptr<absl::Notification> filled;
  };
  // A completion read from the stream, handed to a lane.
  struct Done {
    std::unique_ptr<Pending> pending;
    v1::Completion completion;
  };

  // INVALID_ARGUMENT naming `op` unless `root` (`peer`; -1 too when `any_ok`) is a rank of
  // the group (and, for a peer, not this one).
  absl::Status CheckRoot(const char* op, int root) const;
  absl::Status CheckPeer(const char* op, int peer, bool any_ok) const;

  // all_to_all_single's split sizes: `splits` as given, or, when empty, n / world_size each
  // (INVALID_ARGUMENT naming `what` when that does not divide).
  absl::StatusOr<std::vector<int64_t>> SplitsOrEven(const std::vector<int64_t>& splits, int64_t n,
                                                    const char* what) const;
  // The sum of a gather destination's (scatter source's) per-rank counts: INVALID_ARGUMENT,
  // naming `who`, unless there are world_size of them, each in [0, 2^48].
  absl::StatusOr<int64_t> TotalOfCounts(const std::vector<int64_t>& counts, const char* who) const;
  // The transfers of a tensor at `base` (`total` elements of `dtype`) cut into world_size
  // consecutive pieces of `sizes`, piece r with rank r: INVALID_ARGUMENT (naming `what`)
  // unless there are world_size sizes, each >= 0, adding up to `total`.
  absl::StatusOr<std::vector<RankComm::Transfer>> Pieces(void* base, const std::vector<int64_t>& sizes, int64_t total,
                                                        DataType dtype, const char* what) const;
  // One collective on CUDA tensors (docs/gpu.md): `in` (in_count elements) and, for
  // out-of-place ops, `out` (out_count) are exported by CUDA IPC; an event recorded on
  // `stream` orders the sidecar's work after the caller's, and a successful Wait makes
  // `stream` wait for the sidecar's done event.
  std::shared_ptr<Work> IssueCuda(const Request& r, const void* in, int64_t in_count, void* out, int64_t out_count,
                                  void* stream);

  // COLLSERVE_CUDA_PATH=nccl (InitOptions::cuda_path, client/rank_comm.h): runs `call` on
  // this rank's NCCL communicator of the group, made at the group's first CUDA call on it
  // (rank 0 mints the unique id and puts it in the coordinator's store under the group's name
  // and generation; the others read it, within the init timeout), or, with `pair_peer` (a
  // single send or recv to another rank), on the two-rank communicator of this rank and
  // that peer, made at their first such call (the lower rank mints its id): torch's NCCL
  // backend pairs single point-to-point calls the same way, so that they never wait for
  // ranks that are not part of them. A collective's `record` (its arguments; null for
  // point-to-point) goes to the sidecar first (SendRecord). The Work is complete when this
  // returns: the work is queued on the caller's stream, as NCCL's calls queue theirs (so Wait
  // has nothing to make the stream wait for). Errors name `op`: the record's (the session is
  // gone, or too many records unanswered), the communicator's creation (NCCL missing, no
  // store, a rank that never joined) and the call's.
  // Group rank `rank`'s rank in the two-rank communicator it shares with `peer`: the lower
  // group rank is 0.
  static int RankInPair(int rank, int peer) { return rank < peer ? 0 : 1; }
  std::shared_ptr<Work> OnRankComm(const char* op, const Request* record,
                                   const std::function<absl::Status(RankComm&)>& call, int source = -1,
                                   int pair_peer = -1);
  // Sends the record of a collective this rank runs with NCCL (collserve.v1.Collective.in_rank)
  // without waiting for its answer: the sidecar checks that every rank agrees, and keeps
  // the ledger, flight recorder and metrics of it. The calling thread only numbers and
  // queues it; the record sender's thread writes it (or the next request's writer, first),
  // so the training thread makes no system call for it. An error answer aborts the communicator
  // with the sidecar's reason (RecordAnswered). At most kMaxRecordsInFlight go unanswered:
  // past that the call waits for room, at most the op timeout (DEADLINE_EXCEEDED naming the
  // limit; a call on a completion lane, from a Work's callback, never waits). The session's
  // error when it is gone. `op`: the call's name (a literal).
  absl::Status SendRecord(const char* op, const Request& r);
  // A record's answer (or the session's end, `status` then its reason): counts it
  // answered; INVALID_ARGUMENT (the ranks' calls disagree) aborts the communicator at once,
  // another error (the group failed, the session ended) once its queued work drained.
  void RecordAnswered(const Pending& p, const absl::Status& status);
  // Records a rank keeps unanswered at most (a sidecar that checks slower than the rank
  // issues makes the rank wait for it rather than queue without bound).
  static constexpr int kMaxRecordsInFlight = 1024;
  bool RankNccl() const { return options_.cuda_path == InitOptions::CudaPath::kNccl; }
  // This rank's communicator of the group (`pair_peer` -1) or of it and rank `pair_peer`:
  // the unique id through the store, then the factory's Connect.
  absl::StatusOr<std::unique_ptr<RankComm>> MakeRankComm(int pair_peer);
  // Ends this rank's NCCL communicator with `why`: at once (RankComm::Abort) when the ranks'
  // calls disagree; else (a rank left, the group or the session ended, the process group is
  // destroyed) once the work it queued finished on the GPU, at most kRankCommDrain
  // (RankComm::AbortWhenDrained), so that a collective the lost peer already did its part of
  // completes here rather than being cut off mid-kernel. Later calls fail at once either
  // way. Never blocks. Thread-safe.
  void AbortRankComm(const absl::Status& why, bool at_once = false);
  static constexpr absl::Duration kRankCommDrain = absl::Seconds(10);

  // Sends one request on the session: plans its staging (PlanStaging), copies its inputs
  // into a staging segment (or inline into the message), names its buffers and enqueues it;
  // a pipelined broadcast's root copies its tensor after the request is written. The Work
  // completes with the sidecar's answer, or at once with the request's error
  // (INVALID_ARGUMENT for a bad tensor or a remote session's inline bytes over
  // kMaxMessageBytes; the staging pool's errors).
  std::shared_ptr<Work> Issue(Request r);

  // Numbers `req` (its collective's seq) and writes it on the session; `pending` (with its
  // Work) completes with the sidecar's answer, or at once if the session is gone.
  // `sent` (optional): set to whether the request was written (else its Work has failed and
  // its segment is released).
  std::shared_ptr<Work> Enqueue(v1::SessionRequest& req, std::unique_ptr<Pending> pending, bool* sent = nullptr);

  // Ends the stream during Init: its gRPC status if it has one, else UNAVAILABLE `what`.
  absl::Status FinishWithError(absl::string_view what);

  // A staging segment of at least `bytes` from the pool (StagingPool::Acquire); a collective
  // issued from a completion lane never waits (the lanes return the segments).
  absl::StatusOr<std::unique_ptr<ShmSegment>> AcquireSegment(size_t bytes, bool collective, absl::Time deadline);

  // A new segment of `bytes`, registered with the sidecar (its descriptor passed over the
  // shared-memory channel), so that requests may name it. Thread-safe.
  absl::StatusOr<std::unique_ptr<ShmSegment>> NewRegisteredSegment(size_t bytes);

  void ReleaseSegment(std::unique_ptr<ShmSegment> seg, bool collective) { staging_.Release(std::move(seg), collective); }

  // Copies the result of a completed operation into the caller's tensors and completes its
  // Work. On a lane's thread.
  void Finish(Done& done);

  // Copies a peer's result (PeerSource) into `p`'s outputs through peer_reader_. Lane
  // threads. INTERNAL when this session did not ask for peer reads; else PeerReader::Copy's
  // errors.
  absl::Status CopyFromPeer(const v1::PeerSource& source, Pending& p);
  // A read-only descriptor of local rank `rank`'s segment `name`, over the descriptor
  // channel (fdchannel::OpenPeerSegment, 10 s); its errors. Thread-safe.
  absl::StatusOr<int> OpenPeerSegment(int rank, const std::string& name);

  // Advances last_completed_seq_ over collectives completed OK in seq order; the first
  // failure freezes it (what follows a failed collective is not in step).
  void NoteCollectiveDone(int64_t collective_seq, bool ok);

  // Tells the sidecar this rank has copied out the peer result of its request `seq`.
  void SendReadDone(int64_t seq);

  // Sends `req` over the ops channel, or else the stream. A failure marks the session
  // closed (and shuts the ops channel down, so that the sidecar ends the session and the
  // reader sees it end).
  void WriteLocked(const v1::SessionRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_, write_mu_);
  // WriteLocked's write alone: UNAVAILABLE naming what broke when it failed (the caller
  // then calls WriteFailedLocked).
  absl::Status WriteRaw(const v1::SessionRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);
  // WriteRaw of each of `reqs` in order; on the ops channel several datagrams per system
  // call (opschannel::SendOpsMessages).
  absl::Status WriteRawBatch(const std::vector<v1::SessionRequest>& reqs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);
  // WriteRaw's and WriteRawBatch's failure on the ops channel: says so on stderr, shuts the
  // channel down (the sidecar ends the session) and returns UNAVAILABLE naming `s`.
  absl::Status OpsWriteFailed(const absl::Status& s);
  // Marks the session closed after a failed write; the first failure is why later requests
  // are refused until the reader sees the session end (UsableLocked).
  void WriteFailedLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Why no request can be written any more (the session's end, or the group destroyed), or OK.
  absl::Status UsableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // INVALID_ARGUMENT naming the limit when `req` is too long for the ops channel (16 bytes
  // of room for the seq it has yet to take); OK on a stream.
  absl::Status OpsMessageSizeOk(const v1::SessionRequest& req) const;
  // Puts this thread's call site (SetCallSite) on a collective (not send/recv).
  static void SetCallSite(v1::Collective* c);
  // Gives `c` the next seq (and, unless send/recv, the group's next collective seq) and
  // files `pending` under it.
  void NumberLocked(v1::Collective* c, std::unique_ptr<Pending> pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Numbers the record `req` (SendRecord) and queues it for the record sender, which it
  // starts at the first; UsableLocked's or OpsMessageSizeOk's error when refused.
  absl::Status QueueRecord(v1::SessionRequest req, std::unique_ptr<Pending> pending);
  // Writes the records SendRecord queued (unsent_records_, in seq order) before anything
  // that takes a later seq: every writer of a request calls it first.
  void FlushRecordsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_, write_mu_);
  // The record sender's thread (started by the first SendRecord): writes queued records,
  // as many as have queued while it wrote the last ones, until record_sender_stop_ and
  // nothing is queued.
  void RecordSendLoop();

  // Hands a completion to its lane (the lane copies the result out and completes the Work).
  void Dispatch(v1::SessionResponse& resp);

  // The ops channel's reader: completions until the sidecar closes the channel (when the
  // session ends) or it breaks.
  void OpsReadLoop();
  // The datagrams OpsReadLoop takes per system call (its buffers: 8 * 32 KiB).
  static constexpr int kOpsReceiveBatch = 8;

  // The reader thread: reads the stream (and starts OpsReadLoop) until the session ends,
  // lets the lanes drain what was read (30 s at most), then fails the rest with why the
  // session ended (UNAVAILABLE, or the stream's status).
  void ReadLoop();

  // Completes every pending Work with `why` (its segment released).
  void FailAll(const absl::Status& why);

  // Runs `write` (a blocking write on the session's stream: Write, WritesDone) under the
  // write watch, and returns what it returned. A stream write has no deadline of its own in
  // gRPC's synchronous API, and one the sidecar never takes (a sidecar that is stopped or
  // hung, with the connection's flow-control window full) blocked the issuing thread, and
  // every later call behind its lock, for good.
  bool WatchedWrite(const std::function<bool()>& write);
  // The write watch's thread: cancels the session's stream once a write has been in progress
  // for the op timeout (the write then fails, and the session ends with WriteTimeout()).
  void WriteWatchLoop();
  // DEADLINE_EXCEEDED if the write watch ended the session (a request could not be written
  // within the op timeout), else OK. Thread-safe.
  absl::Status WriteTimeout() const;

  absl::Duration OpTimeout() const { return absl::Milliseconds(op_timeout_ms_.load(std::memory_order_relaxed)); }

  InitOptions options_;
  // The deadline of each operation issued from now on (SetOpTimeout); options_.op_timeout
  // is the one the session attached with.
  std::atomic<int64_t> op_timeout_ms_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Collectives::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  bool shared_memory_ = false;
  absl::Mutex fd_channel_mu_;  // one registration or Open at a time
  bool peer_reads_ = false;    // the sidecar may name results in peers' segments
  // Peers' segments mapped read-only (peer reads): opened over fd_channel_ (its lock is
  // taken inside the reader's).
  PeerReader peer_reader_{[this](int rank, const std::string& name) { return OpenPeerSegment(rank, name); }};
  int fd_channel_ = -1;        // the shared-memory channel (with shared_memory_)
  int ops_sock_ = -1;          // the ops channel, if open (set in Init, closed in the destructor)
  absl::Notification ops_done_;  // its reader ended
  bool finished_ = false;  // Finish() called during Init
  int num_hosts_ = 0;
  int64_t generation_ = 0;
  uint64_t rendezvous_id_ = 0;  // Attached.rendezvous_id: names the NCCL unique id's store key
  int local_world_size_ = 0;
  int traffic_dscp_ = -1;  // Attached.traffic_dscp: the job's class's DSCP, -1 = none

  // One writer on the stream and the ops channel at a time (a message longer than a
  // datagram is several datagrams); taken before write_mu_.
  absl::Mutex send_mu_ ABSL_ACQUIRED_BEFORE(write_mu_);
  absl::Mutex write_mu_;  // orders seq assignment with stream writes
  // Records of NCCL-in-the-rank collectives taken a seq, not yet written (SendRecord queues,
  // RecordSendLoop or the next writer writes), and their sender.
  std::vector<v1::SessionRequest> unsent_records_ ABSL_GUARDED_BY(write_mu_);
  bool record_sender_stop_ ABSL_GUARDED_BY(write_mu_) = false;
  std::thread record_sender_ ABSL_GUARDED_BY(write_mu_);
  int64_t next_seq_ ABSL_GUARDED_BY(write_mu_) = 0;
  int64_t next_collective_seq_ ABSL_GUARDED_BY(write_mu_) = 0;  // collectives only (the group's seq)
  mutable absl::Mutex completed_mu_;
  int64_t last_completed_seq_ ABSL_GUARDED_BY(completed_mu_) = -1;
  std::set<int64_t> completed_ahead_ ABSL_GUARDED_BY(completed_mu_);  // completed OK past a gap
  bool collectives_failed_ ABSL_GUARDED_BY(completed_mu_) = false;
  int64_t next_subgroup_ ABSL_GUARDED_BY(write_mu_) = 0;
  std::vector<int> ranks_;  // GetProcessGroupRanks
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
  absl::Status write_failure_ ABSL_GUARDED_BY(write_mu_);  // the first failed write's error
  absl::Status broken_ ABSL_GUARDED_BY(write_mu_);

  absl::Mutex pending_mu_;
  std::map<int64_t, std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(pending_mu_);

  const std::shared_ptr<Arena> arena_ = std::make_shared<Arena>();
  StagingPool staging_{options_.max_staging_bytes, options_.staging_window_bytes,
                       [this](size_t bytes) { return NewRegisteredSegment(bytes); }};

  absl::Mutex store_mu_;
  std::unique_ptr<StoreClient> store_ ABSL_GUARDED_BY(store_mu_);
  bool store_tried_ ABSL_GUARDED_BY(store_mu_) = false;

  // CUDA tensors: exported allocations and event pairs, and the Work that last used each
  // pair (IssueCuda).
  CudaTensors cuda_;
  absl::Mutex cuda_mu_;
  uint64_t next_cuda_slot_ ABSL_GUARDED_BY(cuda_mu_) = 0;
  std::shared_ptr<WorkImpl> cuda_slot_work_[CudaTensors::kSlots] ABSL_GUARDED_BY(cuda_mu_);

  // COLLSERVE_CUDA_PATH=nccl: this rank's communicator of the group and those of its single
  // point-to-point calls (by peer), or why one could not be made (final: the ranks that did
  // make one would otherwise wait for this one).
  absl::Mutex rank_comm_init_mu_;  // held while one is made (OnRankComm)
  absl::Mutex rank_comm_mu_;
  std::shared_ptr<RankComm> rank_comm_ ABSL_GUARDED_BY(rank_comm_mu_);
  std::map<int, std::shared_ptr<RankComm>> pair_comms_ ABSL_GUARDED_BY(rank_comm_mu_);
  absl::Status rank_comm_failure_ ABSL_GUARDED_BY(rank_comm_mu_);
  absl::Mutex records_mu_;
  int records_in_flight_ ABSL_GUARDED_BY(records_mu_) = 0;  // sent, not yet answered

  using Lane = CompletionLane<Done>;
  std::unique_ptr<Lane> collective_lane_;  // set before reader_ starts; joined in the destructor
  std::unique_ptr<Lane> p2p_lane_;
  std::thread reader_;
  absl::Notification reader_done_;

  // The write watch (WatchedWrite, WriteWatchLoop): when the write in progress started
  // (InfiniteFuture: none), whether the watch cancelled the stream for it, and its thread
  // (started with reader_, joined after it).
  mutable absl::Mutex watch_mu_;
  absl::Time write_started_ ABSL_GUARDED_BY(watch_mu_) = absl::InfiniteFuture();
  bool write_timed_out_ ABSL_GUARDED_BY(watch_mu_) = false;
  absl::Duration timed_out_after_ ABSL_GUARDED_BY(watch_mu_);
  bool watch_wake_ ABSL_GUARDED_BY(watch_mu_) = false;  // stop, or the op timeout changed
  bool watch_stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread write_watch_;
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_SESSION_PROCESS_GROUP_H_
