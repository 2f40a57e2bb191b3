// See collserve_c10d.h.
#include <Python.h>

#include "python/c10d/collserve_c10d.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace collserve::c10d_backend {
namespace {

using ::c10d::OpType;
using client::ReduceOpArg;

// The SDK's dtype for a torch scalar type; throws (c10::Error) for the others.
DataType ToDataType(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kBool;
    default:
      TORCH_CHECK(false, "collserve: ", what, " has dtype ", t,
                  ", which collserve does not support (float32, float64, float16, bfloat16, int32, int64, "
                  "int8, uint8, bool)");
  }
}

// Checks that `t` is a dense contiguous CPU tensor collserve can move in place.
void CheckTensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "collserve: ", what, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "collserve: ", what, " is on ", t.device(),
              "; the collserve backend takes CPU tensors");
  TORCH_CHECK(t.layout() == at::kStrided, "collserve: ", what, " is sparse; collserve takes dense tensors");
  TORCH_CHECK(t.is_contiguous(), "collserve: ", what, " is not contiguous");
  ToDataType(t.scalar_type(), what);
}

// The memory an element-wise in-place op (all_reduce, broadcast, reduce) runs on for `t`,
// and what to do after it succeeds.
//  * A contiguous tensor, or a permuted one whose elements fill one block (a transpose, as
//    autograd gives for a Linear weight's gradient): the op runs on the block in place.
//    Element i of every rank meets element i of the others when the ranks' tensors share
//    their strides (torch's Gloo assumes the same).
//  * Any other strided tensor (a slice with steps, an expand()ed gradient, as autograd gives
//    for the bias of a summed output): the op runs on a contiguous copy, which is copied back
//    on success. Expanded dimensions alias one slice, which receives the result (every
//    aliased element had the same input, so the same result). A tensor that overlaps itself
//    otherwise is refused.
// torch 1.13's Gloo runs on data_ptr() for numel() elements in every case, which reads and
// writes past an expanded tensor's storage and scrambles a stepped slice.
struct InPlace {
  at::Tensor buffer;
  std::function<void()> copy_back;
};

// True unless the strides prove that no two elements of `t` share memory: with dimensions
// sorted by stride (size-1 ones ignored), each stride exceeds the span of the smaller ones.
bool MayOverlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest offset reachable with the dimensions so far
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += stride * (size - 1);
  }
  return false;
}

InPlace ElementwiseInPlace(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "collserve: ", what, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "collserve: ", what, " is on ", t.device(),
              "; the collserve backend takes CPU tensors");
  TORCH_CHECK(t.layout() == at::kStrided, "collserve: ", what, " is sparse; collserve takes dense tensors");
  ToDataType(t.scalar_type(), what);
  bool block = t.is_non_overlapping_and_dense();
  for (int64_t stride : t.strides()) block = block && stride >= 0;
  if (block) return {t, nullptr};
  at::Tensor target = t;
  at::Tensor buffer = t.contiguous();
  at::Tensor source = buffer;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      target = target.narrow(d, 0, 1);
      source = source.narrow(d, 0, 1);
    }
  }
  TORCH_CHECK(!MayOverlap(target), "collserve: ", what,
              " has elements that share memory in a way other than expand(); pass a contiguous tensor");
  return {buffer, [target, source]() mutable { target.copy_(source); }};
}

DataType Dt(const at::Tensor& t, const char* what) { return ToDataType(t.scalar_type(), what); }

// The one tensor of a c10d tensor list (CPU backends take one tensor per call).
at::Tensor& Single(std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "collserve ", op, ": takes a list of exactly one tensor, got ", tensors.size());
  CheckTensor(tensors[0], "the tensor");
  return tensors[0];
}

// The one tensor of an element-wise in-place op (see ElementwiseInPlace).
InPlace SingleInPlace(std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "collserve ", op, ": takes a list of exactly one tensor, got ", tensors.size());
  return ElementwiseInPlace(tensors[0], "the tensor");
}

// Checks a list of tensors sharing `dtype`; returns their data pointers and element counts.
template <typename Ptr>
void Views(std::vector<at::Tensor>& ts, at::ScalarType dtype, const char* what, std::vector<Ptr>* ptrs,
           std::vector<int64_t>* counts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    std::string name = absl::StrCat(what, "[", i, "]");
    CheckTensor(ts[i], name.c_str());
    TORCH_CHECK(ts[i].scalar_type() == dtype, "collserve: ", name, " has dtype ", ts[i].scalar_type(),
                " but the input has ", dtype);
    ptrs->push_back(ts[i].data_ptr());
    counts->push_back(ts[i].numel());
  }
}

// The input and output tensors of an out-of-place op: contiguous, of one dtype.
void CheckInputOutput(const at::Tensor& input, const at::Tensor& output, const char* op) {
  CheckTensor(input, "the input");
  CheckTensor(output, "the output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "collserve ", op, ": output dtype ", output.scalar_type(),
              " differs from input dtype ", input.scalar_type());
}

// Waits for an operation the caller blocks on (monitored_barrier, a step of a multi-step
// operation); throws its error as Work::wait would.
void WaitStep(const std::shared_ptr<client::Work>& work, const char* op) {
  absl::Status s = work->Wait();
  if (!s.ok()) {
    throw std::runtime_error(
        absl::StrCat("collserve ", op, ": ", absl::StatusCodeToString(s.code()), ": ", s.message()));
  }
}

// The coalesced calls' tensors (`what`: "inputs" or "outputs"), checked (at least one, one
// dtype), flattened and concatenated into one new contiguous 1-D tensor.
at::Tensor Flatten(const std::vector<at::Tensor>& ts, const char* op, const char* what) {
  TORCH_CHECK(!ts.empty(), "collserve ", op, ": no tensors");
  std::vector<at::Tensor> parts;
  parts.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    std::string name = absl::StrCat(what, "[", i, "]");
    CheckTensor(ts[i], name.c_str());
    TORCH_CHECK(ts[i].scalar_type() == ts[0].scalar_type(), "collserve ", op, ": ", name, " has dtype ",
                ts[i].scalar_type(), " but ", what, "[0] has ", ts[0].scalar_type(), " (one dtype per call)");
    parts.push_back(ts[i].reshape({-1}));
  }
  return at::cat(parts);
}

// gather's outputs / scatter's inputs: one list of `size` tensors on the root, nothing
// elsewhere. Returns whether this rank has the list.
bool RootList(const std::vector<std::vector<at::Tensor>>& lists, bool is_root, int size, const char* op,
              const char* kind) {
  if (is_root) {
    TORCH_CHECK(lists.size() == 1 && static_cast<int>(lists[0].size()) == size, "collserve ", op,
                ": the root needs one ", kind, " list of ", size, " tensors");
    return true;
  }
  TORCH_CHECK(lists.empty() || (lists.size() == 1 && lists[0].empty()), "collserve ", op, ": only the root passes ",
              kind, " tensors");
  return false;
}

// ---- torch version: what differs between 1.13 and 2.x in this file, besides the
// #if COLLSERVE_TORCH2 block of 2.x-only members at its end ----

// PREMUL_SUM's factor: a double, or a one-element tensor (1.13: a list of them, one per
// device; 2.x: one).
double PremulSumFactor(const ::c10d::NCCLPreMulSumSupplement& s) {
#if COLLSERVE_TORCH2
  const at::Tensor* tensor = s.tensor_factor.defined() ? &s.tensor_factor : nullptr;
#else
  const at::Tensor* tensor = s.tensor_factors.empty() ? nullptr : &s.tensor_factors[0];
#endif
  if (tensor == nullptr) return s.double_factor;
  TORCH_CHECK(tensor->numel() == 1, "collserve: PREMUL_SUM's factor tensor must hold one value");
  return tensor->item<double>();
}

ReduceOpArg ToReduceOp(const ::c10d::ReduceOp& op) {
  switch (op.op_) {
    case ::c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case ::c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case ::c10d::ReduceOp::PRODUCT: return ReduceOp::kProduct;
    case ::c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case ::c10d::ReduceOp::MAX: return ReduceOp::kMax;
    case ::c10d::ReduceOp::BAND: return ReduceOp::kBand;
    case ::c10d::ReduceOp::BOR: return ReduceOp::kBor;
    case ::c10d::ReduceOp::BXOR: return ReduceOp::kBxor;
    case ::c10d::ReduceOp::PREMUL_SUM: {
      auto* s = dynamic_cast<::c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(s != nullptr, "collserve: PREMUL_SUM without a factor");
      return client::MakePremulSum(PremulSumFactor(*s));
    }
    default:
      TORCH_CHECK(false, "collserve: unsupported ReduceOp ", static_cast<int>(op.op_));
  }
}

int Rank(int64_t rank, const char* what) {
  TORCH_CHECK(rank >= -1 && rank <= INT32_MAX, "collserve: ", what, " ", rank, " is out of range");
  return static_cast<int>(rank);
}

// Elements per index of dim 0 (torch's all_to_all_single splits count rows).
int64_t RowElements(const at::Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "collserve alltoall_base: tensors need at least one dimension");
  return t.size(0) == 0 ? 0 : t.numel() / t.size(0);
}

}  // namespace

// ---- CollserveWork ----

struct CollserveWork::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
  std::exception_ptr error;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> keep_alive;
  std::function<void()> on_success;
  std::shared_ptr<client::Work> work;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::string op_name;
};

CollserveWork::CollserveWork(int rank, OpType type, const char* op_name, Pending pending)
    : ::c10d::Work(rank, type), state_(std::make_shared<State>()) {
  state_->outputs = std::move(pending.outputs);
  state_->keep_alive = std::move(pending.keep_alive);
  state_->on_success = std::move(pending.on_success);
  state_->work = std::move(pending.work);
  state_->op_name = op_name;
  state_->future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  // The callback owns the state, not the Work: a dropped Work still completes its Future
  // and keeps its tensors alive until the operation ends.
  std::shared_ptr<State> state = state_;
  state_->work->OnCompletion([state](const absl::Status& s) {
    absl::Status status = s;
    if (status.ok() && state->on_success) {
      try {
        state->on_success();
      } catch (const std::exception& e) {
        status = absl::InternalError(e.what());
      }
    }
    std::exception_ptr error;
    if (!status.ok()) {
      error = std::make_exception_ptr(std::runtime_error(absl::StrCat(
          "collserve ", state->op_name, ": ", absl::StatusCodeToString(status.code()), ": ", status.message())));
    }
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::vector<at::Tensor> outputs;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->done = true;
      state->status = status;
      state->error = error;
      state->keep_alive.clear();
      state->on_success = nullptr;
      future = state->future;
      outputs = state->outputs;
    }
    state->cv.notify_all();
    if (error) {
      future->setError(error);
    } else {
      future->markCompleted(c10::IValue(outputs));
    }
  });
}

CollserveWork::~CollserveWork() = default;

bool CollserveWork::isCompleted() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

bool CollserveWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done && state_->status.ok();
}

std::exception_ptr CollserveWork::exception() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

int CollserveWork::sourceRank() const { return state_->work->SourceRank(); }

std::vector<at::Tensor> CollserveWork::result() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->outputs;
}

bool CollserveWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  if (timeout == kNoTimeout) {
    state_->cv.wait(lock, [&] { return state_->done; });
  } else if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    throw std::runtime_error(absl::StrCat("collserve ", state_->op_name, ": DEADLINE_EXCEEDED: did not complete within ",
                                          timeout.count(), " ms (the operation goes on)"));
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CollserveWork::getFuture() { return state_->future; }

// ---- CollserveProcessGroup ----

namespace {

// Every collserve group alive in this process, for ShutdownAll. Raw pointers: each group
// adds itself in its constructor and removes itself in its destructor, under the mutex. (A
// c10::weak_intrusive_ptr would defer the group's destructor, and with it the end of its
// session, until the weak reference goes.)
std::mutex& RegistryMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::vector<CollserveProcessGroup*>& Registry() {
  static auto* groups = new std::vector<CollserveProcessGroup*>;
  return *groups;
}

}  // namespace

CollserveProcessGroup::CollserveProcessGroup(std::unique_ptr<client::ProcessGroup> pg,
                                             std::chrono::milliseconds op_timeout)
    : TorchBase(pg->GetRank(), pg->GetWorldSize()),
      pg_(std::move(pg)),
      generation_(pg_->generation()),
      op_timeout_ms_(op_timeout.count()) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().push_back(this);
}

CollserveProcessGroup::~CollserveProcessGroup() {
  // Ending the session joins the SDK's completion thread, which may be in a Work's callback
  // dropping its tensors, and dropping a tensor that has a Python object takes the GIL. The
  // last reference usually goes from Python (destroy_process_group), GIL held: let go of it.
  PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    std::vector<CollserveProcessGroup*>& registry = Registry();
    registry.erase(std::remove(registry.begin(), registry.end(), this), registry.end());
  }
  Shutdown();
  if (saved != nullptr) PyEval_RestoreThread(saved);
}

std::shared_ptr<client::ProcessGroup> CollserveProcessGroup::Live(const char* op) {
  std::lock_guard<std::mutex> lock(session_mu_);
  if (pg_ == nullptr) throw std::runtime_error(absl::StrCat("collserve ", op, ": FAILED_PRECONDITION: ", ended_));
  return pg_;
}

std::shared_ptr<client::ProcessGroup> CollserveProcessGroup::Session(const char* op) {
  std::lock_guard<std::mutex> lock(session_mu_);
  if (pg_ == nullptr) throw std::runtime_error(absl::StrCat("collserve ", op, ": FAILED_PRECONDITION: ", ended_));
  // The sidecars compare call sites of collectives, not of barriers or point-to-point calls
  // (engine ChecksCallSite); "empty" allocates.
  static constexpr std::string_view kUnchecked[] = {"barrier", "monitored_barrier", "send", "recv", "empty"};
  if (std::find(std::begin(kUnchecked), std::end(kUnchecked), std::string_view(op)) == std::end(kUnchecked)) {
    client::SetCallSite(MarkCallSite());
  }
  return pg_;
}

std::string CollserveProcessGroup::MarkCallSite() {
  if (!python::CallSitesEnabled()) return "";
  return call_sites_.Mark();
}

std::shared_ptr<client::ProcessGroup> CollserveProcessGroup::TakeSessionLocked() {
  if (pg_ != nullptr) last_completed_seq_ = pg_->last_completed_seq();
  return std::move(pg_);
}

std::shared_ptr<client::ProcessGroup> CollserveProcessGroup::TakeSession(const std::string& why) {
  std::lock_guard<std::mutex> lock(session_mu_);
  if (pg_ != nullptr && !why.empty()) ended_ = why;
  return TakeSessionLocked();
}

void CollserveProcessGroup::Shutdown() {
  TakeSession().reset();  // ends the session here unless a call on another thread still holds it
}

void GroupHealth::Track(const std::shared_ptr<GroupHealth>& health, const std::shared_ptr<client::Work>& work) {
  {
    std::lock_guard<std::mutex> lock(health->mu);
    ++health->in_flight;
  }
  // The callback owns the record: it may run after the group is gone.
  work->OnCompletion([health](const absl::Status& s) {
    std::lock_guard<std::mutex> lock(health->mu);
    if (!s.ok() && health->first_error.ok()) health->first_error = s;
    --health->in_flight;
    health->cv.notify_all();
  });
}

void CollserveProcessGroup::Abort(const std::string& why) {
  std::shared_ptr<client::ProcessGroup> session;
  {
    std::lock_guard<std::mutex> lock(session_mu_);
    if (pg_ == nullptr) return;  // ended already: keep the first reason
    session = TakeSessionLocked();
    ended_ = why.empty() ? "this process group was aborted (collserve.torch.abort or torch's _abort_process_group)"
                         : why;
  }
  {
    std::lock_guard<std::mutex> lock(health_->mu);
    if (health_->first_error.ok()) {
      health_->first_error = absl::CancelledError("the process group was aborted in this process");
    }
  }
  session.reset();
}

bool CollserveProcessGroup::GracefulShutdown(std::chrono::milliseconds timeout) {
  std::shared_ptr<client::ProcessGroup> session =
      TakeSession("this process group was shut down (collserve.torch.shutdown)");
  bool drained;
  {
    std::unique_lock<std::mutex> lock(health_->mu);
    drained = health_->cv.wait_for(lock, timeout, [&] { return health_->in_flight == 0; });
  }
  session.reset();
  return drained;
}

absl::Status CollserveProcessGroup::FirstError() {
  std::lock_guard<std::mutex> lock(health_->mu);
  return health_->first_error;
}

void CollserveProcessGroup::SetTimeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    throw std::invalid_argument(absl::StrCat("collserve set_timeout: ", timeout.count(), " ms (must be > 0)"));
  }
  absl::Status s = Live("set_timeout")->SetOpTimeout(absl::Milliseconds(timeout.count()));
  if (!s.ok()) throw std::invalid_argument(absl::StrCat("collserve set_timeout: ", s.message()));
  op_timeout_ms_.store(timeout.count());
}

int64_t CollserveProcessGroup::LastCompletedSeq() {
  std::lock_guard<std::mutex> lock(session_mu_);
  return pg_ != nullptr ? pg_->last_completed_seq() : last_completed_seq_;
}

void ShutdownAll(const std::string& why) {
  std::vector<std::shared_ptr<client::ProcessGroup>> sessions;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (CollserveProcessGroup* group : Registry()) sessions.push_back(group->TakeSession(why));
  }
  sessions.clear();  // ends them with no lock held: their completions may run Python callbacks
}

at::Tensor CollserveProcessGroup::EmptyShared(int64_t bytes) {
  if (bytes <= 0) throw std::invalid_argument(absl::StrCat("collserve empty: ", bytes, " bytes (must be > 0)"));
  absl::StatusOr<std::shared_ptr<client::SharedBuffer>> buffer =
      Session("empty")->AllocateShared(static_cast<size_t>(bytes));
  if (!buffer.ok()) {
    throw std::runtime_error(absl::StrCat("collserve empty: ", absl::StatusCodeToString(buffer.status().code()),
                                          ": ", buffer.status().message()));
  }
  std::shared_ptr<client::SharedBuffer> keep = std::move(*buffer);
  void* data = keep->data();
  return at::from_blob(
      data, {bytes}, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(at::kByte));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::Make(OpType type, const char* op_name, Pending pending) {
  issued_.fetch_add(1, std::memory_order_relaxed);
  GroupHealth::Track(health_, pending.work);
  c10::intrusive_ptr<CollserveWork> work = c10::make_intrusive<CollserveWork>(getRank(), type, op_name, std::move(pending));
  std::lock_guard<std::mutex> lock(coalescing_mu_);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                                  const ::c10d::BroadcastOptions& opts) {
  InPlace t = SingleInPlace(tensors, "broadcast");
  TORCH_CHECK(opts.rootTensor == 0, "collserve broadcast: rootTensor must be 0");
  Pending p;
  p.work =
      Session("broadcast")
          ->Broadcast(t.buffer.data_ptr(), t.buffer.numel(), Dt(t.buffer, "the tensor"), Rank(opts.rootRank, "root"));
  p.outputs = tensors;
  p.keep_alive = {t.buffer};
  p.on_success = std::move(t.copy_back);
  return Make(OpType::BROADCAST, "broadcast", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                                  const ::c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  InPlace t = SingleInPlace(tensors, "allreduce");
  Pending p;
  p.work =
      Session("allreduce")
          ->AllReduce(t.buffer.data_ptr(), t.buffer.numel(), Dt(t.buffer, "the tensor"), ToReduceOp(opts.reduceOp));
  p.outputs = tensors;
  p.keep_alive = {t.buffer};
  p.on_success = std::move(t.copy_back);
  return Make(OpType::ALLREDUCE, "allreduce", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                         const ::c10d::AllreduceOptions& opts) {
  const char* op = "allreduce_sparse";
  TORCH_CHECK(tensors.size() == 1, "collserve ", op, ": takes a list of exactly one tensor, got ", tensors.size());
  const at::Tensor& in = tensors[0];
  TORCH_CHECK(in.defined() && in.is_sparse() && in.device().is_cpu(), "collserve ", op,
              ": takes a sparse COO CPU tensor");
  TORCH_CHECK(opts.reduceOp == ::c10d::ReduceOp::SUM, "collserve ", op, ": only ReduceOp.SUM (as Gloo)");
  ToDataType(in.scalar_type(), "the tensor");
  at::Tensor t = in.coalesce();
  at::Tensor indices = t._indices().contiguous();  // [sparse_dim, nnz], int64
  at::Tensor values = t._values().contiguous();    // [nnz, dense sizes...]
  const int world = getSize();
  const int64_t nnz = t._nnz();
  int64_t row = 1;  // elements per non-zero entry (the dense dimensions)
  for (int64_t d = 1; d < values.dim(); ++d) row *= values.size(d);
  // Step 1: every rank's nnz, and its sizes (the ranks must agree on them).
  std::vector<int64_t> meta = {nnz, in.dim(), in.sparse_dim(), row};
  for (int64_t s : in.sizes()) meta.push_back(s);
  at::Tensor meta_in = at::tensor(meta, at::kLong);
  at::Tensor meta_all = at::empty({meta_in.numel() * world}, at::kLong);
  WaitStep(Session("allreduce_sparse")
               ->AllGatherIntoTensor(meta_all.data_ptr(), meta_in.data_ptr(), meta_in.numel(), DataType::kInt64),
           op);
  std::vector<int64_t> counts_i, counts_v;
  for (int r = 0; r < world; ++r) {
    at::Tensor m = meta_all.narrow(0, r * meta_in.numel(), meta_in.numel());
    TORCH_CHECK(at::equal(m.narrow(0, 1, m.numel() - 1), meta_in.narrow(0, 1, m.numel() - 1)), "collserve ", op,
                ": rank ", r, "'s tensor has other sizes, sparse or dense dimensions than this rank's ", in.sizes());
    int64_t n = m[0].item<int64_t>();
    TORCH_CHECK(n >= 0 && n <= INT64_MAX / std::max<int64_t>(1, std::max(in.sparse_dim(), row)), "collserve ", op,
                ": rank ", r, " reports ", n, " non-zero entries");
    counts_i.push_back(n * in.sparse_dim());
    counts_v.push_back(n * row);
  }
  // Step 2: the indices; step 3 (the Work returned): the values.
  auto gather = [&](const at::Tensor& mine, const std::vector<int64_t>& counts, at::Tensor* all) {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    *all = at::empty({total}, mine.options());
    std::vector<void*> ptrs;
    int64_t offset = 0;
    for (int64_t c : counts) {
      ptrs.push_back(static_cast<char*>(all->data_ptr()) + offset * all->element_size());
      offset += c;
    }
    return Session("allreduce_sparse")->AllGather(ptrs, counts, mine.data_ptr(), mine.numel(), Dt(mine, "the tensor"));
  };
  at::Tensor all_indices, all_values;
  WaitStep(gather(indices, counts_i, &all_indices), op);
  Pending p;
  p.work = gather(values, counts_v, &all_values);
  p.keep_alive = {indices, values, all_indices, all_values};
  at::Tensor target = in;
  std::vector<int64_t> value_sizes = values.sizes().vec();
  int64_t sparse_dim = in.sparse_dim();
  std::vector<int64_t> nnzs;
  for (int r = 0; r < world; ++r) nnzs.push_back(meta_all[r * meta_in.numel()].item<int64_t>());
  p.on_success = [target, all_indices, all_values, nnzs, value_sizes, sparse_dim]() mutable {
    // Rank r's block of the indices is its [sparse_dim, nnz_r] matrix, row-major.
    std::vector<at::Tensor> idx;
    int64_t offset = 0, total = 0;
    for (int64_t n : nnzs) {
      idx.push_back(all_indices.narrow(0, offset, n * sparse_dim).view({sparse_dim, n}));
      offset += n * sparse_dim;
      total += n;
    }
    value_sizes[0] = total;
    at::Tensor sum =
        at::sparse_coo_tensor(at::cat(idx, 1), all_values.view(value_sizes), target.sizes()).coalesce();
    target.copy_(sum);  // the caller's tensor now holds the sum (its nnz may change)
  };
  p.outputs = tensors;
  return Make(OpType::ALLREDUCE, op, std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const ::c10d::AllreduceCoalescedOptions& opts) {
  at::Tensor flat = Flatten(tensors, "allreduce_coalesced", "tensors");
  Pending p;
  p.work = Session("allreduce_coalesced")
               ->AllReduce(flat.data_ptr(), flat.numel(), Dt(flat, "the tensors"), ToReduceOp(opts.reduceOp));
  p.outputs = tensors;
  p.keep_alive = {flat};
  std::vector<at::Tensor> targets = tensors;
  p.on_success = [flat, targets]() {
    int64_t offset = 0;
    for (const at::Tensor& t : targets) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  };
  return Make(OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::reduce(std::vector<at::Tensor>& tensors,
                                                               const ::c10d::ReduceOptions& opts) {
  InPlace t = SingleInPlace(tensors, "reduce");
  TORCH_CHECK(opts.rootTensor == 0, "collserve reduce: rootTensor must be 0");
  Pending p;
  p.work = Session("reduce")->Reduce(t.buffer.data_ptr(), t.buffer.numel(), Dt(t.buffer, "the tensor"),
                                     ToReduceOp(opts.reduceOp), Rank(opts.rootRank, "root"));
  p.outputs = tensors;
  p.keep_alive = {t.buffer};
  if (getRank() == opts.rootRank) p.on_success = std::move(t.copy_back);
  return Make(OpType::REDUCE, "reduce", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  const ::c10d::AllgatherOptions& opts) {
  at::Tensor& in = Single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "collserve allgather: takes one output list, got ", outputs.size());
  TORCH_CHECK(static_cast<int>(outputs[0].size()) == getSize(), "collserve allgather: the output list has ",
              outputs[0].size(), " tensors, but the group has ", getSize(), " ranks");
  std::vector<void*> ptrs;
  std::vector<int64_t> counts;
  Views(outputs[0], in.scalar_type(), "output_tensor_list", &ptrs, &counts);
  TORCH_CHECK(counts[getRank()] == in.numel(), "collserve allgather: output_tensor_list[", getRank(), "] has ",
              counts[getRank()], " elements but the input has ", in.numel());
  Pending p;
  p.work = Session("allgather")->AllGather(ptrs, counts, in.data_ptr(), in.numel(), Dt(in, "the input"));
  p.outputs = outputs[0];
  p.keep_alive = {in};
  return Make(OpType::ALLGATHER, "allgather", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                        const ::c10d::AllgatherOptions& opts) {
  CheckInputOutput(input, output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "collserve all_gather_into_tensor: the output has ",
              output.numel(), " elements, expected input elements (", input.numel(), ") x world_size (", getSize(),
              ")");
  Pending p;
  p.work = Session("_allgather_base")
               ->AllGatherIntoTensor(output.data_ptr(), input.data_ptr(), input.numel(), Dt(input, "the input"));
  p.outputs = {output};
  p.keep_alive = {input};
  return Make(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_coalesced";
  // outputs[r][i] receives rank r's inputs[i], as torch's Gloo and torch.distributed index them.
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "collserve ", op, ": ", outputs.size(),
              " output lists, but the group has ", getSize(), " ranks (output_tensor_lists[r] receives rank r's "
              "inputs)");
  at::Tensor flat_in = Flatten(inputs, op, "inputs");
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "collserve ", op, ": output list ", r, " has ",
                outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < outputs[r].size(); ++i) {
      std::string name = absl::StrCat("outputs[", r, "][", i, "]");
      CheckTensor(outputs[r][i], name.c_str());
      TORCH_CHECK(outputs[r][i].scalar_type() == flat_in.scalar_type() && outputs[r][i].numel() == inputs[i].numel(),
                  "collserve ", op, ": ", name, " must have inputs[", i, "]'s dtype and ", inputs[i].numel(),
                  " elements (every rank passes the same shapes)");
    }
  }
  // Rank r's block of the gathered buffer holds its inputs back to back.
  at::Tensor flat_out = at::empty({flat_in.numel() * getSize()}, flat_in.options());
  Pending p;
  p.work =
      Session("allgather_coalesced")
          ->AllGatherIntoTensor(flat_out.data_ptr(), flat_in.data_ptr(), flat_in.numel(), Dt(flat_in, "the inputs"));
  p.keep_alive = {flat_in, flat_out};
  for (const std::vector<at::Tensor>& list : outputs) p.outputs.insert(p.outputs.end(), list.begin(), list.end());
  std::vector<std::vector<at::Tensor>> targets = outputs;
  int64_t n = flat_in.numel();
  p.on_success = [flat_out, targets, n]() {
    for (size_t r = 0; r < targets.size(); ++r) {
      int64_t offset = static_cast<int64_t>(r) * n;
      for (const at::Tensor& t : targets[r]) {
        t.copy_(flat_out.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  };
  return Make(OpType::ALLGATHER_COALESCED, op, std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const ::c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "collserve ", op, ": ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  at::Tensor flat_in = Flatten(inputs, op, "inputs");
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::string name = absl::StrCat("outputs[", i, "]");
    CheckTensor(outputs[i], name.c_str());
    TORCH_CHECK(outputs[i].scalar_type() == flat_in.scalar_type() &&
                    outputs[i].numel() == inputs[i].numel() * getSize(),
                "collserve ", op, ": ", name, " must have inputs[", i, "]'s dtype and input elements (",
                inputs[i].numel(), ") x world_size (", getSize(), ") elements");
  }
  // Rank r's block of the gathered buffer holds its inputs back to back; outputs[i] takes
  // input i of every rank in rank order.
  at::Tensor flat_out = at::empty({flat_in.numel() * getSize()}, flat_in.options());
  Pending p;
  p.work =
      Session("allgather_into_tensor_coalesced")
          ->AllGatherIntoTensor(flat_out.data_ptr(), flat_in.data_ptr(), flat_in.numel(), Dt(flat_in, "the inputs"));
  p.keep_alive = {flat_in, flat_out};
  p.outputs = outputs;
  std::vector<at::Tensor> targets = outputs;
  int64_t n = flat_in.numel();
  int world = getSize();
  p.on_success = [flat_out, targets, n, world]() {
    at::Tensor by_rank = flat_out.view({world, n});
    int64_t offset = 0;
    for (const at::Tensor& t : targets) {
      int64_t count = t.numel() / world;
      t.view({world, count}).copy_(by_rank.narrow(1, offset, count));
      offset += count;
    }
  };
  return Make(OpType::ALLGATHER_COALESCED, op, std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const ::c10d::GatherOptions& opts) {
  at::Tensor& in = Single(inputs, "gather");
  int root = Rank(opts.rootRank, "root");
  std::vector<void*> ptrs;
  std::vector<int64_t> counts;
  Pending p;
  if (RootList(outputs, getRank() == root, getSize(), "gather", "output")) {
    Views(outputs[0], in.scalar_type(), "gather_list", &ptrs, &counts);
    p.outputs = outputs[0];
  }
  p.work = Session("gather")->Gather(in.data_ptr(), in.numel(), ptrs, counts, Dt(in, "the input"), root);
  p.keep_alive = {in};
  return Make(OpType::GATHER, "gather", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const ::c10d::ScatterOptions& opts) {
  at::Tensor& out = Single(outputs, "scatter");
  int root = Rank(opts.rootRank, "root");
  std::vector<const void*> ptrs;
  std::vector<int64_t> counts;
  Pending p;
  if (RootList(inputs, getRank() == root, getSize(), "scatter", "input")) {
    Views(inputs[0], out.scalar_type(), "scatter_list", &ptrs, &counts);
    p.keep_alive = inputs[0];
  }
  p.work = Session("scatter")->Scatter(out.data_ptr(), out.numel(), ptrs, counts, Dt(out, "the output"), root);
  p.outputs = outputs;
  return Make(OpType::SCATTER, "scatter", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  at::Tensor& out = Single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
              "collserve reduce_scatter: needs one input list of ", getSize(), " tensors");
  std::vector<const void*> ptrs;
  std::vector<int64_t> counts;
  Views(inputs[0], out.scalar_type(), "input_list", &ptrs, &counts);
  Pending p;
  p.work =
      Session("reduce_scatter")
          ->ReduceScatter(out.data_ptr(), out.numel(), ptrs, counts, Dt(out, "the output"), ToReduceOp(opts.reduceOp));
  p.outputs = outputs;
  p.keep_alive = inputs[0];
  return Make(OpType::REDUCE_SCATTER, "reduce_scatter", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) {
  CheckInputOutput(input, output, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "collserve reduce_scatter_tensor: the input has ",
              input.numel(), " elements, expected output elements (", output.numel(), ") x world_size (", getSize(),
              ")");
  Pending p;
  p.work = Session("_reduce_scatter_base")
               ->ReduceScatterTensor(output.data_ptr(), input.data_ptr(), output.numel(), Dt(output, "the output"),
                                     ToReduceOp(opts.reduceOp));
  p.outputs = {output};
  p.keep_alive = {input};
  return Make(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const ::c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "collserve ", op, ": ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  at::Tensor flat_out = Flatten(outputs, op, "outputs");
  int world = getSize();
  // Packed so that rank r's block holds chunk r of every input, back to back.
  std::vector<at::Tensor> chunks;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::string name = absl::StrCat("inputs[", i, "]");
    CheckTensor(inputs[i], name.c_str());
    TORCH_CHECK(inputs[i].scalar_type() == flat_out.scalar_type() &&
                    inputs[i].numel() == outputs[i].numel() * world,
                "collserve ", op, ": ", name, " must have outputs[", i, "]'s dtype and output elements (",
                outputs[i].numel(), ") x world_size (", world, ") elements");
    chunks.push_back(inputs[i].reshape({world, outputs[i].numel()}));
  }
  at::Tensor packed = chunks.empty() ? at::empty({0}, flat_out.options()) : at::cat(chunks, 1).reshape({-1});
  Pending p;
  p.work = Session("reduce_scatter_tensor_coalesced")
               ->ReduceScatterTensor(flat_out.data_ptr(), packed.data_ptr(), flat_out.numel(),
                                     Dt(flat_out, "the outputs"), ToReduceOp(opts.reduceOp));
  p.keep_alive = {flat_out, packed};
  p.outputs = outputs;
  std::vector<at::Tensor> targets = outputs;
  p.on_success = [flat_out, targets]() {
    int64_t offset = 0;
    for (const at::Tensor& t : targets) {
      t.copy_(flat_out.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  };
  return Make(OpType::_REDUCE_SCATTER_BASE, op, std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                      std::vector<int64_t>& output_split_sizes,
                                                                      std::vector<int64_t>& input_split_sizes,
                                                                      const ::c10d::AllToAllOptions& opts) {
  CheckInputOutput(input, output, "all_to_all_single");
  auto elements = [](const std::vector<int64_t>& rows, int64_t per_row) {
    std::vector<int64_t> out;
    out.reserve(rows.size());
    for (int64_t r : rows) out.push_back(r * per_row);
    return out;
  };
  Pending p;
  p.work = Session("alltoall_base")
               ->AllToAllSingle(output.data_ptr(), output.numel(), input.data_ptr(), input.numel(),
                                elements(output_split_sizes, RowElements(output)),
                                elements(input_split_sizes, RowElements(input)), Dt(input, "the input"));
  p.outputs = {output};
  p.keep_alive = {input};
  return Make(OpType::ALLTOALL_BASE, "all_to_all_single", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::alltoall(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const ::c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize() && static_cast<int>(inputs.size()) == getSize(),
              "collserve all_to_all: needs ", getSize(), " output and input tensors, got ", outputs.size(), " and ",
              inputs.size());
  at::ScalarType dtype = inputs[0].defined() ? inputs[0].scalar_type() : at::kFloat;
  std::vector<void*> out_ptrs;
  std::vector<const void*> in_ptrs;
  std::vector<int64_t> out_counts, in_counts;
  Views(outputs, dtype, "output_tensor_list", &out_ptrs, &out_counts);
  Views(inputs, dtype, "input_tensor_list", &in_ptrs, &in_counts);
  Pending p;
  p.work =
      Session("alltoall")->AllToAll(out_ptrs, out_counts, in_ptrs, in_counts, Dt(inputs[0], "input_tensor_list[0]"));
  p.outputs = outputs;
  p.keep_alive = inputs;
  return Make(OpType::ALLTOALL, "all_to_all", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::barrier(const ::c10d::BarrierOptions& opts) {
  Pending p;
  p.work = Session("barrier")->Barrier();
  return Make(OpType::BARRIER, "barrier", std::move(p));
}

void CollserveProcessGroup::monitoredBarrier(const ::c10d::BarrierOptions& opts, bool wait_all_ranks) {
  std::chrono::milliseconds timeout = opts.timeout == ::c10d::kUnsetTimeout ? OpTimeout() : opts.timeout;
  // Gloo's monitored barrier with a zero timeout fails at once unless every rank has
  // arrived; the SDK takes positive timeouts only, so that is its shortest one.
  timeout = std::max(timeout, std::chrono::milliseconds(1));
  std::shared_ptr<client::Work> work =
      Session("monitored_barrier")->MonitoredBarrier(absl::Milliseconds(timeout.count()), wait_all_ranks);
  GroupHealth::Track(health_, work);
  WaitStep(work, "monitored_barrier");
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                             int tag) {
  at::Tensor& t = Single(tensors, "send");
  Pending p;
  p.work = Session("send")->Send(t.data_ptr(), t.numel(), Dt(t, "the tensor"), dst_rank, tag);
  p.keep_alive = tensors;
  return Make(OpType::SEND, "send", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                             int tag) {
  at::Tensor& t = Single(tensors, "recv");
  TORCH_CHECK(src_rank >= 0 && src_rank < getSize(), "collserve recv: src ", src_rank, " is out of range [0, ",
              getSize(), ")");
  Pending p;
  p.work = Session("recv")->Recv(t.data_ptr(), t.numel(), Dt(t, "the tensor"), src_rank, tag);
  p.outputs = tensors;
  return Make(OpType::RECV, "recv", std::move(p));
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  at::Tensor& t = Single(tensors, "recv");
  Pending p;
  p.work = Session("recv")->Recv(t.data_ptr(), t.numel(), Dt(t, "the tensor"), -1, tag);
  p.outputs = tensors;
  return Make(OpType::RECVANYSOURCE, "recv", std::move(p));
}

#if COLLSERVE_TORCH2

namespace {

// endCoalescing's Work: completes when every Work of the block has (see the header).
class CoalescedWork : public ::c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<CollserveWork>> works)
      : ::c10d::Work(rank, OpType::COALESCED), works_(std::move(works)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (works_.empty()) {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>()));
      return;
    }
    // Chained on the parts' Futures, which complete after their copy-back.
    auto remaining = std::make_shared<std::atomic<size_t>>(works_.size());
    auto future = future_;
    std::vector<c10::intrusive_ptr<CollserveWork>> parts = works_;
    for (const c10::intrusive_ptr<CollserveWork>& w : works_) {
      w->getFuture()->addCallback([remaining, future, parts](c10::ivalue::Future&) {
        if (remaining->fetch_sub(1) != 1) return;
        std::vector<at::Tensor> outputs;
        for (const c10::intrusive_ptr<CollserveWork>& part : parts) {
          if (std::exception_ptr e = part->exception()) {
            future->setError(e);
            return;
          }
          std::vector<at::Tensor> r = part->result();
          outputs.insert(outputs.end(), r.begin(), r.end());
        }
        future->markCompleted(c10::IValue(outputs));
      });
    }
  }

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> outputs;
    for (const c10::intrusive_ptr<CollserveWork>& part : works_) {
      std::vector<at::Tensor> r = part->result();
      outputs.insert(outputs.end(), r.begin(), r.end());
    }
    return outputs;
  }
  // Waits for every part (each within `timeout`); throws the first part's error.
  bool wait(std::chrono::milliseconds timeout) override {
    for (const c10::intrusive_ptr<CollserveWork>& part : works_) part->wait(timeout);
    return true;
  }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<c10::intrusive_ptr<CollserveWork>> works_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

void CollserveProcessGroup::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalescing_mu_);
  TORCH_CHECK(!coalescing_, "collserve: startCoalescing while a coalesced block is already open");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<::c10d::Work> CollserveProcessGroup::endCoalescing() {
  std::vector<c10::intrusive_ptr<CollserveWork>> works;
  {
    std::lock_guard<std::mutex> lock(coalescing_mu_);
    TORCH_CHECK(coalescing_, "collserve: endCoalescing without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return c10::make_intrusive<CoalescedWork>(getRank(), std::move(works));
}

uint64_t CollserveProcessGroup::getSequenceNumberForGroup() { return issued_.load(std::memory_order_relaxed); }

CollserveProcessGroup* FromTorchGroup(const c10::intrusive_ptr<::c10d::ProcessGroup>& group) {
  if (!group) return nullptr;
  try {
    return dynamic_cast<CollserveProcessGroup*>(group->getBackend(c10::DeviceType::CPU).get());
  } catch (const c10::Error&) {  // no CPU backend
    return nullptr;
  }
}

#else

CollserveProcessGroup* FromTorchGroup(const c10::intrusive_ptr<::c10d::ProcessGroup>& group) {
  return dynamic_cast<CollserveProcessGroup*>(group.get());
}

#endif  // COLLSERVE_TORCH2

c10::intrusive_ptr<TorchBase> CreateProcessGroup(const client::InitOptions& options) {
  absl::StatusOr<std::unique_ptr<client::ProcessGroup>> pg = client::InitProcessGroup(options);
  if (!pg.ok()) {
    throw std::runtime_error(absl::StrCat("collserve init_process_group: ",
                                          absl::StatusCodeToString(pg.status().code()), ": ", pg.status().message()));
  }
  return c10::make_intrusive<CollserveProcessGroup>(
      std::move(*pg), std::chrono::milliseconds(absl::ToInt64Milliseconds(options.op_timeout)));
}

}  // namespace collserve::c10d_backend
