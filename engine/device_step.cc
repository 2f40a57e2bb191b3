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
#include <glog/logging.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
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

bool RunsOnDevice(CollectiveOp op) {
  return op == CollectiveOp::kAllReduce || op == CollectiveOp::kBroadcast || op == CollectiveOp::kAllGather ||
         op == CollectiveOp::kReduceScatter;
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
                                                 "all_gather and reduce_scatter are); pass CPU tensors"));
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
  sub.in_bytes = static_cast<size_t>(c.count) * es;
  sub.out_bytes = in_place ? 0 : static_cast<size_t>(c.output_count) * es;
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
  if (!in_place) {
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

absl::Status Group::RunOnDevice(const std::vector<RankArgs>& all, std::map<int, Submission>& subs,
                                absl::Duration timeout, const char** algorithm) {
  const RankArgs& a = all[0];
  const CollectiveOp op = OpOf(a);
  const int device = subs.begin()->second.device;
  for (const auto& [rank, sub] : subs) {
    if (sub.device != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the local ranks of group \"", params_.name, "\" use different GPUs (", device, " and ", sub.device,
          "); the sidecar runs a group's CUDA collectives on one GPU per host"));
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
  backends::DeviceStream& ds = *device_stream_;
  const int hosts = topology_.num_hosts;
  const size_t local = subs.size();
  const bool use_comm = hosts > 1 || local == 1;
  if (use_comm && device_comm_ == nullptr) {
    auto name = env_.backends->Resolve(params_.backend, DeviceType::kCuda);
    if (!name.ok()) name = env_.backends->Resolve("", DeviceType::kCuda);
    if (!name.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("no backend for CUDA tensors across hosts: ",
                                                        name.status().message()));
    }
    std::unique_ptr<backends::RendezvousStore> store = RendezvousStore();
    backends::ConnectParams connect;
    connect.prefix = absl::StrCat("collserve/", *name, "/", params_.name, "/", topology_.generation, "/cuda");
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
  }
  backends::Communicator* comm = device_comm_.get();
  void* stream = ds.stream();
  const DataType dtype = static_cast<DataType>(a.dtype);
  const size_t es = ElementSize(dtype);
  const int world = topology_.world_size;

  for (auto& [rank, sub] : subs) COLLSERVE_RETURN_IF_ERROR(ds.WaitEvent(*sub.ready_event));

  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (auto& [rank, sub] : subs) {
    ins.push_back(sub.in);
    outs.push_back(IsInPlace(op) ? sub.in : sub.out);
  }
  // AVG runs as SUM and a scale by 1/world_size in the last kernel.
  ReduceOp rop = static_cast<ReduceOp>(a.reduce_op);
  double scale = 1.0;
  if (op == CollectiveOp::kAllReduce || op == CollectiveOp::kReduceScatter) {
    if (rop == ReduceOp::kAvg) {
      rop = ReduceOp::kSum;
      scale = 1.0 / world;
    } else if (rop != ReduceOp::kSum && rop != ReduceOp::kProduct && rop != ReduceOp::kMin && rop != ReduceOp::kMax) {
      return absl::UnimplementedError(absl::StrCat("ReduceOp.", ReduceOpName(rop),
                                                   " is not supported on CUDA tensors (SUM, AVG, PRODUCT, MIN, MAX are)"));
    }
  }
  const auto equal_counts = [&](int64_t RankArgs::*field) {
    for (const RankArgs& r : all) {
      if (r.*field != a.*field) return false;
    }
    return true;
  };
  // Whether host h serves exactly rank h (one rank per host, in rank order).
  bool one_rank_per_host = hosts == world;
  for (int r = 0; one_rank_per_host && r < world; ++r) one_rank_per_host = topology_.rank_host[r] == r;

  switch (op) {
    case CollectiveOp::kAllReduce: {
      const size_t count = static_cast<size_t>(a.count);
      if (count == 0) break;
      if (!use_comm) {
        COLLSERVE_RETURN_IF_ERROR(ds.Reduce(ins, outs, count, dtype, rop, scale));
        *algorithm = "local_cuda";
        break;
      }
      if (local > 1) COLLSERVE_RETURN_IF_ERROR(ds.Reduce(ins, {outs[0]}, count, dtype, rop, 1.0));
      COLLSERVE_RETURN_IF_ERROR(comm->AllReduceOnStream(outs[0], count, dtype, rop, stream));
      if (local > 1 || scale != 1.0) {
        COLLSERVE_RETURN_IF_ERROR(ds.Reduce({outs[0]}, outs, count, dtype, ReduceOp::kSum, scale));
      }
      *algorithm = local > 1 ? "local_cuda+nccl" : "nccl";
      break;
    }
    case CollectiveOp::kBroadcast: {
      const size_t bytes = static_cast<size_t>(a.count) * es;
      if (bytes == 0) break;
      const int root = static_cast<int>(a.root);
      auto root_sub = subs.find(root);
      char* src = root_sub != subs.end() ? root_sub->second.in : subs.begin()->second.in;
      if (use_comm) {
        COLLSERVE_RETURN_IF_ERROR(comm->BroadcastOnStream(src, bytes, topology_.rank_host[root], stream));
      }
      for (auto& [rank, sub] : subs) COLLSERVE_RETURN_IF_ERROR(ds.Copy(sub.in, src, bytes));
      *algorithm = use_comm ? (local > 1 ? "nccl+local_cuda" : "nccl") : "local_cuda";
      break;
    }
    case CollectiveOp::kAllGather: {
      if (!equal_counts(&RankArgs::count)) {
        return absl::UnimplementedError("all_gather with different sizes per rank is not supported on CUDA tensors");
      }
      const size_t bytes = static_cast<size_t>(a.count) * es;
      if (bytes == 0) break;
      if (use_comm && local == 1 && one_rank_per_host) {
        COLLSERVE_RETURN_IF_ERROR(comm->AllGatherOnStream(ins[0], outs[0], bytes, stream));
        *algorithm = "nccl";
        break;
      }
      char* dst0 = static_cast<char*>(outs[0]);
      for (auto& [rank, sub] : subs) {
        COLLSERVE_RETURN_IF_ERROR(ds.Copy(dst0 + static_cast<size_t>(rank) * bytes, sub.in, bytes));
      }
      if (use_comm) {
        std::vector<void*> pieces;
        std::vector<size_t> sizes;
        std::vector<int> roots;
        for (int r = 0; r < world; ++r) {
          pieces.push_back(dst0 + static_cast<size_t>(r) * bytes);
          sizes.push_back(bytes);
          roots.push_back(topology_.rank_host[r]);
        }
        COLLSERVE_RETURN_IF_ERROR(comm->BroadcastGroupOnStream(pieces, sizes, roots, stream));
      }
      for (size_t k = 1; k < local; ++k) COLLSERVE_RETURN_IF_ERROR(ds.Copy(outs[k], dst0, bytes * world));
      *algorithm = use_comm ? "local_cuda+nccl" : "local_cuda";
      break;
    }
    case CollectiveOp::kReduceScatter: {
      if (!equal_counts(&RankArgs::output_count) || a.count != a.output_count * world) {
        return absl::UnimplementedError(
            "reduce_scatter with different sizes per rank is not supported on CUDA tensors");
      }
      const size_t count = static_cast<size_t>(a.output_count);
      const size_t bytes = count * es;
      if (count == 0) break;
      if (!use_comm) {
        for (auto& [rank, sub] : subs) {
          std::vector<const void*> block;
          for (const void* in : ins) block.push_back(static_cast<const char*>(in) + static_cast<size_t>(rank) * bytes);
          COLLSERVE_RETURN_IF_ERROR(ds.Reduce(block, {sub.out}, count, dtype, rop, scale));
        }
        *algorithm = "local_cuda";
        break;
      }
      if (local == 1 && one_rank_per_host) {
        COLLSERVE_RETURN_IF_ERROR(comm->ReduceScatterOnStream(ins[0], outs[0], count, dtype, rop, stream));
        if (scale != 1.0) COLLSERVE_RETURN_IF_ERROR(ds.Reduce({outs[0]}, {outs[0]}, count, dtype, ReduceOp::kSum, scale));
        *algorithm = "nccl";
        break;
      }
      auto scratch = ds.Scratch(bytes * world);
      if (!scratch.ok()) return scratch.status();
      char* acc = static_cast<char*>(*scratch);
      COLLSERVE_RETURN_IF_ERROR(ds.Reduce(ins, {acc}, count * world, dtype, rop, 1.0));
      COLLSERVE_RETURN_IF_ERROR(comm->AllReduceOnStream(acc, count * world, dtype, rop, stream));
      for (auto& [rank, sub] : subs) {
        COLLSERVE_RETURN_IF_ERROR(
            ds.Reduce({acc + static_cast<size_t>(rank) * bytes}, {sub.out}, count, dtype, ReduceOp::kSum, scale));
      }
      *algorithm = "local_cuda+nccl";
      break;
    }
    default:
      return absl::UnimplementedError(absl::StrCat(OpName(op), " is not supported on CUDA tensors"));
  }

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
