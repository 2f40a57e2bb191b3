// One GPU per rank (docs/gpu.md, "One GPU per rank"): with COLLSERVE_CUDA_PATH=nccl
// (InitOptions::cuda_path) each rank runs its group's CUDA collectives and point-to-point
// calls with NCCL in its own process, on the caller's stream, as torch's ProcessGroupNCCL
// does; the service keeps the rendezvous (the NCCL unique id goes through the coordinator's
// store, under the group's name and generation) and ends the communicator when the group
// does. This header is the SDK's side of it: a communicator of one rank (RankComm), made by
// a RankCommFactory: NCCL, loaded at run time (dlopen of COLLSERVE_NCCL_LIBRARY, default
// libnccl.so.2: the copy a pip torch already loaded, if any), or a test's.
#ifndef COLLSERVE_CLIENT_RANK_COMM_H_
#define COLLSERVE_CLIENT_RANK_COMM_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collserve/types.h"

namespace collserve::client {

// One rank's communicator of a group generation, on the GPU that was current when it was
// made. Every call queues its work on `stream` (a cudaStream_t of that GPU; nullptr: the
// legacy default stream) and returns without waiting for the GPU, like NCCL's own calls.
// Buffers are device addresses on that GPU; counts are elements of `dtype` (float32,
// float64, float16, bfloat16, int32, int64, int8, uint8; bool as uint8 where no arithmetic
// is involved). Errors: INVALID_ARGUMENT (a dtype or ReduceOp NCCL lacks, a buffer on another
// device), the NCCL error of the call (INTERNAL, or UNAVAILABLE for a failed peer), ABORTED
// once Abort ran, DEADLINE_EXCEEDED when NCCL did not take the call within the communicator's
// timeout. Thread-safe (calls are serialized).
class RankComm {
 public:
  virtual ~RankComm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // ncclAllReduce; `in` may equal `out`. ReduceOp: SUM, AVG, PRODUCT, MIN, MAX.
  virtual absl::Status AllReduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                 void* stream) = 0;
  // ncclBroadcast of `count` elements in place from group rank `root`.
  virtual absl::Status Broadcast(void* data, size_t count, DataType dtype, int root, void* stream) = 0;
  // ncclAllGather: `in` (count elements) from every rank into `out` (size() * count, rank order).
  virtual absl::Status AllGather(const void* in, void* out, size_t count, DataType dtype, void* stream) = 0;
  // ncclReduceScatter: `in` (size() * count) reduced, this rank's block of `count` into `out`.
  virtual absl::Status ReduceScatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                     void* stream) = 0;
  // One transfer of a grouped send/receive: `count` elements at `data` to or from `peer`.
  struct Transfer {
    void* data;
    size_t count;
    int peer;
  };
  // ncclGroupStart; ncclSend for each of `sends`, ncclRecv for each of `recvs`; ncclGroupEnd.
  // NCCL pairs the k-th send from rank a to rank b with b's k-th receive from a; a peer may
  // be this rank (a copy). Transfers of 0 elements are skipped.
  virtual absl::Status SendRecv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs,
                                DataType dtype, void* stream) = 0;

  // Ends the communicator (ncclCommAbort): later calls return ABORTED naming `why` (the
  // first Abort's); work queued on streams is cancelled rather than left waiting for a peer.
  // Idempotent.
  virtual void Abort(const absl::Status& why) = 0;
  // Ends the communicator once the work it queued finished on the GPU, at most `within` from
  // now (then as Abort); later calls fail at once naming `why` (Failure() is `why` from now).
  // For a group that lost a rank, its session or its process group: what a peer already did
  // its part of (its last collective, a send the receiver's NCCL buffer took) completes on
  // this GPU instead of being cancelled mid-kernel, which would leave the output half written
  // with no error; a call that waits on the lost peer ends after `within`. Does not block;
  // Abort (a check that found the ranks disagree) still ends it at once, and its reason
  // replaces this one (the two come from different threads in either order). Idempotent.
  virtual void AbortWhenDrained(const absl::Status& why, absl::Duration within) = 0;
  // The communicator's failure: an asynchronous NCCL error (a peer failed), a collective
  // still unfinished on the GPU longer than the op timeout, or Abort's reason; OK otherwise.
  virtual absl::Status Failure() = 0;
};

// How a communicator is made (RankCommFactory::Connect).
struct RankCommOptions {
  // Every rank joins within it, else DEADLINE_EXCEEDED naming it (the group's init timeout).
  absl::Duration timeout = absl::Seconds(300);
  // How long a collective may stay unfinished on the GPU before the communicator fails
  // (torch's watchdog; checked every 100 ms).
  absl::Duration op_timeout = absl::Seconds(300);
  // The IP traffic class of NCCL's network transports (ncclConfig_t.trafficClass: the job's
  // DSCP << 2, collserve.v1.Attached.traffic_dscp), 0-255; -1 leaves NCCL's own (NCCL_IB_TC).
  int traffic_class = -1;
  // The communicator's name in NCCL's logs (ncclConfig_t.commName); "" = none.
  std::string name;
};

class RankCommFactory {
 public:
  virtual ~RankCommFactory() = default;
  // A new NCCL unique id (ncclGetUniqueId: NCCL_UNIQUE_ID_BYTES bytes), made by rank 0 of a
  // communicator and given to the others.
  virtual absl::StatusOr<std::string> NewUniqueId() = 0;
  // Rank `rank` of `size` of the communicator `unique_id` names, on the calling thread's
  // current GPU, made as `options` say. Blocks until every rank joined, at most
  // options.timeout (DEADLINE_EXCEEDED naming it).
  virtual absl::StatusOr<std::unique_ptr<RankComm>> Connect(const std::string& unique_id, int rank, int size,
                                                            const RankCommOptions& options) = 0;
};

// The factory in use: the one a test set, else NCCL loaded at run time; null (with the
// reason in *why) when this build has no CUDA or NCCL cannot be loaded. Thread-safe.
RankCommFactory* GetRankCommFactory(std::string* why);

// For tests (no GPU): replaces the factory for the process (nullptr: back to NCCL). Call
// before any group uses it.
void SetRankCommFactoryForTesting(RankCommFactory* factory);

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_RANK_COMM_H_
