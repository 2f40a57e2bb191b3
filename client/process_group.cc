// ProcessGroup's calls over a session with the sidecar (client/session_process_group.h
// describes the parts): each call becomes a Request (client/request_builder.h), checked,
// staged and sent by Issue (IssueCuda for CUDA tensors); and InitProcessGroup.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/session_process_group.h"
#include "collserve/client.h"
#include "common/mutex_mode.h"
#include "common/rendezvous.h"
#include "common/types.h"

namespace collserve::client {

namespace pb = ::collserve::v1;

std::string& CallSiteOfThisThread() {
  thread_local std::string call_site;
  return call_site;
}


absl::Status SessionProcessGroup::SetOpTimeout(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("op timeout ", absl::FormatDuration(timeout),
                                                   ": must be positive and finite"));
  }
  op_timeout_ms_.store(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)), std::memory_order_relaxed);
  absl::MutexLock lock(&watch_mu_);
  watch_wake_ = true;  // the write watch takes the new timeout now
  return absl::OkStatus();
}

std::shared_ptr<Work> SessionProcessGroup::AllReduce(void* data, int64_t count, DataType dtype, ReduceOpArg op) {
  if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::ALL_REDUCE, dtype);
  r.reduce = op;
  r.InPlace(data, count);
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::Broadcast(void* data, int64_t count, DataType dtype, int root) {
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

std::shared_ptr<Work> SessionProcessGroup::Reduce(void* data, int64_t count, DataType dtype, ReduceOpArg op, int dst) {
  if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
  if (absl::Status s = CheckRoot("reduce", dst); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::REDUCE, dtype);
  r.reduce = op;
  r.root = dst;
  r.InPlace(data, count);
  if (dst != options_.rank) r.outputs.clear();  // only the destination's tensor changes
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::Barrier() { return Issue(Request(pb::BARRIER, DataType::kFloat32)); }

std::shared_ptr<Work> SessionProcessGroup::MonitoredBarrier(absl::Duration timeout, bool wait_all_ranks) {
  if (timeout <= absl::ZeroDuration()) {
    return WorkImpl::Failed(absl::InvalidArgumentError("monitored_barrier timeout must be > 0"));
  }
  Request r(pb::MONITORED_BARRIER, DataType::kFloat32);
  r.timeout = timeout;
  r.wait_all_ranks = wait_all_ranks;
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::AllGather(const std::vector<void*>& outputs, const std::vector<int64_t>& counts,
                                const void* input, int64_t count, DataType dtype) {
  Request r(pb::ALL_GATHER, dtype);
  if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
  if (absl::Status s = r.OutputList(outputs, counts, options_.world_size, "outputs"); !s.ok()) return WorkImpl::Failed(s);
  r.output_splits = counts;
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::AllGatherIntoTensor(void* output, const void* input, int64_t count, DataType dtype) {
  Request r(pb::ALL_GATHER, dtype);
  if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
  r.output_splits.assign(options_.world_size, count);
  if (absl::Status s = r.Output(output, count * options_.world_size); !s.ok()) return WorkImpl::Failed(s);
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::Gather(const void* input, int64_t count, const std::vector<void*>& outputs,
                             const std::vector<int64_t>& counts, DataType dtype, int dst) {
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

std::shared_ptr<Work> SessionProcessGroup::Scatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                              const std::vector<int64_t>& counts, DataType dtype, int src) {
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

std::shared_ptr<Work> SessionProcessGroup::ReduceScatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                    const std::vector<int64_t>& counts, DataType dtype, ReduceOpArg op) {
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

std::shared_ptr<Work> SessionProcessGroup::ReduceScatterTensor(void* output, const void* input, int64_t count, DataType dtype,
                                          ReduceOpArg op) {
  if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::REDUCE_SCATTER, dtype);
  r.reduce = op;
  if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat("count ", count, " < 0")));
  if (absl::Status s = r.Input(input, count * options_.world_size); !s.ok()) return WorkImpl::Failed(s);
  r.input_splits.assign(options_.world_size, count);
  if (absl::Status s = r.Output(output, count); !s.ok()) return WorkImpl::Failed(s);
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::AllToAll(const std::vector<void*>& outputs, const std::vector<int64_t>& output_counts,
                               const std::vector<const void*>& inputs, const std::vector<int64_t>& input_counts,
                               DataType dtype) {
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

absl::StatusOr<std::vector<int64_t>> SessionProcessGroup::SplitsOrEven(const std::vector<int64_t>& splits, int64_t n,
                                                                      const char* what) const {
  if (!splits.empty()) return splits;
  const int world = options_.world_size;
  if (n < 0 || n % world != 0) {
    return absl::InvalidArgumentError(absl::StrCat("all_to_all_single without ", what, ": ", n,
                                                   " elements do not split evenly over ", world, " ranks"));
  }
  return std::vector<int64_t>(world, n / world);
}

std::shared_ptr<Work> SessionProcessGroup::AllToAllSingle(void* output, int64_t output_count, const void* input, int64_t count,
                                     const std::vector<int64_t>& output_splits,
                                     const std::vector<int64_t>& input_splits, DataType dtype) {
  Request r(pb::ALL_TO_ALL, dtype);
  auto in = SplitsOrEven(input_splits, count, "input_split_sizes");
  auto out = SplitsOrEven(output_splits, output_count, "output_split_sizes");
  if (!in.ok()) return WorkImpl::Failed(in.status());
  if (!out.ok()) return WorkImpl::Failed(out.status());
  if (absl::Status s = r.Input(input, count); !s.ok()) return WorkImpl::Failed(s);
  if (absl::Status s = r.Output(output, output_count); !s.ok()) return WorkImpl::Failed(s);
  r.input_splits = std::move(*in);
  r.output_splits = std::move(*out);
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::Send(const void* data, int64_t count, DataType dtype, int dst, int64_t tag) {
  if (absl::Status s = CheckPeer("send", dst, false); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::SEND, dtype);
  r.peer = dst;
  r.tag = tag;
  if (absl::Status s = r.Input(data, count); !s.ok()) return WorkImpl::Failed(s);
  return Issue(std::move(r));
}

std::shared_ptr<Work> SessionProcessGroup::Recv(void* data, int64_t count, DataType dtype, int src, int64_t tag) {
  if (absl::Status s = CheckPeer("recv", src, true); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::RECV, dtype);
  r.peer = src;
  r.tag = tag;
  if (absl::Status s = r.Output(data, count); !s.ok()) return WorkImpl::Failed(s);
  return Issue(std::move(r));
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> SessionProcessGroup::NewGroup(std::vector<int> ranks) {
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

absl::Status SessionProcessGroup::CheckRoot(const char* op, int root) const {
  if (root < 0 || root >= options_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, " root ", root, " is out of range for world_size ", options_.world_size));
  }
  return absl::OkStatus();
}

absl::Status SessionProcessGroup::CheckPeer(const char* op, int peer, bool any_ok) const {
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

std::shared_ptr<Work> SessionProcessGroup::Issue(Request r) {
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
    // Pieces of a quarter of the tensor, 256 KiB to 1 MiB: the readers start after the first.
    const size_t piece = std::clamp(stage_in / 4, kFillPieceMinBytes, kFillPieceBytes);
    for (size_t off = 0; off < stage_in; off += piece) {
      const size_t n = std::min(piece, stage_in - off);
      std::memcpy(segment + off, src + off, n);
      __atomic_store_n(count, static_cast<uint64_t>(off + n), __ATOMIC_RELEASE);
    }
  }
  filled->Notify();
  return result;
}

std::shared_ptr<Work> SessionProcessGroup::IssueCuda(const Request& r, const void* in, int64_t in_count, void* out, int64_t out_count,
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
  // An event pair is reused only after its previous user was answered (the sidecar has
  // queued its wait and record). The next answered slot is taken, so a recv (or send) still
  // waiting for its peer keeps its pair while later ops go on; when every pair is in use,
  // this waits for the one after the last taken.
  int slot = -1;
  std::shared_ptr<WorkImpl> previous;
  {
    absl::MutexLock lock(&cuda_mu_);
    for (int k = 0; k < CudaTensors::kSlots && slot < 0; ++k) {
      const int s = static_cast<int>((next_cuda_slot_ + static_cast<uint64_t>(k)) % CudaTensors::kSlots);
      if (cuda_slot_work_[s] == nullptr || cuda_slot_work_[s]->IsCompleted()) slot = s;
    }
    if (slot < 0) slot = static_cast<int>(next_cuda_slot_ % CudaTensors::kSlots);
    next_cuda_slot_ = static_cast<uint64_t>(slot) + 1;
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

absl::StatusOr<std::unique_ptr<RankComm>> SessionProcessGroup::MakeRankComm(int pair_peer) {
  std::string why;
  RankCommFactory* factory = GetRankCommFactory(&why);
  if (factory == nullptr) return absl::FailedPreconditionError(why);
  StoreClient* store = this->store();
  if (store == nullptr) {
    return absl::FailedPreconditionError(
        "the NCCL unique id goes through the coordinator's store, and this process has no coordinator address "
        "(COLLSERVE_COORDINATOR)");
  }
  // A pair's communicator: ranks 0 and 1 of it are the lower and the higher group rank.
  const int low = std::min(options_.rank, pair_peer), high = std::max(options_.rank, pair_peer);
  const std::string scope = pair_peer < 0 ? "" : absl::StrCat("/p2p/", low, ":", high);
  const std::string formation = RendezvousScope(generation_, rendezvous_id_);
  const std::string key = absl::StrCat("collserve/rank_nccl/", options_.group, "/", formation, scope, "/unique_id");
  absl::StatusOr<std::string> id;
  if (options_.rank == (pair_peer < 0 ? 0 : low)) {
    id = factory->NewUniqueId();
    if (id.ok()) {
      if (absl::Status set = store->Set(key, *id); !set.ok()) id = set;
    }
  } else {
    id = store->Get(key, options_.init_timeout);
  }
  if (!id.ok()) return id.status();
  RankCommOptions rco;
  rco.timeout = options_.init_timeout;
  rco.op_timeout = OpTimeout();
  rco.traffic_class = traffic_dscp_ >= 0 ? traffic_dscp_ << 2 : -1;  // the DSCP in the IP traffic class's top six bits
  rco.name = absl::StrCat("collserve/", options_.job.empty() ? "default" : options_.job, "/", options_.group, "/",
                          formation, scope);
  if (pair_peer >= 0) return factory->Connect(*id, RankInPair(options_.rank, pair_peer), 2, rco);
  return factory->Connect(*id, options_.rank, options_.world_size, rco);
}

absl::Status SessionProcessGroup::SendRecord(const char* op, const Request& r) {
  // A call from a Work's callback on a completion lane never waits: the lanes answer the
  // records it would wait for.
  const bool on_lane = collective_lane_ != nullptr && (collective_lane_->OnThisThread() || p2p_lane_->OnThisThread());
  {
    absl::MutexLock lock(&records_mu_);
    const auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(records_mu_) {
      return records_in_flight_ < kMaxRecordsInFlight;
    };
    if (!on_lane && !records_mu_.AwaitWithTimeout(absl::Condition(&room), OpTimeout())) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the sidecar has not answered this rank's last ", kMaxRecordsInFlight,
          " records of its NCCL collectives (kMaxRecordsInFlight) within the op timeout of ",
          absl::FormatDuration(OpTimeout())));
    }
    ++records_in_flight_;
  }
  pb::SessionRequest req;
  pb::Collective* c = req.mutable_collective();
  EncodeCollective(r, op_timeout_ms_.load(std::memory_order_relaxed), c);
  c->set_in_rank(true);
  auto pending = std::make_unique<Pending>();
  pending->work = std::make_shared<WorkImpl>(absl::Now() + absl::Milliseconds(c->timeout_ms()) + kClientGrace);
  pending->record = op;
  absl::Status queued = QueueRecord(std::move(req), std::move(pending));
  if (!queued.ok()) {
    absl::MutexLock lock(&records_mu_);
    --records_in_flight_;
  }
  return queued;
}

void SessionProcessGroup::RecordAnswered(const Pending& p, const absl::Status& status) {
  {
    absl::MutexLock lock(&records_mu_);
    --records_in_flight_;
  }
  if (status.ok()) return;
  // The ranks disagree: the NCCL calls already queued cannot be trusted to finish (or to
  // have matched), so the communicator ends at once with the sidecar's reason, which every
  // later call names. The group failed or the session ended: what is queued may still
  // complete (every rank did its part), so it drains first.
  AbortRankComm(absl::Status(status.code(), absl::StrCat("the sidecar's check of this rank's ", p.record,
                                                         " (collective #", p.collective_seq, "): ", status.message())),
                /*at_once=*/status.code() == absl::StatusCode::kInvalidArgument);
}

std::shared_ptr<Work> SessionProcessGroup::OnRankComm(const char* op, const Request* record,
                                                      const std::function<absl::Status(RankComm&)>& call,
                                                      int source, int pair_peer) {
  std::shared_ptr<RankComm> comm;
  absl::Status s = record != nullptr && options_.nccl_records ? SendRecord(op, *record) : absl::OkStatus();
  if (s.ok()) {
    // One creation at a time; rank_comm_mu_ is never held while joining or calling, so that
    // AbortRankComm (the session's reader, on a GroupEvent) never waits for either.
    absl::MutexLock init(&rank_comm_init_mu_);
    const auto slot = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rank_comm_mu_) -> std::shared_ptr<RankComm>& {
      return pair_peer < 0 ? rank_comm_ : pair_comms_[pair_peer];
    };
    {
      absl::MutexLock lock(&rank_comm_mu_);
      comm = slot();
      s = rank_comm_failure_;
    }
    if (comm == nullptr && s.ok()) {
      absl::StatusOr<std::unique_ptr<RankComm>> made = MakeRankComm(pair_peer);
      absl::MutexLock lock(&rank_comm_mu_);
      if (!rank_comm_failure_.ok()) {  // aborted while joining
        if (made.ok()) (*made)->Abort(rank_comm_failure_);
        s = rank_comm_failure_;
      } else if (made.ok()) {
        slot() = comm = std::shared_ptr<RankComm>(std::move(*made));
      } else {
        s = rank_comm_failure_ = absl::Status(
            made.status().code(),
            absl::StrCat("making this rank's NCCL communicator of group \"", options_.group, "\"",
                         pair_peer < 0 ? "" : absl::StrCat(" for send/recv with rank ", pair_peer), " failed: ",
                         made.status().message()));
      }
    }
  }
  if (comm != nullptr) s = call(*comm);  // an aborted communicator says so itself
  if (!s.ok()) {
    return WorkImpl::Failed(absl::Status(
        s.code(), absl::StrCat(op, " on CUDA tensors (COLLSERVE_CUDA_PATH=nccl): ", s.message())));
  }
  auto work = WorkImpl::Failed(absl::OkStatus());  // complete: queued on the caller's stream
  work->SetSourceRank(source);
  work->SetAlgorithm("rank_nccl");
  return work;
}

void SessionProcessGroup::AbortRankComm(const absl::Status& why, bool at_once) {
  std::vector<std::shared_ptr<RankComm>> comms;
  {
    absl::MutexLock lock(&rank_comm_mu_);
    if (rank_comm_ != nullptr) comms.push_back(rank_comm_);
    for (const auto& [peer, pair] : pair_comms_) {
      if (pair != nullptr) comms.push_back(pair);
    }
    if (rank_comm_failure_.ok()) rank_comm_failure_ = why;
  }
  for (const std::shared_ptr<RankComm>& comm : comms) {
    if (at_once) {
      comm->Abort(why);
    } else {
      comm->AbortWhenDrained(why, std::min(kRankCommDrain, OpTimeout()));
    }
  }
}

std::shared_ptr<Work> SessionProcessGroup::AllReduceCuda(void* data, int64_t count, DataType dtype, ReduceOpArg op,
                                    void* stream) {
  if (absl::Status s = ValidateReduce(dtype, op.op); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::ALL_REDUCE, dtype);
  r.reduce = op;
  r.count = count;
  if (RankNccl()) {
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("all_reduce count is negative"));
    return OnRankComm("all_reduce", &r, [&](RankComm& c) {
      return c.AllReduce(data, data, static_cast<size_t>(count), dtype, op.op, stream);
    });
  }
  return IssueCuda(r, data, count, nullptr, 0, stream);
}

std::shared_ptr<Work> SessionProcessGroup::BroadcastCuda(void* data, int64_t count, DataType dtype, int root, void* stream) {
  if (absl::Status s = CheckRoot("broadcast", root); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::BROADCAST, dtype);
  r.root = root;
  r.count = count;
  if (RankNccl()) {
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("broadcast count is negative"));
    return OnRankComm("broadcast", &r, [&](RankComm& c) {
      return c.Broadcast(data, static_cast<size_t>(count), dtype, root, stream);
    });
  }
  return IssueCuda(r, data, count, nullptr, 0, stream);
}

std::shared_ptr<Work> SessionProcessGroup::AllGatherIntoTensorCuda(void* output, const void* input, int64_t count, DataType dtype,
                                              void* stream) {
  Request r(pb::ALL_GATHER, dtype);
  r.count = count;
  const int64_t world = options_.world_size;
  if (count < 0 || count > (int64_t{1} << 48) / world) {
    return WorkImpl::Failed(absl::InvalidArgumentError(absl::StrCat("all_gather count ", count, " is out of range")));
  }
  r.output_count = count * world;
  r.output_splits.assign(static_cast<size_t>(world), count);
  if (RankNccl()) {
    return OnRankComm("all_gather_into_tensor", &r, [&](RankComm& c) {
      return c.AllGather(input, output, static_cast<size_t>(count), dtype, stream);
    });
  }
  return IssueCuda(r, input, count, output, r.output_count, stream);
}

std::shared_ptr<Work> SessionProcessGroup::ReduceScatterTensorCuda(void* output, const void* input, int64_t count, DataType dtype,
                                              ReduceOpArg op, void* stream) {
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
  if (RankNccl()) {
    return OnRankComm("reduce_scatter_tensor", &r, [&](RankComm& c) {
      return c.ReduceScatter(input, output, static_cast<size_t>(count), dtype, op.op, stream);
    });
  }
  return IssueCuda(r, input, r.count, output, count, stream);
}

std::shared_ptr<Work> SessionProcessGroup::AllToAllSingleCuda(void* output, int64_t output_count, const void* input,
                                                              int64_t count, const std::vector<int64_t>& output_splits,
                                                              const std::vector<int64_t>& input_splits, DataType dtype,
                                                              void* stream) {
  auto in = SplitsOrEven(input_splits, count, "input_split_sizes");
  auto out = SplitsOrEven(output_splits, output_count, "output_split_sizes");
  if (!in.ok()) return WorkImpl::Failed(in.status());
  if (!out.ok()) return WorkImpl::Failed(out.status());
  Request r(pb::ALL_TO_ALL, dtype);
  r.count = count;
  r.output_count = output_count;
  r.input_splits = std::move(*in);
  r.output_splits = std::move(*out);
  if (RankNccl()) {
    // Every rank's pieces in rank order (the sizes each pair agrees on are the caller's
    // business, as with NCCL: a mismatch is NCCL's error or a hang until the op timeout).
    auto sends = Pieces(const_cast<void*>(input), r.input_splits, count, dtype, "input_split_sizes");
    auto recvs = Pieces(output, r.output_splits, output_count, dtype, "output_split_sizes");
    if (!sends.ok()) return WorkImpl::Failed(sends.status());
    if (!recvs.ok()) return WorkImpl::Failed(recvs.status());
    return OnRankComm("all_to_all_single", &r, [&](RankComm& c) { return c.SendRecv(*sends, *recvs, dtype, stream); });
  }
  // A rank that sends nothing still names its GPU through its input's address.
  return IssueCuda(r, input != nullptr ? input : output, count, output, output_count, stream);
}

std::shared_ptr<Work> SessionProcessGroup::SendCuda(const void* data, int64_t count, DataType dtype, int dst,
                                                    int64_t tag, void* stream) {
  if (absl::Status s = CheckPeer("send", dst, false); !s.ok()) return WorkImpl::Failed(s);
  if (RankNccl()) {
    // NCCL has no tags: sends to one peer are received in the order sent (torch's NCCL
    // backend ignores them too).
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("send count is negative"));
    // To another rank: on the pair's communicator, where the lower rank is 0 (OnRankComm).
    const bool pair = dst != options_.rank;
    const std::vector<RankComm::Transfer> sends = {
        {const_cast<void*>(data), static_cast<size_t>(count), pair ? RankInPair(dst, options_.rank) : dst}};
    return OnRankComm("send", nullptr, [&](RankComm& c) { return c.SendRecv(sends, {}, dtype, stream); }, -1,
                      pair ? dst : -1);
  }
  Request r(pb::SEND, dtype);
  r.peer = dst;
  r.tag = tag;
  r.count = count;
  return IssueCuda(r, data, count, nullptr, 0, stream);
}

std::shared_ptr<Work> SessionProcessGroup::RecvCuda(void* data, int64_t count, DataType dtype, int src, int64_t tag,
                                                    void* stream) {
  if (absl::Status s = CheckPeer("recv", src, true); !s.ok()) return WorkImpl::Failed(s);
  if (RankNccl()) {
    if (src == -1) {
      return WorkImpl::Failed(absl::InvalidArgumentError(
          "recv from any source on CUDA tensors with COLLSERVE_CUDA_PATH=nccl: NCCL receives only from a named rank "
          "(as torch's NCCL backend); name the source"));
    }
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("recv count is negative"));
    const bool pair = src != options_.rank;
    const std::vector<RankComm::Transfer> recvs = {
        {data, static_cast<size_t>(count), pair ? RankInPair(src, options_.rank) : src}};
    return OnRankComm("recv", nullptr, [&](RankComm& c) { return c.SendRecv({}, recvs, dtype, stream); }, src,
                      pair ? src : -1);
  }
  Request r(pb::RECV, dtype);
  r.peer = src;
  r.tag = tag;
  r.output_count = count;
  // The tensor is the output; the input (no bytes of it) names its GPU.
  return IssueCuda(r, data, 0, data, count, stream);
}

std::vector<std::shared_ptr<Work>> SessionProcessGroup::BatchIsendIrecv(const std::vector<P2POp>& ops) {
  bool any_cuda = false;
  for (const P2POp& op : ops) any_cuda |= op.cuda;
  if (!RankNccl() || !any_cuda) return ProcessGroup::BatchIsendIrecv(ops);
  // One NCCL group of every transfer, in bytes (dtypes may differ between ops), on the
  // first op's stream (torch coalesces a batch on one stream too).
  absl::Status bad;
  std::vector<RankComm::Transfer> sends, recvs;
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    if (!bad.ok()) break;
    if (!op.cuda) {
      bad = absl::InvalidArgumentError("batch_isend_irecv with COLLSERVE_CUDA_PATH=nccl: every op of a batch with "
                                       "CUDA tensors must be on CUDA tensors");
    } else if (op.stream != ops.front().stream) {
      bad = absl::InvalidArgumentError("batch_isend_irecv: every op of the batch must name one stream");
    } else if (op.count < 0 || !IsValidDataType(static_cast<int>(op.dtype))) {
      bad = absl::InvalidArgumentError("batch_isend_irecv: a negative count or an unknown dtype");
    } else if (!send && op.peer == -1) {
      bad = absl::InvalidArgumentError(
          "recv from any source on CUDA tensors with COLLSERVE_CUDA_PATH=nccl: NCCL receives only from a named rank "
          "(as torch's NCCL backend); name the source");
    } else {
      bad = CheckPeer(send ? "send" : "recv", op.peer, false);
    }
    if (bad.ok()) {
      (send ? sends : recvs).push_back({op.data, static_cast<size_t>(op.count) * ElementSize(op.dtype), op.peer});
    }
  }
  std::shared_ptr<Work> batch =
      bad.ok() ? OnRankComm("batch_isend_irecv", nullptr,
                            [&](RankComm& c) { return c.SendRecv(sends, recvs, DataType::kUInt8, ops.front().stream); })
               : WorkImpl::Failed(bad);
  const absl::Status s = batch->Wait();
  std::vector<std::shared_ptr<Work>> works;
  for (const P2POp& op : ops) {
    auto w = WorkImpl::Failed(s);
    if (op.kind == P2POp::Kind::kRecv) w->SetSourceRank(op.peer);
    works.push_back(std::move(w));
  }
  return works;
}

absl::StatusOr<std::vector<RankComm::Transfer>> SessionProcessGroup::Pieces(void* base, const std::vector<int64_t>& sizes,
                                                                           int64_t total, DataType dtype,
                                                                           const char* what) const {
  if (sizes.size() != static_cast<size_t>(options_.world_size)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", sizes.size(), " sizes for world_size ",
                                                   options_.world_size));
  }
  std::vector<RankComm::Transfer> pieces;
  int64_t offset = 0;
  for (int r = 0; r < options_.world_size; ++r) {
    const int64_t n = sizes[static_cast<size_t>(r)];
    if (n < 0 || n > total - offset) {
      return absl::InvalidArgumentError(absl::StrCat(what, " do not fit the tensor of ", total, " elements"));
    }
    pieces.push_back({static_cast<char*>(base) + static_cast<size_t>(offset) * ElementSize(dtype),
                      static_cast<size_t>(n), r});
    offset += n;
  }
  if (offset != total) {
    return absl::InvalidArgumentError(absl::StrCat(what, " add up to ", offset, " elements, not the tensor's ", total));
  }
  return pieces;
}

absl::StatusOr<int64_t> SessionProcessGroup::TotalOfCounts(const std::vector<int64_t>& counts,
                                                           const char* who) const {
  if (counts.size() != static_cast<size_t>(options_.world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " passes world_size (", options_.world_size, ") counts, got ", counts.size()));
  }
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c < 0 || c > (int64_t{1} << 48)) {
      return absl::InvalidArgumentError(absl::StrCat(who, "'s count ", c, " is out of range"));
    }
    total += c;
  }
  return total;
}

std::shared_ptr<Work> SessionProcessGroup::GatherCuda(void* output, const void* input, int64_t count,
                                                      const std::vector<int64_t>& counts, DataType dtype, int dst,
                                                      void* stream) {
  if (absl::Status s = CheckRoot("gather", dst); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::GATHER, dtype);
  r.root = dst;
  r.count = count;
  if (dst == options_.rank) {
    auto total_or = TotalOfCounts(counts, "gather: the destination");
    if (!total_or.ok()) return WorkImpl::Failed(total_or.status());
    const int64_t total = *total_or;
    r.output_count = total;
    r.output_splits = counts;
    if (RankNccl()) {
      if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("gather count is negative"));
      auto recvs = Pieces(output, counts, total, dtype, "gather counts");
      if (!recvs.ok()) return WorkImpl::Failed(recvs.status());
      const std::vector<RankComm::Transfer> sends = {{const_cast<void*>(input), static_cast<size_t>(count), dst}};
      return OnRankComm("gather", &r, [&](RankComm& c) { return c.SendRecv(sends, *recvs, dtype, stream); });
    }
    return IssueCuda(r, input, count, output, total, stream);
  }
  if (output != nullptr || !counts.empty()) {
    return WorkImpl::Failed(absl::InvalidArgumentError("gather: only the destination rank passes outputs"));
  }
  if (RankNccl()) {
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("gather count is negative"));
    const std::vector<RankComm::Transfer> sends = {{const_cast<void*>(input), static_cast<size_t>(count), dst}};
    return OnRankComm("gather", &r, [&](RankComm& c) { return c.SendRecv(sends, {}, dtype, stream); });
  }
  return IssueCuda(r, input, count, nullptr, 0, stream);
}

std::shared_ptr<Work> SessionProcessGroup::ScatterCuda(void* output, int64_t count, const void* input,
                                                       const std::vector<int64_t>& counts, DataType dtype, int src,
                                                       void* stream) {
  if (absl::Status s = CheckRoot("scatter", src); !s.ok()) return WorkImpl::Failed(s);
  Request r(pb::SCATTER, dtype);
  r.root = src;
  r.output_count = count;
  if (src == options_.rank) {
    auto total_or = TotalOfCounts(counts, "scatter: the source");
    if (!total_or.ok()) return WorkImpl::Failed(total_or.status());
    const int64_t total = *total_or;
    r.count = total;
    r.input_splits = counts;
    if (RankNccl()) {
      if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("scatter count is negative"));
      auto sends = Pieces(const_cast<void*>(input), counts, total, dtype, "scatter counts");
      if (!sends.ok()) return WorkImpl::Failed(sends.status());
      const std::vector<RankComm::Transfer> recvs = {{output, static_cast<size_t>(count), src}};
      return OnRankComm("scatter", &r, [&](RankComm& c) { return c.SendRecv(*sends, recvs, dtype, stream); });
    }
    return IssueCuda(r, input, total, output, count, stream);
  }
  if (input != nullptr || !counts.empty()) {
    return WorkImpl::Failed(absl::InvalidArgumentError("scatter: only the source rank passes inputs"));
  }
  if (RankNccl()) {
    if (count < 0) return WorkImpl::Failed(absl::InvalidArgumentError("scatter count is negative"));
    const std::vector<RankComm::Transfer> recvs = {{output, static_cast<size_t>(count), src}};
    return OnRankComm("scatter", &r, [&](RankComm& c) { return c.SendRecv({}, recvs, dtype, stream); });
  }
  // No input: the output names the GPU (nothing of it is read).
  return IssueCuda(r, output, 0, output, count, stream);
}

std::shared_ptr<Work> ProcessGroup::AllToAllSingleCuda(void*, int64_t, const void*, int64_t,
                                                       const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                       DataType, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
std::shared_ptr<Work> ProcessGroup::GatherCuda(void*, const void*, int64_t, const std::vector<int64_t>&, DataType,
                                               int, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
std::shared_ptr<Work> ProcessGroup::ScatterCuda(void*, int64_t, const void*, const std::vector<int64_t>&, DataType,
                                                int, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
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

std::shared_ptr<Work> ProcessGroup::SendCuda(const void*, int64_t, DataType, int, int64_t, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}
std::shared_ptr<Work> ProcessGroup::RecvCuda(void*, int64_t, DataType, int, int64_t, void*) {
  return WorkImpl::Failed(absl::UnimplementedError("this process group takes no CUDA tensors"));
}

std::vector<std::shared_ptr<Work>> ProcessGroup::BatchIsendIrecv(const std::vector<P2POp>& ops) {
  std::vector<std::shared_ptr<Work>> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    if (op.cuda) {
      works.push_back(send ? SendCuda(op.data, op.count, op.dtype, op.peer, op.tag, op.stream)
                           : RecvCuda(op.data, op.count, op.dtype, op.peer, op.tag, op.stream));
    } else {
      works.push_back(send ? Send(op.data, op.count, op.dtype, op.peer, op.tag)
                           : Recv(op.data, op.count, op.dtype, op.peer, op.tag));
    }
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
  if (absl::Status s = ValidateGroupName(options.group); !s.ok()) return s;
  // Abseil's lock-order tracking off, as in its release builds (common/mutex_mode.h).
  if (absl::Status s = ApplyMutexDeadlockDetectionMode(); !s.ok()) return s;
  auto pg = std::make_unique<SessionProcessGroup>(options);
  if (absl::Status s = pg->Init(); !s.ok()) return s;
  return std::unique_ptr<ProcessGroup>(std::move(pg));
}

}  // namespace collserve::client
