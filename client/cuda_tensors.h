// The client's half of CUDA tensors through the sidecar (docs/gpu.md): exporting device
// memory and events with CUDA IPC, and the stream ordering around one collective. Built
// with COLLSERVE_WITH_CUDA; without it every call returns FAILED_PRECONDITION. Links only
// libcudart (the driver's cuPointerGetAttribute / cuMemGetAddressRange are reached through
// cudaGetDriverEntryPointByVersion), so programs start on machines without a GPU.
#ifndef COLLSERVE_CLIENT_CUDA_TENSORS_H_
#define COLLSERVE_CLIENT_CUDA_TENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace collserve::client {

// Where a device tensor lives, as the sidecar needs it.
struct ExportedTensor {
  std::string ipc_handle;   // cudaIpcMemHandle_t of the allocation (64 bytes)
  std::string device_uuid;  // cudaDeviceProp.uuid (16 bytes)
  int64_t offset = 0;       // of the tensor from the allocation's base, bytes
  int device = 0;           // ordinal in this process
};

// One pair of interprocess events for one collective: `ready` is recorded on the caller's
// stream before the request goes out, the sidecar records `done`.
struct EventPair {
  std::string ready_handle, done_handle;  // cudaIpcEventHandle_t bytes (64 each)
  void* ready = nullptr;                  // cudaEvent_t
  void* done = nullptr;
};

// Whether this build has CUDA support (COLLSERVE_WITH_CUDA).
bool CudaBuilt();

// Per process group; thread-safe.
class CudaTensors {
 public:
  CudaTensors() = default;
  ~CudaTensors();
  CudaTensors(const CudaTensors&) = delete;
  CudaTensors& operator=(const CudaTensors&) = delete;

  // Exports the device memory [data, data + bytes): INVALID_ARGUMENT if it is not CUDA
  // device memory, does not fit its allocation, or cannot be exported (memory from
  // cudaMallocAsync pools or torch's expandable segments); FAILED_PRECONDITION without CUDA.
  // The allocation's handle is cached by its CU_POINTER_ATTRIBUTE_BUFFER_ID (unique per
  // allocation, so a freed and reused address is exported afresh).
  absl::StatusOr<ExportedTensor> Export(const void* data, size_t bytes);

  // The event pair of slot `slot` (callers take slots round-robin, kSlots of them) on
  // `device`, created on first use. INTERNAL with CUDA's message.
  static constexpr int kSlots = 64;
  absl::StatusOr<EventPair> Events(int device, int slot);

  // cudaEventRecord(event, stream) / cudaStreamWaitEvent(stream, event) on `device`.
  static absl::Status Record(int device, void* event, void* stream);
  static absl::Status StreamWait(int device, void* stream, void* event);

 private:
  struct Allocation {
    uintptr_t base = 0;
    size_t bytes = 0;
    std::string handle;
  };
  absl::Mutex mu_;
  std::map<unsigned long long, Allocation> allocations_ ABSL_GUARDED_BY(mu_);  // by buffer id
  std::map<int, std::string> uuids_ ABSL_GUARDED_BY(mu_);                    // by device
  std::map<std::pair<int, int>, EventPair> events_ ABSL_GUARDED_BY(mu_);      // by (device, slot)
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_CUDA_TENSORS_H_
