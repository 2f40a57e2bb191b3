// The sidecar's GPU side: CUDA tensors of the training processes on its host, reached with
// CUDA IPC (cudaIpcOpenMemHandle / cudaIpcOpenEventHandle), and one CUDA stream per group
// on which their collectives are queued. An interface without CUDA types, so that the
// engine (which may not see CUDA, NCCL or Gloo headers) can use it; the implementation is
// backends/cuda (CudaDeviceRuntime), built when the CUDA toolkit is found. A build or a
// host without a GPU has no DeviceRuntime, and CUDA tensors are FAILED_PRECONDITION.
//
// Stream semantics follow torch's ProcessGroupNCCL (reference: torch/csrc/distributed/
// c10d/ProcessGroupNCCL.cpp, syncStream and WorkNCCL::synchronizeStream): the sidecar's
// stream waits for an event the client recorded on its stream after producing the input,
// the collective is queued (not waited for), an event the client owns is recorded after
// it, and the client's stream waits for that event. The CPU of neither side waits for the
// GPU, except DeviceStream::EndOp bounding the work in flight.
#ifndef COLLSERVE_BACKENDS_DEVICE_H_
#define COLLSERVE_BACKENDS_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/types.h"

namespace collserve::backends {

// Sizes of the opaque CUDA IPC handles (cudaIpcMemHandle_t, cudaIpcEventHandle_t) and of a
// device UUID (cudaDeviceProp.uuid).
inline constexpr size_t kCudaIpcHandleBytes = 64;
inline constexpr size_t kCudaUuidBytes = 16;

// A client's device allocation mapped into the sidecar; unmapped (cudaIpcCloseMemHandle)
// when the last reference goes. `base` is the sidecar's address of the allocation's first
// byte, `bytes` its size.
struct DeviceMapping {
  virtual ~DeviceMapping() = default;
  char* base = nullptr;
  size_t bytes = 0;
  int device = 0;
};

// A client's interprocess event opened in the sidecar; destroyed with the last reference.
// `event` is a cudaEvent_t.
struct DeviceEvent {
  virtual ~DeviceEvent() = default;
  void* event = nullptr;
};

class DeviceStream;

// Thread-safe.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  // The ordinal of the visible GPU whose UUID is `uuid` (kCudaUuidBytes). INVALID_ARGUMENT
  // for a malformed UUID, NOT_FOUND when no visible GPU has it.
  virtual absl::StatusOr<int> DeviceOf(const std::string& uuid) = 0;

  // Maps the allocation a client exported as `ipc_handle` (kCudaIpcHandleBytes of
  // cudaIpcMemHandle_t) on `device`. One mapping per handle in the process, shared by
  // every holder. INVALID_ARGUMENT (malformed handle; CUDA refuses it: not an allocation
  // of a live process on this device).
  virtual absl::StatusOr<std::shared_ptr<DeviceMapping>> MapMemory(int device, const std::string& ipc_handle) = 0;

  // Opens the interprocess event a client exported as `ipc_handle` (kCudaIpcHandleBytes
  // of cudaIpcEventHandle_t). One per handle in the process. INVALID_ARGUMENT as MapMemory.
  virtual absl::StatusOr<std::shared_ptr<DeviceEvent>> OpenEvent(int device, const std::string& ipc_handle) = 0;

  // A new stream on `device` for one group. INTERNAL with CUDA's message on failure.
  virtual absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(int device) = 0;
};

// One group's queue of GPU work (a cudaStream_t of the sidecar). Used by one thread at a
// time (the group's executor, or one of its point-to-point threads, each with its own).
// Every call but CopyToHost / CopyFromHost queues work and returns; errors are those CUDA
// reports when queueing (INTERNAL, with its message).
class DeviceStream {
 public:
  virtual ~DeviceStream() = default;

  virtual int device() const = 0;
  // The cudaStream_t, for a communicator's device-memory calls.
  virtual void* stream() const = 0;

  // The stream waits for `event` (cudaStreamWaitEvent) / records it (cudaEventRecord).
  virtual absl::Status WaitEvent(const DeviceEvent& event) = 0;
  virtual absl::Status RecordEvent(const DeviceEvent& event) = 0;

  // outputs[k][i] = scale * op(inputs[0][i], ..., inputs[n-1][i]) for i < count, in one
  // pass over the inputs (each element is read once and written once per output; an
  // output may be an input). dtype: float32, float64, float16, bfloat16, int32, int64,
  // int8, uint8, bool; op: kSum, kProduct, kMin, kMax (bool: sum/max = or, product/min =
  // and); scale != 1 only for floating types (AVG's 1/world_size). Accumulates in the
  // element type (float for 16-bit floats). INVALID_ARGUMENT otherwise.
  virtual absl::Status Reduce(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                              size_t count, DataType dtype, ReduceOp op, double scale) = 0;

  // Copies `bytes` from `src` to `dst` (device memory; cudaMemcpyAsync).
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;

  // Device memory of at least `bytes`, owned by the stream, valid until the next call.
  virtual absl::StatusOr<void*> Scratch(size_t bytes) = 0;

  // Copies `bytes` between host memory (any: pageable, a shared-memory segment) and device
  // memory, after the work queued before it (e.g. a WaitEvent on a client's ready event),
  // through the stream's own pinned staging buffer in pieces of at most kHostStagingBytes.
  // Unlike the other calls these wait for the GPU: CopyToHost returns once the bytes are in
  // `dst`, CopyFromHost once `src` may be reused (the copy is finished). Both wait at most
  // `timeout` in all: DEADLINE_EXCEEDED naming it (the stream then counts as failed, as in
  // EndOp), or the CUDA error of a failed copy. Point-to-point between hosts moves CUDA
  // tensors this way (engine/p2p.h).
  static constexpr size_t kHostStagingBytes = size_t{8} << 20;
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes, absl::Duration timeout) = 0;
  virtual absl::Status CopyFromHost(void* dst, const void* src, size_t bytes, absl::Duration timeout) = 0;

  // Ends one collective: `keep` (the mappings and events it used) stays alive until the
  // GPU has finished it. At most `max_in_flight` collectives stay unfinished: beyond that
  // it waits for the oldest, up to `timeout`, polling `check` (a communicator's
  // asynchronous error) meanwhile. DEADLINE_EXCEEDED when the GPU did not finish in time
  // (also when the oldest unfinished one was queued more than `timeout` ago: a stream stuck
  // on a client's event or a peer is found at the next collective); the CUDA error of a
  // failed kernel or copy; `check`'s error.
  virtual absl::Status EndOp(std::vector<std::shared_ptr<void>> keep, int max_in_flight, absl::Duration timeout,
                             const std::function<absl::Status()>& check) = 0;
};

// A DeviceRuntime over the CUDA runtime, or null (with the reason in *why) when this build
// has no CUDA or no GPU is visible. Defined in the collserve_backend_registry library.
std::unique_ptr<DeviceRuntime> NewDeviceRuntime(std::string* why);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_DEVICE_H_
