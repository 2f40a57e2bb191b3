// NCCL implementation of backends::Communicator (built only when CUDA and nccl.h are
// found: COLLSERVE_WITH_NCCL=AUTO|ON). One GPU per host process; the unique id is
// exchanged through the RendezvousStore (as torch's ProcessGroupNCCL does through its
// c10d store). Buffers passed to AllReduce/AllGather are host memory: they are staged
// through a device buffer (the sidecar's tensors live in shared host memory).
#ifndef COLLSERVE_BACKENDS_NCCL_NCCL_COMMUNICATOR_H_
#define COLLSERVE_BACKENDS_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/rendezvous_store.h"

namespace collserve::backends {

struct NcclOptions {
  int device = 0;                                        // CUDA device ordinal
  absl::Duration connect_timeout = absl::Seconds(300);   // unique-id exchange + init
};

// Number of CUDA devices visible (0 when there is no GPU or no driver). Never fails.
int CudaDeviceCount();

// Creates the communicator of host `rank` of `size`. Rank 0 creates the NCCL unique id and
// publishes it under "<prefix>/nccl_id"; the others wait for it. Errors: INVALID_ARGUMENT
// (rank/size/device), FAILED_PRECONDITION (no CUDA device), DEADLINE_EXCEEDED (the id did
// not appear in time), UNAVAILABLE/INTERNAL (ncclResult_t / cudaError_t, with NCCL's text).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(RendezvousStore& store, const std::string& prefix,
                                                           int rank, int size, const NcclOptions& options);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_NCCL_NCCL_COMMUNICATOR_H_
