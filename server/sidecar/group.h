// One group as seen by one sidecar: its local ranks' sessions, the membership learned
// from the coordinator, the backend communicator among the group's hosts, and the
// executor thread that runs the group's collectives in seq order.
#ifndef COLLSERVE_SERVER_SIDECAR_GROUP_H_
#define COLLSERVE_SERVER_SIDECAR_GROUP_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>

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
#include "backends/rendezvous_store.h"
#include "collserve/v1/collectives.pb.h"
#include "collserve/v1/registry.pb.h"
#include "common/shm.h"
#include "server/sidecar/collective_args.h"
#include "server/sidecar/session.h"

namespace collserve::server {

// What a Group needs from its sidecar.
struct GroupEnv {
  std::string host_id;
  std::string gloo_hostname;
  // Store for backend rendezvous, in the group's job namespace.
  std::function<std::unique_ptr<backends::RendezvousStore>(const std::string& job)> rendezvous;
  // Tells the coordinator that `rank` left (fire and forget).
  std::function<void(const std::string& job, const std::string& group, int rank)> leave;
  // Called (once) when the group has no local ranks left; the sidecar drops it.
  std::function<void(const std::string& job, const std::string& group)> on_empty;
  prometheus::Family<prometheus::Counter>* collectives = nullptr;  // may be null
  // collserve_tensor_bytes_total by path: arena, staged, inline (each may be null).
  prometheus::Counter* bytes_arena = nullptr;
  prometheus::Counter* bytes_staged = nullptr;
  prometheus::Counter* bytes_inline = nullptr;
  // Threads for the intra-host data path (reductions and copies); shared by every group.
  backends::ThreadPool* pool = nullptr;
  // All-reduce across hosts: "auto" (direct while bytes x (hosts - 1) <= direct_max_bytes,
  // else Gloo's ring from ring_min_bytes up, else bcube), "direct", "ring" or "bcube"; and
  // the ring's largest piece (0 = Gloo's default).
  std::string allreduce_algorithm = "auto";
  size_t direct_max_bytes = 0;
  size_t ring_min_bytes = 0;
  size_t ring_segment_bytes = 0;
};

struct GroupParams {
  std::string job;
  std::string name;
  int world_size = 0;
  absl::Duration init_timeout;
  absl::Duration op_timeout;
};

// Thread-safe. Created on the first attach of one of its ranks on this host.
class Group {
 public:
  Group(GroupEnv env, GroupParams params);
  ~Group();  // stops and joins the executor

  const GroupParams& params() const { return params_; }

  // Registers a local rank's session (before its join at the coordinator completes).
  // INVALID_ARGUMENT (world_size differs from the group's), ALREADY_EXISTS (rank already
  // attached here), FAILED_PRECONDITION (the group failed; re-attach after every local rank left),
  // ABORTED (the group has just been emptied and is going away: create a new one).
  absl::Status AddLocal(int rank, int world_size, std::shared_ptr<Session> session, bool shared_memory);

  // Registers how to withdraw this rank's in-flight join (cancels the RPC, so the
  // coordinator drops the rank from the forming group). Called once per attach.
  void SetJoinCanceller(int rank, std::function<void()> cancel);

  // The coordinator answered this rank's join. On error the rank's session is closed with it.
  void OnJoined(int rank, const absl::StatusOr<collserve::v1::JoinResponse>& result);

  // A collective from a local rank. Completes (possibly with an error) through the
  // rank's session.
  void Submit(int rank, collserve::v1::Collective collective);

  // The rank's session ended (client closed it or died).
  void OnSessionClosed(int rank);

  // Sidecar shutdown: fails everything with UNAVAILABLE.
  void Stop();

 private:
  struct Submission {
    collserve::v1::Collective args;
    char* in = nullptr;   // the input (in-place ops: input and result)
    size_t in_bytes = 0;
    char* out = nullptr;  // out-of-place ops: the output
    size_t out_bytes = 0;
    std::vector<std::shared_ptr<ShmSegment>> segments;  // keep the mappings alive while queued/running
    std::string inline_in;   // inline input bytes
    std::string inline_out;  // inline output bytes (out-of-place ops)
    bool inline_mode = false;
    absl::Status error;      // invalid request: reported to every rank
    absl::Time deadline;
    int source = -1;         // RECV: the rank the message came from
    const char* algorithm = "";  // how it ran (Completion.algorithm)
  };
  struct LocalRank {
    std::shared_ptr<Session> session;
    bool shared_memory = false;
    bool joined = false;
    bool closed = false;
    std::function<void()> cancel_join;  // until the join completes
    int64_t next_seq = 0;
    std::deque<Submission> queue;  // collectives, in issue order
    std::map<std::string, std::shared_ptr<ShmSegment>> segments;  // mapped by name
  };
  enum class State { kJoining, kConnecting, kReady, kFailed };

  // Point-to-point. A send and a recv match when the recv's source is the sender (or any,
  // -1) and the tags are equal; among candidates the earliest to arrive wins, so
  // messages from one sender with one tag are received in the order sent (MPI's
  // non-overtaking rule, which torch's send/recv follow).
  struct PendingSend {  // a local rank's send to a local rank, not yet received
    int src = 0;
    uint64_t order = 0;
    Submission sub;
  };
  struct StagedMessage {  // a remote rank's message for a local rank, not yet received
    int src = 0;
    int dst = 0;
    int64_t tag = 0;
    int64_t dtype = 0;
    int64_t count = 0;
    uint64_t order = 0;
    std::string bytes;
  };
  struct PendingRecv {
    int dst = 0;
    Submission sub;
  };

  void ExecutorMain();
  // Runs the collectives at position `seq` of every local rank (absent: local ranks that
  // did not call a MONITORED_BARRIER in time).
  void RunCollective(int64_t seq, std::map<int, Submission>& subs, const std::vector<int>& absent);
  // The data step of each op, after the arguments agreed. Executor thread only. `all`
  // and `splits` hold every rank's arguments, indexed by rank.
  absl::Status RunReduce(const std::vector<RankArgs>& all, std::map<int, Submission>& subs, int num_hosts,
                         absl::Duration timeout);
  absl::Status RunBroadcast(const std::vector<RankArgs>& all, std::map<int, Submission>& subs, int num_hosts,
                            absl::Duration timeout);
  absl::Status RunGatherLike(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                             std::map<int, Submission>& subs, int num_hosts, absl::Duration timeout);
  absl::Status RunScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                          std::map<int, Submission>& subs, int num_hosts, absl::Duration timeout);
  absl::Status RunReduceScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                std::map<int, Submission>& subs, int num_hosts, absl::Duration timeout);
  // Across hosts: the local ranks' inputs (offset by `offset` bytes, scaled by PREMUL_SUM's
  // factors) reduced into `acc` (count elements), then all-reduced with the other hosts
  // (SUM for AVG/PREMUL_SUM; the caller divides). Sets algorithm_.
  absl::Status ReduceAcrossHosts(const RankArgs& a, std::map<int, Submission>& subs, size_t offset, char* acc,
                                 size_t count, absl::Duration timeout);
  // Gloo's all_reduce algorithm for `bytes` across hosts (ring from kGlooRingMinBytes,
  // bcube below); sets algorithm_.
  backends::AllReduceAlgorithm ChooseAllReduce(size_t bytes);
  // Whether an all_reduce of `bytes` across `num_hosts` takes the direct exchange (an
  // all-gather of the hosts' partial results, then a local reduction).
  bool UseDirect(size_t bytes, int num_hosts) const;
  // The LocalReduce of `a`'s op over the local inputs (offset by `offset` bytes), count
  // elements, with no destinations yet; reuses local_reduce_.
  backends::LocalReduce& LocalReduceOf(const RankArgs& a, std::map<int, Submission>& subs, size_t offset,
                                       size_t count);
  // Exchanges the splits of every rank across hosts (ops with NeedsSplits).
  absl::StatusOr<std::vector<RankSplits>> ExchangeSplits(const std::map<int, Submission>& subs, int num_hosts,
                                                         absl::Duration timeout);

  void SubmitP2PLocked(int rank, Submission sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Delivers a message to local rank `dst`'s recv; completes the recv (and `send`, if the
  // message is a local send).
  void DeliverLocked(PendingRecv& recv, int src, int64_t dtype, int64_t count, const char* bytes,
                     PendingSend* send) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void P2PTimerMain();
  void P2PSendMain();
  void P2PRecvMain();
  void StopP2P();
  // Fails the group: every queued submission and every later one gets `status`.
  void FailLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Complete(int rank, const Submission& sub, const absl::Status& status);
  // Maps the request's buffers (or takes its inline bytes); sets in/out of `sub`.
  absl::Status ResolveBuffers(LocalRank& local, Submission& sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MapBuffer(LocalRank& local, Submission& sub, const collserve::v1::Buffer& b, size_t bytes,
                         char** ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeEmptyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordCollective(int op, const absl::Status& status);

  const GroupEnv env_;
  const GroupParams params_;

  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kJoining;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::map<int, LocalRank> locals_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool emptied_ ABSL_GUARDED_BY(mu_) = false;
  bool attached_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t submissions_ ABSL_GUARDED_BY(mu_) = 0;  // wakes the executor to recompute its deadline  // Attached was sent to the local sessions
  // Membership (set by the first successful join).
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<collserve::v1::Member> members_ ABSL_GUARDED_BY(mu_);
  std::set<int> expected_local_ ABSL_GUARDED_BY(mu_);
  int host_index_ ABSL_GUARDED_BY(mu_) = 0;
  int num_hosts_ ABSL_GUARDED_BY(mu_) = 0;
  int max_local_ ABSL_GUARDED_BY(mu_) = 0;  // most ranks any host of the group serves
  std::map<std::string, std::vector<int>> host_ranks_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> rank_host_ ABSL_GUARDED_BY(mu_);  // rank -> host index in the communicator

  std::vector<std::vector<int>> ranks_by_host_ ABSL_GUARDED_BY(mu_);  // host index -> its ranks, ascending
  // Executor thread only: reused by every collective so that repeated calls allocate no
  // tensor-sized memory.
  backends::LocalReduce local_reduce_;
  std::vector<backends::CopyJob> copies_;
  std::vector<const void*> comm_inputs_;
  std::vector<void*> comm_outputs_;
  const char* algorithm_ = "local";  // how the current collective runs

  // Point-to-point state.
  uint64_t p2p_order_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<PendingSend> p2p_sends_ ABSL_GUARDED_BY(mu_);
  std::deque<StagedMessage> p2p_staged_ ABSL_GUARDED_BY(mu_);
  std::deque<PendingRecv> p2p_recvs_ ABSL_GUARDED_BY(mu_);
  std::deque<PendingSend> p2p_outgoing_ ABSL_GUARDED_BY(mu_);  // to ranks on other hosts
  bool p2p_stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t p2p_changes_ ABSL_GUARDED_BY(mu_) = 0;  // wakes the timer thread
  char p2p_header_[64] = {};  // the recv thread's header buffer; outlives comm_

  // Reused scratch memory of the executor (no allocation per collective of a repeated size).
  std::vector<char> scratch_a_, scratch_b_;

  std::unique_ptr<backends::Communicator> comm_;  // executor and p2p threads; reset after they stop
  std::thread executor_;
  std::thread p2p_timer_, p2p_sender_, p2p_receiver_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_GROUP_H_
