// collserve-perf --device=cuda: the same nccl-tests columns for CUDA tensors through the
// sidecar (docs/gpu.md), with two yardsticks measured in the same run:
//   nccl   the same op by raw NCCL on the same buffers and stream (a communicator of every
//          rank, unique id through the job's store), where NCCL can run it: one rank per GPU
//          (NCCL refuses two ranks of one communicator on one GPU). "vs_nccl" = NCCL's time
//          / collserve's time (= the ratio of their algbw and busbw).
//   copy   a device-to-device cudaMemcpyAsync of the op's size on rank 0's GPU (the
//          device's copy bandwidth, bytes read + written). For all_reduce with L ranks
//          sharing one GPU the sidecar's kernel must read L tensors and write L: at copy
//          speed that takes L x copy time, the "bound"; "of_bound" = bound / collserve's time.
// The -n timed ops are issued back to back and then waited for (Work::Wait makes the stream
// wait; the CPU waits only for the sidecar's answer), as nccl-tests launches its ops, so the
// service's per-op CPU work overlaps the GPU's; the time is CUDA events on the rank's stream
// around them, divided by -n.
#include <cuda_runtime.h>
#ifdef COLLSERVE_PERF_NCCL
#include <nccl.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "collserve/client.h"

namespace collserve_perf {

using collserve::DataType;
using collserve::ReduceOp;
using collserve::client::ProcessGroup;
using collserve::client::Work;

namespace {

#define PERF_CUDA(call)                                                                              \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "collserve-perf: %s: %s\n", #call, cudaGetErrorString(e_));               \
      return 1;                                                                                      \
    }                                                                                                \
  } while (0)

double BusFactor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter") return static_cast<double>(n - 1) / n;
  return 1.0;
}

// Sum over ranks through the group (host memory).
double Sum(ProcessGroup* pg, double v) {
  std::vector<double> x{v};
  absl::Status s = pg->AllReduce(x.data(), 1, DataType::kFloat64, ReduceOp::kSum)->Wait();
  return s.ok() ? x[0] : std::nan("");
}

}  // namespace

int RunCuda(ProcessGroup* pg, const std::string& op, int64_t min_bytes, int64_t max_bytes, int factor, int iters,
            int warmup, bool check, bool nccl_baseline) {
  const int rank = pg->GetRank(), world = pg->GetWorldSize();
  const int local = pg->local_world_size();
  if (op != "all_reduce" && op != "broadcast" && op != "all_gather" && op != "reduce_scatter") {
    std::fprintf(stderr, "collserve-perf: --device=cuda runs all_reduce, broadcast, all_gather, reduce_scatter\n");
    return 2;
  }
  int gpus = 0;
  PERF_CUDA(cudaGetDeviceCount(&gpus));
  const char* lr = std::getenv("LOCAL_RANK");
  const int device = (lr != nullptr ? std::atoi(lr) : 0) % gpus;
  PERF_CUDA(cudaSetDevice(device));
  cudaStream_t stream;
  PERF_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  PERF_CUDA(cudaEventCreate(&start));
  PERF_CUDA(cudaEventCreate(&stop));
  cudaDeviceProp prop;
  PERF_CUDA(cudaGetDeviceProperties(&prop, device));

  // Raw NCCL over every rank, where each rank has a GPU of its own.
  bool have_nccl = false;
#ifdef COLLSERVE_PERF_NCCL
  ncclComm_t comm = nullptr;
  const bool own_gpus = pg->num_hosts() == 1 ? local <= gpus : local <= gpus;
  if (nccl_baseline && own_gpus) {
    ncclUniqueId id;
    collserve::client::StoreClient* store = pg->store();
    if (world == 1) {
      ncclGetUniqueId(&id);
      have_nccl = true;
    } else if (store != nullptr) {
      const std::string key = absl::StrCat("collserve-perf/nccl_id/", pg->group_name());
      if (rank == 0) {
        ncclGetUniqueId(&id);
        have_nccl = store->Set(key, std::string(id.internal, sizeof id.internal)).ok();
      } else {
        auto v = store->Get(key, absl::Seconds(60));
        have_nccl = v.ok() && v->size() == sizeof id.internal;
        if (have_nccl) std::copy(v->begin(), v->end(), id.internal);
      }
    }
    have_nccl = Sum(pg, have_nccl ? 0 : 1) == 0;  // every rank, or none
    if (have_nccl && ncclCommInitRank(&comm, world, id, rank) != ncclSuccess) {
      std::fprintf(stderr, "collserve-perf: ncclCommInitRank failed: no NCCL baseline\n");
      return 1;
    }
  }
#else
  (void)nccl_baseline;
#endif
  if (rank == 0) {
    std::printf("# collserve-perf --device=cuda: %s, float, %d ranks on %d host(s) (%d on this one), GPU %s, "
                "-n %d -w %d; NCCL baseline: %s\n",
                op.c_str(), world, pg->num_hosts(), local, prop.name, iters, warmup,
                have_nccl ? "yes" : (nccl_baseline ? "no (ranks share a GPU, or no store)" : "off"));
    std::printf("#%11s %12s %6s |%9s %8s %8s %6s |%9s %8s %8s | %7s |%9s %9s %8s  %s\n", "size", "count", "type",
                "time", "algbw", "busbw", "#wrong", "nccl_time", "algbw", "busbw", "vs_nccl", "copy", "bound",
                "of_bound", "algorithm");
    std::printf("#%11s %12s %6s |%9s %8s %8s %6s |%9s %8s %8s | %7s |%9s %9s %8s\n", "(B)", "(elements)", "", "(us)",
                "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "");
  }
  int64_t total_wrong = 0;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes = std::max<int64_t>(bytes * factor, 1)) {
    const bool gather = op == "all_gather", scatter = op == "reduce_scatter";
    // count: elements of this rank's input (all_gather) or output (reduce_scatter) or tensor.
    int64_t count = bytes / 4;
    if (gather || scatter) count /= world;
    const int64_t in_count = scatter ? count * world : count;
    const int64_t out_count = gather ? count * world : count;
    const int64_t size = std::max(in_count, out_count) * 4;
    float* in = nullptr;
    float* out = nullptr;
    PERF_CUDA(cudaMalloc(&in, std::max<int64_t>(in_count, 1) * 4));
    PERF_CUDA(cudaMalloc(&out, std::max<int64_t>(out_count, 1) * 4));
    const auto issue = [&]() -> std::shared_ptr<Work> {
      if (op == "all_reduce") return pg->AllReduceCuda(in, count, DataType::kFloat32, ReduceOp::kSum, stream);
      if (op == "broadcast") return pg->BroadcastCuda(in, count, DataType::kFloat32, 0, stream);
      if (gather) return pg->AllGatherIntoTensorCuda(out, in, count, DataType::kFloat32, stream);
      return pg->ReduceScatterTensorCuda(out, in, count, DataType::kFloat32, ReduceOp::kSum, stream);
    };
    // 1. One checked op: inputs rank + 1 (all_gather's block r holds r + 1).
    std::string algorithm;
    int64_t wrong = 0;
    if (check) {
      std::vector<float> host(static_cast<size_t>(in_count), static_cast<float>(rank + 1));
      PERF_CUDA(cudaMemcpyAsync(in, host.data(), in_count * 4, cudaMemcpyHostToDevice, stream));
      auto work = issue();
      if (absl::Status s = work->Wait(); !s.ok()) {
        std::fprintf(stderr, "collserve-perf: rank %d: %s\n", rank, s.ToString().c_str());
        return 1;
      }
      algorithm = work->Algorithm();
      std::vector<float> result(static_cast<size_t>(out_count));
      PERF_CUDA(cudaMemcpyAsync(result.data(), op == "all_reduce" || op == "broadcast" ? in : out, out_count * 4,
                                cudaMemcpyDeviceToHost, stream));
      PERF_CUDA(cudaStreamSynchronize(stream));
      for (int64_t i = 0; i < out_count; ++i) {
        float want = op == "broadcast" ? 1.0f : static_cast<float>(world) * (world + 1) / 2;
        if (gather) want = static_cast<float>(i / std::max<int64_t>(count, 1) + 1);
        if (result[i] != want) ++wrong;
      }
      wrong = static_cast<int64_t>(Sum(pg, static_cast<double>(wrong)));
      total_wrong += wrong;
    }
    // 2. collserve, timed.
    for (int i = 0; i < warmup; ++i) {
      if (absl::Status s = issue()->Wait(); !s.ok()) {
        std::fprintf(stderr, "collserve-perf: rank %d: %s\n", rank, s.ToString().c_str());
        return 1;
      }
    }
    PERF_CUDA(cudaStreamSynchronize(stream));
    PERF_CUDA(cudaEventRecord(start, stream));
    // Back to back, as nccl-tests launches its ops: every op is issued, then waited for.
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < iters; ++i) works.push_back(issue());
    for (auto& work : works) {
      if (absl::Status s = work->Wait(); !s.ok()) {
        std::fprintf(stderr, "collserve-perf: rank %d: %s\n", rank, s.ToString().c_str());
        return 1;
      }
      if (algorithm.empty()) algorithm = work->Algorithm();
    }
    PERF_CUDA(cudaEventRecord(stop, stream));
    PERF_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    PERF_CUDA(cudaEventElapsedTime(&ms, start, stop));
    const double us = Sum(pg, ms * 1e3 / iters) / world;
    // 3. Raw NCCL on the same buffers.
    double nccl_us = std::nan("");
#ifdef COLLSERVE_PERF_NCCL
    if (have_nccl) {
      const auto run = [&]() {
        if (op == "all_reduce") return ncclAllReduce(in, in, count, ncclFloat32, ncclSum, comm, stream);
        if (op == "broadcast") return ncclBroadcast(in, in, count, ncclFloat32, 0, comm, stream);
        if (gather) return ncclAllGather(in, out, count, ncclFloat32, comm, stream);
        return ncclReduceScatter(in, out, count, ncclFloat32, ncclSum, comm, stream);
      };
      for (int i = 0; i < warmup; ++i) run();
      PERF_CUDA(cudaStreamSynchronize(stream));
      PERF_CUDA(cudaEventRecord(start, stream));
      for (int i = 0; i < iters; ++i) {
        if (run() != ncclSuccess) {
          std::fprintf(stderr, "collserve-perf: raw NCCL failed\n");
          return 1;
        }
      }
      PERF_CUDA(cudaEventRecord(stop, stream));
      PERF_CUDA(cudaEventSynchronize(stop));
      PERF_CUDA(cudaEventElapsedTime(&ms, start, stop));
      nccl_us = Sum(pg, ms * 1e3 / iters) / world;
    }
#endif
    // 4. The device's copy time for `size` bytes, on rank 0 (the others wait in Sum).
    double copy_us = 0;
    if (rank == 0) {
      float* a = nullptr;
      float* b = nullptr;
      PERF_CUDA(cudaMalloc(&a, std::max<int64_t>(size, 4)));
      PERF_CUDA(cudaMalloc(&b, std::max<int64_t>(size, 4)));
      for (int i = 0; i < warmup; ++i) PERF_CUDA(cudaMemcpyAsync(b, a, size, cudaMemcpyDeviceToDevice, stream));
      PERF_CUDA(cudaEventRecord(start, stream));
      for (int i = 0; i < iters; ++i) PERF_CUDA(cudaMemcpyAsync(b, a, size, cudaMemcpyDeviceToDevice, stream));
      PERF_CUDA(cudaEventRecord(stop, stream));
      PERF_CUDA(cudaEventSynchronize(stop));
      PERF_CUDA(cudaEventElapsedTime(&ms, start, stop));
      copy_us = ms * 1e3 / iters;
      cudaFree(a);
      cudaFree(b);
    }
    copy_us = Sum(pg, copy_us);
    cudaFree(in);
    cudaFree(out);
    if (rank == 0) {
      const double algbw = size / (us * 1e3);
      const double busbw = algbw * BusFactor(op, world);
      std::string nccl_cols = absl::StrFormat("%9s %8s %8s | %7s", "N/A", "N/A", "N/A", "N/A");
      if (!std::isnan(nccl_us)) {
        const double nalg = size / (nccl_us * 1e3);
        nccl_cols = absl::StrFormat("%9.1f %8.2f %8.2f | %7.3f", nccl_us, nalg, nalg * BusFactor(op, world),
                                    nccl_us / us);
      }
      // The single-pass bound holds for all_reduce among the ranks of one host.
      const bool bounded = op == "all_reduce" && pg->num_hosts() == 1 && local > 1;
      const double bound_us = copy_us * local;
      std::printf(" %11lld %12lld %6s |%9.1f %8.2f %8.2f %6lld |%s |%9.1f %9s %8s  %s\n",
                  static_cast<long long>(size), static_cast<long long>(count), "float", us, algbw, busbw,
                  static_cast<long long>(wrong), nccl_cols.c_str(), copy_us,
                  bounded ? absl::StrFormat("%.1f", bound_us).c_str() : "N/A",
                  bounded ? absl::StrFormat("%.3f", bound_us / us).c_str() : "N/A",
                  algorithm.empty() ? "-" : algorithm.c_str());
      std::fflush(stdout);
    }
    if (bytes == 0) break;
  }
  if (rank == 0) std::printf("# Out of bounds values : %lld %s\n#\n", static_cast<long long>(total_wrong),
                             total_wrong ? "FAILED" : "OK");
#ifdef COLLSERVE_PERF_NCCL
  if (comm != nullptr) ncclCommDestroy(comm);
#endif
  absl::Status s = pg->Barrier()->Wait();
  return total_wrong == 0 && s.ok() ? 0 : 1;
}

}  // namespace collserve_perf
