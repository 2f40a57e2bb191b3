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
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/reduce.h"
#include "common/types.h"

namespace collserve::backends {

// Which algorithm an all_reduce across hosts uses, where the backend has a choice.
enum class AllReduceAlgorithm {
  kDefault,  // the backend's own choice
  kRing,     // Gloo's ring: 2(h-1) steps, 2(h-1)/h of the bytes per host (bandwidth-optimal)
  kBcube,    // Gloo's bcube (recursive halving-doubling for base 2): 2 log2(h) steps
};

// One point-to-point transfer of device memory in a grouped call (SendRecvGroupOnStream):
// `bytes` at `data`, to or from host `peer` (0..size()-1, not this one).
struct StreamTransfer {
  void* data = nullptr;
  size_t bytes = 0;
  int peer = -1;
};

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
  // `algorithm` is a request; backends without that choice (NCCL picks its own) ignore it.
  virtual absl::Status AllReduce(void* data, size_t count, DataType dtype, ReduceOp op, absl::Duration timeout,
                                 AllReduceAlgorithm algorithm = AllReduceAlgorithm::kDefault) = 0;

  // All-reduce of several local buffers: every outputs[k] gets `op` over the inputs of
  // every host (count elements each, in `dtype`). An output may be an input (in place).
  // Gloo interleaves the local reduction and the copies into the outputs with the
  // transfer, segment by segment (its ring and bcube take several inputs and outputs);
  // this default reduces locally, all-reduces outputs[0], then copies. Errors as AllReduce,
  // plus INVALID_ARGUMENT for empty inputs or outputs.
  virtual absl::Status AllReduceLocal(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                                      size_t count, DataType dtype, ReduceOp op, absl::Duration timeout,
                                      AllReduceAlgorithm algorithm = AllReduceAlgorithm::kDefault) {
    if (inputs.empty() || outputs.empty()) {
      return absl::InvalidArgumentError("AllReduceLocal needs at least one input and one output");
    }
    const size_t bytes = count * ElementSize(dtype);
    if (outputs[0] != inputs[0] && bytes > 0) std::memcpy(outputs[0], inputs[0], bytes);
    for (size_t i = 1; i < inputs.size(); ++i) Reduce(dtype, op, outputs[0], outputs[0], inputs[i], count);
    if (absl::Status s = AllReduce(outputs[0], count, dtype, op, timeout, algorithm); !s.ok()) return s;
    for (size_t i = 1; i < outputs.size(); ++i) {
      if (outputs[i] != outputs[0] && bytes > 0) std::memcpy(outputs[i], outputs[0], bytes);
    }
    return absl::OkStatus();
  }

  // Broadcast of `bytes` bytes at `data` from host `root` to every host (in place).
  // Same errors as AllReduce; INVALID_ARGUMENT if root is out of range.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root, absl::Duration timeout) = 0;

  // All-gather of `bytes` bytes per host: out (size() * bytes) gets host i's input at
  // offset i * bytes. Same errors as AllReduce.
  virtual absl::Status AllGather(const void* in, void* out, size_t bytes,
                                 absl::Duration timeout) = 0;

  // All-gather with a size per host (MPI_Allgatherv): host i contributes bytes[i] bytes
  // (this host's are at `in`); `out` (sum(bytes)) gets them concatenated in host order.
  // Every host passes the same `bytes` (size() entries). Same errors as AllReduce, plus
  // INVALID_ARGUMENT when bytes.size() != size(). Gloo: gloo::allgatherv.
  virtual absl::Status AllGatherV(const void* in, void* out, const std::vector<size_t>& bytes,
                                  absl::Duration timeout) = 0;

  // All-to-all with a size per pair of hosts (MPI_Alltoallv): this host sends send_bytes[j]
  // bytes to host j (the pieces concatenated in host order at `in`) and receives
  // recv_bytes[j] bytes from host j into `out`, concatenated in host order. Host i's
  // send_bytes[j] must equal host j's recv_bytes[i]. Same errors as AllReduce, plus
  // INVALID_ARGUMENT when a vector does not have size() entries. Gloo: gloo::alltoallv.
  // Backends without it return UNIMPLEMENTED and stay usable (callers fall back to
  // AllGatherV).
  virtual absl::Status AllToAllV(const void* in, const std::vector<size_t>& send_bytes, void* out,
                                 const std::vector<size_t>& recv_bytes, absl::Duration timeout) {
    (void)in, (void)send_bytes, (void)out, (void)recv_bytes, (void)timeout;
    return absl::UnimplementedError("this backend has no all-to-all with sizes");
  }

  // Point-to-point between hosts, on numbered slots (0 <= slot < 2^24) separate from the
  // collectives' (so it may run on other threads while collectives run; Send, Recv and
  // AbortRecv are thread-safe). Send: `bytes` at `data` to host `peer`; returns once the
  // bytes are handed to the transport, which waits for the peer to post a matching Recv.
  // Recv: `bytes` into `data` from any host in `peers` (on the same slot); *from gets
  // the sender. Errors: as AllReduce; CANCELLED if AbortRecv was called (then the Recv's
  // buffer must stay valid until the communicator is destroyed). Messages on one slot
  // from one host arrive in the order sent. Backends without tagged any-source receives
  // (NCCL) return UNIMPLEMENTED.
  virtual absl::Status Send(const void* data, size_t bytes, int peer, uint32_t slot, absl::Duration timeout) {
    (void)data, (void)bytes, (void)peer, (void)slot, (void)timeout;
    return absl::UnimplementedError("this backend has no point-to-point between hosts");
  }
  virtual absl::Status Recv(void* data, size_t bytes, const std::vector<int>& peers, uint32_t slot, int* from,
                            absl::Duration timeout) {
    (void)data, (void)bytes, (void)peers, (void)slot, (void)from, (void)timeout;
    return absl::UnimplementedError("this backend has no point-to-point between hosts");
  }
  // Makes a blocked (or the next) Recv return CANCELLED. For shutting down a receive loop.
  virtual void AbortRecv() {}
  // Host `peer` is known to be gone (the coordinator lost it): every call blocked on it, and
  // every later one, fails now instead of at its timeout; calls among the other hosts fail
  // as the failure spreads (the communicator is unusable afterwards, as after any error).
  // Best effort: a call the transport does not wake still ends at its timeout (the engine
  // answers its ranks without it: engine::Group::AnswerStrandedCollective).
  // Thread-safe; any thread. Default: nothing (calls end at their timeout).
  virtual void ShutdownPeer(int peer) { (void)peer; }

  // Marks this communicator's connections to every peer host with a traffic class, so that
  // priority queueing on the path (a switch's QoS on DSCP, a host qdisc on the socket
  // priority: pfifo_fast's bands, an htb class chosen by a u32 filter on the DSCP) can send
  // one job's packets before another's bulk bytes. `dscp` (0-63, RFC 2474; -1 leaves it) goes
  // into the IP header's traffic-class byte (IP_TOS / IPV6_TCLASS, dscp << 2); `socket_priority`
  // (SO_PRIORITY, socket(7); -1 leaves it) orders the host's own queues: 0-6 need no
  // privilege, higher values CAP_NET_ADMIN or CAP_NET_RAW. Returns how many connections it
  // marked. Errors: INVALID_ARGUMENT (dscp over 63, a negative priority other than -1),
  // PERMISSION_DENIED (the kernel refused a priority: names it and the capabilities; no
  // socket changed), UNIMPLEMENTED (a backend whose sockets are not reachable: MPI, NCCL).
  // Call it once connected; thread-safe.
  virtual absl::StatusOr<int> MarkTraffic(int dscp, int socket_priority) {
    (void)dscp, (void)socket_priority;
    return absl::UnimplementedError("this backend cannot mark its connections' traffic");
  }

  // Device memory (backends with a GPU data path: NCCL). Each call queues the collective on
  // `stream` (a cudaStream_t on this communicator's device) and returns without waiting;
  // `data`, `in` and `out` are device addresses. Errors are those of queueing (a failure
  // while it runs shows in AsyncError): INVALID_ARGUMENT (dtype/op the backend lacks),
  // UNAVAILABLE/INTERNAL (the backend's), FAILED_PRECONDITION (aborted before). Backends
  // without device memory return UNIMPLEMENTED.
  //   AllReduceOnStream: in place, `count` elements; `op` as AllReduce (no kAvg).
  //   BroadcastOnStream: in place, `bytes` from host `root`.
  //   AllGatherOnStream: `in` (`bytes`) to `out` (size() * bytes; host i's at i * bytes).
  //   ReduceScatterOnStream: `in` (size() * count elements) reduced; host i gets block i in
  //     `out` (count elements).
  //   BroadcastGroupOnStream: several broadcasts as one (ncclGroupStart/End): piece k of
  //     `bytes[k]` at datas[k] from host roots[k].
  //   SendRecvGroupOnStream: every send and receive as one (ncclGroupStart, ncclSend /
  //     ncclRecv, ncclGroupEnd; NCCL's point-to-point, 2.7 and later). Between two hosts the
  //     k-th send of one is the k-th receive of the other, with the same size: both sides
  //     list them in the same order. Zero-byte transfers are skipped. INVALID_ARGUMENT for a
  //     peer out of range or this host.
  virtual absl::Status AllReduceOnStream(void* data, size_t count, DataType dtype, ReduceOp op, void* stream) {
    (void)data, (void)count, (void)dtype, (void)op, (void)stream;
    return absl::UnimplementedError("this backend has no device-memory collectives");
  }
  virtual absl::Status BroadcastOnStream(void* data, size_t bytes, int root, void* stream) {
    (void)data, (void)bytes, (void)root, (void)stream;
    return absl::UnimplementedError("this backend has no device-memory collectives");
  }
  virtual absl::Status AllGatherOnStream(const void* in, void* out, size_t bytes, void* stream) {
    (void)in, (void)out, (void)bytes, (void)stream;
    return absl::UnimplementedError("this backend has no device-memory collectives");
  }
  virtual absl::Status ReduceScatterOnStream(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                             void* stream) {
    (void)in, (void)out, (void)count, (void)dtype, (void)op, (void)stream;
    return absl::UnimplementedError("this backend has no device-memory collectives");
  }
  virtual absl::Status BroadcastGroupOnStream(const std::vector<void*>& datas, const std::vector<size_t>& bytes,
                                              const std::vector<int>& roots, void* stream) {
    (void)datas, (void)bytes, (void)roots, (void)stream;
    return absl::UnimplementedError("this backend has no device-memory collectives");
  }
  virtual absl::Status SendRecvGroupOnStream(const std::vector<StreamTransfer>& sends,
                                             const std::vector<StreamTransfer>& recvs, void* stream) {
    (void)sends, (void)recvs, (void)stream;
    return absl::UnimplementedError("this backend has no device-memory point-to-point");
  }
  // The first asynchronous failure of queued device-memory work (ncclCommGetAsyncError), OK
  // while there is none. Thread-safe.
  virtual absl::Status AsyncError() { return absl::OkStatus(); }
  // Aborts queued device-memory work (ncclCommAbort) so that nothing waits on a peer that
  // will not come; the communicator is unusable afterwards. Thread-safe.
  virtual void Abort() {}
};

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_COMMUNICATOR_H_
