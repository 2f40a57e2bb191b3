#include "client/rank_comm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#ifdef COLLSERVE_CLIENT_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include "client/device_scope.h"
#endif

namespace collserve::client {
namespace {

std::atomic<RankCommFactory*> g_testing_factory{nullptr};

#ifdef COLLSERVE_CLIENT_NCCL

// NCCL's entry points, looked up in the library at run time (the SDK does not link NCCL:
// a pip torch brings its own copy, and a program without CUDA tensors needs none).
struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclBroadcast) Broadcast = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
};

absl::StatusOr<NcclApi> Load() {
  const char* env = std::getenv("COLLSERVE_NCCL_LIBRARY");
  const char* name = env != nullptr && *env != '\0' ? env : "libnccl.so.2";
  void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot load NCCL (", name, "): ", dlerror(),
        "; set COLLSERVE_NCCL_LIBRARY to the libnccl.so.2 torch uses (pip: site-packages/nvidia/nccl/lib)"));
  }
  NcclApi api;
  const char* missing = nullptr;
  const auto find = [&](auto*& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    if (fn == nullptr && missing == nullptr) missing = symbol;
  };
  find(api.GetUniqueId, "ncclGetUniqueId");
  find(api.CommInitRankConfig, "ncclCommInitRankConfig");
  find(api.CommAbort, "ncclCommAbort");
  find(api.CommGetAsyncError, "ncclCommGetAsyncError");
  find(api.GetErrorString, "ncclGetErrorString");
  find(api.AllReduce, "ncclAllReduce");
  find(api.Broadcast, "ncclBroadcast");
  find(api.AllGather, "ncclAllGather");
  find(api.ReduceScatter, "ncclReduceScatter");
  find(api.Send, "ncclSend");
  find(api.Recv, "ncclRecv");
  find(api.GroupStart, "ncclGroupStart");
  find(api.GroupEnd, "ncclGroupEnd");
  if (missing != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(name, " has no ", missing, " (NCCL 2.14 or later is needed)"));
  }
  return api;
}

const absl::StatusOr<NcclApi>& Nccl() {
  static const absl::StatusOr<NcclApi>* api = new absl::StatusOr<NcclApi>(Load());
  return *api;
}

absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

absl::Status FromNccl(const NcclApi& nccl, ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", nccl.GetErrorString(r));
  // A peer's failure (ncclRemoteError) or the network's (ncclSystemError): the group's
  // other ranks are the likely cause, as for a Gloo connection that broke.
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(message);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return absl::InvalidArgumentError(message);
  return absl::InternalError(message);
}

absl::StatusOr<ncclDataType_t> NcclType(DataType d) {
  switch (d) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kInt8: return ncclInt8;
    case DataType::kUInt8:
    case DataType::kBool: return ncclUint8;
  }
  return absl::InvalidArgumentError(absl::StrCat("dtype #", static_cast<int>(d), " is not supported by NCCL"));
}

// bool as torch's NCCL backend maps it: SUM and MAX are a logical or, PRODUCT and MIN an and.
absl::StatusOr<ncclRedOp_t> NcclOp(ReduceOp op, DataType d) {
  const bool b = d == DataType::kBool;
  switch (op) {
    case ReduceOp::kSum: return b ? ncclMax : ncclSum;
    case ReduceOp::kAvg:
      if (b) break;
      return ncclAvg;
    case ReduceOp::kProduct: return b ? ncclMin : ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    default: break;
  }
  return absl::InvalidArgumentError(absl::StrCat("ReduceOp #", static_cast<int>(op), b ? " on bool" : "",
                                                 " is not supported with NCCL (SUM, AVG, PRODUCT, MIN, MAX are)"));
}

size_t ElementBytes(DataType d) {
  switch (d) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    default: return 1;
  }
}


constexpr absl::Duration kWatchEvery = absl::Milliseconds(100);
// How long destroying a communicator waits for the collectives it still has on the GPU.
constexpr absl::Duration kDrainOnDestroy = absl::Seconds(10);

class NcclRankComm : public RankComm {
 public:
  NcclRankComm(const NcclApi& nccl, ncclComm_t comm, int device, int rank, int size, absl::Duration op_timeout,
               std::shared_ptr<const std::string> name)
      : nccl_(nccl), comm_(comm), device_(device), rank_(rank), size_(size), op_timeout_(op_timeout),
        name_(std::move(name)) {
    watchdog_ = std::thread([this] { WatchMain(); });
  }
  ~NcclRankComm() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    watchdog_.join();
    {
      // What is queued finishes first (bounded by kDrainOnDestroy and AbortWhenDrained's
      // deadline), so that destroying a healthy group does not cancel its last collectives;
      // then the communicator ends (ncclCommAbort never waits for a peer that is gone).
      absl::MutexLock lock(&mu_);
      DeviceScope scope(device_);
      TakeDrainLocked();
      const absl::Time deadline = std::min(drain_deadline_, absl::Now() + kDrainOnDestroy);
      while (!aborted_ && !abort_requested_.load() && !RetireLocked() && absl::Now() < deadline) {
        absl::SleepFor(absl::Microseconds(100));
      }
      cudaGetLastError();
    }
    Abort(absl::CancelledError("the process group was destroyed"));
    DeviceScope scope(device_);
    for (auto& [event, queued] : in_flight_) cudaEventDestroy(event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                         void* stream) override {
    auto t = NcclType(dtype);
    if (!t.ok()) return t.status();
    auto o = NcclOp(op, dtype);
    if (!o.ok()) return o.status();
    return Run("ncclAllReduce", stream, {in, out}, [&] {
      return nccl_.AllReduce(in, out, count, *t, *o, comm_, static_cast<cudaStream_t>(stream));
    });
  }
  absl::Status Broadcast(void* data, size_t count, DataType dtype, int root, void* stream) override {
    auto t = NcclType(dtype);
    if (!t.ok()) return t.status();
    return Run("ncclBroadcast", stream, {data}, [&] {
      return nccl_.Broadcast(data, data, count, *t, root, comm_, static_cast<cudaStream_t>(stream));
    });
  }
  absl::Status AllGather(const void* in, void* out, size_t count, DataType dtype, void* stream) override {
    auto t = NcclType(dtype);
    if (!t.ok()) return t.status();
    return Run("ncclAllGather", stream, {in, out}, [&] {
      return nccl_.AllGather(in, out, count, *t, comm_, static_cast<cudaStream_t>(stream));
    });
  }
  absl::Status ReduceScatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                             void* stream) override {
    auto t = NcclType(dtype);
    if (!t.ok()) return t.status();
    auto o = NcclOp(op, dtype);
    if (!o.ok()) return o.status();
    return Run("ncclReduceScatter", stream, {in, out}, [&] {
      return nccl_.ReduceScatter(in, out, count, *t, *o, comm_, static_cast<cudaStream_t>(stream));
    });
  }
  absl::Status SendRecv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, DataType dtype,
                        void* stream) override {
    auto t = NcclType(dtype);
    if (!t.ok()) return t.status();
    const size_t es = ElementBytes(dtype);
    std::vector<const void*> buffers;
    for (const Transfer& x : sends) buffers.push_back(x.data);
    for (const Transfer& x : recvs) buffers.push_back(x.data);
    const auto s = static_cast<cudaStream_t>(stream);
    return Run("ncclSend/ncclRecv", stream, buffers, [&] {
      // Transfers to this rank are copies on the stream, the k-th send to self into the k-th
      // receive from self (NCCL's own pairing).
      std::vector<const Transfer*> to_self, from_self;
      for (const Transfer& x : sends) {
        if (x.peer == rank_ && x.count > 0) to_self.push_back(&x);
      }
      for (const Transfer& x : recvs) {
        if (x.peer == rank_ && x.count > 0) from_self.push_back(&x);
      }
      if (to_self.size() != from_self.size()) return ncclInvalidUsage;
      for (size_t k = 0; k < to_self.size(); ++k) {
        if (to_self[k]->count != from_self[k]->count) return ncclInvalidUsage;
        if (cudaMemcpyAsync(from_self[k]->data, to_self[k]->data, to_self[k]->count * es, cudaMemcpyDeviceToDevice,
                            s) != cudaSuccess) {
          cudaGetLastError();
          return ncclUnhandledCudaError;
        }
      }
      ncclResult_t r = nccl_.GroupStart();
      if (r != ncclSuccess) return r;
      for (const Transfer& x : sends) {
        if (x.peer != rank_ && x.count > 0 && r == ncclSuccess) r = nccl_.Send(x.data, x.count, *t, x.peer, comm_, s);
      }
      for (const Transfer& x : recvs) {
        if (x.peer != rank_ && x.count > 0 && r == ncclSuccess) r = nccl_.Recv(x.data, x.count, *t, x.peer, comm_, s);
      }
      const ncclResult_t end = nccl_.GroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  void Abort(const absl::Status& why) override {
    abort_requested_.store(true);  // a call waiting for NCCL (SettleLocked) lets go of mu_
    absl::MutexLock lock(&mu_);
    if (!aborted_) failure_ = why;  // over AbortWhenDrained's reason: a disagreement says more
    AbortLocked(why);
  }

  // Never takes mu_, which a call holds while NCCL connects to its peer (SettleLocked, up to
  // the op timeout): the request waits in drain_why_/drain_by_ for the next holder of mu_
  // (TakeDrainLocked: a call, which then fails at once, or the watchdog, which aborts when
  // in_flight_ is empty or at the deadline).
  void AbortWhenDrained(const absl::Status& why, absl::Duration within) override {
    {
      absl::MutexLock lock(&drain_mu_);
      if (drain_why_.ok()) drain_why_ = why;
      drain_by_ = std::min(drain_by_, absl::Now() + within);
    }
    drain_requested_.store(true);
  }

  absl::Status Failure() override {
    absl::MutexLock lock(&mu_);
    TakeDrainLocked();
    return failure_;
  }

 private:
  // AbortWhenDrained's request, if any, into failure_ (unless failed already) and
  // drain_deadline_.
  void TakeDrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!drain_requested_.load()) return;
    absl::MutexLock lock(&drain_mu_);
    if (failure_.ok()) failure_ = drain_why_;
    drain_deadline_ = std::min(drain_deadline_, drain_by_);
  }
  bool DrainTimeIsUp() {
    if (!drain_requested_.load()) return false;
    absl::MutexLock lock(&drain_mu_);
    return absl::Now() >= drain_by_;
  }

  void AbortLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (aborted_) return;
    aborted_ = true;
    if (failure_.ok()) failure_ = why;
    DeviceScope scope(device_);
    nccl_.CommAbort(comm_);
  }

  // Runs one NCCL call (or group) for `stream` on this communicator's GPU: the buffers must
  // be device memory of that GPU; NCCL's "in progress" is waited out (bounded); an event
  // after the call lets the watchdog see it finish.
  absl::Status Run(const char* what, void* stream, const std::vector<const void*>& buffers,
                   const std::function<ncclResult_t()>& call) {
    absl::MutexLock lock(&mu_);
    TakeDrainLocked();
    if (!failure_.ok()) return absl::Status(failure_.code(), absl::StrCat("the NCCL communicator failed: ",
                                                                          failure_.message()));
    for (const void* p : buffers) {
      if (p == nullptr) continue;
      cudaPointerAttributes a;
      if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.type != cudaMemoryTypeDevice) {
        cudaGetLastError();
        return absl::InvalidArgumentError(absl::StrCat("address ", reinterpret_cast<uintptr_t>(p),
                                                       " is not CUDA device memory"));
      }
      if (a.device != device_) {
        return absl::InvalidArgumentError(absl::StrCat("a tensor is on GPU ", a.device, " but this rank's NCCL "
                                                       "communicator is on GPU ", device_,
                                                       " (one GPU per rank: make it current before the group's "
                                                       "first CUDA call, torch.cuda.set_device)"));
      }
    }
    DeviceScope scope(device_);
    ncclResult_t r = call();
    if (r == ncclInProgress || r == ncclSuccess) r = SettleLocked();
    if (r != ncclSuccess && abort_requested_.load()) {
      return absl::AbortedError(absl::StrCat(what, ": the NCCL communicator is being aborted"));  // Abort says why
    }
    if (r != ncclSuccess && DrainTimeIsUp()) {  // still connecting to a peer that is gone
      TakeDrainLocked();
      AbortLocked(failure_);
      return absl::Status(failure_.code(), absl::StrCat(what, ": ", failure_.message()));
    }
    if (absl::Status s = FromNccl(nccl_, r, what); !s.ok()) {
      if (r != ncclInvalidArgument && r != ncclInvalidUsage) AbortLocked(s);
      return s;
    }
    cudaEvent_t event;
    if (!free_events_.empty()) {
      event = free_events_.back();
      free_events_.pop_back();
    } else if (absl::Status s = FromCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
               !s.ok()) {
      return s;
    }
    if (absl::Status s = FromCuda(cudaEventRecord(event, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
        !s.ok()) {
      free_events_.push_back(event);
      return s;
    }
    in_flight_.emplace_back(event, absl::Now());
    return absl::OkStatus();
  }

  // Retires the collectives finished on the GPU from in_flight_ (their events to
  // free_events_); true when none is left. A failed one aborts the communicator.
  bool RetireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!in_flight_.empty()) {
      const cudaError_t q = cudaEventQuery(in_flight_.front().first);
      if (q == cudaErrorNotReady) return false;
      if (q != cudaSuccess) {
        AbortLocked(FromCuda(q, "a collective on the GPU failed"));
        return false;
      }
      free_events_.push_back(in_flight_.front().first);
      in_flight_.pop_front();
    }
    return true;
  }

  // A nonblocking communicator returns ncclInProgress until the call is queued (its first
  // transfer with a peer waits for that peer to connect: a pipeline's next stage to post its
  // first receive), at most the op timeout, as a call unfinished on the GPU; ncclSystemError
  // when that passed, Abort was called or AbortWhenDrained's time is up.
  ncclResult_t SettleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time deadline = absl::Now() + op_timeout_;
    for (int i = 0;; ++i) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = nccl_.CommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return r;
      if (state != ncclInProgress) return state;
      if (absl::Now() > deadline || abort_requested_.load() || (i % 1024 == 1023 && DrainTimeIsUp())) {
        return ncclSystemError;
      }
      absl::SleepFor(absl::Microseconds(i < 1000 ? 10 : 1000));
    }
  }

  // Every kWatchEvery: retires finished collectives; fails (and aborts) the communicator on
  // NCCL's asynchronous error or on a collective unfinished past the op timeout, so that no
  // stream waits forever on a failed peer (torch's ProcessGroupNCCL watchdog).
  void WatchMain() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), kWatchEvery);
      if (stop_ || aborted_) continue;
      DeviceScope scope(device_);
      TakeDrainLocked();
      const bool drained = RetireLocked();
      if (aborted_) continue;
      if (!failure_.ok() && (drained || absl::Now() >= drain_deadline_)) {  // AbortWhenDrained
        AbortLocked(failure_);
        continue;
      }
      if (!in_flight_.empty() && absl::Now() - in_flight_.front().second > op_timeout_) {
        AbortLocked(absl::DeadlineExceededError(absl::StrCat(
            "an NCCL collective queued ", absl::FormatDuration(absl::Now() - in_flight_.front().second),
            " ago has not finished on the GPU (op timeout ", absl::FormatDuration(op_timeout_), ")")));
        continue;
      }
      ncclResult_t state = ncclSuccess;
      if (nccl_.CommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
        AbortLocked(FromNccl(nccl_, state, "NCCL reported an asynchronous error"));
      }
    }
  }

  const NcclApi& nccl_;
  const ncclComm_t comm_;
  const int device_, rank_, size_;
  const absl::Duration op_timeout_;
  const std::shared_ptr<const std::string> name_;  // ncclConfig_t.commName points into it
  absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time drain_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();  // AbortWhenDrained's
  std::atomic<bool> abort_requested_{false};
  // AbortWhenDrained's request until TakeDrainLocked takes it (drain_mu_ is never held long).
  absl::Mutex drain_mu_ ABSL_ACQUIRED_AFTER(mu_);
  absl::Status drain_why_ ABSL_GUARDED_BY(drain_mu_);
  absl::Time drain_by_ ABSL_GUARDED_BY(drain_mu_) = absl::InfiniteFuture();
  std::atomic<bool> drain_requested_{false};
  std::deque<std::pair<cudaEvent_t, absl::Time>> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> free_events_ ABSL_GUARDED_BY(mu_);
  std::thread watchdog_;
};

class NcclFactory : public RankCommFactory {
 public:
  explicit NcclFactory(const NcclApi& nccl) : nccl_(nccl) {}

  absl::StatusOr<std::string> NewUniqueId() override {
    ncclUniqueId id;
    if (absl::Status s = FromNccl(nccl_, nccl_.GetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
    return std::string(id.internal, sizeof id.internal);
  }

  absl::StatusOr<std::unique_ptr<RankComm>> Connect(const std::string& unique_id, int rank, int size,
                                                    const RankCommOptions& options) override {
    const absl::Duration timeout = options.timeout;
    ncclUniqueId id;
    if (unique_id.size() != sizeof id.internal) {
      return absl::InvalidArgumentError(absl::StrCat("an NCCL unique id has ", sizeof id.internal, " bytes, not ",
                                                     unique_id.size()));
    }
    std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
    int device = -1;
    if (absl::Status s = FromCuda(cudaGetDevice(&device), "cudaGetDevice (no CUDA device?)"); !s.ok()) {
      return absl::FailedPreconditionError(s.message());
    }
    // Nonblocking, so that joining is bounded: NCCL's blocking init waits for every rank forever.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // The job's class on the network (NCCL's InfiniBand/RoCE transport; a library older than
    // the field ignores it), and a name for NCCL's logs, kept alive with the communicator.
    if (options.traffic_class >= 0 && options.traffic_class <= 255) config.trafficClass = options.traffic_class;
    auto name = std::make_shared<const std::string>(options.name);
    if (!name->empty()) config.commName = name->c_str();
    ncclComm_t comm = nullptr;
    ncclResult_t r = nccl_.CommInitRankConfig(&comm, size, id, rank, &config);
    const absl::Time deadline = absl::Now() + timeout;
    while (r == ncclSuccess || r == ncclInProgress) {
      ncclResult_t state = ncclSuccess;
      r = nccl_.CommGetAsyncError(comm, &state);
      if (r != ncclSuccess) break;
      if (state == ncclSuccess) {
        return std::unique_ptr<RankComm>(new NcclRankComm(nccl_, comm, device, rank, size, options.op_timeout, name));
      }
      if (state != ncclInProgress) {
        r = state;
        break;
      }
      if (absl::Now() > deadline) {
        nccl_.CommAbort(comm);
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", rank, " of ", size, ": not every rank joined the NCCL communicator within ",
            absl::FormatDuration(timeout), " (every rank of the group makes its first CUDA call; init timeout)"));
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    if (comm != nullptr) nccl_.CommAbort(comm);
    return FromNccl(nccl_, r, "ncclCommInitRankConfig");
  }

 private:
  const NcclApi& nccl_;
};

#endif  // COLLSERVE_CLIENT_NCCL

}  // namespace

RankCommFactory* GetRankCommFactory(std::string* why) {
  if (RankCommFactory* f = g_testing_factory.load(); f != nullptr) return f;
#ifdef COLLSERVE_CLIENT_NCCL
  const absl::StatusOr<NcclApi>& nccl = Nccl();
  if (!nccl.ok()) {
    *why = std::string(nccl.status().message());
    return nullptr;
  }
  static NcclFactory* factory = new NcclFactory(*nccl);
  return factory;
#else
  *why = "this collserve build has no NCCL support (built without CUDA and nccl.h)";
  return nullptr;
#endif
}

void SetRankCommFactoryForTesting(RankCommFactory* factory) { g_testing_factory.store(factory); }

}  // namespace collserve::client
