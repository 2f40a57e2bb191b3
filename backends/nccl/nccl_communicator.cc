#include "backends/nccl/nccl_communicator.h"

#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace collserve::backends {
namespace {

#define COLLSERVE_NCCL_CHECK_USABLE()          \
  do {                                         \
    if (!failure_.ok()) return Aborted();      \
    if (absl::Status a = AsyncError(); !a.ok()) return a; \
  } while (0)

// ncclResult_t -> absl::Status at the backend boundary (STYLE.md §3.2).
absl::Status FromNccl(ncclResult_t r, absl::string_view what) {
  if (r == ncclSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", ncclGetErrorString(r));
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return absl::InvalidArgumentError(msg);
    case ncclSystemError:
    case ncclRemoteError: return absl::UnavailableError(msg);
    default: return absl::InternalError(msg);
  }
}

absl::Status FromCuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::StatusOr<ncclDataType_t> NcclType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat16: return ncclFloat16;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
    case DataType::kBFloat16: return ncclBfloat16;
#else
    case DataType::kBFloat16: return absl::InvalidArgumentError("bfloat16 needs NCCL 2.10 or later");
#endif
    case DataType::kInt8: return ncclInt8;
    case DataType::kUInt8: return ncclUint8;
    case DataType::kBool: return ncclUint8;  // 0/1 bytes; ops mapped by NcclOp
  }
  return absl::InvalidArgumentError("unknown dtype");
}

// bool follows torch's ProcessGroupNCCL: SUM/MAX -> max (or), PRODUCT/MIN -> min (and).
absl::StatusOr<ncclRedOp_t> NcclOp(ReduceOp op, DataType dtype) {
  if (dtype == DataType::kBool) {
    if (op == ReduceOp::kSum || op == ReduceOp::kMax) return ncclMax;
    if (op == ReduceOp::kProduct || op == ReduceOp::kMin) return ncclMin;
  }
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProduct: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    default:
      return absl::InvalidArgumentError(absl::StrCat("NCCL has no ReduceOp.", ReduceOpName(op),
                                                     " (bitwise ops run on the Gloo backend)"));
  }
}

absl::StatusOr<std::pair<ncclDataType_t, ncclRedOp_t>> TypeAndOp(DataType dtype, ReduceOp op) {
  auto type = NcclType(dtype);
  if (!type.ok()) return type.status();
  auto nop = NcclOp(op, dtype);
  if (!nop.ok()) return nop.status();
  return std::make_pair(*type, *nop);
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int device, int rank, int size)
      : comm_(comm), stream_(stream), device_(device), rank_(rank), size_(size) {}
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (aborted_) {
      // ncclCommAbort already released it.
    } else if (!failure_.ok() || !async_failure_.ok()) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(void* data, size_t count, DataType dtype, ReduceOp op, absl::Duration timeout,
                         AllReduceAlgorithm /*algorithm: NCCL chooses*/) override {
    if (!failure_.ok()) return Aborted();
    auto type = NcclType(dtype);
    if (!type.ok()) return type.status();
    auto nop = NcclOp(op, dtype);
    if (!nop.ok()) return nop.status();
    if (count == 0) return absl::OkStatus();
    const size_t bytes = count * ElementSize(dtype);
    return Run(data, bytes, 0, data, bytes, timeout, [&](void* dev) {
      return ncclAllReduce(dev, dev, count, *type, *nop, comm_, stream_);
    });
  }

  absl::Status Broadcast(void* data, size_t bytes, int root, absl::Duration timeout) override {
    if (!failure_.ok()) return Aborted();
    if (root < 0 || root >= size_) return absl::InvalidArgumentError(absl::StrCat("broadcast root host ", root));
    if (bytes == 0) return absl::OkStatus();
    return Run(data, bytes, 0, data, bytes, timeout, [&](void* dev) {
      return ncclBroadcast(dev, dev, bytes, ncclChar, root, comm_, stream_);
    });
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes, absl::Duration timeout) override {
    if (!failure_.ok()) return Aborted();
    if (bytes == 0) return absl::OkStatus();
    return Run(in, bytes, static_cast<size_t>(rank_) * bytes, out, bytes * size_, timeout, [&](void* dev) {
      // In place: this rank's block sits at offset rank * bytes of the output.
      char* base = static_cast<char*>(dev);
      return ncclAllGather(base + rank_ * bytes, base, bytes, ncclChar, comm_, stream_);
    });
  }

  absl::Status AllGatherV(const void* in, void* out, const std::vector<size_t>& bytes,
                          absl::Duration timeout) override {
    if (!failure_.ok()) return Aborted();
    if (bytes.size() != static_cast<size_t>(size_)) {
      return absl::InvalidArgumentError(absl::StrCat("AllGatherV needs ", size_, " sizes, got ", bytes.size()));
    }
    std::vector<size_t> offsets(bytes.size() + 1, 0);
    for (size_t i = 0; i < bytes.size(); ++i) offsets[i + 1] = offsets[i] + bytes[i];
    if (offsets.back() == 0) return absl::OkStatus();
    // One broadcast per host in a group call (what torch's ProcessGroupNCCL does for
    // uneven all_gather).
    return Run(in, bytes[rank_], offsets[rank_], out, offsets.back(), timeout, [&](void* dev) {
      char* base = static_cast<char*>(dev);
      ncclResult_t r = ncclGroupStart();
      for (int i = 0; r == ncclSuccess && i < size_; ++i) {
        if (bytes[i] == 0) continue;
        r = ncclBroadcast(base + offsets[i], base + offsets[i], bytes[i], ncclChar, i, comm_, stream_);
      }
      ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  absl::Status AllReduceOnStream(void* data, size_t count, DataType dtype, ReduceOp op, void* stream) override {
    COLLSERVE_NCCL_CHECK_USABLE();
    auto t = TypeAndOp(dtype, op);
    if (!t.ok()) return t.status();
    if (count == 0) return absl::OkStatus();
    return Queued(ncclAllReduce(data, data, count, t->first, t->second, comm_, static_cast<cudaStream_t>(stream)),
                  "ncclAllReduce");
  }

  absl::Status BroadcastOnStream(void* data, size_t bytes, int root, void* stream) override {
    COLLSERVE_NCCL_CHECK_USABLE();
    if (root < 0 || root >= size_) return absl::InvalidArgumentError(absl::StrCat("broadcast root host ", root));
    if (bytes == 0) return absl::OkStatus();
    return Queued(ncclBroadcast(data, data, bytes, ncclChar, root, comm_, static_cast<cudaStream_t>(stream)),
                  "ncclBroadcast");
  }

  absl::Status AllGatherOnStream(const void* in, void* out, size_t bytes, void* stream) override {
    COLLSERVE_NCCL_CHECK_USABLE();
    if (bytes == 0) return absl::OkStatus();
    return Queued(ncclAllGather(in, out, bytes, ncclChar, comm_, static_cast<cudaStream_t>(stream)), "ncclAllGather");
  }

  absl::Status ReduceScatterOnStream(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                     void* stream) override {
    COLLSERVE_NCCL_CHECK_USABLE();
    auto t = TypeAndOp(dtype, op);
    if (!t.ok()) return t.status();
    if (count == 0) return absl::OkStatus();
    return Queued(ncclReduceScatter(in, out, count, t->first, t->second, comm_, static_cast<cudaStream_t>(stream)),
                  "ncclReduceScatter");
  }

  absl::Status BroadcastGroupOnStream(const std::vector<void*>& datas, const std::vector<size_t>& bytes,
                                      const std::vector<int>& roots, void* stream) override {
    COLLSERVE_NCCL_CHECK_USABLE();
    if (datas.size() != bytes.size() || datas.size() != roots.size()) {
      return absl::InvalidArgumentError("BroadcastGroupOnStream needs as many sizes and roots as pieces");
    }
    for (int root : roots) {
      if (root < 0 || root >= size_) return absl::InvalidArgumentError(absl::StrCat("broadcast root host ", root));
    }
    ncclResult_t r = ncclGroupStart();
    for (size_t k = 0; r == ncclSuccess && k < datas.size(); ++k) {
      if (bytes[k] == 0) continue;
      r = ncclBroadcast(datas[k], datas[k], bytes[k], ncclChar, roots[k], comm_, static_cast<cudaStream_t>(stream));
    }
    ncclResult_t end = ncclGroupEnd();
    return Queued(r != ncclSuccess ? r : end, "grouped ncclBroadcast");
  }

  absl::Status SendRecvGroupOnStream(const std::vector<StreamTransfer>& sends, const std::vector<StreamTransfer>& recvs,
                                     void* stream) override {
    COLLSERVE_NCCL_CHECK_USABLE();
    for (const std::vector<StreamTransfer>* list : {&sends, &recvs}) {
      for (const StreamTransfer& t : *list) {
        if (t.peer < 0 || t.peer >= size_ || t.peer == rank_) {
          return absl::InvalidArgumentError(absl::StrCat("point-to-point peer host ", t.peer, " (this is host ", rank_,
                                                         " of ", size_, ")"));
        }
      }
    }
    const auto s = static_cast<cudaStream_t>(stream);
    ncclResult_t r = ncclGroupStart();
    for (size_t k = 0; r == ncclSuccess && k < sends.size(); ++k) {
      if (sends[k].bytes == 0) continue;
      r = ncclSend(sends[k].data, sends[k].bytes, ncclChar, sends[k].peer, comm_, s);
    }
    for (size_t k = 0; r == ncclSuccess && k < recvs.size(); ++k) {
      if (recvs[k].bytes == 0) continue;
      r = ncclRecv(recvs[k].data, recvs[k].bytes, ncclChar, recvs[k].peer, comm_, s);
    }
    ncclResult_t end = ncclGroupEnd();
    return Queued(r != ncclSuccess ? r : end, "grouped ncclSend/ncclRecv");
  }

  absl::Status AsyncError() override {
    absl::MutexLock lock(&async_mu_);
    if (!async_failure_.ok()) return async_failure_;
    ncclResult_t async_err = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &async_err);
    if (r != ncclSuccess) async_failure_ = FromNccl(r, "ncclCommGetAsyncError");
    else if (async_err != ncclSuccess) async_failure_ = FromNccl(async_err, "NCCL asynchronous error");
    return async_failure_;
  }

  void Abort() override {
    absl::MutexLock lock(&async_mu_);
    if (aborted_) return;
    aborted_ = true;
    if (async_failure_.ok()) async_failure_ = absl::AbortedError("the NCCL communicator was aborted");
    ncclCommAbort(comm_);
  }

 private:
  absl::Status Queued(ncclResult_t r, absl::string_view what) {
    absl::Status s = FromNccl(r, what);
    if (!s.ok()) failure_ = s;
    return s;
  }

  // Stages `in` to the device, runs `op`, waits up to `timeout` (aborting the communicator
  // on expiry, as torch's NCCL watchdog does), and copies `out_bytes` back to `out`.
  template <typename Op>
  absl::Status Run(const void* in, size_t in_bytes, size_t in_offset, void* out, size_t out_bytes,
                   absl::Duration timeout, Op op) {
    const absl::Time deadline = absl::Now() + timeout;
    absl::Status s = FromCuda(cudaSetDevice(device_), "cudaSetDevice");
    if (s.ok()) s = EnsureScratch(std::max(in_bytes, out_bytes));
    char* dev = static_cast<char*>(scratch_);
    if (s.ok() && in_bytes > 0) s = FromCuda(cudaMemcpyAsync(dev + in_offset, in, in_bytes, cudaMemcpyHostToDevice, stream_), "H2D copy");
    if (s.ok()) s = FromNccl(op(dev), "NCCL collective");
    if (s.ok()) s = FromCuda(cudaMemcpyAsync(out, dev, out_bytes, cudaMemcpyDeviceToHost, stream_), "D2H copy");
    while (s.ok()) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        s = FromCuda(q, "NCCL stream");
        break;
      }
      ncclResult_t async_err;
      ncclCommGetAsyncError(comm_, &async_err);
      if (async_err != ncclSuccess) {
        s = FromNccl(async_err, "NCCL async error");
        break;
      }
      if (absl::Now() >= deadline) {
        s = absl::DeadlineExceededError(absl::StrCat("NCCL collective across hosts timed out after ",
                                                     absl::FormatDuration(timeout)));
        break;
      }
      absl::SleepFor(absl::Microseconds(20));
    }
    if (!s.ok()) failure_ = s;
    return s;
  }

  absl::Status EnsureScratch(size_t bytes) {
    if (bytes <= scratch_bytes_) return absl::OkStatus();
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    absl::Status s = FromCuda(cudaMalloc(&scratch_, bytes), "cudaMalloc");
    if (s.ok()) scratch_bytes_ = bytes;
    return s;
  }

  absl::Status Aborted() const {
    return absl::FailedPreconditionError(
        absl::StrCat("the group's NCCL communicator was aborted by an earlier failure: ", failure_.message()));
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int device_, rank_, size_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  absl::Status failure_;
  absl::Mutex async_mu_;
  absl::Status async_failure_ ABSL_GUARDED_BY(async_mu_);
  bool aborted_ = false;  // written under async_mu_; read by the destructor
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(RendezvousStore& store, const std::string& prefix,
                                                           int rank, int size, const NcclOptions& options) {
  if (size <= 0 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("nccl rank ", rank, " is out of range for ", size, " hosts"));
  }
  const int devices = CudaDeviceCount();
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device is visible");
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", options.device, " of ", devices));
  }
  const std::string key = absl::StrCat(prefix, "/nccl_id");
  ncclUniqueId id;
  if (rank == 0) {
    if (absl::Status s = FromNccl(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
    if (absl::Status s = store.Set(key, std::string(id.internal, sizeof(id.internal))); !s.ok()) return s;
  } else {
    auto v = store.Get(key, options.connect_timeout);
    if (!v.ok()) return v.status();
    if (v->size() != sizeof(id.internal)) return absl::InternalError("malformed NCCL unique id in the store");
    std::memcpy(id.internal, v->data(), sizeof(id.internal));
  }
  if (absl::Status s = FromCuda(cudaSetDevice(options.device), "cudaSetDevice"); !s.ok()) return s;
  cudaStream_t stream;
  if (absl::Status s = FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); !s.ok()) {
    return s;
  }
  ncclComm_t comm;
  if (absl::Status s = FromNccl(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank"); !s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, stream, options.device, rank, size));
}

}  // namespace collserve::backends
