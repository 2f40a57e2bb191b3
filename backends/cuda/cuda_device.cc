// backends::DeviceRuntime over the CUDA runtime (backends/device.h).
#include "backends/cuda/cuda_device.h"

#include <cuda_runtime.h>
#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "backends/cuda/reduce_kernels.h"

namespace collserve::backends {
namespace {

// How long a group's stream may take to finish its queued work when the group ends.
constexpr absl::Duration kStopWait = absl::Seconds(30);

absl::Status FromCuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

// Sets the calling thread's device for the scope.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

struct CudaMapping : DeviceMapping {
  ~CudaMapping() override {
    DeviceScope scope(device);
    cudaIpcCloseMemHandle(base);
  }
};

struct CudaEvent : DeviceEvent {
  int device = 0;
  ~CudaEvent() override {
    DeviceScope scope(device);
    cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
};

absl::StatusOr<cuda::KernelType> KernelTypeOf(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return cuda::KernelType::kF32;
    case DataType::kFloat64: return cuda::KernelType::kF64;
    case DataType::kFloat16: return cuda::KernelType::kF16;
    case DataType::kBFloat16: return cuda::KernelType::kBF16;
    case DataType::kInt32: return cuda::KernelType::kI32;
    case DataType::kInt64: return cuda::KernelType::kI64;
    case DataType::kInt8: return cuda::KernelType::kI8;
    case DataType::kUInt8: return cuda::KernelType::kU8;
    case DataType::kBool: return cuda::KernelType::kBool;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
}

absl::StatusOr<cuda::KernelOp> KernelOpOf(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return cuda::KernelOp::kSum;
    case ReduceOp::kProduct: return cuda::KernelOp::kProduct;
    case ReduceOp::kMin: return cuda::KernelOp::kMin;
    case ReduceOp::kMax: return cuda::KernelOp::kMax;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("ReduceOp.", ReduceOpName(op), " is not supported on CUDA tensors (SUM, AVG, PRODUCT, MIN, MAX are)"));
  }
}

bool IsFloating(DataType d) {
  return d == DataType::kFloat32 || d == DataType::kFloat64 || d == DataType::kFloat16 || d == DataType::kBFloat16;
}

class CudaStream : public DeviceStream {
 public:
  CudaStream(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaStream() override {
    DeviceScope scope(device_);
    // Whatever is still queued finishes before the mappings it uses go (EndOp bounded it;
    // a failed group's stream may never finish: wait at most kStopWait, then leak them).
    const absl::Time deadline = absl::Now() + (failed_ ? absl::ZeroDuration() : kStopWait);
    cudaError_t q;
    while ((q = cudaStreamQuery(stream_)) == cudaErrorNotReady && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(100));
    }
    if (q == cudaErrorNotReady) {
      LOG(WARNING) << "a group's CUDA stream did not finish within " << kStopWait
                   << "; its mappings stay open";
      for (Op& op : in_flight_) new std::vector<std::shared_ptr<void>>(std::move(op.keep));  // leaked on purpose
      return;
    }
    in_flight_.clear();
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (staging_ != nullptr) cudaFreeHost(staging_);
    cudaStreamDestroy(stream_);
  }

  int device() const override { return device_; }
  void* stream() const override { return stream_; }

  absl::Status WaitEvent(const DeviceEvent& event) override {
    return FromCuda(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event.event), 0), "cudaStreamWaitEvent");
  }
  absl::Status RecordEvent(const DeviceEvent& event) override {
    DeviceScope scope(device_);
    return FromCuda(cudaEventRecord(static_cast<cudaEvent_t>(event.event), stream_), "cudaEventRecord");
  }

  absl::Status Reduce(const std::vector<const void*>& inputs, const std::vector<void*>& outputs, size_t count,
                      DataType dtype, ReduceOp op, double scale) override {
    auto type = KernelTypeOf(dtype);
    if (!type.ok()) return type.status();
    auto kop = KernelOpOf(op);
    if (!kop.ok()) return kop.status();
    if (scale != 1.0 && !IsFloating(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("scaling (AVG) needs a floating dtype, not ", DataTypeName(dtype)));
    }
    if (inputs.empty() || outputs.empty() || outputs.size() > cuda::kMaxReducePointers) {
      return absl::InvalidArgumentError(absl::StrCat("Reduce takes 1 to ", cuda::kMaxReducePointers,
                                                     " outputs and at least one input; got ", outputs.size(),
                                                     " and ", inputs.size()));
    }
    DeviceScope scope(device_);
    // More inputs than one launch takes: fold them into outputs[0] in steps.
    std::vector<const void*> in(inputs);
    while (static_cast<int>(in.size()) > cuda::kMaxReducePointers) {
      void* acc = outputs[0];
      absl::Status s = FromCuda(cuda::LaunchReduce(in.data(), cuda::kMaxReducePointers, &acc, 1, count, *type, *kop,
                                                   1.0, stream_),
                                "local reduction kernel");
      if (!s.ok()) return s;
      in.erase(in.begin(), in.begin() + cuda::kMaxReducePointers);
      in.insert(in.begin(), acc);
    }
    return FromCuda(cuda::LaunchReduce(in.data(), static_cast<int>(in.size()), outputs.data(),
                                       static_cast<int>(outputs.size()), count, *type, *kop, scale, stream_),
                    "local reduction kernel");
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return absl::OkStatus();
    DeviceScope scope(device_);
    return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
  }

  absl::StatusOr<void*> Scratch(size_t bytes) override {
    if (bytes <= scratch_bytes_) return scratch_;
    DeviceScope scope(device_);
    if (scratch_ != nullptr) {
      // The stream may still use it.
      if (absl::Status s = FromCuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); !s.ok()) return s;
      cudaFree(scratch_);
    }
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    if (absl::Status s = FromCuda(cudaMalloc(&scratch_, bytes), absl::StrCat("cudaMalloc(", bytes, ")")); !s.ok()) {
      return s;
    }
    scratch_bytes_ = bytes;
    return scratch_;
  }

  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, absl::Duration timeout) override {
    return ThroughStaging(static_cast<char*>(dst), static_cast<const char*>(src), bytes, /*to_host=*/true, timeout);
  }
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes, absl::Duration timeout) override {
    return ThroughStaging(static_cast<char*>(dst), static_cast<const char*>(src), bytes, /*to_host=*/false, timeout);
  }

  absl::Status EndOp(std::vector<std::shared_ptr<void>> keep, int max_in_flight, absl::Duration timeout,
                     const std::function<absl::Status()>& check) override {
    DeviceScope scope(device_);
    cudaEvent_t done;
    if (absl::Status s = FromCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
        !s.ok()) {
      return Failed(s);
    }
    Op op;
    op.done = done;
    op.keep = std::move(keep);
    op.queued = absl::Now();
    if (absl::Status s = FromCuda(cudaEventRecord(done, stream_), "cudaEventRecord"); !s.ok()) {
      cudaEventDestroy(done);
      return Failed(s);
    }
    in_flight_.push_back(std::move(op));
    // Retire what has finished; wait for the oldest while too many are in flight.
    const absl::Time deadline = absl::Now() + timeout;
    while (!in_flight_.empty()) {
      cudaError_t q = cudaEventQuery(in_flight_.front().done);
      if (q == cudaSuccess) {
        in_flight_.pop_front();
        continue;
      }
      if (q != cudaErrorNotReady) return Failed(FromCuda(q, "a collective on the GPU failed"));
      // The oldest has been on the GPU longer than an op may take (torch's NCCL watchdog
      // fails such a collective the same way; a stream stuck on a peer never drains).
      if (absl::Now() - in_flight_.front().queued > timeout) {
        return Failed(absl::DeadlineExceededError(absl::StrCat(
            "a collective queued on the GPU ", absl::FormatDuration(absl::Now() - in_flight_.front().queued),
            " ago has not finished (op timeout ", absl::FormatDuration(timeout), ")")));
      }
      if (static_cast<int>(in_flight_.size()) <= max_in_flight) break;
      if (check) {
        if (absl::Status s = check(); !s.ok()) return Failed(s);
      }
      if (absl::Now() >= deadline) {
        return Failed(absl::DeadlineExceededError(absl::StrCat(
            "the GPU did not finish a queued collective within ", absl::FormatDuration(timeout),
            " (", in_flight_.size(), " in flight on the group's stream)")));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
    return absl::OkStatus();
  }

 private:
  struct Op {
    Op() = default;
    Op(Op&& o) noexcept : done(std::exchange(o.done, nullptr)), keep(std::move(o.keep)), queued(o.queued) {}
    Op& operator=(Op&&) = delete;
    ~Op() {
      if (done != nullptr) cudaEventDestroy(done);
    }
    cudaEvent_t done = nullptr;
    std::vector<std::shared_ptr<void>> keep;
    absl::Time queued;
  };

  absl::Status Failed(absl::Status s) {
    failed_ = true;
    return s;
  }

  // CopyToHost / CopyFromHost: piece by piece through pinned memory (cudaMemcpyAsync with
  // pageable host memory would block the thread without a bound), each piece waited for.
  absl::Status ThroughStaging(char* dst, const char* src, size_t bytes, bool to_host, absl::Duration timeout) {
    if (bytes == 0) return absl::OkStatus();
    DeviceScope scope(device_);
    const size_t piece = std::min(bytes, kHostStagingBytes);
    if (staging_bytes_ < piece) {
      if (staging_ != nullptr) cudaFreeHost(staging_);  // every earlier use was waited for
      staging_ = nullptr;
      staging_bytes_ = 0;
      if (absl::Status s = FromCuda(cudaHostAlloc(&staging_, piece, cudaHostAllocDefault),
                                    absl::StrCat("cudaHostAlloc(", piece, ")"));
          !s.ok()) {
        return s;
      }
      staging_bytes_ = piece;
    }
    char* stage = static_cast<char*>(staging_);
    const absl::Time deadline = absl::Now() + timeout;
    for (size_t off = 0; off < bytes; off += piece) {
      const size_t n = std::min(piece, bytes - off);
      if (!to_host) std::memcpy(stage, src + off, n);
      absl::Status s = to_host ? FromCuda(cudaMemcpyAsync(stage, src + off, n, cudaMemcpyDeviceToHost, stream_),
                                          "cudaMemcpyAsync (to the host)")
                               : FromCuda(cudaMemcpyAsync(dst + off, stage, n, cudaMemcpyHostToDevice, stream_),
                                          "cudaMemcpyAsync (from the host)");
      if (!s.ok()) return Failed(s);
      cudaError_t q;
      while ((q = cudaStreamQuery(stream_)) == cudaErrorNotReady) {
        if (absl::Now() >= deadline) {
          return Failed(absl::DeadlineExceededError(absl::StrCat(
              "a copy of ", bytes, " bytes ", to_host ? "from the GPU to the host" : "from the host to the GPU",
              " did not finish within ", absl::FormatDuration(timeout),
              " (it waits for the work the client queued before it)")));
        }
        absl::SleepFor(absl::Microseconds(20));
      }
      if (q != cudaSuccess) return Failed(FromCuda(q, "a copy between the host and the GPU failed"));
      if (to_host) std::memcpy(dst + off, stage, n);
    }
    return absl::OkStatus();
  }

  const int device_;
  cudaStream_t stream_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  void* staging_ = nullptr;  // pinned host memory (ThroughStaging)
  size_t staging_bytes_ = 0;
  bool failed_ = false;
  std::deque<Op> in_flight_;
};

class CudaDeviceRuntime : public DeviceRuntime {
 public:
  explicit CudaDeviceRuntime(std::vector<std::string> uuids) : uuids_(std::move(uuids)) {}

  absl::StatusOr<int> DeviceOf(const std::string& uuid) override {
    if (uuid.size() != kCudaUuidBytes) {
      return absl::InvalidArgumentError(absl::StrCat("a CUDA device UUID has ", kCudaUuidBytes, " bytes, not ",
                                                     uuid.size()));
    }
    for (size_t d = 0; d < uuids_.size(); ++d) {
      if (uuids_[d] == uuid) return static_cast<int>(d);
    }
    return absl::NotFoundError(absl::StrCat("no GPU visible to the sidecar has UUID ", absl::BytesToHexString(uuid),
                                            " (the sidecar sees ", uuids_.size(),
                                            "; check its CUDA_VISIBLE_DEVICES and that it runs on the client's host)"));
  }

  absl::StatusOr<std::shared_ptr<DeviceMapping>> MapMemory(int device, const std::string& ipc_handle) override {
    if (ipc_handle.size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC memory handle has ", kCudaIpcHandleBytes,
                                                     " bytes, not ", ipc_handle.size()));
    }
    if (device < 0 || device >= static_cast<int>(uuids_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " of ", uuids_.size()));
    }
    const std::string key = absl::StrCat(device, ":", ipc_handle);
    absl::MutexLock lock(&mu_);
    if (auto it = mappings_.find(key); it != mappings_.end()) {
      if (auto m = it->second.lock()) return std::shared_ptr<DeviceMapping>(m);
      mappings_.erase(it);
    }
    if (mappings_.size() > 4096) {
      for (auto it = mappings_.begin(); it != mappings_.end();) it = it->second.expired() ? mappings_.erase(it) : ++it;
    }
    DeviceScope scope(device);
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, ipc_handle.data(), sizeof handle);
    void* base = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear it: it is not sticky
      return absl::InvalidArgumentError(absl::StrCat("cudaIpcOpenMemHandle refused the client's memory handle: ",
                                                     cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
    }
    auto m = std::make_shared<CudaMapping>();
    m->base = static_cast<char*>(base);
    m->device = device;
    // The allocation's size: what the kernels may touch.
    size_t bytes = 0;
    if (absl::Status s = AllocationBytes(base, &bytes); !s.ok()) return s;
    m->bytes = bytes;
    mappings_[key] = m;
    return std::shared_ptr<DeviceMapping>(m);
  }

  absl::StatusOr<std::shared_ptr<DeviceEvent>> OpenEvent(int device, const std::string& ipc_handle) override {
    if (ipc_handle.size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC event handle has ", kCudaIpcHandleBytes,
                                                     " bytes, not ", ipc_handle.size()));
    }
    if (device < 0 || device >= static_cast<int>(uuids_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " of ", uuids_.size()));
    }
    const std::string key = absl::StrCat(device, ":", ipc_handle);
    absl::MutexLock lock(&mu_);
    if (auto it = events_.find(key); it != events_.end()) {
      if (auto ev = it->second.lock()) return std::shared_ptr<DeviceEvent>(ev);
      events_.erase(it);
    }
    if (events_.size() > 4096) {
      for (auto it = events_.begin(); it != events_.end();) it = it->second.expired() ? events_.erase(it) : ++it;
    }
    DeviceScope scope(device);
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, ipc_handle.data(), sizeof handle);
    cudaEvent_t event;
    cudaError_t e = cudaIpcOpenEventHandle(&event, handle);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat("cudaIpcOpenEventHandle refused the client's event handle: ",
                                                     cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
    }
    auto ev = std::make_shared<CudaEvent>();
    ev->event = event;
    ev->device = device;
    events_[key] = ev;
    return std::shared_ptr<DeviceEvent>(ev);
  }

  absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(int device) override {
    if (device < 0 || device >= static_cast<int>(uuids_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " of ", uuids_.size()));
    }
    DeviceScope scope(device);
    cudaStream_t stream;
    if (absl::Status s = FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        !s.ok()) {
      return s;
    }
    return std::unique_ptr<DeviceStream>(new CudaStream(device, stream));
  }

 private:
  const std::vector<std::string> uuids_;
  absl::Mutex mu_;
  std::map<std::string, std::weak_ptr<CudaMapping>> mappings_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::weak_ptr<CudaEvent>> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status AllocationBytes(const void* base, size_t* bytes) {
  // cuMemGetAddressRange through the runtime's driver entry point: linking libcuda would
  // make every binary fail to start on a machine without the driver.
  using GetRange = int (*)(unsigned long long*, size_t*, unsigned long long);  // CUresult(CUdeviceptr*, size_t*, CUdeviceptr)
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<GetRange>(nullptr);
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  unsigned long long start = 0;
  size_t size = 0;
  const int r = get_range(&start, &size, reinterpret_cast<unsigned long long>(base));
  if (r != 0) return absl::InvalidArgumentError(absl::StrCat("cuMemGetAddressRange failed (CUresult ", r, ")"));
  if (start != reinterpret_cast<unsigned long long>(base)) {
    // Sizes are counted from `base`.
    const unsigned long long end = start + size;
    size = end > reinterpret_cast<unsigned long long>(base) ? end - reinterpret_cast<unsigned long long>(base) : 0;
  }
  *bytes = size;
  return absl::OkStatus();
}

std::unique_ptr<DeviceRuntime> NewCudaDeviceRuntime(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    if (why != nullptr) {
      *why = e != cudaSuccess ? absl::StrCat("no CUDA device: ", cudaGetErrorString(e)) : "no CUDA device is visible";
    }
    return nullptr;
  }
  std::vector<std::string> uuids;
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
      if (why != nullptr) *why = absl::StrCat("cudaGetDeviceProperties(", d, ") failed");
      return nullptr;
    }
    uuids.emplace_back(prop.uuid.bytes, kCudaUuidBytes);
  }
  return std::make_unique<CudaDeviceRuntime>(std::move(uuids));
}

}  // namespace collserve::backends
