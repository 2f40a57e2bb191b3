// Point-to-point (send/recv) for the local ranks of one group generation: matching on this
// host, and a small wire protocol over the communicator's tagged slots to ranks on other
// hosts.
//
// Matching follows MPI's non-overtaking rule, which torch's send/recv follow: a send and a
// recv match when the recv's source is the sender (or any, -1) and the tags are equal;
// among candidates the earliest to arrive wins, so messages from one sender with one tag
// are received in the order sent. A send to a rank on this host completes when it is
// received; a send to another host completes when its bytes are handed to the transport.
// A mismatch in dtype or count fails both sides with INVALID_ARGUMENT naming them.
//
// CUDA tensors (Submission::device >= 0, docs/gpu.md) follow the same matching. On one
// host, a matched pair is one device copy on a point-to-point stream of the sidecar, after
// the sender's and the receiver's ready events, before both done events; both complete once
// it is queued (the GPU work is not waited for, as in a collective). Between hosts the bytes
// travel as host bytes over the same protocol: the sender's host copies them off the GPU
// (DeviceStream::CopyToHost) and the receiver's host onto it (CopyFromHost), so a CUDA
// tensor may be received into a CPU tensor and the other way round. The two tensors of a
// pair on one host must be on one GPU (INVALID_ARGUMENT otherwise: a request error, the
// group stays usable); a failed or timed-out GPU copy fails the group.
//
// Threads: a timer (deadlines), with several hosts a sender and a receiver, and a mover
// (started at the first pair that needs it): the copies of CUDA tensors, and host copies of
// at least kMoverHostBytes matched when a request arrives (a local pair, or a recv of a
// message already received from another host), which would otherwise run on the thread
// that submits, in the sidecar the one that reads every session's ops channel. Thread-safe.
#ifndef COLLSERVE_ENGINE_P2P_H_
#define COLLSERVE_ENGINE_P2P_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/device.h"
#include "engine/interfaces.h"
#include "engine/submission.h"
#include "engine/topology.h"

namespace collserve::engine {

class PointToPoint {
 public:
  // `on_failure` is called (without this object's lock) when the transport between hosts
  // fails; the owner then fails its group, which calls Fail here. `observer` may be null.
  // `device` (may be null: no CUDA tensors reach it) gives the streams for CUDA tensors.
  PointToPoint(const Topology& topology, absl::Duration op_timeout, EngineObserver* observer,
               std::function<void(const absl::Status&)> on_failure, backends::DeviceRuntime* device = nullptr);
  ~PointToPoint();  // Stop()

  // Starts the threads; `comm` (may be null with one host) must outlive Stop().
  void Start(backends::Communicator* comm);
  // A SEND or RECV of a local rank whose request passed ValidateRequest and ResolveBuffers.
  // Completes through the submission's session; after Fail, at once with the failure.
  void Submit(Submission sub);
  // Completes every pending send and recv with `status`, as every later Submit. Idempotent
  // (the first status stays).
  void Fail(const absl::Status& status);
  // Completes `sub` (a SEND or RECV of a local rank) at once without running it, after its
  // group failed with `failure`: with the peer's departure when the peer is known to have
  // left (for a RECV, by its host's in-band word), which names the reason this call could
  // never complete whatever broke the transport since; else with `failure`. Thread-safe.
  void Refuse(Submission sub, const absl::Status& failure);
  // Why the lowest-numbered rank known here to have left did (Depart, or its host's in-band
  // word), or OK when none did. Thread-safe.
  absl::Status FirstDeparture() const;
  // Local rank `rank` left the group (its session ended; `why` says so). Its own pending
  // sends and recvs are dropped (completed with `why`: nobody reads the answer); the other
  // ranks' sends to it and recvs from it (source `rank`, no message from it waiting) fail
  // now, and so do later ones, with `why`'s code and a message naming both ranks and
  // `why`. Everything else goes on: leaving is local, as in torch.distributed. With
  // several hosts the sender thread then tells every other host, in band (a departure
  // header on the header slot, after every message the rank sent): there its recvs and
  // sends fail the same way, and never before the rank's earlier messages arrived.
  void Depart(int rank, const absl::Status& why);
  // Rank `rank` of another host left (the coordinator said so; `why`): sends to it fail now
  // and later, as in Depart. Recvs from it wait for its host's in-band word (its messages
  // sent before it left may still be on their way), or their deadline.
  void DepartSendsTo(int rank, const absl::Status& why);
  // Stops and joins the threads (idempotent). The communicator may be destroyed after.
  // Departures of local ranks not yet announced to the other hosts are sent first (for up
  // to kAnnounceFlush): a host whose last rank leaves closes its connections once stopped,
  // and the others must hear of its ranks' departures before that end of file, or they
  // would take it as a failure (and keep announcing their own departures to it).
  void Stop();
  static constexpr absl::Duration kAnnounceFlush = absl::Seconds(2);
  // Host copies of at least this many bytes that a Submit matches go to the mover (a copy of
  // 1 GiB takes a core a few hundred milliseconds); smaller ones are made at once.
  static constexpr size_t kMoverHostBytes = size_t{1} << 20;

 private:
  struct PendingSend {  // a local rank's send, not yet received (or not yet sent across hosts)
    uint64_t order = 0;
    Submission sub;
  };
  // Fails what needs `rank` (Depart's effect on this host).
  void DepartLocked(int rank, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refuse's body.
  void RefuseLocked(const Submission& sub, const absl::Status& failure) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why sends to `peer` cannot complete (it left), or null.
  const absl::Status* WhyLeftLocked(int peer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct StagedMessage {  // a remote rank's message for a local rank, not yet received
    int src = 0;
    int dst = 0;
    int64_t tag = 0;
    int64_t dtype = 0;
    int64_t count = 0;
    uint64_t order = 0;
    std::string bytes;
  };

  // A matched pair that needs the GPU (either tensor is a CUDA tensor), for the mover.
  struct DeviceJob {
    Submission recv;
    bool has_send = false;
    Submission send;    // a local sender's submission (has_send)
    std::string bytes;  // else the message's bytes, from another host
    bool host = false;  // both tensors in host memory: a memcpy (kMoverHostBytes or more)
  };
  // Delivers a message to `recv`; completes it (and `send`, for a local send), or hands the
  // pair to the mover when either tensor is on the GPU. `owned`, when not null, holds
  // `bytes` and may be moved from (a message from another host).
  void DeliverLocked(Submission& recv, int src, int64_t dtype, int64_t count, const char* bytes, Submission* send,
                     std::string* owned = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes every pair waiting for the mover with `status`.
  void CompleteJobsLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The mover's loop and one job's GPU work; the sender's copy of a CUDA tensor off the GPU.
  void MoveMain();
  absl::Status MoveOnDevice(DeviceJob& job);
  absl::Status StageDeviceSend(const Submission& send, std::string* bytes);
  // The stream of `device` in `streams` (one thread's), made at first use.
  absl::StatusOr<backends::DeviceStream*> StreamOf(std::map<int, std::unique_ptr<backends::DeviceStream>>& streams,
                                                   int device);
  // How long the GPU may take for `sub`'s copy: its op timeout.
  absl::Duration GpuTimeout(const Submission& sub) const;
  void TimerMain();
  void SendMain();
  void RecvMain();

  const Topology& topology_;
  const absl::Duration op_timeout_;
  EngineObserver* const observer_;
  const std::function<void(const absl::Status&)> on_failure_;
  backends::Communicator* comm_ = nullptr;
  backends::DeviceRuntime* const device_;

  mutable absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t order_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // wakes the timer thread
  std::deque<PendingSend> sends_ ABSL_GUARDED_BY(mu_);     // to local ranks
  std::deque<PendingSend> outgoing_ ABSL_GUARDED_BY(mu_);  // to ranks on other hosts
  std::deque<StagedMessage> staged_ ABSL_GUARDED_BY(mu_);
  std::deque<Submission> recvs_ ABSL_GUARDED_BY(mu_);
  std::map<int, absl::Status> departed_ ABSL_GUARDED_BY(mu_);  // rank -> why it left
  std::map<int, absl::Status> unreachable_ ABSL_GUARDED_BY(mu_);  // DepartSendsTo: sends only
  std::deque<DeviceJob> jobs_ ABSL_GUARDED_BY(mu_);  // for the mover
  std::deque<int> announce_ ABSL_GUARDED_BY(mu_);  // local ranks that left, for the sender to announce
  bool announcing_ ABSL_GUARDED_BY(mu_) = false;   // the sender is sending one of them
  // The error of `sub` (a send to or a recv from a departed rank).
  absl::Status PeerLeftLocked(const Submission& sub) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The receiver thread's buffers: a cancelled Recv may still write them until the
  // communicator is destroyed, so they live as long as this object.
  char header_[64] = {};
  std::string payload_;
  // CUDA streams by GPU: the mover's and the sender's (each used by its thread only).
  std::map<int, std::unique_ptr<backends::DeviceStream>> move_streams_, send_streams_;
  std::string staged_send_;  // the sender's copy of a CUDA tensor's bytes
  std::thread timer_, sender_, receiver_, mover_;
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_P2P_H_
