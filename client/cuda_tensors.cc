#include "client/cuda_tensors.h"

#include "absl/strings/str_cat.h"

#ifdef COLLSERVE_WITH_CUDA
#include <cuda_runtime.h>

#include <cstring>

#include "client/device_scope.h"
#endif

namespace collserve::client {

#ifndef COLLSERVE_WITH_CUDA

bool CudaBuilt() { return false; }
CudaTensors::~CudaTensors() = default;
absl::StatusOr<ExportedTensor> CudaTensors::Export(const void*, size_t) {
  return absl::FailedPreconditionError("this collserve build has no CUDA support (COLLSERVE_WITH_CUDA)");
}
absl::StatusOr<EventPair> CudaTensors::Events(int, int) {
  return absl::FailedPreconditionError("this collserve build has no CUDA support (COLLSERVE_WITH_CUDA)");
}
absl::Status CudaTensors::Record(int, void*, void*) {
  return absl::FailedPreconditionError("this collserve build has no CUDA support");
}
absl::Status CudaTensors::StreamWait(int, void*, void*) {
  return absl::FailedPreconditionError("this collserve build has no CUDA support");
}

#else

namespace {

absl::Status FromCuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

// The driver calls the runtime does not wrap, by entry point (CUresult is an int; 0 = OK).
struct Driver {
  int (*get_attribute)(void* data, int attribute, unsigned long long ptr) = nullptr;
  int (*get_range)(unsigned long long* base, size_t* size, unsigned long long ptr) = nullptr;
};

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      d.get_attribute = reinterpret_cast<int (*)(void*, int, unsigned long long)>(fn);
    }
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      d.get_range = reinterpret_cast<int (*)(unsigned long long*, size_t*, unsigned long long)>(fn);
    }
    cudaGetLastError();
    return d;
  }();
  return driver;
}

constexpr int kPointerAttributeBufferId = 7;  // CU_POINTER_ATTRIBUTE_BUFFER_ID


}  // namespace

bool CudaBuilt() { return true; }

CudaTensors::~CudaTensors() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, pair] : events_) {
    DeviceScope scope(key.first);
    cudaEventDestroy(static_cast<cudaEvent_t>(pair.ready));
    cudaEventDestroy(static_cast<cudaEvent_t>(pair.done));
  }
}

absl::StatusOr<ExportedTensor> CudaTensors::Export(const void* data, size_t bytes) {
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, data);
  if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("address 0x", absl::Hex(reinterpret_cast<uintptr_t>(data)),
                                                   " is not CUDA device memory",
                                                   e != cudaSuccess ? absl::StrCat(" (", cudaGetErrorString(e), ")") : ""));
  }
  const Driver& driver = GetDriver();
  if (driver.get_attribute == nullptr || driver.get_range == nullptr) {
    return absl::FailedPreconditionError("the CUDA driver lacks cuPointerGetAttribute or cuMemGetAddressRange");
  }
  const auto ptr = reinterpret_cast<unsigned long long>(data);
  unsigned long long buffer_id = 0;
  if (int r = driver.get_attribute(&buffer_id, kPointerAttributeBufferId, ptr); r != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuPointerGetAttribute(BUFFER_ID) failed (CUresult ", r, ")"));
  }
  ExportedTensor out;
  out.device = attr.device;
  absl::MutexLock lock(&mu_);
  auto it = allocations_.find(buffer_id);
  if (it == allocations_.end()) {
    unsigned long long base = 0;
    size_t size = 0;
    if (int r = driver.get_range(&base, &size, ptr); r != 0) {
      return absl::InvalidArgumentError(absl::StrCat("cuMemGetAddressRange failed (CUresult ", r, ")"));
    }
    cudaIpcMemHandle_t handle;
    {
      DeviceScope scope(attr.device);
      e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          "cudaIpcGetMemHandle cannot export this tensor's memory (", cudaGetErrorString(e),
          "): CUDA IPC needs memory from cudaMalloc (not cudaMallocAsync pools, not torch's "
          "expandable segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)"));
    }
    if (allocations_.size() >= 4096) allocations_.clear();
    Allocation a;
    a.base = static_cast<uintptr_t>(base);
    a.bytes = size;
    a.handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
    it = allocations_.emplace(buffer_id, std::move(a)).first;
  }
  const Allocation& a = it->second;
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  if (p < a.base || p - a.base > a.bytes || bytes > a.bytes - (p - a.base)) {
    return absl::InvalidArgumentError(absl::StrCat("a tensor of ", bytes, " bytes at offset ", p - a.base,
                                                   " does not fit its CUDA allocation of ", a.bytes, " bytes"));
  }
  out.ipc_handle = a.handle;
  out.offset = static_cast<int64_t>(p - a.base);
  auto uuid = uuids_.find(attr.device);
  if (uuid == uuids_.end()) {
    cudaDeviceProp prop;
    if (absl::Status s = FromCuda(cudaGetDeviceProperties(&prop, attr.device), "cudaGetDeviceProperties"); !s.ok()) {
      return s;
    }
    uuid = uuids_.emplace(attr.device, std::string(prop.uuid.bytes, sizeof prop.uuid.bytes)).first;
  }
  out.device_uuid = uuid->second;
  return out;
}

absl::StatusOr<EventPair> CudaTensors::Events(int device, int slot) {
  absl::MutexLock lock(&mu_);
  auto it = events_.find({device, slot});
  if (it != events_.end()) return it->second;
  DeviceScope scope(device);
  EventPair pair;
  cudaEvent_t ready, done;
  const unsigned flags = cudaEventDisableTiming | cudaEventInterprocess;
  if (absl::Status s = FromCuda(cudaEventCreateWithFlags(&ready, flags), "cudaEventCreate"); !s.ok()) return s;
  if (absl::Status s = FromCuda(cudaEventCreateWithFlags(&done, flags), "cudaEventCreate"); !s.ok()) {
    cudaEventDestroy(ready);
    return s;
  }
  cudaIpcEventHandle_t hr, hd;
  absl::Status s = FromCuda(cudaIpcGetEventHandle(&hr, ready), "cudaIpcGetEventHandle");
  if (s.ok()) s = FromCuda(cudaIpcGetEventHandle(&hd, done), "cudaIpcGetEventHandle");
  if (!s.ok()) {
    cudaEventDestroy(ready);
    cudaEventDestroy(done);
    return s;
  }
  pair.ready = ready;
  pair.done = done;
  pair.ready_handle.assign(reinterpret_cast<const char*>(&hr), sizeof hr);
  pair.done_handle.assign(reinterpret_cast<const char*>(&hd), sizeof hd);
  events_.emplace(std::make_pair(device, slot), pair);
  return pair;
}

absl::Status CudaTensors::Record(int device, void* event, void* stream) {
  DeviceScope scope(device);
  return FromCuda(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
                  "cudaEventRecord on the caller's stream");
}

absl::Status CudaTensors::StreamWait(int device, void* stream, void* event) {
  DeviceScope scope(device);
  return FromCuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
                  "cudaStreamWaitEvent on the caller's stream");
}

#endif  // COLLSERVE_WITH_CUDA

}  // namespace collserve::client
