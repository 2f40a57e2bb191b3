// ProcessGroup over one collserve.v1.Collectives/Session stream to the sidecar.
//
// One stream per (group, rank). Requests are written in issue order with consecutive seq
// numbers; a reader thread hands each Completion to a lane thread (one for collectives, one
// for send/recv) that copies its result out and completes the Work. Tensor bytes go through
// shared-memory segments (sealed memfds created here, passed to the sidecar as descriptors
// over the unix socket's fd channel, common/fd_channel.h) on a unix-socket session, inline
// in the messages otherwise. With shared memory, requests and completions go over the ops
// channel (common/ops_channel.h: the descriptor channel in ops mode, one datagram per
// message; its own reader thread) and the stream carries only attach and the session's end.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "collserve/client.h"
#include "client/channel.h"
#include "client/completion_lane.h"
#include "client/cuda_tensors.h"
#include "client/request_builder.h"
#include "client/staging_pool.h"
#include "client/work_impl.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/fd_channel.h"
#include "common/ops_channel.h"
#include "common/shm.h"
#include "common/types.h"

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;

// The calling thread's call site (ScopedCallSite, SetCallSite).
std::string& CallSiteOfThisThread() {
  thread_local std::string call_site;
  return call_site;
}

// Past the op deadline the sidecar must have answered; this much later Work::Wait gives up.
constexpr absl::Duration kClientGrace = absl::Seconds(10);
constexpr int64_t kMaxMessageBytes = 1 << 30;
// Peers' segments a rank keeps mapped for peer reads (broadcast results it copies straight
// out of the root's staging segment): the root's free segments are reused op after op, so
// the few a job cycles through stay mapped.
constexpr size_t kMaxPeerBytes = size_t{512} << 20;
constexpr size_t kMaxPeerSegments = 256;
// A pipelined broadcast's root publishes its copy's progress every this many bytes (1 MiB:
// bench/membw.cc's BM_PipelinedHeapBroadcast hides the root's copy of 64 MiB under the
// readers' with it).
constexpr size_t kFillPieceBytes = size_t{1} << 20;

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  args.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  // Every session gets its own connection so one busy stream does not delay another.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

class SessionProcessGroup : public ProcessGroup {
 public:
  explicit SessionProcessGroup(InitOptions options)
      : options_(std::move(options)), op_timeout_ms_(absl::ToInt64Milliseconds(options_.op_timeout)) {
    for (int r = 0; r < options_.world_size; ++r) ranks_.push_back(r);
  }

  ~SessionProcessGroup() override {
    if (fd_channel_ >= 0) close(fd_channel_);  // registrations only; the sidecar keeps its mappings
    if (!reader_.joinable()) {
      // Init failed before the session started: end the stream if it is still open.
      if (stream_ != nullptr && !finished_) {
        ctx_.TryCancel();
        stream_->Finish();
      }
      if (ops_sock_ >= 0) close(ops_sock_);
      return;
    }
    {
      absl::MutexLock lock(&write_mu_);
      if (stream_ != nullptr && !closed_) stream_->WritesDone();
      closed_ = true;
    }
    // The sidecar ends the stream after WritesDone; cancel if it does not promptly.
    if (!reader_done_.WaitForNotificationWithTimeout(absl::Seconds(5))) ctx_.TryCancel();
    if (reader_.joinable()) reader_.join();
    FailAll(absl::CancelledError("process group destroyed"));
    collective_lane_.reset();  // finishes what it holds, then joins
    p2p_lane_.reset();
    if (ops_sock_ >= 0) close(ops_sock_);  // its reader was joined by reader_
  }

  absl::Status Init() {
    const std::string address = options_.sidecar_address.empty()
                                    ? std::string(kDefaultSidecarAddress)
                                    : options_.sidecar_address;
    auto channel = CreateChannel(address, options_.tls, ChannelArgs());
    if (!channel.ok()) return channel.status();
    channel_ = std::move(*channel);
    const absl::Time init_deadline = absl::Now() + options_.init_timeout;
    if (!channel_->WaitForConnected(absl::ToChronoTime(std::min(
            init_deadline, absl::Now() + std::min(options_.init_timeout, absl::Seconds(30)))))) {
      return absl::UnavailableError(absl::StrCat("no collserve sidecar reachable at ", address));
    }
    stub_ = pb::Collectives::NewStub(channel_);
    AddJobToken(ctx_, options_.token);  // the sidecar checks it with the coordinator before it serves us
    stream_ = stub_->Session(&ctx_);

    pb::SessionRequest req;
    pb::Attach* attach = req.mutable_attach();
    attach->set_job(options_.job);
    attach->set_group(options_.group);
    attach->set_rank(options_.rank);
    attach->set_world_size(options_.world_size);
    attach->set_init_timeout_ms(absl::ToInt64Milliseconds(options_.init_timeout));
    attach->set_op_timeout_ms(absl::ToInt64Milliseconds(options_.op_timeout));
    attach->set_shared_memory(options_.shared_memory);
    attach->set_generation(options_.generation);
    attach->set_peer_reads(options_.shared_memory && options_.peer_reads);
    if (!stream_->Write(req)) return FinishWithError("the sidecar closed the session at attach");

    // Watchdog: the sidecar bounds rendezvous by init_timeout; if it does not answer at
    // all, cancel the stream shortly after.
    absl::Notification attached;
    std::thread watchdog([&] {
      if (!attached.WaitForNotificationWithDeadline(init_deadline + kClientGrace)) ctx_.TryCancel();
    });
    pb::SessionResponse resp;
    const bool got = stream_->Read(&resp);
    attached.Notify();
    watchdog.join();
    if (!got) return FinishWithError("the sidecar closed the session before attaching");
    if (!resp.has_attached()) {
      return absl::InternalError("the sidecar answered attach with something else");
    }
    shared_memory_ = resp.attached().shared_memory();
    if (shared_memory_) {
      // Segments go to the sidecar as descriptors; if its channel cannot be reached (say,
      // the socket's directory is not visible here), tensors go inline instead.
      auto sock = fdchannel::Connect(resp.attached().fd_socket(), resp.attached().session_token(),
                                     absl::Now() + absl::Seconds(10));
      if (sock.ok()) {
        fd_channel_ = *sock;
      } else {
        shared_memory_ = false;
      }
    }
    if (shared_memory_ && options_.ops_channel) {
      // Requests and completions over a datagram socket (common/ops_channel.h); a sidecar
      // that refuses keeps them on the stream.
      auto ops = fdchannel::ConnectOps(resp.attached().fd_socket(), resp.attached().session_token(),
                                       absl::Now() + absl::Seconds(10));
      if (ops.ok()) {
        ops_sock_ = *ops;
      } else {
        std::fprintf(stderr, "collserve: no ops channel (requests go over the session's stream): %s\n",
                     ops.status().ToString().c_str());
      }
    }
    peer_reads_ = shared_memory_ && resp.attached().peer_reads();
    num_hosts_ = resp.attached().num_hosts();
    generation_ = resp.attached().generation();
    local_world_size_ = resp.attached().local_world_size();
    collective_lane_ = std::make_unique<Lane>([this](Done& d) { Finish(d); });
    p2p_lane_ = std::make_unique<Lane>([this](Done& d) { Finish(d); });
    reader_ = std::thread([this] { ReadLoop(); });
    return absl::OkStatus();
  }

  int GetRank() const override { return options_.rank; }
  int GetWorldSize() const override { return options_.world_size; }
  const std::string& group_name() const override { return options_.group; }
  int num_hosts() const override { return num_hosts_; }
  int64_t generation() const override { return generation_; }
  int local_world_size() const override { return local_world_size_; }
  int64_t last_completed_seq() const override {
    absl::MutexLock lock(&completed_mu_);
    return last_completed_seq_;
  }

  absl::Status SetOpTimeout(absl::Duration timeout) override {
    if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat("op timeout ", absl::FormatDuration(timeout),
                                                     ": must be positive and finite"));
    }
    op_timeout_ms_.store(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)), std::memory_order_relaxed);
    return absl::OkStatus();
  }

  std::shared_ptr<Work> AllReduce(void* data, int64_t count, DataType dtype, ReduceOpArg op) override {
    if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::ALL_REDUCE, dtype);
    r.reduce = op;
    r.InPlace(data, count);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Broadcast(void* data, int64_t count, DataType dtype, int root) override {
    if (absl::Status s = CheckRoot("broadcast", root); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::BROADCAST, dtype);
    r.root = root;
    r.InPlace(data, count);
    // Only the root's bytes go in and only the others' come back: a staged tensor is copied
    // once on each rank, not twice.
    if (root == options_.rank) {
      r.outputs.clear();
    } else {
      r.input_unused = true;
    }
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Reduce(void* data, int64_t count, DataType dtype, ReduceOpArg op, int dst) override {
    if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
    if (absl::Status s = CheckRoot("reduce", dst); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::REDUCE, dtype);
    r.reduce = op;
    r.root = dst;
    r.InPlace(data, count);
    if (dst != options_.rank) r.outputs.clear();  // only the destination's tensor changes
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Barrier() override { return Issue(Request(pb::BARRIER, DataType::kFloat32)); }

  std::shared_ptr<Work> MonitoredBarrier(absl::Duration timeout, bool wait_all_ranks) override {
    if (timeout <= absl::ZeroDuration()) {
      return WorkImpl::Failed(absl::InvalidArgumentError("monitored_barrier timeout must be > 0"));
    }
    Request r(pb::MONITORED_BARRIER, DataType::kFloat32);
    r.timeout = timeout;
    r.wait_all_ranks = wait_all_ranks;
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> AllGather(const std::vector<void*>& outputs, const std::vector<int64_t>& counts,
                                  const void* input, int64_t count, DataType dtype) override {
    Request r(pb::ALL_GATHER, dtype);
    if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
    if (absl::Status s = r.OutputList(outputs, counts, options_.world_size, "outputs"); !s.ok()) return WorkImpl::Failed(s);
    r.output_splits = counts;
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> AllGatherIntoTensor(void* output, const void* input, int64_t count, DataType dtype) override {
    Request r(pb::ALL_GATHER, dtype);
    if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
    r.output_splits.assign(options_.world_size, count);
    if (absl::Status s = r.Output(output, count * options_.world_size); !s.ok()) return WorkImpl::Failed(s);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Gather(const void* input, int64_t count, const std::vector<void*>& outputs,
                               const std::vector<int64_t>& counts, DataType dtype, int dst) override {
    if (absl::Status s = CheckRoot("gather", dst); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::GATHER, dtype);
    r.root = dst;
    if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
    if (dst == options_.rank) {
      if (absl::Status s = r.OutputList(outputs, counts, options_.world_size, "gather outputs"); !s.ok()) {
        return WorkImpl::Failed(s);
      }
      r.output_splits = counts;
    } else if (!outputs.empty() || !counts.empty()) {
      return WorkImpl::Failed(absl::InvalidArgumentError("gather: only the destination rank passes outputs"));
    }
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Scatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                const std::vector<int64_t>& counts, DataType dtype, int src) override {
    if (absl::Status s = CheckRoot("scatter", src); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::SCATTER, dtype);
    r.root = src;
    if (src == options_.rank) {
      if (absl::Status s = r.InputList(inputs, counts, options_.world_size, "scatter inputs"); !s.ok()) {
        return WorkImpl::Failed(s);
      }
      r.input_splits = counts;
    } else if (!inputs.empty() || !counts.empty()) {
      return WorkImpl::Failed(absl::InvalidArgumentError("scatter: only the source rank passes inputs"));
    }
    if (absl::Status s = r.Output(output, count); !s.ok()) return WorkImpl::Failed(s);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> ReduceScatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                      const std::vector<int64_t>& counts, DataType dtype, ReduceOpArg op) override {
    if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::REDUCE_SCATTER, dtype);
    r.reduce = op;
    if (absl::Status s = r.InputList(inputs, counts, options_.world_size, "reduce_scatter inputs"); !s.ok()) {
      return WorkImpl::Failed(s);
    }
    r.input_splits = counts;
    if (absl::Status s = r.Output(output, count); !s.ok()) return WorkImpl::Failed(s);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> ReduceScatterTensor(void* output, const void* input, int64_t count, DataType dtype,
                                            ReduceOpArg op) override {
    if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::REDUCE_SCATTER, dtype);
    r.reduce = op;
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat("count ", count, " < 0")));
    if (absl::Status s = r.Input(input, count * options_.world_size); !s.ok()) return WorkImpl::Failed(s);
    r.input_splits.assign(options_.world_size, count);
    if (absl::Status s = r.Output(output, count); !s.ok()) return WorkImpl::Failed(s);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> AllToAll(const std::vector<void*>& outputs, const std::vector<int64_t>& output_counts,
                                 const std::vector<const void*>& inputs, const std::vector<int64_t>& input_counts,
                                 DataType dtype) override {
    Request r(pb::ALL_TO_ALL, dtype);
    if (absl::Status s = r.InputList(inputs, input_counts, options_.world_size, "all_to_all inputs"); !s.ok()) {
      return WorkImpl::Failed(s);
    }
    if (absl::Status s = r.OutputList(outputs, output_counts, options_.world_size, "all_to_all outputs"); !s.ok()) {
      return WorkImpl::Failed(s);
    }
    r.input_splits = input_counts;
    r.output_splits = output_counts;
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> AllToAllSingle(void* output, int64_t output_count, const void* input, int64_t count,
                                       const std::vector<int64_t>& output_splits,
                                       const std::vector<int64_t>& input_splits, DataType dtype) override {
    const int world = options_.world_size;
    auto even = [world](int64_t n, const char* what) -> absl::StatusOr<std::vector<int64_t>> {
      if (n < 0 || n % world != 0) {
        return absl::InvalidArgumentError(absl::StrCat("all_to_all_single without ", what, ": ", n,
                                                       " elements do not split evenly over ", world, " ranks"));
      }
      return std::vector<int64_t>(world, n / world);
    };
    Request r(pb::ALL_TO_ALL, dtype);
    auto in = input_splits.empty() ? even(count, "input_split_sizes") : absl::StatusOr<std::vector<int64_t>>(input_splits);
    auto out = output_splits.empty() ? even(output_count, "output_split_sizes")
                                     : absl::StatusOr<std::vector<int64_t>>(output_splits);
    if (!in.ok()) return WorkImpl::Failed(in.status());
    if (!out.ok()) return WorkImpl::Failed(out.status());
    if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
    if (absl::Status s = r.Output(output, output_count); !s.ok()) return WorkImpl::Failed(s);
    r.input_splits = std::move(*in);
    r.output_splits = std::move(*out);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Send(const void* data, int64_t count, DataType dtype, int dst, int64_t tag) override {
    if (absl::Status s = CheckPeer("send", dst, false); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::SEND, dtype);
    r.peer = dst;
    r.tag = tag;
    if (absl::Status s = r.Input(data, count); !s.ok()) return WorkImpl::Failed(s);
    return Issue(std::move(r));
  }

  std::shared_ptr<Work> Recv(void* data, int64_t count, DataType dtype, int src, int64_t tag) override {
    if (absl::Status s = CheckPeer("recv", src, true); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::RECV, dtype);
    r.peer = src;
    r.tag = tag;
    if (absl::Status s = r.Output(data, count); !s.ok()) return WorkImpl::Failed(s);
    return Issue(std::move(r));
  }

  absl::StatusOr<std::unique_ptr<ProcessGroup>> NewGroup(std::vector<int> ranks) override {
    int64_t index;
    {
      absl::MutexLock lock(&write_mu_);
      index = next_subgroup_++;
    }
    if (ranks.empty()) return absl::InvalidArgumentError("new_group needs at least one rank");
    std::vector<int> sorted = ranks;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (sorted[i] < 0 || sorted[i] >= options_.world_size) {
        return absl::InvalidArgumentError(absl::StrCat("new_group: rank ", sorted[i],
                                                       " is out of range for world_size ", options_.world_size));
      }
      if (i > 0 && sorted[i] == sorted[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat("new_group: rank ", sorted[i], " is listed twice"));
      }
    }
    auto me = std::find(ranks.begin(), ranks.end(), options_.rank);
    if (me == ranks.end()) return std::unique_ptr<ProcessGroup>();
    InitOptions sub = options_;
    sub.group = absl::StrCat(options_.group, "/", index);
    sub.rank = static_cast<int>(me - ranks.begin());
    sub.world_size = static_cast<int>(ranks.size());
    auto pg = std::make_unique<SessionProcessGroup>(sub);
    pg->ranks_ = std::move(ranks);
    if (absl::Status s = pg->Init(); !s.ok()) return s;
    return std::unique_ptr<ProcessGroup>(std::move(pg));
  }

  const std::vector<int>& GetProcessGroupRanks() const override { return ranks_; }

 private:
  struct Pending;

  absl::Status CheckRoot(const char* op, int root) const {
    if (root < 0 || root >= options_.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, " root ", root, " is out of range for world_size ", options_.world_size));
    }
    return absl::OkStatus();
  }
  absl::Status CheckPeer(const char* op, int peer, bool any_ok) const {
    if (any_ok && peer == -1) return absl::OkStatus();
    if (peer < 0 || peer >= options_.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, " peer rank ", peer, " is out of range for world_size ", options_.world_size));
    }
    if (peer == options_.rank) {
      return absl::InvalidArgumentError(absl::StrCat(op, " with itself (rank ", peer, ") would never complete"));
    }
    return absl::OkStatus();
  }

  // One collective on CUDA tensors (docs/gpu.md): `in` (in_count elements) and, for
  // out-of-place ops, `out` (out_count) are exported by CUDA IPC; an event recorded on
  // `stream` orders the sidecar's work after the caller's, and a successful Wait makes
  // `stream` wait for the sidecar's done event.
  std::shared_ptr<Work> IssueCuda(const Request& r, const void* in, int64_t in_count, void* out, int64_t out_count,
                                  void* stream) {
    if (absl::Status s = r.Check(in, in_count); !s.ok()) return WorkImpl::Failed(s);
    if (out != nullptr || out_count > 0) {
      if (absl::Status s = r.Check(out, out_count); !s.ok()) return WorkImpl::Failed(s);
    }
    if (!CudaBuilt()) {
      return WorkImpl::Failed(absl::FailedPreconditionError(
          "this collserve build has no CUDA support (built without COLLSERVE_WITH_CUDA)"));
    }
    if (!shared_memory_) {
      return WorkImpl::Failed(absl::PermissionDeniedError(
          "CUDA tensors need a session with this host's sidecar on its unix socket with shared memory "
          "(CUDA IPC works only between processes of one host)"));
    }
    const size_t es = ElementSize(r.dtype);
    // A zero-element tensor still names its device (any address of it will do).
    auto ein = cuda_.Export(in, static_cast<size_t>(in_count) * es);
    if (!ein.ok()) return WorkImpl::Failed(ein.status());
    ExportedTensor eout;
    if (out != nullptr) {
      auto e = cuda_.Export(out, static_cast<size_t>(out_count) * es);
      if (!e.ok()) return WorkImpl::Failed(e.status());
      if (e->device != ein->device) {
        return WorkImpl::Failed(absl::InvalidArgumentError("the output is on another GPU than the input"));
      }
      eout = std::move(*e);
    }
    // An event pair is reused every CudaTensors::kSlots collectives: the previous user must
    // have been answered (the sidecar has queued its wait and record) before it is recorded
    // again.
    int slot;
    std::shared_ptr<WorkImpl> previous;
    {
      absl::MutexLock lock(&cuda_mu_);
      slot = static_cast<int>(next_cuda_slot_++ % CudaTensors::kSlots);
      previous = std::move(cuda_slot_work_[slot]);
    }
    if (previous != nullptr) previous->Wait(absl::InfiniteDuration()).IgnoreError();  // bounded by its op deadline
    auto events = cuda_.Events(ein->device, slot);
    if (!events.ok()) return WorkImpl::Failed(events.status());
    if (absl::Status s = CudaTensors::Record(ein->device, events->ready, stream); !s.ok()) {
      return WorkImpl::Failed(s);
    }
    pb::SessionRequest req;
    pb::Collective* c = req.mutable_collective();
    EncodeCollective(r, op_timeout_ms_.load(std::memory_order_relaxed), c);
    const auto name = [](pb::Buffer* b, const ExportedTensor& e) {
      b->set_cuda_ipc_handle(e.ipc_handle);
      b->set_cuda_device_uuid(e.device_uuid);
      b->set_offset(e.offset);
    };
    name(c->mutable_buffer(), *ein);
    if (out != nullptr) name(c->mutable_output(), eout);
    c->set_cuda_ready_event(events->ready_handle);
    c->set_cuda_done_event(events->done_handle);
    auto work = std::make_shared<WorkImpl>(absl::Now() + absl::Milliseconds(c->timeout_ms()) + kClientGrace);
    const int device = ein->device;
    void* done = events->done;
    work->SetAfterWait([device, stream, done] { return CudaTensors::StreamWait(device, stream, done); });
    {
      absl::MutexLock lock(&cuda_mu_);
      cuda_slot_work_[slot] = work;
    }
    auto pending = std::make_unique<Pending>();
    pending->work = work;
    return Enqueue(req, std::move(pending));
  }

  // Sends one request on the session; the Work completes with the sidecar's answer.
  std::shared_ptr<Work> Issue(Request r) {
    if (absl::Status s = r.Check(nullptr, 0); !s.ok()) return WorkImpl::Failed(s);
    const PlanContext ctx{options_.rank, shared_memory_, options_.pipelined_broadcast};
    const StagingPlan plan =
        PlanStaging(r, ctx, [this](const void* p, size_t bytes, ArenaRef* ref) { return arena_->Find(p, bytes, ref); });
    pb::SessionRequest req;
    pb::Collective* c = req.mutable_collective();
    EncodeCollective(r, op_timeout_ms_.load(std::memory_order_relaxed), c);

    auto pending = std::make_unique<Pending>();
    pending->p2p = r.op == pb::SEND || r.op == pb::RECV;
    pending->out_offset = plan.out_offset;
    pending->out_bytes = plan.result_bytes;
    if (pending->out_bytes > 0) pending->outputs = std::move(r.outputs);
    const size_t in_bytes = plan.in_bytes, stage_in = plan.stage_in;
    const bool fill_after_send = plan.fill_after_send;
    if (in_bytes + plan.out_region > 0 && shared_memory_) {
      if (plan.total > 0) {
        pending->collective = r.op != pb::SEND && r.op != pb::RECV;
        auto seg = AcquireSegment(plan.total, pending->collective, absl::Now() + absl::Milliseconds(c->timeout_ms()));
        if (!seg.ok()) return WorkImpl::Failed(seg.status());
        pending->segment = std::move(*seg);
        size_t off = 0;
        for (const auto& [p, b] : r.inputs) {
          if (stage_in > 0 && b > 0 && !r.input_unused && !fill_after_send) {
            std::memcpy(pending->segment->data() + off, p, b);
          }
          off += b;
        }
      }
      NameBuffers(plan, r.in_place, pending->segment.get(), c);
      if (fill_after_send) pending->filled = std::make_shared<absl::Notification>();
    } else if (in_bytes + plan.out_region > 0) {
      if (in_bytes + plan.out_bytes > static_cast<size_t>(kMaxMessageBytes) - 4096) {
        return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat(
            "tensors of ", in_bytes + plan.out_bytes, " bytes exceed the ", kMaxMessageBytes,
            "-byte message limit of a remote (non-shared-memory) session")));
      }
      std::string* data = c->mutable_buffer()->mutable_inline_data();
      data->reserve(in_bytes);
      for (const auto& [p, b] : r.inputs) data->append(static_cast<const char*>(p), b);
    }
    auto work = std::make_shared<WorkImpl>(absl::Now() + absl::Milliseconds(c->timeout_ms()) + kClientGrace);
    pending->work = work;
    if (!fill_after_send) return Enqueue(req, std::move(pending));
    char* segment = pending->segment->data();
    uint64_t* count = reinterpret_cast<uint64_t*>(segment + plan.fill_offset);
    __atomic_store_n(count, 0, __ATOMIC_RELAXED);  // a reused segment holds the last count
    std::shared_ptr<absl::Notification> filled = pending->filled;
    bool sent = false;
    std::shared_ptr<Work> result = Enqueue(req, std::move(pending), &sent);
    if (sent) {
      // The segment stays this op's until `filled`: its Finish (or FailAll) waits for it.
      const char* src = static_cast<const char*>(r.inputs[0].first);
      for (size_t off = 0; off < stage_in; off += kFillPieceBytes) {
        const size_t n = std::min(kFillPieceBytes, stage_in - off);
        std::memcpy(segment + off, src + off, n);
        __atomic_store_n(count, static_cast<uint64_t>(off + n), __ATOMIC_RELEASE);
      }
    }
    filled->Notify();
    return result;
  }

  // Numbers `req` (its collective's seq) and writes it on the session; `pending` (with its
  // Work) completes with the sidecar's answer, or at once if the session is gone.
  // `sent` (optional): set to whether the request was written (else its Work has failed and
  // its segment is released).
  std::shared_ptr<Work> Enqueue(pb::SessionRequest& req, std::unique_ptr<Pending> pending, bool* sent = nullptr) {
    pb::Collective* c = req.mutable_collective();
    if (c->op() != pb::SEND && c->op() != pb::RECV && !CallSiteOfThisThread().empty()) {
      c->set_call_site(CallSiteOfThisThread().substr(0, 256));
    }
    std::shared_ptr<WorkImpl> work = pending->work;
    {
      std::vector<std::string> released;
      arena_->TakeReleased(&released);
      staging_.TakeReleased(&released);
      for (std::string& name : released) c->add_released_segments(std::move(name));
    }

    absl::MutexLock lock(&write_mu_);
    if (closed_ || !broken_.ok()) {
      absl::Status why = broken_.ok() ? absl::FailedPreconditionError("process group destroyed")
                                      : broken_;
      ReleaseSegment(std::move(pending->segment), pending->collective);
      work->Complete(why);
      return work;
    }
    if (ops_sock_ >= 0 && req.ByteSizeLong() + 16 > opschannel::kMaxOpsMessageBytes) {
      // Refused before it takes a seq (16: room for the seq's varint).
      ReleaseSegment(std::move(pending->segment), pending->collective);
      work->Complete(absl::InvalidArgumentError(absl::StrCat("a request of ", req.ByteSizeLong(),
                                                             " bytes exceeds the ops channel's limit of ",
                                                             opschannel::kMaxOpsMessageBytes, " bytes")));
      return work;
    }
    const int64_t seq = next_seq_++;
    c->set_seq(seq);
    if (c->op() != pb::SEND && c->op() != pb::RECV) pending->collective_seq = next_collective_seq_++;
    {
      absl::MutexLock plock(&pending_mu_);
      pending_[seq] = std::move(pending);
    }
    // On failure the reader thread sees the session end and fails every pending Work.
    WriteLocked(req);
    if (sent != nullptr) *sent = true;
    return work;
  }

  std::shared_ptr<Work> AllReduceCuda(void* data, int64_t count, DataType dtype, ReduceOpArg op,
                                      void* stream) override {
    if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::ALL_REDUCE, dtype);
    r.reduce = op;
    r.count = count;
    return IssueCuda(r, data, count, nullptr, 0, stream);
  }

  std::shared_ptr<Work> BroadcastCuda(void* data, int64_t count, DataType dtype, int root, void* stream) override {
    if (absl::Status s = CheckRoot("broadcast", root); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::BROADCAST, dtype);
    r.root = root;
    r.count = count;
    return IssueCuda(r, data, count, nullptr, 0, stream);
  }

  std::shared_ptr<Work> AllGatherIntoTensorCuda(void* output, const void* input, int64_t count, DataType dtype,
                                                void* stream) override {
    Request r(pb::ALL_GATHER, dtype);
    r.count = count;
    const int64_t world = options_.world_size;
    if (count < 0 || count > (int64_t{1} << 48) / world) {
      return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat("all_gather count ", count, " is out of range")));
    }
    r.output_count = count * world;
    r.output_splits.assign(static_cast<size_t>(world), count);
    return IssueCuda(r, input, count, output, r.output_count, stream);
  }

  std::shared_ptr<Work> ReduceScatterTensorCuda(void* output, const void* input, int64_t count, DataType dtype,
                                                ReduceOpArg op, void* stream) override {
    if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
    Request r(pb::REDUCE_SCATTER, dtype);
    r.reduce = op;
    const int64_t world = options_.world_size;
    if (count < 0 || count > (int64_t{1} << 48) / world) {
      return WorkImpl::Failed(
          absl::InvalidArgumentError(absl::StrCat("reduce_scatter count ", count, " is out of range")));
    }
    r.count = count * world;
    r.output_count = count;
    r.input_splits.assign(static_cast<size_t>(world), count);
    return IssueCuda(r, input, r.count, output, count, stream);
  }

  absl::StatusOr<std::shared_ptr<SharedBuffer>> AllocateShared(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("AllocateShared needs bytes > 0");
    if (!shared_memory_) return std::shared_ptr<SharedBuffer>(std::make_shared<HeapBuffer>(bytes));
    auto seg = NewRegisteredSegment(bytes);
    if (!seg.ok()) return seg.status();
    return std::shared_ptr<SharedBuffer>(std::make_shared<ArenaBuffer>(arena_, std::move(*seg), bytes));
  }

  StoreClient* store() override {
    absl::MutexLock lock(&store_mu_);
    if (store_ == nullptr && !options_.coordinator_address.empty() && !store_tried_) {
      store_tried_ = true;
      StoreClientOptions so;
      so.job = options_.job;
      so.timeout = options_.op_timeout;
      so.tls = options_.tls;
      so.token = options_.token;
      auto s = StoreClient::Connect(options_.coordinator_address, so);
      if (s.ok()) store_ = std::move(*s);
    }
    return store_.get();
  }

 private:
  struct Pending {
    std::shared_ptr<WorkImpl> work;
    std::vector<std::pair<void*, size_t>> outputs;  // filled in order from the result
    size_t out_offset = 0;  // of the result in the segment
    size_t out_bytes = 0;   // of the result
    std::unique_ptr<ShmSegment> segment;
    bool collective = false;  // a collective's segment (StagingPool::Acquire's `collective`)
    bool p2p = false;         // send/recv: completes on the point-to-point lane
    int64_t collective_seq = -1;  // the group's seq of a collective (not send/recv): last_completed_seq
    // Set when the issuing thread writes the input into `segment` after sending the request
    // (Buffer.fill_offset); notified once it is all there. The op completes and the segment
    // is released only after that.
    std::shared_ptr<absl::Notification> filled;
  };
  // A completion read from the stream, handed to a lane.
  struct Done {
    std::unique_ptr<Pending> pending;
    pb::Completion completion;
  };

  absl::Status FinishWithError(absl::string_view what) {
    finished_ = true;
    grpc::Status s = stream_->Finish();
    if (!s.ok()) return FromGrpcStatus(s);
    return absl::UnavailableError(what);
  }

  // A staging segment of at least `bytes` from the pool (StagingPool::Acquire); a collective
  // issued from a completion lane never waits (the lanes return the segments).
  absl::StatusOr<std::unique_ptr<ShmSegment>> AcquireSegment(size_t bytes, bool collective, absl::Time deadline) {
    const bool on_lane = collective_lane_ != nullptr && (collective_lane_->OnThisThread() || p2p_lane_->OnThisThread());
    return staging_.Acquire(bytes, collective, /*may_wait=*/!on_lane, deadline);
  }

  // A new segment of `bytes`, registered with the sidecar (its descriptor passed over the
  // shared-memory channel), so that requests may name it. Thread-safe.
  absl::StatusOr<std::unique_ptr<ShmSegment>> NewRegisteredSegment(size_t bytes) {
    auto seg = ShmSegment::Create(bytes);
    if (!seg.ok()) return seg.status();
    absl::MutexLock lock(&fd_channel_mu_);
    absl::Status s = fdchannel::RegisterSegment(fd_channel_, (*seg)->name(), (*seg)->size(), (*seg)->fd(),
                                                absl::Now() + absl::Seconds(30));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("registering a ", bytes, "-byte shared-memory segment: ", s.message()));
    }
    return seg;
  }

  void ReleaseSegment(std::unique_ptr<ShmSegment> seg, bool collective) { staging_.Release(std::move(seg), collective); }

  // Copies the result of a completed operation into the caller's tensors and completes its
  // Work. On a lane's thread.
  void Finish(Done& done) {
    Pending* p = done.pending.get();
    if (p->filled != nullptr) p->filled->WaitForNotification();  // a memcpy on the issuing thread
    const pb::Completion& c = done.completion;
    absl::Status status(static_cast<absl::StatusCode>(c.code()), c.message());
    const bool peer_read = status.ok() && c.has_peer_source();
    if (peer_read) {
      // The result is in a peer's segment (collserve.v1.PeerSource): copy it out of there,
      // then tell the sidecar (ReadDone), which holds the owner's completion until then.
      status = CopyFromPeer(c.peer_source(), *p);
      SendReadDone(c.seq());
    } else if (status.ok() && p->out_bytes > 0) {
      const char* result = nullptr;
      if (p->segment != nullptr) {
        result = p->segment->data() + p->out_offset;
      } else if (c.inline_data().size() == p->out_bytes) {
        result = c.inline_data().data();
      } else {
        status = absl::InternalError(absl::StrCat("the sidecar returned ", c.inline_data().size(),
                                                  " bytes for a ", p->out_bytes, "-byte result"));
      }
      if (result != nullptr) CopyResultRange(*p, result, 0, p->out_bytes);
    }
    if (status.ok()) {
      p->work->SetSourceRank(c.source());
      p->work->SetAlgorithm(c.algorithm());
    }
    if (p->collective_seq >= 0) NoteCollectiveDone(p->collective_seq, status.ok());
    p->work->Complete(std::move(status));
    // After Complete: a collective waiting for room sees this one completed.
    ReleaseSegment(std::move(p->segment), p->collective);
  }

  // Copies a peer's result (PeerSource) into `p`'s outputs, mapping the peer's segment
  // first if it is not mapped yet (Open over the descriptor channel, read-only). Lane
  // threads (only the collective lane gets peer results). INTERNAL for a source that does
  // not match the op; else the channel's errors.
  absl::Status CopyFromPeer(const pb::PeerSource& source, Pending& p) {
    if (!peer_reads_ || source.bytes() < 0 || static_cast<uint64_t>(source.bytes()) != p.out_bytes ||
        source.offset() < 0) {
      return absl::InternalError(absl::StrCat("the sidecar named a ", source.bytes(), "-byte result in rank ",
                                              source.rank(), "'s segment for a ", p.out_bytes, "-byte result"));
    }
    // Held through the copy: an eviction must not unmap what is being read.
    absl::MutexLock lock(&peer_mu_);
    auto key = std::make_pair(source.rank(), source.segment());
    auto it = peer_segments_.find(key);
    if (it == peer_segments_.end()) {
      absl::StatusOr<int> fd;
      {
        absl::MutexLock channel(&fd_channel_mu_);
        fd = fdchannel::OpenPeerSegment(fd_channel_, source.rank(), source.segment(), absl::Now() + absl::Seconds(10));
      }
      if (!fd.ok()) {
        return absl::Status(fd.status().code(), absl::StrCat("reading rank ", source.rank(), "'s result segment: ",
                                                             fd.status().message()));
      }
      auto mapped = ShmSegment::FromFd(source.segment(), *fd, 0, {.share = false, .read_only = true});
      if (!mapped.ok()) return mapped.status();
      EvictPeerSegmentsLocked((*mapped)->size());
      peer_bytes_ += (*mapped)->size();
      peer_order_.push_back(key);
      it = peer_segments_.emplace(key, std::move(*mapped)).first;
    }
    const char* base = it->second->data();
    const size_t size = it->second->size();
    const uint64_t offset = static_cast<uint64_t>(source.offset());
    if (offset > size || p.out_bytes > size - offset) {
      return absl::InternalError(absl::StrCat("the sidecar named bytes [", offset, ", ", offset + p.out_bytes,
                                              ") of rank ", source.rank(), "'s ", size, "-byte segment"));
    }
    if (source.fill_offset() <= 0) {
      CopyResultRange(p, base + offset, 0, p.out_bytes);
      return absl::OkStatus();
    }
    // The owner is still writing the bytes: follow its count (PeerSource.fill_offset).
    const uint64_t at = static_cast<uint64_t>(source.fill_offset());
    if (at % sizeof(uint64_t) != 0 || size < sizeof(uint64_t) || at > size - sizeof(uint64_t) ||
        (at + sizeof(uint64_t) > offset && at < offset + p.out_bytes)) {
      return absl::InternalError(absl::StrCat("the sidecar named a fill count at byte ", at, " of rank ", source.rank(),
                                              "'s ", size, "-byte segment, whose result is at [", offset, ", ",
                                              offset + p.out_bytes, ")"));
    }
    const uint64_t* count = reinterpret_cast<const uint64_t*>(base + at);
    const absl::Duration op_timeout = OpTimeout();
    const absl::Time deadline = absl::Now() + op_timeout;
    size_t done = 0;
    int idle = 0;
    while (done < p.out_bytes) {
      const size_t avail =
          static_cast<size_t>(std::min<uint64_t>(__atomic_load_n(count, __ATOMIC_ACQUIRE), p.out_bytes));
      if (avail > done) {
        CopyResultRange(p, base + offset, done, avail);
        done = avail;
        idle = 0;
        continue;
      }
      // The owner copies at memory speed: yield at first, then nap (at most 1 ms).
      if (++idle < 64) {
        std::this_thread::yield();
        continue;
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("rank ", source.rank(), " had written ", done, " of its ",
                                                        p.out_bytes, "-byte broadcast tensor within the op timeout (",
                                                        absl::FormatDuration(op_timeout), ")"));
      }
      absl::SleepFor(absl::Microseconds(std::min(idle - 63, 1000)));
    }
    return absl::OkStatus();
  }

  // Copies bytes [from, to) of a result at `result` into `p`'s outputs (filled in order).
  static void CopyResultRange(Pending& p, const char* result, size_t from, size_t to) {
    size_t off = 0;
    for (const auto& [ptr, b] : p.outputs) {
      if (off >= to || off + b > p.out_bytes) break;
      const size_t lo = std::max(off, from), hi = std::min(off + b, to);
      if (hi > lo) std::memcpy(static_cast<char*>(ptr) + (lo - off), result + lo, hi - lo);
      off += b;
    }
  }

  // Unmaps the oldest peer segments until `incoming` more bytes fit under kMaxPeerBytes
  // (and the count under kMaxPeerSegments). The owner's copy lives on in its process.
  void EvictPeerSegmentsLocked(size_t incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) {
    while (!peer_order_.empty() &&
           (peer_bytes_ + incoming > kMaxPeerBytes || peer_order_.size() >= kMaxPeerSegments)) {
      auto it = peer_segments_.find(peer_order_.front());
      peer_order_.pop_front();
      if (it == peer_segments_.end()) continue;
      peer_bytes_ -= it->second->size();
      peer_segments_.erase(it);
    }
  }

  // Advances last_completed_seq_ over collectives completed OK in seq order; the first
  // failure freezes it (what follows a failed collective is not in step).
  void NoteCollectiveDone(int64_t collective_seq, bool ok) {
    absl::MutexLock lock(&completed_mu_);
    if (!ok) {
      collectives_failed_ = true;
      return;
    }
    if (collectives_failed_) return;
    completed_ahead_.insert(collective_seq);
    while (!completed_ahead_.empty() && *completed_ahead_.begin() == last_completed_seq_ + 1) {
      last_completed_seq_ = *completed_ahead_.begin();
      completed_ahead_.erase(completed_ahead_.begin());
    }
  }

  // Tells the sidecar this rank has copied out the peer result of its request `seq`.
  void SendReadDone(int64_t seq) {
    pb::SessionRequest req;
    req.mutable_read_done()->set_seq(seq);
    absl::MutexLock lock(&write_mu_);
    if (closed_ || !broken_.ok()) return;
    WriteLocked(req);  // on failure the reader sees the session end
  }

  // Sends `req` over the ops channel, or else the stream. A failure marks the session
  // closed (and shuts the ops channel down, so that the sidecar ends the session and the
  // reader sees it end).
  void WriteLocked(const pb::SessionRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    if (ops_sock_ < 0) {
      if (!stream_->Write(req)) closed_ = true;
      return;
    }
    // The sidecar's channel thread reads continuously: waiting the op timeout for room means
    // it is stuck.
    absl::Status s = opschannel::SendOpsMessage(ops_sock_, req.SerializeAsString(), absl::Now() + OpTimeout());
    if (!s.ok()) {
      std::fprintf(stderr, "collserve: the ops channel broke: %s\n", s.ToString().c_str());
      closed_ = true;
      shutdown(ops_sock_, SHUT_RDWR);
    }
  }

  // Hands a completion to its lane (the lane copies the result out and completes the Work).
  void Dispatch(pb::SessionResponse& resp) {
    if (!resp.has_completion()) return;
    Done done;
    {
      absl::MutexLock lock(&pending_mu_);
      auto it = pending_.find(resp.completion().seq());
      if (it == pending_.end()) return;
      done.pending = std::move(it->second);
      pending_.erase(it);
    }
    done.completion = std::move(*resp.mutable_completion());
    (done.pending->p2p ? p2p_lane_ : collective_lane_)->Push(std::move(done));
  }

  // The ops channel's reader: completions until the sidecar closes the channel (when the
  // session ends) or it breaks.
  void OpsReadLoop() {
    std::vector<char> buf(opschannel::kMaxDatagramBytes);
    opschannel::Reassembler reassembler;
    pb::SessionResponse resp;
    for (;;) {
      const ssize_t n = recv(ops_sock_, buf.data(), buf.size(), MSG_TRUNC);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      absl::StatusOr<bool> complete =
          static_cast<size_t>(n) > buf.size()
              ? absl::InvalidArgumentError(absl::StrCat("a datagram of ", n, " bytes"))
              : reassembler.Add(buf.data(), static_cast<size_t>(n));
      if (complete.ok() && !*complete) continue;
      if (!complete.ok() || !resp.ParseFromString(reassembler.Take())) {
        const absl::Status why = complete.ok() ? absl::InvalidArgumentError("not a SessionResponse") : complete.status();
        std::fprintf(stderr, "collserve: a malformed message on the ops channel; ending the session: %s\n",
                     why.ToString().c_str());
        shutdown(ops_sock_, SHUT_RDWR);
        ctx_.TryCancel();
        break;
      }
      Dispatch(resp);
    }
    ops_done_.Notify();
  }

  void ReadLoop() {
    pb::SessionResponse resp;
    if (ops_sock_ >= 0) {
      std::thread ops_reader([this] { OpsReadLoop(); });
      while (stream_->Read(&resp)) {
      }
      // The sidecar closes the ops channel when the session ends; completions it sent before
      // are read first.
      if (!ops_done_.WaitForNotificationWithTimeout(absl::Seconds(5))) shutdown(ops_sock_, SHUT_RDWR);
      ops_reader.join();
    }
    while (stream_->Read(&resp)) Dispatch(resp);
    // What was read completes first (in order), then the rest fails.
    collective_lane_->Drain(absl::Now() + absl::Seconds(30));
    p2p_lane_->Drain(absl::Now() + absl::Seconds(30));
    grpc::Status final_status = stream_->Finish();
    absl::Status why = final_status.ok()
                           ? absl::UnavailableError("the sidecar ended the session")
                           : absl::Status(FromGrpcStatus(final_status).code(),
                                          absl::StrCat("session with the sidecar ended: ",
                                                       final_status.error_message()));
    if (final_status.error_code() == grpc::StatusCode::CANCELLED) {
      why = absl::UnavailableError(absl::StrCat("session with the sidecar was cancelled: ",
                                                final_status.error_message()));
    }
    {
      absl::MutexLock lock(&write_mu_);
      broken_ = why;
    }
    FailAll(why);
    reader_done_.Notify();
  }

  void FailAll(const absl::Status& why) {
    std::map<int64_t, std::unique_ptr<Pending>> pending;
    {
      absl::MutexLock lock(&pending_mu_);
      pending.swap(pending_);
    }
    for (auto& [seq, p] : pending) {
      if (p->filled != nullptr) p->filled->WaitForNotification();  // a memcpy on the issuing thread
      ReleaseSegment(std::move(p->segment), p->collective);
      p->work->Complete(why);
    }
  }

  absl::Duration OpTimeout() const { return absl::Milliseconds(op_timeout_ms_.load(std::memory_order_relaxed)); }

  InitOptions options_;
  // The deadline of each operation issued from now on (SetOpTimeout); options_.op_timeout
  // is the one the session attached with.
  std::atomic<int64_t> op_timeout_ms_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Collectives::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::SessionRequest, pb::SessionResponse>> stream_;
  bool shared_memory_ = false;
  absl::Mutex fd_channel_mu_;  // one registration or Open at a time
  bool peer_reads_ = false;    // the sidecar may name results in peers' segments
  // Peers' segments mapped read-only (peer reads), by (rank, name), oldest first in
  // peer_order_; at most kMaxPeerBytes and kMaxPeerSegments of them.
  absl::Mutex peer_mu_;  // taken before fd_channel_mu_
  std::map<std::pair<int, std::string>, std::unique_ptr<ShmSegment>> peer_segments_ ABSL_GUARDED_BY(peer_mu_);
  std::deque<std::pair<int, std::string>> peer_order_ ABSL_GUARDED_BY(peer_mu_);
  size_t peer_bytes_ ABSL_GUARDED_BY(peer_mu_) = 0;
  int fd_channel_ = -1;        // the shared-memory channel (with shared_memory_)
  int ops_sock_ = -1;          // the ops channel, if open (set in Init, closed in the destructor)
  absl::Notification ops_done_;  // its reader ended
  bool finished_ = false;  // Finish() called during Init
  int num_hosts_ = 0;
  int64_t generation_ = 0;
  int local_world_size_ = 0;

  absl::Mutex write_mu_;  // orders seq assignment with stream writes
  int64_t next_seq_ ABSL_GUARDED_BY(write_mu_) = 0;
  int64_t next_collective_seq_ ABSL_GUARDED_BY(write_mu_) = 0;  // collectives only (the group's seq)
  mutable absl::Mutex completed_mu_;
  int64_t last_completed_seq_ ABSL_GUARDED_BY(completed_mu_) = -1;
  std::set<int64_t> completed_ahead_ ABSL_GUARDED_BY(completed_mu_);  // completed OK past a gap
  bool collectives_failed_ ABSL_GUARDED_BY(completed_mu_) = false;
  int64_t next_subgroup_ ABSL_GUARDED_BY(write_mu_) = 0;
  std::vector<int> ranks_;  // GetProcessGroupRanks
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(write_mu_);

  absl::Mutex pending_mu_;
  std::map<int64_t, std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(pending_mu_);

  const std::shared_ptr<Arena> arena_ = std::make_shared<Arena>();
  StagingPool staging_{options_.max_staging_bytes, options_.staging_window_bytes,
                       [this](size_t bytes) { return NewRegisteredSegment(bytes); }};

  absl::Mutex store_mu_;
  std::unique_ptr<StoreClient> store_ ABSL_GUARDED_BY(store_mu_);
  bool store_tried_ ABSL_GUARDED_BY(store_mu_) = false;

  // CUDA tensors: exported allocations and event pairs, and the Work that last used each
  // pair (IssueCuda).
  CudaTensors cuda_;
  absl::Mutex cuda_mu_;
  uint64_t next_cuda_slot_ ABSL_GUARDED_BY(cuda_mu_) = 0;
  std::shared_ptr<WorkImpl> cuda_slot_work_[CudaTensors::kSlots] ABSL_GUARDED_BY(cuda_mu_);

  using Lane = CompletionLane<Done>;
  std::unique_ptr<Lane> collective_lane_;  // set before reader_ starts; joined in the destructor
  std::unique_ptr<Lane> p2p_lane_;
  std::thread reader_;
  absl::Notification reader_done_;
};

}  // namespace

std::shared_ptr<Work> ProcessGroup::AllReduceCuda(void*, int64_t, DataType, ReduceOpArg, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
std::shared_ptr<Work> ProcessGroup::BroadcastCuda(void*, int64_t, DataType, int, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
std::shared_ptr<Work> ProcessGroup::AllGatherIntoTensorCuda(void*, const void*, int64_t, DataType, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
std::shared_ptr<Work> ProcessGroup::ReduceScatterTensorCuda(void*, const void*, int64_t, DataType, ReduceOpArg,
                                                            void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}

bool CudaSupported() { return CudaBuilt(); }

std::vector<std::shared_ptr<Work>> ProcessGroup::BatchIsendIrecv(const std::vector<P2POp>& ops) {
  std::vector<std::shared_ptr<Work>> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops) {
    works.push_back(op.kind == P2POp::Kind::kSend ? Send(op.data, op.count, op.dtype, op.peer, op.tag)
                                                  : Recv(op.data, op.count, op.dtype, op.peer, op.tag));
  }
  return works;
}

absl::StatusOr<int> ProcessGroup::GetGlobalRank(int group_rank) const {
  const std::vector<int>& ranks = GetProcessGroupRanks();
  if (group_rank < 0 || group_rank >= static_cast<int>(ranks.size())) {
    return absl::InvalidArgumentError(absl::StrCat("group rank ", group_rank, " is not in group \"", group_name(),
                                                   "\" of ", ranks.size(), " ranks"));
  }
  return ranks[group_rank];
}

absl::StatusOr<int> ProcessGroup::GetGroupRank(int global_rank) const {
  const std::vector<int>& ranks = GetProcessGroupRanks();
  auto it = std::find(ranks.begin(), ranks.end(), global_rank);
  if (it == ranks.end()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", global_rank, " is not a member of group \"",
                                                   group_name(), "\""));
  }
  return static_cast<int>(it - ranks.begin());
}

ScopedCallSite::ScopedCallSite(std::string call_site) : previous_(std::move(CallSiteOfThisThread())) {
  CallSiteOfThisThread() = std::move(call_site);
}

ScopedCallSite::~ScopedCallSite() { CallSiteOfThisThread() = std::move(previous_); }

void SetCallSite(std::string call_site) { CallSiteOfThisThread() = std::move(call_site); }

namespace {
std::string& CallSiteOverrideOfThisThread() {
  thread_local std::string name;
  return name;
}
}  // namespace

void SetCallSiteOverride(std::string name) { CallSiteOverrideOfThisThread() = std::move(name); }

const std::string& CallSiteOverride() { return CallSiteOverrideOfThisThread(); }

absl::StatusOr<std::unique_ptr<ProcessGroup>> InitProcessGroup(const InitOptions& options) {
  if (options.world_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", options.world_size, " must be > 0"));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", options.rank, " is out of range for world_size ",
                                                   options.world_size));
  }
  if (options.group.empty()) return absl::InvalidArgumentError("empty group name");
  auto pg = std::make_unique<SessionProcessGroup>(options);
  if (absl::Status s = pg->Init(); !s.ok()) return s;
  return std::unique_ptr<ProcessGroup>(std::move(pg));
}

}  // namespace collserve::client
