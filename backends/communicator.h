// A communicator among the hosts (sidecars) of one group: the inter-host step of a
// hierarchical collective. One per (group, generation) on each host. Host-memory buffers.
//
// Thread safety: a Communicator is used by one thread at a time (the group's executor);
// calls must be issued in the same order on every host.
// Failure: after any error the communicator is unusable; every later call returns
// FAILED_PRECONDITION naming the first error (like an aborted NCCL communicator).
#ifndef COLLSERVE_BACKENDS_COMMUNICATOR_H_
#define COLLSERVE_BACKENDS_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/types.h"

namespace collserve::backends {

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This host's index in [0, size()) and the number of hosts.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In-place all_reduce of `count` elements of `dtype` at `data` with `op` across hosts.
  // `op` must not be kAvg (callers divide after a kSum; the divisor is the world size of
  // ranks, not of hosts). Errors: DEADLINE_EXCEEDED (a peer did not take part within
  // `timeout`), UNAVAILABLE (a peer host went away), FAILED_PRECONDITION (aborted before).
  virtual absl::Status AllReduce(void* data, size_t count, DataType dtype, ReduceOp op,
                                 absl::Duration timeout) = 0;

  // Broadcast of `bytes` bytes at `data` from host `root` to every host (in place).
  // Same errors as AllReduce; INVALID_ARGUMENT if root is out of range.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root, absl::Duration timeout) = 0;

  // All-gather of `bytes` bytes per host: out (size() * bytes) gets host i's input at
  // offset i * bytes. Same errors as AllReduce.
  virtual absl::Status AllGather(const void* in, void* out, size_t bytes,
                                 absl::Duration timeout) = 0;
};

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_COMMUNICATOR_H_
