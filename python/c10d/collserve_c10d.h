// The "collserve" c10d backend: torch.distributed's ProcessGroup interface over the C++ SDK
// (client/include/collserve/client.h), so that `dist.init_process_group("collserve")`,
// torch's collectives, point-to-point calls, barrier, Work objects and
// DistributedDataParallel run through the collserve sidecar.
//
// Registered from Python by collserve/torch.py through torch.distributed.Backend.
// register_backend ("Third-party backends" in https://pytorch.org/docs/stable/distributed.html;
// torch's example is test/cpp_extensions/cpp_c10d_extension.cpp). The creator attaches to the
// sidecar as (group, rank, world_size) and returns a CollserveProcessGroup.
//
// Torch versions: 1.13 (Debian 12) and 2.2 or later (tested on Debian 13's 2.6) build from
// this one source. Everything uses torch API that both share (at::Tensor, c10d::Work,
// c10d::ReduceOp and the *Options structs, c10::ivalue::Future); what differs is isolated
// in the "torch version" block below: the base class (1.13's register_backend wants a
// c10d::ProcessGroup, 2.x's a c10d::Backend registered for the CPU device, with the same
// virtual functions), the calls only 2.x has (the *_tensor_coalesced ones, coalescing),
// and how to find this backend inside a torch ProcessGroup. collserve/torch.py holds the
// Python side's one difference (register_backend's `devices`).
//
// Tensors: dense, contiguous CPU tensors of float32, float64, float16, bfloat16, int32,
// int64, int8, uint8 or bool, one tensor per call (as torch's Gloo backend for CPU). Data
// moves in place: collectives read and write the tensors' own memory. all_reduce, broadcast
// and reduce also take a transposed tensor (in place) and other strided or expand()ed ones
// (through a contiguous copy, written back on success; see ElementwiseInPlace in the .cc). Anything else fails
// at the call with c10::Error (Python RuntimeError) naming the tensor and the reason.
//
// Errors. A call with bad arguments throws at once. Failures of the operation itself
// (ranks disagreeing on sizes, a timeout, a peer or the sidecar gone) come back through the
// Work: wait() throws std::runtime_error (Python RuntimeError) whose message starts with
// "collserve <op>: <absl status code>:", the Future completes with that error, and
// isSuccess()/exception() report it.
//
// Thread safety: every method may be called from any thread; collectives must be issued in
// the same order on every rank (as with torch).
#ifndef COLLSERVE_PYTHON_C10D_COLLSERVE_C10D_H_
#define COLLSERVE_PYTHON_C10D_COLLSERVE_C10D_H_

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "collserve/client.h"
#include "python/common/call_sites.h"

namespace collserve::c10d_backend {

// ---- torch version (see the file comment): the only version-specific declarations ----
#if TORCH_VERSION_MAJOR >= 2
#define COLLSERVE_TORCH2 1
using TorchBase = ::c10d::Backend;
// Marks the overrides of virtual functions that only torch 2.x's c10d::Backend declares
// (on 1.13 they are ordinary members nothing calls).
#define COLLSERVE_TORCH2_OVERRIDE override
#elif TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR == 13
#define COLLSERVE_TORCH2 0
using TorchBase = ::c10d::ProcessGroup;
#define COLLSERVE_TORCH2_OVERRIDE
#else
#error "the collserve c10d backend supports torch 1.13 and 2.2 or later"
#endif

// What a group's operations report back to it: the first failure (getError) and how many
// are in flight (Shutdown waits for them). Shared with the operations' completion callbacks,
// which may run after the group is gone. Thread-safe.
struct GroupHealth {
  std::mutex mu;
  std::condition_variable cv;
  absl::Status first_error;  // OK until an operation of the group fails
  int64_t in_flight = 0;
  // Counts `work` in flight in `health` until it completes, and notes its error there.
  static void Track(const std::shared_ptr<GroupHealth>& health, const std::shared_ptr<client::Work>& work);
};

// One operation in flight: the SDK's Work, the tensors it reads and writes (kept alive until
// it completes), the tensors its Future yields, and what to do on success before completing
// (e.g. copying a flattened buffer back into the caller's tensors).
struct Pending {
  std::shared_ptr<client::Work> work;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> keep_alive;
  std::function<void()> on_success;
};

// c10d::Work over an SDK Work. Completion (success or error) is recorded, on_success run and
// the Future completed from the SDK's completion callback, so wait(), isCompleted() and
// getFuture() agree. Thread-safe.
class CollserveWork : public ::c10d::Work {
 public:
  CollserveWork(int rank, ::c10d::OpType type, const char* op_name, Pending pending);
  ~CollserveWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // recv: the group rank the message came from (-1 before completion and for other ops).
  int sourceRank() const override;
  // The output tensors (those the Future yields).
  std::vector<at::Tensor> result() override;
  // Blocks until the operation completes or `timeout` passes (kNoTimeout: no bound but the
  // operation's own deadline, InitOptions::op_timeout). Returns true on success; throws
  // std::runtime_error with the operation's error, or "... did not complete within N ms"
  // (the operation goes on; wait may be called again).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // CPU tensors: nothing to synchronize.
  void synchronize() override {}
  // A Future of List[Tensor] (the outputs), completed when the operation completes, with
  // the same error as wait() on failure. DistributedDataParallel's comm hooks use it.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// torch.distributed's ProcessGroup over one collserve group session. Ranks (roots, peers)
// are ranks of this group, as c10d passes them.
class CollserveProcessGroup : public TorchBase {
 public:
  // Takes a session from client::InitProcessGroup. op_timeout is the default deadline of
  // monitoredBarrier (torch passes kUnsetTimeout there) until SetTimeout.
  CollserveProcessGroup(std::unique_ptr<client::ProcessGroup> pg, std::chrono::milliseconds op_timeout);
  ~CollserveProcessGroup() override;

  const std::string getBackendName() const override { return "collserve"; }

  c10::intrusive_ptr<::c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const ::c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const ::c10d::AllreduceOptions& opts) override;
  // A sparse COO tensor (torch's SparseCPU: DDP with sparse embeddings; 1.13 passes it to
  // allreduce, 2.x to allreduce_sparse): SUM only, every rank's tensor of the same sizes and
  // dtype. As Gloo's: each rank's coalesced indices and values are all-gathered (the nnz
  // counts first; those two steps block the caller until every rank has called), and the
  // tensor holds the coalesced sum when the returned Work completes.
  c10::intrusive_ptr<::c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                    const ::c10d::AllreduceOptions& opts) COLLSERVE_TORCH2_OVERRIDE;
  // Any number of tensors of one dtype: flattened into one buffer, all-reduced, copied back.
  c10::intrusive_ptr<::c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                       const ::c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                          const ::c10d::ReduceOptions& opts) override;
  // outputs[0][r] receives rank r's input; sizes may differ between ranks.
  c10::intrusive_ptr<::c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const ::c10d::AllgatherOptions& opts) override;
  // all_gather_into_tensor: output.numel() == input.numel() * world_size.
  c10::intrusive_ptr<::c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const ::c10d::AllgatherOptions& opts) override;
  // all_gather_coalesced: outputs[r][i] receives rank r's inputs[i] (torch's and Gloo's
  // order: outputs.size() == world_size, outputs[r].size() == inputs.size()). Every rank passes
  // tensors of the same shapes (as Gloo requires); one dtype per call. One all_gather of
  // the flattened inputs, copied out on success.
  c10::intrusive_ptr<::c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const ::c10d::AllgatherOptions& opts) override;
  // torch 2.x's coalesced all_gather_into_tensor (_coalescing_manager's fast path):
  // outputs[i].numel() == inputs[i].numel() * world_size; one dtype per call; one
  // all_gather of the flattened inputs, copied out on success.
  c10::intrusive_ptr<::c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const ::c10d::AllgatherOptions& opts)
      COLLSERVE_TORCH2_OVERRIDE;
  c10::intrusive_ptr<::c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const ::c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const ::c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const ::c10d::ReduceScatterOptions& opts) override;
  // reduce_scatter_tensor: input.numel() == output.numel() * world_size.
  c10::intrusive_ptr<::c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                        const ::c10d::ReduceScatterOptions& opts) override;
  // torch 2.x's coalesced reduce_scatter_tensor: inputs[i].numel() == outputs[i].numel() *
  // world_size; one dtype per call. Rank r's chunks of every input are packed together,
  // reduce-scattered in one operation and copied out on success.
  c10::intrusive_ptr<::c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const ::c10d::ReduceScatterOptions& opts)
      COLLSERVE_TORCH2_OVERRIDE;
  // all_to_all_single: splits are counts of rows (dim 0), as torch's; empty = equal rows.
  c10::intrusive_ptr<::c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_split_sizes,
                                                 std::vector<int64_t>& input_split_sizes,
                                                 const ::c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                            const ::c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> barrier(const ::c10d::BarrierOptions& opts) override;
  // Blocks; throws std::runtime_error naming the first rank (all ranks with wait_all_ranks)
  // that did not arrive within opts.timeout (unset: the group's op timeout). A zero or
  // negative timeout times out at once unless every rank is already there, as Gloo's.
  void monitoredBarrier(const ::c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<::c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<::c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<::c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

#if COLLSERVE_TORCH2
  // torch 2.x's coalescing (ProcessGroup._start_coalescing / _end_coalescing, used by
  // _coalescing_manager with a device): the operations issued in between run as usual
  // (each returns its own Work), and endCoalescing returns one Work that completes when all
  // of them have (the first error wins); its Future yields all their outputs. Throws
  // c10::Error when coalescing is already on (start) or off (end). Thread-safe, but the
  // operations of one coalesced block must come from one thread, as with NCCL.
  void startCoalescing() override;
  c10::intrusive_ptr<::c10d::Work> endCoalescing() override;
  // torch 2.x's sequence numbers (set at creation for gloo and nccl, and by
  // TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper): the number of operations issued so far.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;
#endif

  // A 1-D uint8 tensor of `bytes` bytes (> 0; 64-byte aligned, zero-filled) in this group's
  // shared-memory arena (client::ProcessGroup::AllocateShared). This group's collectives on
  // a tensor viewing it (collserve.torch.empty reshapes it to any dtype) move no bytes
  // between this process and the sidecar: the sidecar reads and writes it in place (see
  // AllocateShared for what that means while an operation runs). The memory lives as long
  // as the tensor's storage. Throws std::runtime_error with the SDK's status (e.g.
  // RESOURCE_EXHAUSTED when /dev/shm is full). Thread-safe.
  at::Tensor EmptyShared(int64_t bytes);

  // Ends this group's session now, as its destruction would: operations still in flight
  // fail (UNAVAILABLE, FAILED_PRECONDITION or CANCELLED, by how far the sidecar got: the
  // codes of a destroyed group's), their Works complete, and the SDK's threads are joined. Later calls
  // throw std::runtime_error "collserve <op>: FAILED_PRECONDITION: ... shut down". Called
  // by ShutdownAll; idempotent. Call it without the GIL (completions may need it to drop
  // tensors). Thread-safe.
  void Shutdown();
  // The call site of the caller's Python stack for this group's next collective, counted as
  // one occurrence (python/common/call_sites.h); "" without the GIL or with
  // COLLSERVE_CALL_SITES=0. Every collective but barriers and point-to-point calls sets it
  // (client::SetCallSite) before it is issued. Thread-safe; needs the GIL for a non-empty result.
  std::string MarkCallSite();

  // Moves the session out (null once shut down); for Shutdown and ShutdownAll. `why`, when
  // not empty and the session was live, is what later calls' errors say (the default:
  // "shut down ... at interpreter exit").
  std::shared_ptr<client::ProcessGroup> TakeSession(const std::string& why = "");

  // ---- lifecycle (collserve.torch's abort, shutdown, get_error, set_timeout; torch's
  // _abort_process_group, destroy_process_group and _set_pg_timeout on 2.x) ----

  // Ends the session now, as Shutdown, and says `why` in later calls' errors ("" = that the
  // group was aborted): operations in flight fail (their Works complete with the error).
  // Idempotent. Call without the GIL. Thread-safe.
  void Abort(const std::string& why = "");
  // Waits up to `timeout` for the operations issued so far to complete, then ends the
  // session as Abort does (what is still in flight then fails); later calls throw "... shut
  // down". Returns true when nothing was in flight at the end. Call without the GIL.
  // Thread-safe.
  bool GracefulShutdown(std::chrono::milliseconds timeout);
  // The first failure of an operation of this group (OK while none failed): the group is
  // unusable after one (every later operation fails too) until it is re-formed
  // (collserve.torch.reconfigure). Thread-safe; never blocks.
  absl::Status FirstError();
  // The deadline of operations issued from now on, and monitored_barrier's default
  // (client::ProcessGroup::SetOpTimeout). Throws std::invalid_argument for timeout <= 0.
  // Thread-safe.
  void SetTimeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds OpTimeout() const { return std::chrono::milliseconds(op_timeout_ms_.load()); }
  // The coordinator's generation of this group (client::ProcessGroup::generation) and this
  // rank's last completed collective seq (last_completed_seq; after the session ended, the
  // one it had then); reconfigure needs both. Thread-safe; never block.
  int64_t Generation() const { return generation_; }
  int64_t LastCompletedSeq();

 private:
  c10::intrusive_ptr<::c10d::Work> Make(::c10d::OpType type, const char* op_name, Pending pending);
  // The session for one call of `op`; throws (see Shutdown) once the group is shut down.
  // The caller's copy keeps the session alive until the call returns.
  std::shared_ptr<client::ProcessGroup> Session(const char* op);

  // The session, or an error naming why it ended (once pg_ is null).
  std::shared_ptr<client::ProcessGroup> Live(const char* op);
  // Moves the session out, keeping its last_completed_seq. REQUIRES: session_mu_ held.
  std::shared_ptr<client::ProcessGroup> TakeSessionLocked();

  python::CallSites call_sites_;
  std::mutex session_mu_;
  std::shared_ptr<client::ProcessGroup> pg_;  // guarded by session_mu_; null once shut down
  // guarded by session_mu_: why pg_ is null, for later calls' errors.
  std::string ended_ = "this process group was shut down (its session ended at interpreter exit)";
  const int64_t generation_;
  int64_t last_completed_seq_ = -1;  // guarded by session_mu_: pg_'s when it was taken
  std::atomic<int64_t> op_timeout_ms_;
  std::shared_ptr<GroupHealth> health_ = std::make_shared<GroupHealth>();
  std::atomic<uint64_t> issued_{0};
  std::mutex coalescing_mu_;
  bool coalescing_ = false;          // guarded by coalescing_mu_
  // guarded by coalescing_mu_: the Works of the operations since startCoalescing.
  std::vector<c10::intrusive_ptr<CollserveWork>> coalesced_;
};

// The collserve backend of a torch ProcessGroup object as Python passes it (1.13: the group
// itself; 2.x: its CPU backend), or nullptr when it is not a collserve group.
CollserveProcessGroup* FromTorchGroup(const c10::intrusive_ptr<::c10d::ProcessGroup>& group);

// Attaches to the sidecar (blocking until all world_size ranks of `group` have joined, or
// init_timeout) and returns the process group. Throws std::runtime_error with the SDK's
// status (INVALID_ARGUMENT, ALREADY_EXISTS, DEADLINE_EXCEEDED naming the missing ranks,
// UNAVAILABLE) on failure.
c10::intrusive_ptr<TorchBase> CreateProcessGroup(const client::InitOptions& options);

// Shuts down (CollserveProcessGroup::Shutdown) every collserve group of this process that
// is still alive. collserve.torch calls it at interpreter exit (atexit, before Python
// finalizes): a group that outlives destroy_process_group (DistributedDataParallel keeps
// a reference) would otherwise complete an operation on an SDK thread during
// finalization, and dropping that operation's tensors asks for the GIL, which ends the
// thread with pthread_exit in a noexcept destructor: std::terminate ("terminate called
// without an active exception"). Call it without the GIL. Thread-safe.
// `why` (when not empty) is what later calls on those groups say in their errors.
void ShutdownAll(const std::string& why = "");

}  // namespace collserve::c10d_backend

#endif  // COLLSERVE_PYTHON_C10D_COLLSERVE_C10D_H_
