// collserve_surface_rank: one rank of the collective-surface tests (surface_test.cc), run
// as its own process with the env:// variables. Every check compares against a reference
// computed from every rank's deterministic input, and prints what is wrong.
//
// Modes:
//   collectives  every collective x every dtype, uneven and zero sizes; prints
//                "collectives done: <n> checked, <w> wrong".
//   examples     the reference texts' examples: the before/after tables of all_reduce,
//                broadcast, all_gather and reduce_scatter (distributed_training_overview.md),
//                the blocking and non-blocking send/recv examples and the isend/recv ring
//                all-reduce (dist_tuto_writing_distributed_applications.md); prints
//                "examples done: <w> wrong".
//   p2p          tags, any-source, ordering, batch_isend_irecv, size mismatch, timeouts.
//   groups       new_group: disjoint subgroups at once, ranks outside doing other work,
//                rank translation, destroy.
//   desync       the last rank differs in --kind (op, root, dtype, reduce_op, count);
//                prints "status: <code>: <message>".
//   monitored    the last rank skips a monitored_barrier(--timeout_ms, wait_all_ranks);
//                prints "status: <code>: <message>".
//   p2p_after_leave  the ranks in --leavers leave at once (their group ends with this process);
//                the others pass a ring of point-to-point messages among themselves for
//                --iters rounds (4096 int64 each, checked) while and after they leave: a
//                pipeline whose first stage finished first; prints "p2p_after_leave done:
//                <n> checked, <w> wrong".
//   big_broadcast --big_broadcast_bytes broadcasts of ordinary float32 vectors from every root, one waited
//                for at once and three back to back (the SDK's pipelined broadcast: the root
//                copies after its request); prints "big_broadcast done: <n> checked, <w> wrong".
// Exit codes: 0 ok, 1 wrong result, 2 usage, 3 an operation failed unexpectedly.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "backends/reduce.h"
#include "collserve/client.h"

ABSL_FLAG(std::string, mode, "collectives", "see the file comment");
ABSL_FLAG(std::string, kind, "count", "desync: op | root | dtype | reduce_op | count");
ABSL_FLAG(int64_t, timeout_ms, 2000, "monitored: the barrier's timeout");
ABSL_FLAG(bool, wait_all_ranks, true, "monitored: name every missing rank");
ABSL_FLAG(int, skip, 1, "monitored: how many of the last ranks skip the barrier");
ABSL_FLAG(std::string, leavers, "", "p2p_after_leave: comma-separated ranks that leave at once");
ABSL_FLAG(int, iters, 200, "p2p_after_leave: rounds of the survivors' ring");
ABSL_FLAG(bool, arena, false,
          "collectives: every other tensor lives in the group's shared-memory arena "
          "(ProcessGroup::AllocateShared), so zero-copy and copied tensors meet in one call");
ABSL_FLAG(int64_t, big_broadcast_bytes, int64_t{8} << 20,
          "big_broadcast: bytes of each broadcast (a multiple of 4; above the SDK's "
          "kPipelinedBroadcastMinBytes, 1 MiB, for the pipelined broadcast)");

namespace {

using collserve::DataType;
using collserve::ReduceOp;
using collserve::client::ProcessGroup;
using collserve::client::Work;

const DataType kAllDtypes[] = {DataType::kFloat32, DataType::kFloat64,  DataType::kInt32,
                               DataType::kInt64,   DataType::kFloat16,  DataType::kBFloat16,
                               DataType::kInt8,    DataType::kUInt8,    DataType::kBool};

std::string Name(DataType d) { return std::string(collserve::DataTypeName(d)); }
std::string StatusLine(const absl::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
}

// With --arena: the group tensors are allocated from (every other one), and a count.
ProcessGroup* g_arena_pg = nullptr;
int64_t g_tensors = 0;
int64_t g_arena_tensors = 0;

// A tensor of any dtype, read and written as double (values here are small integers or
// halves, exact in every dtype). With --arena every other one is a SharedBuffer.
struct Tensor {
  DataType dtype;
  std::vector<char> heap;
  std::shared_ptr<collserve::client::SharedBuffer> shared;
  char* base;
  size_t nbytes;
  Tensor(DataType d, size_t n) : dtype(d), nbytes(n * collserve::ElementSize(d) + 1) {
    if (g_arena_pg != nullptr && g_tensors++ % 2 == 0) {
      auto b = g_arena_pg->AllocateShared(nbytes);
      if (!b.ok()) {
        std::printf("AllocateShared(%zu): %s\n", nbytes, std::string(b.status().message()).c_str());
        std::exit(3);
      }
      shared = std::move(*b);
      base = static_cast<char*>(shared->data());
      ++g_arena_tensors;
    } else {
      heap.assign(nbytes, 0);
      base = heap.data();
    }
  }
  Tensor(Tensor&& o) noexcept
      : dtype(o.dtype), heap(std::move(o.heap)), shared(std::move(o.shared)), base(o.base), nbytes(o.nbytes) {
    if (shared == nullptr) base = heap.data();
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  size_t size() const { return (nbytes - 1) / collserve::ElementSize(dtype); }
  void* data() { return base; }
  double Get(size_t i) const {
    const char* p = base + i * collserve::ElementSize(dtype);
    switch (dtype) {
      case DataType::kFloat32: { float v; std::memcpy(&v, p, 4); return v; }
      case DataType::kFloat64: { double v; std::memcpy(&v, p, 8); return v; }
      case DataType::kInt32: { int32_t v; std::memcpy(&v, p, 4); return v; }
      case DataType::kInt64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
      case DataType::kFloat16: { uint16_t v; std::memcpy(&v, p, 2); return collserve::backends::HalfToFloat(v); }
      case DataType::kBFloat16: { uint16_t v; std::memcpy(&v, p, 2); return collserve::backends::BFloat16ToFloat(v); }
      case DataType::kInt8: return static_cast<int8_t>(*p);
      case DataType::kUInt8: return static_cast<uint8_t>(*p);
      case DataType::kBool: return *p != 0 ? 1 : 0;
    }
    return 0;
  }
  void Set(size_t i, double x) {
    char* p = base + i * collserve::ElementSize(dtype);
    switch (dtype) {
      case DataType::kFloat32: { float v = static_cast<float>(x); std::memcpy(p, &v, 4); return; }
      case DataType::kFloat64: std::memcpy(p, &x, 8); return;
      case DataType::kInt32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p, &v, 4); return; }
      case DataType::kInt64: { int64_t v = static_cast<int64_t>(x); std::memcpy(p, &v, 8); return; }
      case DataType::kFloat16: {
        uint16_t v = collserve::backends::FloatToHalf(static_cast<float>(x));
        std::memcpy(p, &v, 2);
        return;
      }
      case DataType::kBFloat16: {
        uint16_t v = collserve::backends::FloatToBFloat16(static_cast<float>(x));
        std::memcpy(p, &v, 2);
        return;
      }
      case DataType::kInt8: *p = static_cast<char>(static_cast<int8_t>(x)); return;
      case DataType::kUInt8: *p = static_cast<char>(static_cast<uint8_t>(x)); return;
      case DataType::kBool: *p = x != 0 ? 1 : 0; return;
    }
  }
};

// Rank r's element i of input `salt`: a small integer (0/1 for bool; 1/2 for PRODUCT).
double Val(DataType d, int rank, size_t i, int salt, ReduceOp op = ReduceOp::kSum) {
  const uint64_t h = (static_cast<uint64_t>(rank) * 1000003u + i * 7919u + static_cast<uint64_t>(salt) * 104729u) %
                     1000000007u;
  if (d == DataType::kBool) return static_cast<double>(h % 2);
  if (op == ReduceOp::kProduct) return static_cast<double>(1 + h % 2);
  return static_cast<double>(h % 8);
}

double Combine(DataType d, ReduceOp op, double a, double b) {
  if (d == DataType::kBool) {
    switch (op) {
      case ReduceOp::kProduct: case ReduceOp::kMin: case ReduceOp::kBand: return std::min(a, b);
      case ReduceOp::kBxor: return a != b ? 1 : 0;
      default: return std::max(a, b);
    }
  }
  const int64_t x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
  switch (op) {
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
    case ReduceOp::kBand: return static_cast<double>(x & y);
    case ReduceOp::kBor: return static_cast<double>(x | y);
    case ReduceOp::kBxor: return static_cast<double>(x ^ y);
    default: return a + b;
  }
}

// The value `x` as stored in dtype `d` (rounding, truncation).
double AsDtype(DataType d, double x) {
  Tensor t(d, 1);
  t.Set(0, x);
  return t.Get(0);
}

struct Checker {
  ProcessGroup& pg;
  int64_t checked = 0;
  int64_t wrong = 0;
  bool failed = false;

  // Waits for `work`; on error prints it and counts the check as wrong.
  bool Ok(const std::shared_ptr<Work>& work, const std::string& what) {
    absl::Status s = work->Wait();
    ++checked;
    if (!s.ok()) {
      std::printf("rank %d: %s failed: %s\n", pg.GetRank(), what.c_str(), StatusLine(s).c_str());
      ++wrong;
      failed = true;
      return false;
    }
    return true;
  }
  // Counts a check; prints `what` if it failed.
  void Expect(bool ok, const std::string& what) {
    ++checked;
    if (!ok) {
      std::printf("rank %d: %s\n", pg.GetRank(), what.c_str());
      ++wrong;
    }
  }
  void Expect(const Tensor& t, size_t i, double want, const std::string& what) {
    const double got = t.Get(i);
    const double w = AsDtype(t.dtype, want);
    const double tol = (t.dtype == DataType::kFloat16 || t.dtype == DataType::kBFloat16) ? 1e-2 * std::max(1.0, std::fabs(w)) : 1e-9;
    if (std::fabs(got - w) > tol) {
      if (wrong < 10) std::printf("rank %d: %s [%zu] = %g, want %g\n", pg.GetRank(), what.c_str(), i, got, w);
      ++wrong;
    }
  }
};

std::vector<ReduceOp> OpsFor(DataType d) {
  std::vector<ReduceOp> ops;
  for (int v = 1; v <= 9; ++v) {
    if (collserve::ValidateReduce(d, static_cast<ReduceOp>(v)).ok()) ops.push_back(static_cast<ReduceOp>(v));
  }
  return ops;
}

void CheckCollectives(Checker& c, DataType d) {
  ProcessGroup& pg = c.pg;
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  const std::string dn = Name(d);
  int salt = 0;
  for (size_t n : {size_t{0}, size_t{1}, size_t{37}}) {
    // all_reduce and reduce, every op defined for the dtype.
    for (ReduceOp op : OpsFor(d)) {
      ++salt;
      const double factor = 0.5 * (rank + 1);
      collserve::client::ReduceOpArg arg =
          op == ReduceOp::kPremulSum ? collserve::client::MakePremulSum(factor) : collserve::client::ReduceOpArg(op);
      for (int reduce_root : {-1, world - 1}) {
        Tensor t(d, n);
        for (size_t i = 0; i < n; ++i) t.Set(i, Val(d, rank, i, salt, op));
        const std::string what = absl::StrCat(reduce_root < 0 ? "all_reduce(" : "reduce(", dn, ", ",
                                              collserve::ReduceOpName(op), ", n=", n, ")");
        auto w = reduce_root < 0 ? pg.AllReduce(t.data(), n, d, arg) : pg.Reduce(t.data(), n, d, arg, reduce_root);
        if (!c.Ok(w, what)) continue;
        for (size_t i = 0; i < n; ++i) {
          if (reduce_root >= 0 && rank != reduce_root) {
            c.Expect(t, i, Val(d, rank, i, salt, op), what + " (non-root unchanged)");
            continue;
          }
          double want = 0;
          for (int r = 0; r < world; ++r) {
            const double v = Val(d, r, i, salt, op);
            if (op == ReduceOp::kPremulSum) {
              want += v * 0.5 * (r + 1);
            } else {
              want = r == 0 ? v : Combine(d, op, want, v);
            }
          }
          if (op == ReduceOp::kAvg) {
            want = collserve::IsFloatingPoint(d) ? want / world : std::trunc(want / world);
          }
          c.Expect(t, i, want, what);
        }
      }
    }
    ++salt;
    // broadcast from every root.
    for (int root = 0; root < world; ++root) {
      Tensor t(d, n);
      for (size_t i = 0; i < n; ++i) t.Set(i, Val(d, rank, i, salt));
      const std::string what = absl::StrCat("broadcast(", dn, ", n=", n, ", root=", root, ")");
      if (!c.Ok(pg.Broadcast(t.data(), n, d, root), what)) continue;
      for (size_t i = 0; i < n; ++i) c.Expect(t, i, Val(d, root, i, salt), what);
    }
    // Uneven per-rank sizes: rank r contributes (n + r) % (n + 1) elements (rank 0: n,
    // and with n == 0 every rank contributes nothing).
    auto size_of = [n](int r) { return static_cast<int64_t>((n + static_cast<size_t>(r)) % (n + 1)); };
    std::vector<int64_t> sizes(world);
    for (int r = 0; r < world; ++r) sizes[r] = size_of(r);
    // all_gather (list form, uneven) and all_gather_into_tensor.
    {
      Tensor in(d, sizes[rank]);
      for (int64_t i = 0; i < sizes[rank]; ++i) in.Set(i, Val(d, rank, i, salt));
      std::vector<Tensor> outs;
      std::vector<void*> ptrs;
      for (int r = 0; r < world; ++r) outs.emplace_back(d, sizes[r]);
      for (Tensor& o : outs) ptrs.push_back(o.data());
      const std::string what = absl::StrCat("all_gather(", dn, ", sizes=[", absl::StrJoin(sizes, ","), "])");
      if (c.Ok(pg.AllGather(ptrs, sizes, in.data(), sizes[rank], d), what)) {
        for (int r = 0; r < world; ++r) {
          for (int64_t i = 0; i < sizes[r]; ++i) c.Expect(outs[r], i, Val(d, r, i, salt), what);
        }
      }
      Tensor in2(d, n), out2(d, n * world);
      for (size_t i = 0; i < n; ++i) in2.Set(i, Val(d, rank, i, salt + 1));
      const std::string what2 = absl::StrCat("all_gather_into_tensor(", dn, ", n=", n, ")");
      if (c.Ok(pg.AllGatherIntoTensor(out2.data(), in2.data(), n, d), what2)) {
        for (int r = 0; r < world; ++r) {
          for (size_t i = 0; i < n; ++i) c.Expect(out2, r * n + i, Val(d, r, i, salt + 1), what2);
        }
        for (size_t i = 0; i < n; ++i) c.Expect(in2, i, Val(d, rank, i, salt + 1), what2 + " input kept");
      }
      // In place, as torch's FSDP lays it out: the input is this rank's own piece of the
      // output (in the arena both go by reference: the sidecar never writes that piece).
      Tensor out3(d, n * world);
      for (size_t i = 0; i < n; ++i) out3.Set(static_cast<size_t>(rank) * n + i, Val(d, rank, i, salt + 2));
      char* own = out3.base + static_cast<size_t>(rank) * n * collserve::ElementSize(d);
      const std::string what3 = absl::StrCat("all_gather_into_tensor in place(", dn, ", n=", n, ")");
      if (c.Ok(pg.AllGatherIntoTensor(out3.data(), own, n, d), what3)) {
        for (int r = 0; r < world; ++r) {
          for (size_t i = 0; i < n; ++i) c.Expect(out3, r * n + i, Val(d, r, i, salt + 2), what3);
        }
      }
    }
    // gather and scatter (uneven) to/from every root.
    for (int root = 0; root < world; ++root) {
      Tensor in(d, sizes[rank]);
      for (int64_t i = 0; i < sizes[rank]; ++i) in.Set(i, Val(d, rank, i, salt + root));
      std::vector<Tensor> outs;
      std::vector<void*> ptrs;
      std::vector<int64_t> counts;
      if (rank == root) {
        for (int r = 0; r < world; ++r) outs.emplace_back(d, sizes[r]);
        for (Tensor& o : outs) ptrs.push_back(o.data());
        counts = sizes;
      }
      const std::string what = absl::StrCat("gather(", dn, ", root=", root, ", sizes=[", absl::StrJoin(sizes, ","), "])");
      if (c.Ok(pg.Gather(in.data(), sizes[rank], ptrs, counts, d, root), what) && rank == root) {
        for (int r = 0; r < world; ++r) {
          for (int64_t i = 0; i < sizes[r]; ++i) c.Expect(outs[r], i, Val(d, r, i, salt + root), what);
        }
      }
      // scatter: the root's piece r for rank r is Val(root-independent r, i).
      std::vector<Tensor> pieces;
      std::vector<const void*> cptrs;
      if (rank == root) {
        for (int r = 0; r < world; ++r) {
          pieces.emplace_back(d, sizes[r]);
          for (int64_t i = 0; i < sizes[r]; ++i) pieces.back().Set(i, Val(d, r + 100, i, salt + root));
        }
        for (Tensor& p : pieces) cptrs.push_back(p.data());
      }
      Tensor out(d, sizes[rank]);
      const std::string what2 = absl::StrCat("scatter(", dn, ", root=", root, ")");
      if (c.Ok(pg.Scatter(out.data(), sizes[rank], cptrs, counts, d, root), what2)) {
        for (int64_t i = 0; i < sizes[rank]; ++i) c.Expect(out, i, Val(d, rank + 100, i, salt + root), what2);
      }
    }
    // reduce_scatter: list form (uneven pieces) and tensor form, SUM (MAX for bool: same).
    {
      const ReduceOp op = ReduceOp::kSum;
      std::vector<Tensor> ins;
      std::vector<const void*> cptrs;
      for (int r = 0; r < world; ++r) {
        ins.emplace_back(d, sizes[r]);
        for (int64_t i = 0; i < sizes[r]; ++i) ins.back().Set(i, Val(d, rank, i, salt + 7 * r));
      }
      for (Tensor& t : ins) cptrs.push_back(t.data());
      Tensor out(d, sizes[rank]);
      const std::string what = absl::StrCat("reduce_scatter(", dn, ", sizes=[", absl::StrJoin(sizes, ","), "])");
      if (c.Ok(pg.ReduceScatter(out.data(), sizes[rank], cptrs, sizes, d, op), what)) {
        for (int64_t i = 0; i < sizes[rank]; ++i) {
          double want = 0;
          for (int r = 0; r < world; ++r) {
            const double v = Val(d, r, i, salt + 7 * rank);
            want = r == 0 ? v : Combine(d, op, want, v);
          }
          c.Expect(out, i, want, what);
        }
      }
      Tensor in2(d, n * world), out2(d, n);
      for (size_t i = 0; i < n * world; ++i) in2.Set(i, Val(d, rank, i, salt + 3));
      const std::string what2 = absl::StrCat("reduce_scatter_tensor(", dn, ", n=", n, ")");
      if (c.Ok(pg.ReduceScatterTensor(out2.data(), in2.data(), n, d, op), what2)) {
        for (size_t i = 0; i < n; ++i) {
          double want = 0;
          for (int r = 0; r < world; ++r) {
            const double v = Val(d, r, rank * n + i, salt + 3);
            want = r == 0 ? v : Combine(d, op, want, v);
          }
          c.Expect(out2, i, want, what2);
        }
        // Inputs are only read (an arena input is the caller's own memory).
        for (size_t i = 0; i < n * world; ++i) c.Expect(in2, i, Val(d, rank, i, salt + 3), what2 + " input kept");
      }
    }
    // all_to_all (list form): rank i sends (i + j + n) % (n + 2) elements to rank j; and
    // all_to_all_single with the same splits.
    {
      auto split = [n](int i, int j) { return static_cast<int64_t>((static_cast<size_t>(i + j) + n) % (n + 2)); };
      std::vector<int64_t> in_counts(world), out_counts(world);
      std::vector<Tensor> ins, outs;
      std::vector<const void*> cptrs;
      std::vector<void*> ptrs;
      for (int j = 0; j < world; ++j) {
        in_counts[j] = split(rank, j);
        out_counts[j] = split(j, rank);
        ins.emplace_back(d, in_counts[j]);
        for (int64_t e = 0; e < in_counts[j]; ++e) ins.back().Set(e, Val(d, rank * 10 + j, e, salt));
        outs.emplace_back(d, out_counts[j]);
      }
      for (Tensor& t : ins) cptrs.push_back(t.data());
      for (Tensor& t : outs) ptrs.push_back(t.data());
      const std::string what = absl::StrCat("all_to_all(", dn, ", n=", n, ")");
      if (c.Ok(pg.AllToAll(ptrs, out_counts, cptrs, in_counts, d), what)) {
        for (int j = 0; j < world; ++j) {
          for (int64_t e = 0; e < out_counts[j]; ++e) c.Expect(outs[j], e, Val(d, j * 10 + rank, e, salt), what);
        }
      }
      int64_t in_total = 0, out_total = 0;
      for (int j = 0; j < world; ++j) in_total += in_counts[j], out_total += out_counts[j];
      Tensor in1(d, in_total), out1(d, out_total);
      int64_t off = 0;
      for (int j = 0; j < world; ++j) {
        for (int64_t e = 0; e < in_counts[j]; ++e) in1.Set(off + e, Val(d, rank * 10 + j, e, salt + 1));
        off += in_counts[j];
      }
      const std::string what2 = absl::StrCat("all_to_all_single(", dn, ", n=", n, ")");
      if (c.Ok(pg.AllToAllSingle(out1.data(), out_total, in1.data(), in_total, out_counts, in_counts, d), what2)) {
        off = 0;
        for (int j = 0; j < world; ++j) {
          for (int64_t e = 0; e < out_counts[j]; ++e) c.Expect(out1, off + e, Val(d, j * 10 + rank, e, salt + 1), what2);
          off += out_counts[j];
        }
        off = 0;
        for (int j = 0; j < world; ++j) {
          for (int64_t e = 0; e < in_counts[j]; ++e) c.Expect(in1, off + e, Val(d, rank * 10 + j, e, salt + 1), what2 + " input kept");
          off += in_counts[j];
        }
      }
      // Even splits (no split sizes given).
      Tensor in3(d, n * world), out3(d, n * world);
      for (size_t e = 0; e < n * world; ++e) in3.Set(e, Val(d, rank, e, salt + 2));
      const std::string what3 = absl::StrCat("all_to_all_single(", dn, ", even, n=", n, ")");
      if (c.Ok(pg.AllToAllSingle(out3.data(), n * world, in3.data(), n * world, {}, {}, d), what3)) {
        for (int j = 0; j < world; ++j) {
          for (size_t e = 0; e < n; ++e) c.Expect(out3, j * n + e, Val(d, j, rank * n + e, salt + 2), what3);
        }
      }
    }
    salt += 10;
  }
}

int Collectives(ProcessGroup& pg) {
  Checker c{pg};
  for (DataType d : kAllDtypes) CheckCollectives(c, d);
  // Barriers complete on every rank (their ordering is covered by the broadcast test).
  c.Ok(pg.Barrier(), "barrier");
  c.Ok(pg.MonitoredBarrier(absl::Seconds(30), true), "monitored_barrier");
  if (g_arena_pg != nullptr) {
    std::printf("arena tensors: %lld of %lld\n", static_cast<long long>(g_arena_tensors),
                static_cast<long long>(g_tensors));
  }
  std::printf("collectives done: %lld checked, %lld wrong\n", static_cast<long long>(c.checked),
              static_cast<long long>(c.wrong));
  return c.wrong == 0 ? 0 : 1;
}

int Examples(ProcessGroup& pg) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  Checker c{pg};
  auto expect_vec = [&](const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
    ++c.checked;
    if (got != want) {
      std::printf("rank %d: %s: got [%s], want [%s]\n", rank, what.c_str(), absl::StrJoin(got, ", ").c_str(),
                  absl::StrJoin(want, ", ").c_str());
      ++c.wrong;
    }
  };
  // all_reduce: rank r has [1 + 2r, 2 + 2r]; after SUM every rank has the column sums
  // ([4, 6] for two ranks).
  {
    std::vector<int64_t> t = {1 + 2 * rank, 2 + 2 * rank};
    if (c.Ok(pg.AllReduce(t), "all_reduce example")) {
      double a = 0, b = 0;
      for (int r = 0; r < world; ++r) a += 1 + 2 * r, b += 2 + 2 * r;
      expect_vec({static_cast<double>(t[0]), static_cast<double>(t[1])}, {a, b}, "all_reduce example");
    }
  }
  // broadcast: rank 0 has [1, 2, 3, 4], the others zeros; after, all have [1, 2, 3, 4].
  {
    std::vector<float> t = rank == 0 ? std::vector<float>{1, 2, 3, 4} : std::vector<float>(4, 0.0f);
    if (c.Ok(pg.Broadcast(t, 0), "broadcast example")) {
      expect_vec(std::vector<double>(t.begin(), t.end()), {1, 2, 3, 4}, "broadcast example");
    }
  }
  // all_gather: rank r has [1 + 2r, 2 + 2r]; every rank gets [[1, 2], [3, 4], ...].
  {
    std::vector<int64_t> t = {1 + 2 * rank, 2 + 2 * rank};
    std::vector<std::vector<int64_t>> list(world, std::vector<int64_t>(2, 0));
    std::vector<void*> ptrs;
    for (auto& v : list) ptrs.push_back(v.data());
    if (c.Ok(pg.AllGather(ptrs, std::vector<int64_t>(world, 2), t.data(), 2, DataType::kInt64), "all_gather example")) {
      for (int r = 0; r < world; ++r) {
        expect_vec({static_cast<double>(list[r][0]), static_cast<double>(list[r][1])},
                   {1.0 + 2 * r, 2.0 + 2 * r}, absl::StrCat("all_gather example [", r, "]"));
      }
    }
  }
  // reduce_scatter: input_list = [[1, 2], [3, 4], ...] on every rank; rank r gets
  // world * [1 + 2r, 2 + 2r] ([2, 4] and [6, 8] for two ranks).
  {
    std::vector<std::vector<int64_t>> inputs;
    for (int k = 0; k < world; ++k) inputs.push_back({1 + 2 * k, 2 + 2 * k});
    std::vector<const void*> ptrs;
    for (auto& v : inputs) ptrs.push_back(v.data());
    std::vector<int64_t> out(2, 0);
    if (c.Ok(pg.ReduceScatter(out.data(), 2, ptrs, std::vector<int64_t>(world, 2), DataType::kInt64),
             "reduce_scatter example")) {
      expect_vec({static_cast<double>(out[0]), static_cast<double>(out[1])},
                 {static_cast<double>(world * (1 + 2 * rank)), static_cast<double>(world * (2 + 2 * rank))},
                 "reduce_scatter example");
    }
  }
  // Blocking point-to-point: rank 0 sends zeros(1) + 1 to rank 1 (the others idle).
  if (rank <= 1) {
    std::vector<float> t = {0.0f};
    if (rank == 0) {
      t[0] += 1;
      c.Ok(pg.Send(t.data(), 1, DataType::kFloat32, 1), "blocking send example");
    } else if (c.Ok(pg.Recv(t.data(), 1, DataType::kFloat32, 0), "blocking recv example")) {
      expect_vec({t[0]}, {1.0}, "blocking send/recv example");
    }
    std::printf("Rank %d has data %g\n", rank, t[0]);
  }
  // Non-blocking: isend / irecv, then wait.
  if (rank <= 1) {
    std::vector<float> t = {0.0f};
    std::shared_ptr<Work> req;
    if (rank == 0) {
      t[0] += 1;
      req = pg.Send(t.data(), 1, DataType::kFloat32, 1);
      std::printf("Rank 0 started sending\n");
    } else {
      req = pg.Recv(t.data(), 1, DataType::kFloat32, 0);
      std::printf("Rank 1 started receiving\n");
    }
    if (c.Ok(req, "isend/irecv example")) expect_vec({t[0]}, {1.0}, "isend/irecv example");
  }
  // The tutorial's ring all-reduce with isend / recv.
  {
    const int n = 5;
    std::vector<float> send(n), recv(n);
    for (int i = 0; i < n; ++i) send[i] = static_cast<float>(rank * 10 + i);
    std::vector<float> send_buff = send, recv_buff = send, accum = send;
    const int left = (rank - 1 + world) % world, right = (rank + 1) % world;
    for (int i = 0; i < world - 1; ++i) {
      std::shared_ptr<Work> send_req;
      if (i % 2 == 0) {
        send_req = pg.Send(send_buff.data(), n, DataType::kFloat32, right);
        c.Ok(pg.Recv(recv_buff.data(), n, DataType::kFloat32, left), "ring recv");
        for (int k = 0; k < n; ++k) accum[k] += recv_buff[k];
      } else {
        send_req = pg.Send(recv_buff.data(), n, DataType::kFloat32, right);
        c.Ok(pg.Recv(send_buff.data(), n, DataType::kFloat32, left), "ring recv");
        for (int k = 0; k < n; ++k) accum[k] += send_buff[k];
      }
      c.Ok(send_req, "ring send");
    }
    recv = accum;
    std::vector<double> want(n);
    for (int k = 0; k < n; ++k) {
      for (int r = 0; r < world; ++r) want[k] += r * 10 + k;
    }
    expect_vec(std::vector<double>(recv.begin(), recv.end()), want, "ring all-reduce");
  }
  // The tutorial's collective example: new_group([0, 1]) and all_reduce(ones(1)) in it.
  {
    auto group = pg.NewGroup({0, 1});
    if (!group.ok()) {
      std::printf("rank %d: new_group failed: %s\n", rank, StatusLine(group.status()).c_str());
      ++c.wrong;
    } else if (*group != nullptr) {
      std::vector<float> t = {1.0f};
      if (c.Ok((*group)->AllReduce(t), "subgroup all_reduce example")) expect_vec({t[0]}, {2.0}, "new_group example");
      std::printf("Rank %d has data %g\n", rank, t[0]);
    }
  }
  // Ranks leave together: a rank that ends its session ends the group for the others.
  c.Ok(pg.Barrier(), "final barrier");
  std::printf("examples done: %lld wrong\n", static_cast<long long>(c.wrong));
  return c.wrong == 0 && !c.failed ? 0 : 1;
}

int P2PAfterLeave(ProcessGroup& pg) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  std::set<int> leavers;
  for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_leavers), ',', absl::SkipEmpty())) {
    int v = -1;
    if (!absl::SimpleAtoi(r, &v) || v < 0 || v >= world) {
      std::printf("bad --leavers\n");
      return 2;
    }
    leavers.insert(v);
  }
  if (leavers.count(rank) != 0) {
    std::printf("rank %d leaves\n", rank);
    return 0;  // the group ends with this process: its session ends, the rank leaves
  }
  std::vector<int> ring;
  for (int r = 0; r < world; ++r) {
    if (leavers.count(r) == 0) ring.push_back(r);
  }
  const size_t me = static_cast<size_t>(std::find(ring.begin(), ring.end(), rank) - ring.begin());
  const int next = ring[(me + 1) % ring.size()], prev = ring[(me + ring.size() - 1) % ring.size()];
  Checker c{pg};
  constexpr int64_t kCount = 4096;
  std::vector<int64_t> out(kCount), in(kCount);
  for (int i = 0; i < absl::GetFlag(FLAGS_iters) && !c.failed; ++i) {
    for (int64_t j = 0; j < kCount; ++j) out[static_cast<size_t>(j)] = int64_t{rank} * 1000000007 + i * kCount + j;
    auto sent = pg.Send(out.data(), kCount, DataType::kInt64, next, 7);
    auto got = pg.Recv(in.data(), kCount, DataType::kInt64, prev, 7);
    if (!c.Ok(got, absl::StrCat("recv ", i, " from rank ", prev)) || !c.Ok(sent, absl::StrCat("send ", i, " to rank ", next))) {
      break;
    }
    int64_t bad = 0;
    for (int64_t j = 0; j < kCount; ++j) bad += in[static_cast<size_t>(j)] != int64_t{prev} * 1000000007 + i * kCount + j;
    c.Expect(bad == 0, absl::StrCat("round ", i, ": ", bad, " wrong elements from rank ", prev));
  }
  std::printf("p2p_after_leave done: %lld checked, %lld wrong\n", static_cast<long long>(c.checked),
              static_cast<long long>(c.wrong));
  return c.failed ? 3 : c.wrong == 0 ? 0 : 1;
}

int P2P(ProcessGroup& pg) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  Checker c{pg};
  auto expect = [&](bool ok, const std::string& what) { c.Expect(ok, what); };
  // Any source: every other rank sends its rank to rank 0, which receives from any source
  // and learns the sender; all dtypes' sizes travel (int64 here).
  if (rank == 0) {
    std::vector<bool> seen(world, false);
    for (int k = 1; k < world; ++k) {
      int64_t v = -1;
      auto w = pg.Recv(&v, 1, DataType::kInt64, -1, 5);
      if (!c.Ok(w, "recv any source")) continue;
      expect(w->SourceRank() == v && v > 0 && v < world && !seen[v],
             absl::StrCat("any-source recv got ", v, " from source ", w->SourceRank()));
      if (v > 0 && v < world) seen[v] = true;
    }
  } else {
    int64_t v = rank;
    c.Ok(pg.Send(&v, 1, DataType::kInt64, 0, 5), "send to rank 0");
  }
  // Tags: the last rank sends tag 1 then tag 2 to rank 0; rank 0 receives tag 2 first.
  // Then three messages with one tag arrive in the order sent.
  const int last = world - 1;
  if (world == 1) {
    // no peer
  } else if (rank == last) {
    int32_t a = 111, b = 222;
    auto w1 = pg.Send(&a, 1, DataType::kInt32, 0, 1);
    auto w2 = pg.Send(&b, 1, DataType::kInt32, 0, 2);
    c.Ok(w2, "send tag 2");
    c.Ok(w1, "send tag 1");
    std::vector<std::shared_ptr<Work>> ws;
    std::vector<int32_t> vals = {1, 2, 3};
    for (int32_t& v : vals) ws.push_back(pg.Send(&v, 1, DataType::kInt32, 0, 9));
    for (auto& w : ws) c.Ok(w, "ordered send");
  } else if (rank == 0) {
    int32_t a = 0, b = 0;
    auto w2 = pg.Recv(&b, 1, DataType::kInt32, last, 2);
    c.Ok(w2, "recv tag 2");
    auto w1 = pg.Recv(&a, 1, DataType::kInt32, last, 1);
    c.Ok(w1, "recv tag 1");
    expect(a == 111 && b == 222, absl::StrCat("tags mixed up: tag1=", a, " tag2=", b));
    std::vector<int32_t> got;
    for (int k = 0; k < 3; ++k) {
      int32_t v = 0;
      if (c.Ok(pg.Recv(&v, 1, DataType::kInt32, last, 9), "ordered recv")) got.push_back(v);
    }
    expect(got == std::vector<int32_t>({1, 2, 3}), absl::StrCat("order [", absl::StrJoin(got, ","), "]"));
  }
  // batch_isend_irecv: a ring exchange of 1000 doubles each way.
  {
    const int right = (rank + 1) % world, left = (rank - 1 + world) % world;
    std::vector<double> to_right(1000), from_left(1000, -1), to_left(1000), from_right(1000, -1);
    for (int i = 0; i < 1000; ++i) to_right[i] = rank * 1000 + i, to_left[i] = -(rank * 1000 + i);
    using collserve::client::P2POp;
    std::vector<P2POp> ops = {
        {P2POp::Kind::kSend, to_right.data(), 1000, DataType::kFloat64, right, 3},
        {P2POp::Kind::kRecv, from_left.data(), 1000, DataType::kFloat64, left, 3},
        {P2POp::Kind::kSend, to_left.data(), 1000, DataType::kFloat64, left, 4},
        {P2POp::Kind::kRecv, from_right.data(), 1000, DataType::kFloat64, right, 4},
    };
    if (world == 1) ops.clear();
    for (auto& w : pg.BatchIsendIrecv(ops)) c.Ok(w, "batch_isend_irecv");
    if (world > 1) {
      expect(from_left[999] == left * 1000 + 999 && from_right[7] == -(right * 1000 + 7),
             "batch_isend_irecv data");
    }
  }
  // A size mismatch fails both ends with a clear error; then the pair still works.
  if (rank == 0 && world > 1) {
    std::vector<float> v(8, 1.0f);
    absl::Status s = pg.Send(v.data(), 8, DataType::kFloat32, 1, 7)->Wait();
    const bool local_peer = pg.local_world_size() == pg.GetWorldSize();
    // Across hosts the send completes when the bytes reach the receiving host.
    expect(local_peer ? s.code() == absl::StatusCode::kInvalidArgument : s.ok(), "mismatch send: " + StatusLine(s));
  } else if (rank == 1) {
    std::vector<float> v(4);
    absl::Status s = pg.Recv(v.data(), 4, DataType::kFloat32, 0, 7)->Wait();
    expect(s.code() == absl::StatusCode::kInvalidArgument && s.message().find("sent 8 float32 elements") != std::string::npos &&
               s.message().find("receives 4 float32") != std::string::npos,
           "mismatch recv: " + StatusLine(s));
  }
  // An unmatched recv times out (the op timeout is short in this test) and the group
  // stays usable. Every rank waits for one, so they reach the next collective together.
  {
    int32_t v;
    const int src = rank == 0 ? (world > 1 ? 1 : -1) : 0;
    absl::Status s = pg.Recv(&v, 1, DataType::kInt32, src, 99)->Wait();
    expect(s.code() == absl::StatusCode::kDeadlineExceeded && s.message().find("tag 99") != std::string::npos,
           "unmatched recv: " + StatusLine(s));
  }
  std::vector<int32_t> t = {1};
  if (c.Ok(pg.AllReduce(t), "all_reduce after p2p")) expect(t[0] == world, "all_reduce after p2p");
  std::printf("p2p done: %lld checked, %lld wrong\n", static_cast<long long>(c.checked),
              static_cast<long long>(c.wrong));
  return c.wrong == 0 ? 0 : 1;
}

int Groups(ProcessGroup& pg) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  Checker c{pg};
  auto expect = [&](bool ok, const std::string& what) { c.Expect(ok, what); };
  // Two disjoint subgroups (even and odd ranks), listed in reverse order so group ranks
  // differ from global ranks; every rank calls both NewGroups, in the same order.
  std::vector<int> evens, odds;
  for (int r = world - 1; r >= 0; --r) (r % 2 == 0 ? evens : odds).push_back(r);
  auto even = pg.NewGroup(evens);
  auto odd = odds.empty() ? absl::StatusOr<std::unique_ptr<ProcessGroup>>(nullptr) : pg.NewGroup(odds);
  if (!even.ok() || !odd.ok()) {
    std::printf("rank %d: new_group failed: %s %s\n", rank, even.status().ToString().c_str(),
                odd.status().ToString().c_str());
    return 3;
  }
  ProcessGroup* mine = rank % 2 == 0 ? even->get() : odd->get();
  ProcessGroup* other = rank % 2 == 0 ? odd->get() : even->get();
  expect(mine != nullptr && other == nullptr, "membership");
  const std::vector<int>& members = rank % 2 == 0 ? evens : odds;
  expect(mine->GetProcessGroupRanks() == members, "get_process_group_ranks");
  auto group_rank = mine->GetGroupRank(rank);
  expect(group_rank.ok() && members[*group_rank] == rank && mine->GetRank() == *group_rank, "get_group_rank");
  auto global = mine->GetGlobalRank(mine->GetRank());
  expect(global.ok() && *global == rank, "get_global_rank");
  expect(!mine->GetGroupRank(rank % 2 == 0 ? 1 : 0).ok(), "get_group_rank of a non-member");
  // Both subgroups run 20 all_reduces at the same time; meanwhile ranks also use the
  // world group for point-to-point. Every sum is over the subgroup only.
  std::vector<std::shared_ptr<Work>> works;
  std::vector<std::vector<int64_t>> bufs(20, std::vector<int64_t>(1000));
  for (int k = 0; k < 20; ++k) {
    for (auto& v : bufs[k]) v = rank + k;
    works.push_back(mine->AllReduce(bufs[k]));
  }
  if (world > 1 && rank < 2) {
    // Ranks 0 and 1 (in different subgroups) exchange through the world group meanwhile.
    int64_t v = rank == 0 ? 42 : 0;
    if (rank == 0) c.Ok(pg.Send(&v, 1, DataType::kInt64, 1), "world send during subgroup work");
    else if (c.Ok(pg.Recv(&v, 1, DataType::kInt64, 0), "world recv during subgroup work")) expect(v == 42, "world p2p");
  }
  for (int k = 0; k < 20; ++k) {
    if (!c.Ok(works[k], "subgroup all_reduce")) continue;
    int64_t want = 0;
    for (int r : members) want += r + k;
    expect(bufs[k][0] == want && bufs[k][999] == want, absl::StrCat("subgroup sum ", bufs[k][0], " want ", want));
  }
  // A subgroup of a subset while the others do nothing with it: [0] alone.
  auto solo = pg.NewGroup({0});
  expect(solo.ok() && ((rank == 0) == (*solo != nullptr)), "new_group([0])");
  if (rank == 0 && solo.ok() && *solo != nullptr) {
    std::vector<float> f = {3.0f};
    if (c.Ok((*solo)->AllReduce(f), "solo all_reduce")) expect(f[0] == 3.0f, "solo all_reduce");
  }
  // Bad ranks.
  expect(pg.NewGroup({0, world}).status().code() == absl::StatusCode::kInvalidArgument, "new_group out of range");
  // destroy_process_group of the subgroups, then the world group still works.
  even->reset();
  odd->reset();
  if (solo.ok()) solo->reset();
  c.Ok(pg.Barrier(), "barrier after destroy");
  std::vector<int32_t> t = {1};
  if (c.Ok(pg.AllReduce(t), "world all_reduce after destroy")) expect(t[0] == world, "world sum");
  std::printf("groups done: %lld checked, %lld wrong\n", static_cast<long long>(c.checked),
              static_cast<long long>(c.wrong));
  return c.wrong == 0 ? 0 : 1;
}

// The last rank calls something different at the same position in the sequence.
int Desync(ProcessGroup& pg) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  const bool odd_one = rank == world - 1;
  const std::string kind = absl::GetFlag(FLAGS_kind);
  std::vector<float> f(16, 1.0f);
  std::vector<double> g(16, 1.0);
  std::shared_ptr<Work> w;
  if (kind == "op") {
    w = odd_one ? pg.Broadcast(f.data(), 16, DataType::kFloat32, 0) : pg.AllReduce(f.data(), 16, DataType::kFloat32);
  } else if (kind == "root") {
    w = pg.Broadcast(f.data(), 16, DataType::kFloat32, odd_one ? 1 : 0);
  } else if (kind == "dtype") {
    w = odd_one ? pg.AllReduce(g.data(), 16, DataType::kFloat64) : pg.AllReduce(f.data(), 16, DataType::kFloat32);
  } else if (kind == "reduce_op") {
    w = pg.AllReduce(f.data(), 16, DataType::kFloat32, odd_one ? ReduceOp::kMax : ReduceOp::kSum);
  } else if (kind == "count") {
    w = pg.AllReduce(f.data(), odd_one ? 7 : 16, DataType::kFloat32);
  } else if (kind == "splits") {
    // all_to_all where the last rank expects one element more from rank 0 than it sends.
    std::vector<int64_t> in(world, 1), out(world, 1);
    if (odd_one) out[0] = 2;
    int64_t out_total = 0;
    for (int64_t v : out) out_total += v;
    std::vector<float> o(out_total);
    w = pg.AllToAllSingle(o.data(), out_total, f.data(), world, out, in, DataType::kFloat32);
  } else {
    return 2;
  }
  absl::Status s = w->Wait();
  std::printf("status: %s\n", StatusLine(s).c_str());
  // The group stays usable after a desync.
  std::vector<int32_t> t = {1};
  absl::Status after = pg.AllReduce(t)->Wait();
  std::printf("after: %s sum=%d\n", StatusLine(after).c_str(), t[0]);
  return s.code() == absl::StatusCode::kInvalidArgument && after.ok() && t[0] == world ? 0 : 1;
}

int Monitored(ProcessGroup& pg) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  if (rank >= world - absl::GetFlag(FLAGS_skip)) {
    // Does not call the barrier; stays alive past the others' timeout (the pause the mode is about).
    absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms)) * 3);
    std::printf("status: skipped\n");
    return 0;
  }
  absl::Status s =
      pg.MonitoredBarrier(absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms)), absl::GetFlag(FLAGS_wait_all_ranks))
          ->Wait();
  std::printf("status: %s\n", StatusLine(s).c_str());
  return s.code() == absl::StatusCode::kDeadlineExceeded ? 0 : 1;
}

int BigBroadcast(ProcessGroup& pg) {
  Checker c{pg};
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  const size_t n = static_cast<size_t>(absl::GetFlag(FLAGS_big_broadcast_bytes)) / sizeof(float);
  auto value = [](int root, int i, size_t j) { return static_cast<float>((j % 1000003) * (root + 1) + i); };
  for (int root = 0; root < world; ++root) {
    std::vector<std::vector<float>> t(4, std::vector<float>(n, -1.0f));
    if (rank == root) {
      for (int i = 0; i < 4; ++i) {
        for (size_t j = 0; j < n; ++j) t[i][j] = value(root, i, j);
      }
    }
    const std::string what = absl::StrCat("broadcast(", n * sizeof(float), " bytes, root=", root, ")");
    c.Ok(pg.Broadcast(t[0].data(), static_cast<int64_t>(n), DataType::kFloat32, root), what);
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 1; i < 4; ++i) {
      works.push_back(pg.Broadcast(t[i].data(), static_cast<int64_t>(n), DataType::kFloat32, root));
    }
    for (auto& w : works) c.Ok(w, what);
    for (int i = 0; i < 4; ++i) {
      size_t bad = 0;
      for (size_t j = 0; j < n; ++j) bad += t[i][j] != value(root, i, j);
      c.Expect(bad == 0, absl::StrCat(what, " #", i, ": ", bad, " wrong elements"));
    }
  }
  std::printf("big_broadcast done: %lld checked, %lld wrong\n", static_cast<long long>(c.checked),
              static_cast<long long>(c.wrong));
  return c.wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  auto options = collserve::client::InitOptions::FromEnv();
  if (!options.ok()) {
    std::printf("init: %s\n", StatusLine(options.status()).c_str());
    return 2;
  }
  auto pg = collserve::client::InitProcessGroup(*options);
  if (!pg.ok()) {
    std::printf("init: %s\n", StatusLine(pg.status()).c_str());
    return 3;
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (absl::GetFlag(FLAGS_arena)) g_arena_pg = pg->get();
  if (mode == "collectives") return Collectives(**pg);
  if (mode == "examples") return Examples(**pg);
  if (mode == "p2p") return P2P(**pg);
  if (mode == "p2p_after_leave") return P2PAfterLeave(**pg);
  if (mode == "groups") return Groups(**pg);
  if (mode == "desync") return Desync(**pg);
  if (mode == "monitored") return Monitored(**pg);
  if (mode == "big_broadcast") return BigBroadcast(**pg);
  std::printf("unknown --mode\n");
  return 2;
}
