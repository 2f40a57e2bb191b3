// CUDA tensors in a group (docs/gpu.md): resolving a request's CUDA IPC handles, and the
// data step of an agreed op on the GPU. The engine sees only backends/device.h (no CUDA
// types); the kernels and NCCL calls live in backends/.
//
// Per op, with L local ranks on this host and H hosts (the GPU of the local ranks):
//   all_reduce: H = 1, L > 1: one kernel reads the L inputs once and writes all L outputs
//     ("local_cuda"). Otherwise the L inputs are reduced into the first local rank's tensor,
//     NCCL all-reduces it across hosts (for L = 1 and H = 1 this is NCCL with one rank, as
//     torch's ProcessGroupNCCL would run it), and one kernel copies (and for AVG scales) it
//     to the others ("nccl" / "local_cuda+nccl").
//   broadcast: NCCL broadcast from the root's host into the root's (or the first local)
//     tensor, then copies to the other local ranks.
//   all_gather (equal counts): the local inputs are copied into the first local output,
//     NCCL moves every rank's piece from its host (one ncclAllGather when each host has one
//     rank and rank r is on host r, else one grouped broadcast per rank), then copies.
//   reduce_scatter (equal counts): H = 1: a kernel per local rank reduces its block; else a
//     lone rank per host in host order runs ncclReduceScatter, and otherwise the local
//     reduction of the whole input is all-reduced across hosts and each rank takes its block.
//   all_to_all (any splits), gather and scatter (any sizes per rank): each piece whose
//     sender and receiver are both on this host is one copy on the stream; the pieces that
//     cross hosts go in one grouped ncclSend/ncclRecv (SendRecvGroupOnStream), each directly
//     between the sender's tensor and the receiver's, listed in (sender, receiver) rank
//     order on both sides. No NCCL with one host.
#include <glog/logging.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/rendezvous.h"
#include "common/status_macros.h"
#include "common/types.h"
#include "engine/group.h"

namespace collserve::engine {
namespace {

// Handles cached per rank (mappings and events each); beyond it the cache is cleared.
constexpr size_t kMaxDeviceHandles = 1024;
// Collectives queued on a group's stream and not yet finished by the GPU; the executor
// waits for the oldest beyond this (which bounds what a hung GPU or peer holds).
constexpr int kMaxDeviceOpsInFlight = 8;

// Ops whose data step moves each rank's pieces as they are (PieceWise).
bool IsPieceWise(CollectiveOp op) {
  return op == CollectiveOp::kAllToAll || op == CollectiveOp::kGather || op == CollectiveOp::kScatter;
}

bool RunsOnDevice(CollectiveOp op) {
  return op == CollectiveOp::kAllReduce || op == CollectiveOp::kBroadcast || op == CollectiveOp::kAllGather ||
         op == CollectiveOp::kReduceScatter || IsPieceWise(op) || op == CollectiveOp::kSend ||
         op == CollectiveOp::kRecv;
}

}  // namespace

absl::Status Group::ResolveDeviceBuffers(LocalRank& local, Submission& sub) {
  const Request& c = sub.args;
  if (!local.shared_memory) {
    return absl::PermissionDeniedError(
        "CUDA tensors need a session on the sidecar's unix socket with shared memory (CUDA IPC works only "
        "between processes of one host)");
  }
  if (env_.device == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("this sidecar cannot take CUDA tensors: ", env_.device_unavailable));
  }
  if (!RunsOnDevice(c.op)) {
    return absl::UnimplementedError(absl::StrCat(OpName(c.op),
                                                 " is not supported on CUDA tensors (all_reduce, broadcast, "
                                                 "all_gather, reduce_scatter, all_to_all, gather, scatter, send and "
                                                 "recv are); pass CPU tensors"));
  }
  // What only the GPU path lacks is refused here, as this rank's request error (the group
  // stays usable), not in the data step (which would fail the group).
  if (c.op == CollectiveOp::kAllReduce || c.op == CollectiveOp::kReduceScatter) {
    const auto rop = static_cast<ReduceOp>(c.reduce_op);
    if (rop != ReduceOp::kSum && rop != ReduceOp::kAvg && rop != ReduceOp::kProduct && rop != ReduceOp::kMin &&
        rop != ReduceOp::kMax) {
      return absl::UnimplementedError(absl::StrCat("ReduceOp.", ReduceOpName(rop),
                                                   " is not supported on CUDA tensors (SUM, AVG, PRODUCT, MIN, MAX are)"));
    }
  }
  const std::vector<int64_t>& splits = c.op == CollectiveOp::kAllGather ? c.output_splits : c.input_splits;
  if (c.op == CollectiveOp::kAllGather || c.op == CollectiveOp::kReduceScatter) {
    for (int64_t s : splits) {
      if (s != splits.front()) {
        return absl::UnimplementedError(absl::StrCat(OpName(c.op),
                                                     " with different sizes per rank is not supported on CUDA tensors"));
      }
    }
  }
  auto device = env_.device->DeviceOf(c.buffer.cuda_device_uuid);
  if (!device.ok()) return device.status();
  const size_t es = ElementSize(static_cast<DataType>(c.dtype));
  const bool in_place = IsInPlace(c.op);
  // SEND reads `count` elements and writes nothing; RECV's tensor (its output, `count`
  // elements) is the output buffer, its input buffer only names the GPU.
  sub.in_bytes = c.op == CollectiveOp::kRecv ? 0 : static_cast<size_t>(c.count) * es;
  sub.out_bytes = in_place || c.op == CollectiveOp::kSend
                      ? 0
                      : static_cast<size_t>(c.op == CollectiveOp::kRecv ? c.count : c.output_count) * es;
  const auto map = [&](const BufferRef& b, size_t bytes, const char* what) -> absl::StatusOr<char*> {
    if (b.cuda_ipc_handle.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("the input is a CUDA tensor but the ", what, " is not"));
    }
    if (b.cuda_device_uuid != c.buffer.cuda_device_uuid) {
      return absl::InvalidArgumentError(absl::StrCat("the ", what, " is on another GPU than the input"));
    }
    std::shared_ptr<backends::DeviceMapping> m;
    if (auto it = local.device_memory.find(b.cuda_ipc_handle); it != local.device_memory.end()) {
      m = it->second;
    } else {
      auto opened = env_.device->MapMemory(*device, b.cuda_ipc_handle);
      if (!opened.ok()) return opened.status();
      m = std::move(*opened);
      if (local.device_memory.size() >= kMaxDeviceHandles) local.device_memory.clear();
      local.device_memory.emplace(b.cuda_ipc_handle, m);
    }
    if (b.offset < 0 || static_cast<uint64_t>(b.offset) > m->bytes ||
        bytes > m->bytes - static_cast<uint64_t>(b.offset)) {
      return absl::InvalidArgumentError(absl::StrCat("the ", what, " (", bytes, " bytes at offset ", b.offset,
                                                     ") does not fit its CUDA allocation of ", m->bytes, " bytes"));
    }
    sub.device_refs.push_back(m);
    return m->base + b.offset;
  };
  if (sub.in_bytes > 0 || in_place) {
    auto p = map(c.buffer, sub.in_bytes, "input");
    if (!p.ok()) return p.status();
    sub.in = *p;
  }
  // A gather's non-root ranks (and any rank receiving nothing) may pass no output.
  if (!in_place && (sub.out_bytes > 0 || !c.output.cuda_ipc_handle.empty())) {
    auto p = map(c.output, sub.out_bytes, "output");
    if (!p.ok()) return p.status();
    sub.out = *p;
  }
  const auto event = [&](const std::string& handle,
                         const char* what) -> absl::StatusOr<std::shared_ptr<backends::DeviceEvent>> {
    if (handle.empty()) return absl::InvalidArgumentError(absl::StrCat("a CUDA collective needs a ", what, " event"));
    if (auto it = local.device_events.find(handle); it != local.device_events.end()) return it->second;
    auto opened = env_.device->OpenEvent(*device, handle);
    if (!opened.ok()) return opened.status();
    if (local.device_events.size() >= kMaxDeviceHandles) local.device_events.clear();
    local.device_events.emplace(handle, *opened);
    return *opened;
  };
  auto ready = event(c.cuda_ready_event, "ready");
  if (!ready.ok()) return ready.status();
  auto done = event(c.cuda_done_event, "done");
  if (!done.ok()) return done.status();
  sub.ready_event = std::move(*ready);
  sub.done_event = std::move(*done);
  sub.device = *device;
  return absl::OkStatus();
}

namespace {

// One agreed op's data step on the GPU, as each op's function below sees it.
struct DeviceStep {
  const std::vector<RankArgs>& all;   // every rank's arguments (all[0]: the op's)
  std::map<int, Submission>& subs;    // the local ranks' submissions, by rank
  const Topology& topology;
  backends::DeviceStream& ds;         // the group's stream
  backends::Communicator* comm;       // NCCL among the hosts; null when use_comm is false
  bool use_comm;                      // several hosts, or one local rank (NCCL with one rank)
  std::vector<const void*> ins;       // the local ranks' inputs, in rank order
  std::vector<void*> outs;            // their outputs (in place: the inputs)
  DataType dtype;
  size_t es;                          // bytes per element
  ReduceOp rop;                       // AVG runs as SUM ...
  double scale;                       // ... and a scale by 1/world_size in the last kernel
  bool one_rank_per_host;             // host h serves exactly rank h
  const std::vector<RankSplits>* splits = nullptr;  // every rank's (ops with NeedsSplits)

  const RankArgs& a() const { return all[0]; }
  size_t local() const { return subs.size(); }
  int world() const { return topology.world_size; }
  void* stream() const { return ds.stream(); }
};

// Each op's step; returns the algorithm it ran (Completion.algorithm). The module comment
// says what each does.
absl::StatusOr<const char*> DeviceAllReduce(DeviceStep& d) {
  const size_t count = static_cast<size_t>(d.a().count);
  if (count == 0) return "";
  if (!d.use_comm) {
    COLLSERVE_RETURN_IF_ERROR(d.ds.Reduce(d.ins, d.outs, count, d.dtype, d.rop, d.scale));
    return "local_cuda";
  }
  if (d.local() > 1) COLLSERVE_RETURN_IF_ERROR(d.ds.Reduce(d.ins, {d.outs[0]}, count, d.dtype, d.rop, 1.0));
  COLLSERVE_RETURN_IF_ERROR(d.comm->AllReduceOnStream(d.outs[0], count, d.dtype, d.rop, d.stream()));
  if (d.local() > 1 || d.scale != 1.0) {
    COLLSERVE_RETURN_IF_ERROR(d.ds.Reduce({d.outs[0]}, d.outs, count, d.dtype, ReduceOp::kSum, d.scale));
  }
  return d.local() > 1 ? "local_cuda+nccl" : "nccl";
}

absl::StatusOr<const char*> DeviceBroadcast(DeviceStep& d) {
  const size_t bytes = static_cast<size_t>(d.a().count) * d.es;
  if (bytes == 0) return "";
  const int root = static_cast<int>(d.a().root);
  auto root_sub = d.subs.find(root);
  char* src = root_sub != d.subs.end() ? root_sub->second.in : d.subs.begin()->second.in;
  if (d.use_comm) {
    COLLSERVE_RETURN_IF_ERROR(d.comm->BroadcastOnStream(src, bytes, d.topology.rank_host[root], d.stream()));
  }
  for (auto& [rank, sub] : d.subs) COLLSERVE_RETURN_IF_ERROR(d.ds.Copy(sub.in, src, bytes));
  return d.use_comm ? (d.local() > 1 ? "nccl+local_cuda" : "nccl") : "local_cuda";
}

bool EqualCounts(const std::vector<RankArgs>& all, int64_t RankArgs::*field) {
  for (const RankArgs& r : all) {
    if (r.*field != all[0].*field) return false;
  }
  return true;
}

absl::StatusOr<const char*> DeviceAllGather(DeviceStep& d) {
  if (!EqualCounts(d.all, &RankArgs::count)) {
    return absl::UnimplementedError("all_gather with different sizes per rank is not supported on CUDA tensors");
  }
  const size_t bytes = static_cast<size_t>(d.a().count) * d.es;
  if (bytes == 0) return "";
  if (d.use_comm && d.local() == 1 && d.one_rank_per_host) {
    COLLSERVE_RETURN_IF_ERROR(d.comm->AllGatherOnStream(d.ins[0], d.outs[0], bytes, d.stream()));
    return "nccl";
  }
  char* dst0 = static_cast<char*>(d.outs[0]);
  for (auto& [rank, sub] : d.subs) {
    COLLSERVE_RETURN_IF_ERROR(d.ds.Copy(dst0 + static_cast<size_t>(rank) * bytes, sub.in, bytes));
  }
  if (d.use_comm) {
    std::vector<void*> pieces;
    std::vector<size_t> sizes;
    std::vector<int> roots;
    for (int r = 0; r < d.world(); ++r) {
      pieces.push_back(dst0 + static_cast<size_t>(r) * bytes);
      sizes.push_back(bytes);
      roots.push_back(d.topology.rank_host[r]);
    }
    COLLSERVE_RETURN_IF_ERROR(d.comm->BroadcastGroupOnStream(pieces, sizes, roots, d.stream()));
  }
  for (size_t k = 1; k < d.local(); ++k) COLLSERVE_RETURN_IF_ERROR(d.ds.Copy(d.outs[k], dst0, bytes * d.world()));
  return d.use_comm ? "local_cuda+nccl" : "local_cuda";
}

absl::StatusOr<const char*> DeviceReduceScatter(DeviceStep& d) {
  if (!EqualCounts(d.all, &RankArgs::output_count) || d.a().count != d.a().output_count * d.world()) {
    return absl::UnimplementedError("reduce_scatter with different sizes per rank is not supported on CUDA tensors");
  }
  const size_t count = static_cast<size_t>(d.a().output_count);
  const size_t bytes = count * d.es;
  if (count == 0) return "";
  if (!d.use_comm) {
    for (auto& [rank, sub] : d.subs) {
      std::vector<const void*> block;
      for (const void* in : d.ins) block.push_back(static_cast<const char*>(in) + static_cast<size_t>(rank) * bytes);
      COLLSERVE_RETURN_IF_ERROR(d.ds.Reduce(block, {sub.out}, count, d.dtype, d.rop, d.scale));
    }
    return "local_cuda";
  }
  if (d.local() == 1 && d.one_rank_per_host) {
    COLLSERVE_RETURN_IF_ERROR(d.comm->ReduceScatterOnStream(d.ins[0], d.outs[0], count, d.dtype, d.rop, d.stream()));
    if (d.scale != 1.0) {
      COLLSERVE_RETURN_IF_ERROR(d.ds.Reduce({d.outs[0]}, {d.outs[0]}, count, d.dtype, ReduceOp::kSum, d.scale));
    }
    return "nccl";
  }
  auto scratch = d.ds.Scratch(bytes * d.world());
  if (!scratch.ok()) return scratch.status();
  char* acc = static_cast<char*>(*scratch);
  COLLSERVE_RETURN_IF_ERROR(d.ds.Reduce(d.ins, {acc}, count * d.world(), d.dtype, d.rop, 1.0));
  COLLSERVE_RETURN_IF_ERROR(d.comm->AllReduceOnStream(acc, count * d.world(), d.dtype, d.rop, d.stream()));
  for (auto& [rank, sub] : d.subs) {
    COLLSERVE_RETURN_IF_ERROR(
        d.ds.Reduce({acc + static_cast<size_t>(rank) * bytes}, {sub.out}, count, d.dtype, ReduceOp::kSum, d.scale));
  }
  return "local_cuda+nccl";
}

// The pieces of all_to_all, gather and scatter (the module comment): copies for those
// within this host, one grouped send/receive for those across hosts.
class PieceWise {
 public:
  explicit PieceWise(DeviceStep& d) : d_(d) {}
  // Piece of `bytes` from rank `from` (at `src` when it is local) to rank `to` (at `dst`
  // when local). Call in (from, to) rank order, the same on every host.
  void Add(int from, const char* src, int to, char* dst, size_t bytes) {
    if (bytes == 0) return;
    const bool from_here = d_.subs.count(from) > 0, to_here = d_.subs.count(to) > 0;
    if (from_here && to_here) {
      copies_.push_back({dst, src, bytes});
    } else if (from_here) {
      sends_.push_back({const_cast<char*>(src), bytes, d_.topology.rank_host[to]});
    } else if (to_here) {
      recvs_.push_back({dst, bytes, d_.topology.rank_host[from]});
    }
  }
  absl::StatusOr<const char*> Run() {
    for (const Copy& c : copies_) COLLSERVE_RETURN_IF_ERROR(d_.ds.Copy(c.dst, c.src, c.bytes));
    const bool remote = !sends_.empty() || !recvs_.empty();
    if (remote) {
      if (d_.comm == nullptr) return absl::InternalError("pieces across hosts without a communicator");
      COLLSERVE_RETURN_IF_ERROR(d_.comm->SendRecvGroupOnStream(sends_, recvs_, d_.stream()));
    }
    if (!remote) return copies_.empty() ? "" : "local_cuda";
    return copies_.empty() ? "nccl" : "local_cuda+nccl";
  }

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  DeviceStep& d_;
  std::vector<Copy> copies_;
  std::vector<backends::StreamTransfer> sends_, recvs_;
};

// Element offsets of each piece in a rank's split buffer: offsets[k] = sum of sizes[0..k).
std::vector<size_t> Offsets(const std::vector<int64_t>& sizes, size_t es) {
  std::vector<size_t> offsets(sizes.size() + 1, 0);
  for (size_t k = 0; k < sizes.size(); ++k) offsets[k + 1] = offsets[k] + static_cast<size_t>(sizes[k]) * es;
  return offsets;
}

char* At(void* base, size_t offset) { return base == nullptr ? nullptr : static_cast<char*>(base) + offset; }

absl::StatusOr<const char*> DeviceAllToAll(DeviceStep& d) {
  const std::vector<RankSplits>& sp = *d.splits;
  std::vector<std::vector<size_t>> in_off(d.world()), out_off(d.world());
  for (auto& [rank, sub] : d.subs) {
    in_off[rank] = Offsets(sp[rank].input, d.es);
    out_off[rank] = Offsets(sp[rank].output, d.es);
  }
  PieceWise pieces(d);
  for (int from = 0; from < d.world(); ++from) {
    auto f = d.subs.find(from);
    for (int to = 0; to < d.world(); ++to) {
      auto t = d.subs.find(to);
      if (f == d.subs.end() && t == d.subs.end()) continue;
      const char* src = f != d.subs.end() ? At(f->second.in, in_off[from][to]) : nullptr;
      char* dst = t != d.subs.end() ? At(t->second.out, out_off[to][from]) : nullptr;
      pieces.Add(from, src, to, dst, static_cast<size_t>(sp[from].input[to]) * d.es);
    }
  }
  return pieces.Run();
}

absl::StatusOr<const char*> DeviceGather(DeviceStep& d) {
  const int root = static_cast<int>(d.a().root);
  auto r = d.subs.find(root);
  const std::vector<size_t> out_off = Offsets((*d.splits)[root].output, d.es);
  PieceWise pieces(d);
  for (int from = 0; from < d.world(); ++from) {
    auto f = d.subs.find(from);
    if (f == d.subs.end() && r == d.subs.end()) continue;
    pieces.Add(from, f != d.subs.end() ? f->second.in : nullptr, root,
               r != d.subs.end() ? At(r->second.out, out_off[from]) : nullptr,
               static_cast<size_t>(d.all[from].count) * d.es);
  }
  return pieces.Run();
}

absl::StatusOr<const char*> DeviceScatter(DeviceStep& d) {
  const int root = static_cast<int>(d.a().root);
  auto r = d.subs.find(root);
  const std::vector<size_t> in_off = Offsets((*d.splits)[root].input, d.es);
  PieceWise pieces(d);
  for (int to = 0; to < d.world(); ++to) {
    auto t = d.subs.find(to);
    if (t == d.subs.end() && r == d.subs.end()) continue;
    pieces.Add(root, r != d.subs.end() ? At(r->second.in, in_off[to]) : nullptr, to,
               t != d.subs.end() ? t->second.out : nullptr, static_cast<size_t>(d.all[to].output_count) * d.es);
  }
  return pieces.Run();
}

}  // namespace

absl::StatusOr<backends::DeviceStream*> Group::DeviceStreamFor(const std::map<int, Submission>& subs) {
  const int device = subs.begin()->second.device;
  for (const auto& [rank, sub] : subs) {
    if (sub.device != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the local ranks of group \"", params_.name, "\" use different GPUs (", device, " and ", sub.device,
          "); the sidecar runs a group's CUDA collectives on one GPU per host. With one GPU per rank, run NCCL in "
          "the ranks: COLLSERVE_CUDA_PATH=nccl on every rank (docs/gpu.md)"));
    }
  }
  if (device_stream_ == nullptr) {
    auto stream = env_.device->NewStream(device);
    if (!stream.ok()) return stream.status();
    device_stream_ = std::move(*stream);
  } else if (device_stream_->device() != device) {
    return absl::InvalidArgumentError(absl::StrCat("group \"", params_.name, "\" ran on GPU ", device_stream_->device(),
                                                   " before; its local ranks now use GPU ", device));
  }
  return device_stream_.get();
}

absl::StatusOr<backends::Communicator*> Group::DeviceCommunicator(int device, absl::Duration timeout) {
  if (device_comm_ != nullptr) return device_comm_.get();
  const int hosts = topology_.num_hosts;
  auto name = env_.backends->Resolve(params_.backend, DeviceType::kCuda);
  if (!name.ok()) name = env_.backends->Resolve("", DeviceType::kCuda);
  if (!name.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("no backend for CUDA tensors across hosts: ",
                                                      name.status().message()));
  }
  std::unique_ptr<backends::RendezvousStore> store = RendezvousStore();
  backends::ConnectParams connect;
  connect.prefix = absl::StrCat("collserve/", *name, "/", params_.name, "/",
                                RendezvousScope(topology_.generation, topology_.rendezvous_id), "/cuda");
  connect.rank = topology_.host_index;
  connect.size = hosts;
  connect.hostname = env_.hostname;
  connect.connect_timeout = std::min(timeout, params_.init_timeout);
  connect.device = device;
  auto comm = env_.backends->Connect(*name, *store, connect);
  if (!comm.ok()) {
    return absl::Status(comm.status().code(), absl::StrCat("connecting ", *name, " for CUDA tensors across ", hosts,
                                                           " host(s) failed: ", comm.status().message()));
  }
  device_comm_ = std::move(*comm);
  LOG(INFO) << "group \"" << params_.name << "\": " << *name << " communicator for CUDA tensors on GPU " << device
            << " (host " << topology_.host_index << " of " << hosts << ")";
  return device_comm_.get();
}

absl::Status Group::RunOnDevice(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                std::map<int, Submission>& subs, absl::Duration timeout, const char** algorithm) {
  COLLSERVE_ASSIGN_OR_RETURN(backends::DeviceStream * ds, DeviceStreamFor(subs));
  const RankArgs& a = all[0];
  const CollectiveOp op = OpOf(a);
  // A lone rank runs the collectives as NCCL with one rank (torch's ProcessGroupNCCL would);
  // the piece-wise ops need no NCCL on one host.
  const bool use_comm = topology_.num_hosts > 1 || (subs.size() == 1 && !IsPieceWise(op));
  backends::Communicator* comm = nullptr;
  if (use_comm) {
    COLLSERVE_ASSIGN_OR_RETURN(comm, DeviceCommunicator(ds->device(), timeout));
  }
  DeviceStep d{all, subs, topology_, *ds, comm, use_comm, {}, {}, static_cast<DataType>(a.dtype), 0,
               static_cast<ReduceOp>(a.reduce_op), 1.0, topology_.num_hosts == topology_.world_size};
  d.es = ElementSize(d.dtype);
  d.splits = &splits;
  if (IsPieceWise(op) && splits.size() != static_cast<size_t>(d.world())) {
    return absl::InternalError(absl::StrCat(OpName(op), " on CUDA tensors without every rank's sizes"));
  }
  for (int r = 0; d.one_rank_per_host && r < d.world(); ++r) d.one_rank_per_host = topology_.rank_host[r] == r;
  if ((op == CollectiveOp::kAllReduce || op == CollectiveOp::kReduceScatter) && d.rop == ReduceOp::kAvg) {
    d.rop = ReduceOp::kSum;
    d.scale = 1.0 / d.world();
  }
  if ((op == CollectiveOp::kAllReduce || op == CollectiveOp::kReduceScatter) && d.rop != ReduceOp::kSum &&
      d.rop != ReduceOp::kProduct && d.rop != ReduceOp::kMin && d.rop != ReduceOp::kMax) {
    return absl::UnimplementedError(absl::StrCat("ReduceOp.", ReduceOpName(d.rop),
                                                 " is not supported on CUDA tensors (SUM, AVG, PRODUCT, MIN, MAX are)"));
  }
  for (auto& [rank, sub] : subs) {
    COLLSERVE_RETURN_IF_ERROR(ds->WaitEvent(*sub.ready_event));
    d.ins.push_back(sub.in);
    d.outs.push_back(IsInPlace(op) ? sub.in : sub.out);
  }
  absl::StatusOr<const char*> ran;
  switch (op) {
    case CollectiveOp::kAllReduce:
      ran = DeviceAllReduce(d);
      break;
    case CollectiveOp::kBroadcast:
      ran = DeviceBroadcast(d);
      break;
    case CollectiveOp::kAllGather:
      ran = DeviceAllGather(d);
      break;
    case CollectiveOp::kReduceScatter:
      ran = DeviceReduceScatter(d);
      break;
    case CollectiveOp::kAllToAll:
      ran = DeviceAllToAll(d);
      break;
    case CollectiveOp::kGather:
      ran = DeviceGather(d);
      break;
    case CollectiveOp::kScatter:
      ran = DeviceScatter(d);
      break;
    default:
      return absl::UnimplementedError(absl::StrCat(OpName(op), " is not supported on CUDA tensors"));
  }
  if (!ran.ok()) return ran.status();
  if (**ran != '\0') *algorithm = *ran;
  return EndDeviceOp(subs, *ds, comm, timeout);
}

absl::Status Group::EndDeviceOp(std::map<int, Submission>& subs, backends::DeviceStream& ds,
                                backends::Communicator* comm, absl::Duration timeout) {
  for (auto& [rank, sub] : subs) COLLSERVE_RETURN_IF_ERROR(ds.RecordEvent(*sub.done_event));
  std::vector<std::shared_ptr<void>> keep;
  for (auto& [rank, sub] : subs) {
    keep.insert(keep.end(), sub.device_refs.begin(), sub.device_refs.end());
    keep.push_back(sub.ready_event);
    keep.push_back(sub.done_event);
  }
  // How long the GPU may take: the op timeout the ranks asked for, not what is left of this
  // collective's budget (which a straggling rank may have used up before the GPU saw it).
  absl::Duration gpu_timeout = timeout;
  for (const auto& [rank, sub] : subs) {
    gpu_timeout = std::max(gpu_timeout, sub.args.timeout_ms > 0 ? absl::Milliseconds(sub.args.timeout_ms)
                                                                : params_.op_timeout);
  }
  return ds.EndOp(std::move(keep), kMaxDeviceOpsInFlight, gpu_timeout, [comm]() {
    return comm != nullptr ? comm->AsyncError() : absl::OkStatus();
  });
}

void Group::StopDevice(bool failed) {
  if (failed && device_comm_ != nullptr) device_comm_->Abort();
  device_stream_.reset();  // waits (bounded) for what is queued
  device_comm_.reset();
}

}  // namespace collserve::engine
