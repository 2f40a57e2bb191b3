// collserve-perf: collective bandwidth through collserve, shaped like nccl-tests
// (github.com/NVIDIA/nccl-tests; columns and bus-bandwidth factors from its
// doc/PERFORMANCE.md). One process per rank, started like any rank (env:// variables plus
// COLLSERVE_SIDECAR), e.g.
//
//   collserve launch --nproc_per_node 4 --no_python build/bench/collserve-perf -b 8 -e 64M -f 4 -o all_reduce
//
// Rank 0 prints, per size:  size count type redop root | out-of-place: time algbw busbw #wrong
// | in-place: time algbw busbw #wrong, then "# Out of bounds values" and "# Avg bus
// bandwidth". Columns, as nccl-tests:
//   size   bytes of the op's largest buffer: the tensor for all_reduce, broadcast, reduce and
//          send_recv; the gathered output for all_gather; the input for reduce_scatter; the
//          whole send buffer for all_to_all.
//   time   microseconds per op, each rank's mean over -n back-to-back ops (-z 1: over -n ops
//          each waited for before the next, its latency), averaged over ranks (nccl-tests'
//          default -a 1). Before them, -w warm-up ops are issued back to
//          back and waited for, as nccl-tests does: with ordinary memory (-m heap), -w >= -n
//          has the timed ops reuse the staging segments the warm-up created, as a training
//          loop's steps do, instead of timing their creation.
//   algbw  size / time (GB/s, 1e9 bytes); busbw = algbw x the op's factor: all_reduce
//          2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce,
//          send_recv 1.
//   #wrong elements that differ from the expected result after one checked op, summed over
//          ranks (-c 0 skips the check: "N/A"). Inputs are small integers, exact in every
//          dtype, so any difference is an error.
// In-place means the output buffer is the input (all_gather: the input is this rank's block
// of the output; reduce_scatter: the output is this rank's block of the input). collserve's
// all_reduce, broadcast and reduce work in place only (torch's signatures), and send_recv
// out of place only: the other columns print N/A.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "collserve/client.h"

ABSL_FLAG(std::string, b, "8", "Smallest size in bytes (suffixes K, M, G: powers of 1024).");
ABSL_FLAG(std::string, e, "32M", "Largest size in bytes (suffixes K, M, G).");
ABSL_FLAG(int, f, 2, "Multiplication factor between sizes.");
ABSL_FLAG(int, n, 20, "Timed iterations per size.");
ABSL_FLAG(int, w, 5, "Warm-up iterations per size.");
ABSL_FLAG(std::string, o, "all_reduce",
          "Operation: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, send_recv.");
ABSL_FLAG(std::string, d, "float", "Data type: float, double, int32, int64.");
ABSL_FLAG(int, r, 0, "Root rank of broadcast and reduce.");
ABSL_FLAG(int, c, 1, "Check results (1) or not (0).");
ABSL_FLAG(int, z, 0,
          "Blocking (1): wait for each op before issuing the next (nccl-tests' -z), so time is one "
          "op's latency; 0: -n ops back to back, then wait for them all.");
ABSL_FLAG(std::string, m, "arena",
          "Where the tensors live: arena (ProcessGroup::AllocateShared, the session's shared memory: "
          "no copy between rank and sidecar, as nccl-tests' device buffers) or heap (ordinary memory: "
          "the SDK copies through a staging segment, as torch tensors are).");
ABSL_FLAG(std::string, device, "cpu",
          "cpu, or cuda: CUDA tensors (cudaMalloc on GPU LOCAL_RANK % GPUs, float; all_reduce, broadcast, "
          "all_gather, reduce_scatter), with raw NCCL on the same buffers and the device's copy bound in the "
          "same output (bench/cuda_perf.cc).");
ABSL_FLAG(std::string, backend, "",
          "The backend between the sidecars (InitOptions.backend): gloo, nccl, mpi (sidecars started as one MPI "
          "world with --mpi); default COLLSERVE_BACKEND, else the sidecar's default. Printed in the header.");
ABSL_FLAG(bool, nccl, true, "--device=cuda: also time raw NCCL on the same buffers (where each rank has a GPU).");

#ifdef COLLSERVE_PERF_CUDA
namespace collserve_perf {
int RunCuda(collserve::client::ProcessGroup* pg, const std::string& op, int64_t min_bytes, int64_t max_bytes,
            int factor, int iters, int warmup, bool check, bool nccl_baseline);
}  // namespace collserve_perf
#endif

namespace {

using collserve::DataType;
using collserve::ReduceOp;
using collserve::client::ProcessGroup;
using collserve::client::Work;

enum class Op { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kAllToAll, kSendRecv };

struct OpInfo {
  const char* name;
  Op op;
  bool out_of_place;  // the API has an out-of-place form
  bool in_place;
};
constexpr OpInfo kOps[] = {
    {"all_reduce", Op::kAllReduce, false, true},        {"all_gather", Op::kAllGather, true, true},
    {"reduce_scatter", Op::kReduceScatter, true, true}, {"broadcast", Op::kBroadcast, false, true},
    {"reduce", Op::kReduce, false, true},               {"all_to_all", Op::kAllToAll, true, true},
    {"send_recv", Op::kSendRecv, true, false},
};

double BusFactor(Op op, int n) {
  switch (op) {
    case Op::kAllReduce: return 2.0 * (n - 1) / n;
    case Op::kAllGather:
    case Op::kReduceScatter:
    case Op::kAllToAll: return static_cast<double>(n - 1) / n;
    default: return 1.0;
  }
}

bool ParseBytes(const std::string& text, int64_t* out) {
  std::string digits = text;
  int64_t scale = 1;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': scale = int64_t{1} << 10; break;
      case 'M': case 'm': scale = int64_t{1} << 20; break;
      case 'G': case 'g': scale = int64_t{1} << 30; break;
      default: scale = 0;
    }
    if (scale != 0) digits.pop_back(); else scale = 1;
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(digits, &v) || v < 0) return false;
  *out = v * scale;
  return true;
}

// The input pattern: small integers, exact in every dtype and in every sum here.
double Value(int rank, int64_t i) { return static_cast<double>((rank + 1) * (i % 13 + 1)); }

// A typed buffer: elements are read and written as doubles for filling and checking.
class Buffer {
 public:
  // In `pg`'s shared-memory arena when `arena`, else on the heap.
  static absl::StatusOr<std::unique_ptr<Buffer>> Make(DataType dtype, int64_t count, ProcessGroup* pg, bool arena) {
    auto b = std::unique_ptr<Buffer>(new Buffer(dtype));
    const size_t bytes = static_cast<size_t>(count) * Size(dtype) + sizeof(uint64_t);
    if (arena) {
      auto shared = pg->AllocateShared(bytes);
      if (!shared.ok()) return shared.status();
      b->shared_ = std::move(*shared);
      b->data_ = static_cast<char*>(b->shared_->data());
    } else {
      b->heap_.assign(bytes / sizeof(uint64_t) + 1, 0);
      b->data_ = reinterpret_cast<char*>(b->heap_.data());
    }
    return b;
  }
  static size_t Size(DataType d) { return d == DataType::kFloat64 || d == DataType::kInt64 ? 8 : 4; }
  char* data() { return data_; }
  void Set(int64_t i, double v) {
    switch (dtype_) {
      case DataType::kFloat32: reinterpret_cast<float*>(data())[i] = static_cast<float>(v); break;
      case DataType::kFloat64: reinterpret_cast<double*>(data())[i] = v; break;
      case DataType::kInt32: reinterpret_cast<int32_t*>(data())[i] = static_cast<int32_t>(v); break;
      default: reinterpret_cast<int64_t*>(data())[i] = static_cast<int64_t>(v); break;
    }
  }
  double Get(int64_t i) {
    switch (dtype_) {
      case DataType::kFloat32: return reinterpret_cast<float*>(data())[i];
      case DataType::kFloat64: return reinterpret_cast<double*>(data())[i];
      case DataType::kInt32: return reinterpret_cast<int32_t*>(data())[i];
      default: return static_cast<double>(reinterpret_cast<int64_t*>(data())[i]);
    }
  }

 private:
  explicit Buffer(DataType dtype) : dtype_(dtype) {}
  DataType dtype_;
  std::shared_ptr<collserve::client::SharedBuffer> shared_;
  std::vector<uint64_t> heap_;
  char* data_ = nullptr;
};


class Bench {
 public:
  Bench(ProcessGroup* pg, Op op, DataType dtype, int root)
      : pg_(pg), op_(op), dtype_(dtype), root_(root), rank_(pg->GetRank()), n_(pg->GetWorldSize()) {}

  // Elements of the op's "size" buffer for `bytes` (a multiple of world_size where the op
  // cuts it into per-rank blocks).
  int64_t Count(int64_t bytes) const {
    int64_t count = bytes / static_cast<int64_t>(Buffer::Size(dtype_));
    if (op_ == Op::kAllGather || op_ == Op::kReduceScatter || op_ == Op::kAllToAll) count -= count % n_;
    return count;
  }

  // One op on `count` elements; in_place as described in the file comment.
  std::shared_ptr<Work> Issue(Buffer& in, Buffer& out, int64_t count, bool in_place) {
    const int64_t block = count / n_;
    switch (op_) {
      case Op::kAllReduce: return pg_->AllReduce(in.data(), count, dtype_, ReduceOp::kSum);
      case Op::kBroadcast: return pg_->Broadcast(in.data(), count, dtype_, root_);
      case Op::kReduce: return pg_->Reduce(in.data(), count, dtype_, ReduceOp::kSum, root_);
      case Op::kAllGather:
        return pg_->AllGatherIntoTensor(out.data(), in_place ? Block(out, rank_ * block) : in.data(), block, dtype_);
      case Op::kReduceScatter:
        return pg_->ReduceScatterTensor(in_place ? Block(in, rank_ * block) : out.data(), in.data(), block, dtype_,
                                        ReduceOp::kSum);
      case Op::kAllToAll:
        return pg_->AllToAllSingle(in_place ? in.data() : out.data(), count, in.data(), count, {}, {}, dtype_);
      case Op::kSendRecv: {
        // A ring: send to the next rank, receive from the previous one.
        auto send = pg_->Send(in.data(), count, dtype_, (rank_ + 1) % n_);
        auto recv = pg_->Recv(out.data(), count, dtype_, (rank_ + n_ - 1) % n_);
        pending_sends_.push_back(send);
        return recv;
      }
    }
    return nullptr;
  }

  // Fills the input, runs one op and counts the wrong output elements on this rank.
  absl::StatusOr<int64_t> Check(Buffer& in, Buffer& out, int64_t count, bool in_place) {
    const int64_t block = count / n_;
    for (int64_t i = 0; i < count; ++i) in.Set(i, Value(rank_, i));
    if (op_ == Op::kAllGather && in_place) {
      for (int64_t i = 0; i < block; ++i) out.Set(rank_ * block + i, Value(rank_, i));
    }
    absl::Status s = Wait(Issue(in, out, count, in_place));
    if (!s.ok()) return s;
    const double sum_ranks = n_ * (n_ + 1) / 2.0;
    int64_t wrong = 0;
    auto expect = [&](Buffer& b, int64_t at, double want) { wrong += b.Get(at) != want; };
    switch (op_) {
      case Op::kAllReduce:
        for (int64_t i = 0; i < count; ++i) expect(in, i, (i % 13 + 1) * sum_ranks);
        break;
      case Op::kBroadcast:
        for (int64_t i = 0; i < count; ++i) expect(in, i, Value(root_, i));
        break;
      case Op::kReduce:
        for (int64_t i = 0; rank_ == root_ && i < count; ++i) expect(in, i, (i % 13 + 1) * sum_ranks);
        break;
      case Op::kAllGather:
        for (int64_t i = 0; i < count; ++i) expect(out, i, Value(static_cast<int>(i / block), i % block));
        break;
      case Op::kReduceScatter: {
        Buffer& o = in_place ? in : out;
        const int64_t base = in_place ? rank_ * block : 0;
        for (int64_t j = 0; j < block; ++j) expect(o, base + j, ((rank_ * block + j) % 13 + 1) * sum_ranks);
        break;
      }
      case Op::kAllToAll: {
        Buffer& o = in_place ? in : out;
        for (int64_t i = 0; i < count; ++i) {
          expect(o, i, Value(static_cast<int>(i / block), rank_ * block + i % block));
        }
        break;
      }
      case Op::kSendRecv:
        for (int64_t i = 0; i < count; ++i) expect(out, i, Value((rank_ + n_ - 1) % n_, i));
        break;
    }
    return wrong;
  }

  // Mean microseconds per op over `iters` back-to-back ops (issued, then all waited).
  // The warm-up ops are issued the same way, so the timed ones find what they reuse
  // (staging segments) already made.
  // `blocking`: each op is waited for before the next is issued.
  absl::StatusOr<double> Time(Buffer& in, Buffer& out, int64_t count, bool in_place, int warmup, int iters,
                              bool blocking) {
    const auto run = [&](int ops) {
      if (!blocking) return Batch(in, out, count, in_place, ops);
      for (int i = 0; i < ops; ++i) {
        if (absl::Status s = Batch(in, out, count, in_place, 1); !s.ok()) return s;
      }
      return absl::OkStatus();
    };
    if (absl::Status s = run(warmup); !s.ok()) return s;
    if (absl::Status s = Wait(pg_->Barrier()); !s.ok()) return s;
    auto start = std::chrono::steady_clock::now();
    if (absl::Status s = run(iters); !s.ok()) return s;
    std::chrono::duration<double, std::micro> elapsed = std::chrono::steady_clock::now() - start;
    return elapsed.count() / iters;
  }

  // How the sidecars ran the last timed op (Work::Algorithm).
  const std::string& algorithm() const { return algorithm_; }

 private:
  // Issues `ops` ops back to back, then waits for them all; the last one's algorithm is
  // kept.
  absl::Status Batch(Buffer& in, Buffer& out, int64_t count, bool in_place, int ops) {
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < ops; ++i) works.push_back(Issue(in, out, count, in_place));
    for (auto& w : works) {
      if (absl::Status s = Wait(w); !s.ok()) return s;
    }
    if (!works.empty()) algorithm_ = works.back()->Algorithm();
    return absl::OkStatus();
  }

  char* Block(Buffer& b, int64_t element) const { return b.data() + element * Buffer::Size(dtype_); }

  absl::Status Wait(const std::shared_ptr<Work>& w) {
    absl::Status s = w->Wait();
    for (auto& send : pending_sends_) {
      if (absl::Status t = send->Wait(); s.ok() && !t.ok()) s = t;
    }
    pending_sends_.clear();
    return s;
  }

  ProcessGroup* pg_;
  Op op_;
  DataType dtype_;
  int root_;
  int rank_;
  int n_;
  std::vector<std::shared_ptr<Work>> pending_sends_;
  std::string algorithm_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("collserve-perf: nccl-tests-style collective benchmark over collserve");
  absl::ParseCommandLine(argc, argv);
  int64_t min_bytes = 0, max_bytes = 0;
  if (!ParseBytes(absl::GetFlag(FLAGS_b), &min_bytes) || !ParseBytes(absl::GetFlag(FLAGS_e), &max_bytes) ||
      min_bytes > max_bytes || absl::GetFlag(FLAGS_f) < 2 || absl::GetFlag(FLAGS_n) < 1 || absl::GetFlag(FLAGS_w) < 0) {
    std::fprintf(stderr, "collserve-perf: need 0 <= -b <= -e, -f >= 2, -n >= 1, -w >= 0\n");
    return 2;
  }
  const OpInfo* info = nullptr;
  for (const OpInfo& o : kOps) {
    if (absl::GetFlag(FLAGS_o) == o.name) info = &o;
  }
  const std::string type = absl::GetFlag(FLAGS_d);
  DataType dtype = type == "float" ? DataType::kFloat32 : type == "double" ? DataType::kFloat64
                   : type == "int32" ? DataType::kInt32 : type == "int64" ? DataType::kInt64 : DataType{};
  if (info == nullptr || dtype == DataType{}) {
    std::fprintf(stderr, "collserve-perf: unknown -o %s or -d %s (see --help)\n", absl::GetFlag(FLAGS_o).c_str(),
                 type.c_str());
    return 2;
  }
  auto options = collserve::client::InitOptions::FromEnv();
  if (!options.ok()) {
    std::fprintf(stderr, "collserve-perf: %s\n", options.status().ToString().c_str());
    return 2;
  }
  if (!absl::GetFlag(FLAGS_backend).empty()) options->backend = absl::GetFlag(FLAGS_backend);
  auto pg = collserve::client::InitProcessGroup(*options);
  if (!pg.ok()) {
    std::fprintf(stderr, "collserve-perf: init: %s\n", pg.status().ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_device) == "cuda") {
#ifdef COLLSERVE_PERF_CUDA
    return collserve_perf::RunCuda(pg->get(), info->name, min_bytes, max_bytes, absl::GetFlag(FLAGS_f),
                                   absl::GetFlag(FLAGS_n), absl::GetFlag(FLAGS_w), absl::GetFlag(FLAGS_c) != 0,
                                   absl::GetFlag(FLAGS_nccl));
#else
    std::fprintf(stderr, "collserve-perf: this build has no CUDA (COLLSERVE_WITH_CUDA)\n");
    return 2;
#endif
  } else if (absl::GetFlag(FLAGS_device) != "cpu") {
    std::fprintf(stderr, "collserve-perf: --device must be cpu or cuda\n");
    return 2;
  }
  const int rank = (*pg)->GetRank(), n = (*pg)->GetWorldSize();
  const bool root_op = info->op == Op::kBroadcast || info->op == Op::kReduce;
  const int root = root_op ? absl::GetFlag(FLAGS_r) : -1;
  Bench bench(pg->get(), info->op, dtype, std::max(root, 0));
  // Sums over ranks through the group itself (a double per value).
  auto sum = [&](double v) -> double {
    std::vector<double> x{v};
    absl::Status s = (*pg)->AllReduce(x.data(), 1, DataType::kFloat64, ReduceOp::kSum)->Wait();
    return s.ok() ? x[0] : std::nan("");
  };
  if (rank == 0) {
    std::printf(
        "# collserve-perf: %s, %s, %d ranks on %d host(s) (%d on this one), -n %d -w %d -c %d -z %d -m %s, backend %s\n",
        info->name, type.c_str(), n, (*pg)->num_hosts(), (*pg)->local_world_size(), absl::GetFlag(FLAGS_n),
        absl::GetFlag(FLAGS_w), absl::GetFlag(FLAGS_c), absl::GetFlag(FLAGS_z), absl::GetFlag(FLAGS_m).c_str(),
        options->backend.empty() ? "default" : options->backend.c_str());
    std::printf("#%62s%32s\n", "out-of-place", "in-place");
    std::printf("#%11s %12s %8s %6s %6s %8s %7s %7s %6s %8s %7s %7s %6s  %s\n", "size", "count", "type", "redop",
                "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "algorithm");
    std::printf("#%11s %12s %8s %6s %6s %8s %7s %7s %6s %8s %7s %7s %6s\n", "(B)", "(elements)", "", "", "", "(us)",
                "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
  }
  const std::string memory = absl::GetFlag(FLAGS_m);
  if (memory != "arena" && memory != "heap") {
    std::fprintf(stderr, "collserve-perf: -m must be arena or heap, not %s\n", memory.c_str());
    return 2;
  }
  const bool reduces = info->op == Op::kAllReduce || info->op == Op::kReduce || info->op == Op::kReduceScatter;
  int64_t total_wrong = 0;
  double busbw_sum = 0;
  int busbw_count = 0;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes = std::max<int64_t>(bytes * absl::GetFlag(FLAGS_f), 1)) {
    const int64_t count = bench.Count(bytes);
    const int64_t size = count * static_cast<int64_t>(Buffer::Size(dtype));
    auto in_buf = Buffer::Make(dtype, count, pg->get(), memory == "arena");
    auto out_buf = Buffer::Make(dtype, count, pg->get(), memory == "arena");
    if (!in_buf.ok() || !out_buf.ok()) {
      std::fprintf(stderr, "collserve-perf: rank %d: allocating: %s\n", rank,
                   (in_buf.ok() ? out_buf.status() : in_buf.status()).ToString().c_str());
      return 1;
    }
    Buffer& in = **in_buf;
    Buffer& out = **out_buf;
    std::string columns;
    for (bool in_place : {false, true}) {
      if (!(in_place ? info->in_place : info->out_of_place)) {
        columns += absl::StrFormat(" %8s %7s %7s %6s", "N/A", "N/A", "N/A", "N/A");
        continue;
      }
      int64_t wrong = 0;
      if (absl::GetFlag(FLAGS_c)) {
        auto w = bench.Check(in, out, count, in_place);
        if (!w.ok()) {
          std::fprintf(stderr, "collserve-perf: rank %d: %s\n", rank, w.status().ToString().c_str());
          return 1;
        }
        wrong = static_cast<int64_t>(sum(static_cast<double>(*w)));
        total_wrong += wrong;
      }
      auto us = bench.Time(in, out, count, in_place, absl::GetFlag(FLAGS_w), absl::GetFlag(FLAGS_n),
                           absl::GetFlag(FLAGS_z) != 0);
      if (!us.ok()) {
        std::fprintf(stderr, "collserve-perf: rank %d: %s\n", rank, us.status().ToString().c_str());
        return 1;
      }
      const double mean_us = sum(*us) / n;
      const double algbw = size / (mean_us * 1e3);  // bytes / ns = GB/s
      const double busbw = algbw * BusFactor(info->op, n);
      busbw_sum += busbw;
      ++busbw_count;
      columns += absl::StrFormat(" %8.1f %7.3f %7.3f %6s", mean_us, algbw, busbw,
                                 absl::GetFlag(FLAGS_c) ? absl::StrCat(wrong) : std::string("N/A"));
    }
    if (rank == 0) {
      std::printf(" %11lld %12lld %8s %6s %6d%s  %s\n", static_cast<long long>(size), static_cast<long long>(count),
                  type.c_str(), reduces ? "sum" : "none", root, columns.c_str(),
                  bench.algorithm().empty() ? "-" : bench.algorithm().c_str());
      std::fflush(stdout);
    }
    if (bytes == 0) break;
  }
  if (rank == 0) {
    std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong), total_wrong ? "FAILED" : "OK");
    std::printf("# Avg bus bandwidth    : %g\n#\n", busbw_count ? busbw_sum / busbw_count : 0.0);
  }
  absl::Status s = (*pg)->Barrier()->Wait();
  return total_wrong == 0 && s.ok() ? 0 : 1;
}
