// collserve_test_rank: one rank of an integration test, run as its own process with the
// env:// variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, COLLSERVE_SIDECAR).
//
// Modes:
//   sweep   all_reduce of every dtype x valid ReduceOp x --counts, each checked against a
//           local reference computed from every rank's (deterministic) input. Exit 0 if all match.
//   single  one all_reduce of --count elements; prints "status: <code>: <message>".
//   loop    all_reduce --iters times (0 = until an error); prints progress and the error.
//   init    only init_process_group; prints "init: <status>".
//   surface broadcast of every dtype x --counts with cycling roots, then barriers
//           checked through the store.
//   bcast_root / barrier  one broadcast with root --iters / one barrier (rank 0 late by --iters s).
//   async   Work semantics (two ranks): Wait with a short timeout, IsCompleted, OnCompletion.
//   ring_leave  the tutorial's ring all_reduce from isend/recv (--iters rounds of it), then
//           the group is destroyed at once, with no barrier: exit 0 when every sum is right.
//   leave_early rank 0 leaves at once; the others pass a token 1 -> 2 -> ... by send/recv
//           (p2p that does not need rank 0), then check that an all_reduce and a send to
//           rank 0 fail naming rank 0. Prints "leave_early: OK".
//   leave_queued rank 2 leaves with an all_reduce queued on its host; every other rank's
//           all_reduce must fail naming rank 2. Prints "leave_queued: OK".
//   store_loop  --iters rounds of an int64 all_reduce plus store add / set / get /
//           compare_set / append, every result checked (exactly-once writes included);
//           at the end the shared counter must hold world_size * iters.
// Exit codes: 0 ok, 1 wrong result, 2 usage, 3 an operation failed (status printed).
#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "collserve/client.h"
#include "collserve/elastic.h"
#include "common/types.h"
#include "tests/testing/null_rank_comm.h"
#include "tests/testing/store_rank_comm.h"
#include "tests/testing/wait_for.h"

ABSL_FLAG(std::string, mode, "sweep", "sweep | single | loop | init | idle | ...");
ABSL_FLAG(std::string, counts, "0,1,7,1000,1048576", "element counts for sweep");
ABSL_FLAG(int64_t, count, 1000, "element count for single/loop");
ABSL_FLAG(std::string, dtype, "float32", "dtype for single/loop");
ABSL_FLAG(std::string, op, "SUM", "reduce op for single/loop");
ABSL_FLAG(int64_t, iters, 0, "loop iterations (0 = until error)");
ABSL_FLAG(std::string, group, "world", "group name");
ABSL_FLAG(int64_t, generation, 0, "the group's generation to form (InitOptions::generation; 0 = the next)");
ABSL_FLAG(int64_t, delay_ms, 0, "loop: sleep this long before each iteration's call (a straggler)");
ABSL_FLAG(int64_t, hold_s, 0, "loop: after an error, keep the process (and its session) this long before exiting");
ABSL_FLAG(bool, elastic_join, false,
          "reconfigure: join the running job (collserve::client::JoinRunningGroup) instead of initializing");
ABSL_FLAG(int64_t, admit_every, 10, "reconfigure: members ask ShouldReconfigure every this many iterations");
ABSL_FLAG(int64_t, join_window_s, 3, "reconfigure: ReconfigureOptions::join_window, seconds");
ABSL_FLAG(std::string, key_prefix, "t", "store_loop: prefix of the store keys it writes");

namespace {

using collserve::DataType;
using collserve::ReduceOp;

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
T Value(ReduceOp op, int rank, size_t i, int salt) {
  const uint64_t h = Mix((static_cast<uint64_t>(rank) << 40) ^ (i * 7919) ^ (static_cast<uint64_t>(op) << 32) ^
                         static_cast<uint64_t>(salt));
  if constexpr (std::is_floating_point_v<T>) {
    if (op == ReduceOp::kProduct) {
      const T choices[] = {T(0.5), T(1), T(2), T(-1)};
      return choices[h % 4];
    }
    // Multiples of 1/64 below 16 in magnitude: sums of a few are exact in float32.
    return static_cast<T>(static_cast<int64_t>(h % 2001) - 1000) / T(64);
  } else {
    switch (op) {
      case ReduceOp::kProduct: {
        const T choices[] = {1, -1, 2, 3};
        return choices[h % 4];
      }
      case ReduceOp::kBand:
      case ReduceOp::kBor:
      case ReduceOp::kBxor:
        return static_cast<T>(h);
      default:
        return static_cast<T>(static_cast<int64_t>(h % 200001) - 100000);
    }
  }
}

template <typename T>
T Combine(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return static_cast<T>(a + b);
    case ReduceOp::kProduct: return static_cast<T>(a * b);
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    if (op == ReduceOp::kBand) return a & b;
    if (op == ReduceOp::kBor) return a | b;
    if (op == ReduceOp::kBxor) return a ^ b;
  }
  return a;
}

template <typename T>
bool Close(T got, T want) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::fabs(static_cast<double>(got) - static_cast<double>(want)) <=
           1e-5 * std::max(1.0, std::fabs(static_cast<double>(want)));
  } else {
    return got == want;
  }
}

std::string StatusLine(const absl::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
}

// Returns the number of wrong elements (printing the first), or -1 if the op failed.
template <typename T>
int64_t CheckOne(collserve::client::ProcessGroup& pg, DataType dtype, ReduceOp op, size_t count, int salt) {
  const int rank = pg.GetRank(), world = pg.GetWorldSize();
  std::vector<T> data(count);
  for (size_t i = 0; i < count; ++i) data[i] = Value<T>(op, rank, i, salt);
  absl::Status s = pg.AllReduce(data.data(), static_cast<int64_t>(count), dtype, op)->Wait();
  if (!s.ok()) {
    std::printf("rank %d: all_reduce(%s, %s, count=%zu) failed: %s\n", rank,
                std::string(collserve::DataTypeName(dtype)).c_str(), std::string(collserve::ReduceOpName(op)).c_str(),
                count, StatusLine(s).c_str());
    return -1;
  }
  int64_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    T want = Value<T>(op, 0, i, salt);
    for (int r = 1; r < world; ++r) want = Combine(op, want, Value<T>(op, r, i, salt));
    if (op == ReduceOp::kAvg) want = static_cast<T>(want / static_cast<T>(world));
    if (!Close(data[i], want)) {
      if (wrong == 0) {
        std::printf("rank %d: all_reduce(%s, %s, count=%zu) element %zu = %.17g, want %.17g\n", rank,
                    std::string(collserve::DataTypeName(dtype)).c_str(),
                    std::string(collserve::ReduceOpName(op)).c_str(), count, i, static_cast<double>(data[i]),
                    static_cast<double>(want));
      }
      ++wrong;
    }
  }
  return wrong;
}

int64_t CheckAny(collserve::client::ProcessGroup& pg, DataType dtype, ReduceOp op, size_t count, int salt) {
  switch (dtype) {
    case DataType::kFloat32: return CheckOne<float>(pg, dtype, op, count, salt);
    case DataType::kFloat64: return CheckOne<double>(pg, dtype, op, count, salt);
    case DataType::kInt32: return CheckOne<int32_t>(pg, dtype, op, count, salt);
    case DataType::kInt64: return CheckOne<int64_t>(pg, dtype, op, count, salt);
    default: break;  // the other dtypes are covered by surface_rank.cc
  }
  return -1;
}

bool ParseDtype(const std::string& s, DataType* out) {
  for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
    if (s == collserve::DataTypeName(d)) return *out = d, true;
  }
  return false;
}

bool ParseOp(const std::string& s, ReduceOp* out) {
  for (int v = 1; v <= 8; ++v) {
    if (s == collserve::ReduceOpName(static_cast<ReduceOp>(v))) return *out = static_cast<ReduceOp>(v), true;
  }
  return false;
}

}  // namespace

// --mode=rank_nccl: every CUDA call of the SDK with COLLSERVE_CUDA_PATH=nccl (one GPU per
// rank: NCCL in this process), over the store-backed stand-in for NCCL (host memory), each
// element checked. Prints "rank_nccl: OK" or the first mismatch.
int RankNcclMode(collserve::client::ProcessGroup& pg, collserve::testing::StoreRankCommFactory& fake) {
  const int r = pg.GetRank(), w = pg.GetWorldSize();
  int failures = 0;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::printf("MISMATCH: %s\n", what.c_str());
      ++failures;
    }
  };
  const auto ok = [&](const std::shared_ptr<collserve::client::Work>& work, const std::string& what) {
    absl::Status s = work->Wait();
    expect(s.ok(), absl::StrCat(what, ": ", StatusLine(s)));
  };
  const auto filled = [](size_t n, float first) {
    std::vector<float> v(n);
    for (size_t k = 0; k < n; ++k) v[k] = first + static_cast<float>(k);
    return v;
  };
  // A single send/recv runs on the pair's own communicator, as with torch's NCCL backend, so
  // it needs no other rank: ranks 0 and 1 exchange before rank 2 made any CUDA call (it
  // waits for them in the store; a communicator of the whole group would wait for it).
  if (w >= 3 && r <= 2) {
    auto store = fake.NewStoreClient();
    if (!store.ok()) return 4;
    std::vector<float> first = filled(6, 7.0f);
    absl::Status s;
    if (r == 0) s = pg.SendCuda(first.data(), 6, DataType::kFloat32, 1, 0, nullptr)->Wait();
    if (r == 1) {
      std::vector<float> got(6, -1.0f);
      s = pg.RecvCuda(got.data(), 6, DataType::kFloat32, 0, 0, nullptr)->Wait();
      expect(got == first, "the first recv, on the pair's communicator");
      if (s.ok()) s = (*store)->Set("rank_nccl_test/pair_done", "1");
    }
    if (r == 2) s = (*store)->Wait({"rank_nccl_test/pair_done"}, absl::Seconds(20));
    expect(s.ok(), absl::StrCat("a send/recv before rank 2's first CUDA call: ", StatusLine(s)));
  }
  // all_reduce: SUM, AVG (float32), MAX (int64).
  std::vector<float> a = filled(5, static_cast<float>(r));
  ok(pg.AllReduceCuda(a.data(), 5, DataType::kFloat32, ReduceOp::kSum, nullptr), "all_reduce");
  for (size_t k = 0; k < 5; ++k) expect(a[k] == w * (w - 1) / 2.0f + w * static_cast<float>(k), "all_reduce SUM");
  std::vector<float> avg(3, static_cast<float>(2 * r));
  ok(pg.AllReduceCuda(avg.data(), 3, DataType::kFloat32, ReduceOp::kAvg, nullptr), "all_reduce AVG");
  expect(avg[2] == static_cast<float>(w - 1), "all_reduce AVG");
  std::vector<int64_t> mx = {r, -r};
  ok(pg.AllReduceCuda(mx.data(), 2, DataType::kInt64, ReduceOp::kMax, nullptr), "all_reduce MAX");
  expect(mx[0] == w - 1 && mx[1] == 0, "all_reduce MAX");
  // broadcast from each root.
  for (int root = 0; root < w; ++root) {
    std::vector<float> b(4, static_cast<float>(r * 10));
    ok(pg.BroadcastCuda(b.data(), 4, DataType::kFloat32, root, nullptr), "broadcast");
    expect(b == std::vector<float>(4, static_cast<float>(root * 10)), absl::StrCat("broadcast from ", root));
  }
  // all_gather_into_tensor and reduce_scatter_tensor.
  std::vector<float> in3 = filled(3, static_cast<float>(100 * r)), all(3 * static_cast<size_t>(w), -1);
  ok(pg.AllGatherIntoTensorCuda(all.data(), in3.data(), 3, DataType::kFloat32, nullptr), "all_gather");
  for (int q = 0; q < w; ++q) {
    expect(std::equal(all.begin() + 3 * q, all.begin() + 3 * q + 3, filled(3, 100.0f * q).begin()), "all_gather");
  }
  std::vector<float> rs(2, -1);
  std::vector<float> big = filled(2 * static_cast<size_t>(w), static_cast<float>(r));
  ok(pg.ReduceScatterTensorCuda(rs.data(), big.data(), 2, DataType::kFloat32, ReduceOp::kSum, nullptr),
     "reduce_scatter");
  for (int k = 0; k < 2; ++k) {
    expect(rs[k] == w * (w - 1) / 2.0f + w * static_cast<float>(2 * r + k), "reduce_scatter");
  }
  // all_to_all_single, uneven: rank s sends s + d + 1 elements 100 s + 10 d + k to rank d.
  std::vector<float> send, recv;
  std::vector<int64_t> in_splits, out_splits;
  for (int d = 0; d < w; ++d) {
    auto piece = filled(static_cast<size_t>(r + d + 1), 100.0f * r + 10.0f * d);
    send.insert(send.end(), piece.begin(), piece.end());
    in_splits.push_back(r + d + 1);
    out_splits.push_back(d + r + 1);
  }
  recv.assign(static_cast<size_t>(w * (w - 1) / 2 + w * (r + 1)), -1);
  ok(pg.AllToAllSingleCuda(recv.data(), static_cast<int64_t>(recv.size()), send.data(),
                           static_cast<int64_t>(send.size()), out_splits, in_splits, DataType::kFloat32, nullptr),
     "all_to_all_single");
  std::vector<float> want;
  for (int q = 0; q < w; ++q) {
    auto piece = filled(static_cast<size_t>(q + r + 1), 100.0f * q + 10.0f * r);
    want.insert(want.end(), piece.begin(), piece.end());
  }
  expect(recv == want, "all_to_all_single");
  // gather and scatter, uneven, from each root: rank k's piece is k + 1 elements.
  for (int root = 0; root < w; ++root) {
    std::vector<int64_t> counts;
    for (int k = 0; k < w; ++k) counts.push_back(k + 1);
    std::vector<float> mine = filled(static_cast<size_t>(r + 1), 10.0f * r);
    std::vector<float> gathered(static_cast<size_t>(w * (w + 1) / 2), -1);
    ok(pg.GatherCuda(r == root ? gathered.data() : nullptr, mine.data(), r + 1,
                     r == root ? counts : std::vector<int64_t>{}, DataType::kFloat32, root, nullptr),
       "gather");
    std::vector<float> pieces;
    for (int k = 0; k < w; ++k) {
      auto p = filled(static_cast<size_t>(k + 1), 10.0f * k);
      pieces.insert(pieces.end(), p.begin(), p.end());
    }
    if (r == root) expect(gathered == pieces, absl::StrCat("gather to ", root));
    std::vector<float> got(static_cast<size_t>(r + 1), -1);
    ok(pg.ScatterCuda(got.data(), r + 1, r == root ? pieces.data() : nullptr,
                      r == root ? counts : std::vector<int64_t>{}, DataType::kFloat32, root, nullptr),
       "scatter");
    expect(got == mine, absl::StrCat("scatter from ", root));
  }
  // send/recv in a ring, then batch_isend_irecv; recv from any source is refused.
  if (w > 1) {
    const int next = (r + 1) % w, prev = (r + w - 1) % w;
    std::vector<float> out = filled(static_cast<size_t>(7 + r), static_cast<float>(r));
    std::vector<float> back(static_cast<size_t>(7 + prev), -1.0f);
    auto sw = pg.SendCuda(out.data(), static_cast<int64_t>(out.size()), DataType::kFloat32, next, 0, nullptr);
    auto rw = pg.RecvCuda(back.data(), static_cast<int64_t>(back.size()), DataType::kFloat32, prev, 0, nullptr);
    ok(sw, "send");
    ok(rw, "recv");
    expect(back == filled(static_cast<size_t>(7 + prev), static_cast<float>(prev)), "recv");
    expect(rw->SourceRank() == prev, "recv's source rank");
    std::vector<int64_t> x = {r, r}, y = {-1, -1};
    using P2P = collserve::client::P2POp;
    auto works = pg.BatchIsendIrecv({P2P{P2P::Kind::kSend, x.data(), 2, DataType::kInt64, next, 0, true, nullptr},
                                     P2P{P2P::Kind::kRecv, y.data(), 2, DataType::kInt64, prev, 0, true, nullptr}});
    for (auto& work : works) ok(work, "batch_isend_irecv");
    expect(y == std::vector<int64_t>{prev, prev}, "batch_isend_irecv");
    absl::Status any = pg.RecvCuda(back.data(), 1, DataType::kFloat32, -1, 0, nullptr)->Wait();
    std::printf("recv from any source: %s\n", StatusLine(any).c_str());
  }
  // A last all_reduce, so that no rank leaves (which aborts the others' communicators)
  // before every rank's point-to-point calls ran: rank 2 can finish its batch while rank 0
  // has yet to send its part.
  std::vector<int64_t> last = {1};
  ok(pg.AllReduceCuda(last.data(), 1, DataType::kInt64, ReduceOp::kSum, nullptr), "last all_reduce");
  expect(last[0] == w, "last all_reduce");
  // One communicator for the group and one per peer of a single send/recv: at 3 ranks, the
  // ring's next and previous ranks (rank 0 and 1 made theirs first).
  const int pairs = w > 2 ? 2 : w - 1;
  expect(fake.connects() == 1 + pairs, absl::StrCat("communicators made: ", fake.connects(), ", not ", 1 + pairs));
  const collserve::client::RankCommOptions made = fake.last_options();
  std::printf("communicator: traffic_class=%d name=%s\n", made.traffic_class, made.name.c_str());
  // Each collective's record (collserve.v1.Collective.in_rank) was agreed by the sidecars:
  // 4 all_reduces, w broadcasts, all_gather, reduce_scatter, all_to_all, w gathers and w
  // scatters. With COLLSERVE_NCCL_RECORDS=0 the sidecars saw none.
  const char* records_env = std::getenv("COLLSERVE_NCCL_RECORDS");
  const bool records = records_env == nullptr || std::string(records_env) != "0";
  const int64_t last_seq = records ? 6 + 3 * static_cast<int64_t>(w) : -1;
  const bool recorded = collserve::testing::WaitFor([&] { return pg.last_completed_seq() == last_seq; },
                                                    absl::Seconds(30));
  expect(recorded, absl::StrCat("records agreed through seq ", pg.last_completed_seq(), ", not ", last_seq));
  if (failures == 0) std::printf("rank_nccl: OK (rank %d of %d)\n", r, w);
  // The last rank leaves; the others hear of it from their sidecar (collserve.v1.GroupEvent,
  // through the coordinator's watch for the other host) and abort their communicator, so a
  // later call fails at once naming the leaver instead of waiting on it.
  if (w > 1 && r < w - 1 && failures == 0) {
    const bool aborted =
        collserve::testing::WaitFor([&] { return !fake.LastFailure().ok(); }, absl::Seconds(30));
    std::printf("aborted (%s): %s\n", fake.LastAbortHow().c_str(),
                aborted ? StatusLine(fake.LastFailure()).c_str() : "no");
    std::vector<float> t(1, 1.0f);
    std::printf("after the last rank left: %s\n",
                StatusLine(pg.AllReduceCuda(t.data(), 1, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait()).c_str());
    if (!aborted) ++failures;
  }
  return failures == 0 ? 0 : 4;
}

// --mode=rank_nccl_burst: COLLSERVE_CUDA_PATH=nccl over a communicator that does nothing
// (tests/testing/null_rank_comm.h), so that this rank queues the records of its NCCL
// collectives faster than the record sender's thread writes them: rounds of 16 CUDA
// all_reduces then one all_reduce of host memory (through the sidecar), which must take its
// turn after the records queued before it (the sidecar refuses a seq out of order). Prints
// "rank_nccl_burst: OK" once every record and every host all_reduce was answered.
int RankNcclBurstMode(collserve::client::ProcessGroup& pg) {
  const int r = pg.GetRank(), w = pg.GetWorldSize();
  void* fake_device_memory = reinterpret_cast<void*>(uintptr_t{1} << 40);  // never dereferenced
  constexpr int kRounds = 100, kRecords = 16;
  for (int round = 0; round < kRounds; ++round) {
    for (int k = 0; k < kRecords; ++k) {
      absl::Status s =
          pg.AllReduceCuda(fake_device_memory, 1024, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
      if (!s.ok()) {
        std::printf("round %d, CUDA all_reduce %d: %s\n", round, k, StatusLine(s).c_str());
        return 4;
      }
    }
    std::vector<int64_t> host = {r + round};
    absl::Status s = pg.AllReduce(host.data(), 1, DataType::kInt64, ReduceOp::kSum)->Wait();
    if (!s.ok() || host[0] != w * (w - 1) / 2 + int64_t{w} * round) {
      std::printf("round %d, host all_reduce: %s, %lld\n", round, StatusLine(s).c_str(),
                  static_cast<long long>(host[0]));
      return 4;
    }
  }
  const int64_t last_seq = int64_t{kRounds} * (kRecords + 1) - 1;
  if (!collserve::testing::WaitFor([&] { return pg.last_completed_seq() == last_seq; }, absl::Seconds(30))) {
    std::printf("answered through seq %lld, not %lld\n", static_cast<long long>(pg.last_completed_seq()),
                static_cast<long long>(last_seq));
    return 4;
  }
  std::printf("rank_nccl_burst: OK (rank %d of %d)\n", r, w);
  return 0;
}

// --mode=rank_nccl_desync: COLLSERVE_CUDA_PATH=nccl over the stand-in for NCCL; after one
// all_reduce every rank agrees on, rank 0 calls broadcast where the others call all_reduce
// (the stand-in moves the bytes regardless, as NCCL might). The sidecars find the
// disagreement in the calls' records and each rank aborts its communicator with their reason;
// prints it and the next call's error.
int RankNcclDesyncMode(collserve::client::ProcessGroup& pg, collserve::testing::StoreRankCommFactory& fake) {
  const int r = pg.GetRank();
  std::vector<float> a(4, 1.0f);
  absl::Status first = pg.AllReduceCuda(a.data(), 4, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
  std::printf("agreed all_reduce: %s\n", StatusLine(first).c_str());
  absl::Status odd = r == 0 ? pg.BroadcastCuda(a.data(), 4, DataType::kFloat32, 0, nullptr)->Wait()
                            : pg.AllReduceCuda(a.data(), 4, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
  std::printf("odd call queued: %s\n", StatusLine(odd).c_str());
  // At once, by the sidecars' answer (a rank that left first, aborted by it, only starts a
  // drain, whose reason the answer's replaces: the two come from different threads).
  const bool aborted = collserve::testing::WaitFor([&] { return fake.LastAbortHow() == "at once"; }, absl::Seconds(30));
  std::printf("aborted (%s): %s\n", fake.LastAbortHow().c_str(),
              aborted ? StatusLine(fake.LastFailure()).c_str() : "no");
  std::printf("next call: %s\n",
              StatusLine(pg.AllReduceCuda(a.data(), 4, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait()).c_str());
  return first.ok() && aborted ? 0 : 4;
}

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  auto options = collserve::client::InitOptions::FromEnv();
  if (!options.ok()) {
    std::printf("init: %s\n", StatusLine(options.status()).c_str());
    return 2;
  }
  options->group = absl::GetFlag(FLAGS_group);
  options->generation = absl::GetFlag(FLAGS_generation);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "reconfigure") {
    // An elastic loop (collserve/elastic.h): int64 all_reduces of 1 (the sum is the world
    // size); a failed one re-forms the group among the ranks left (join window 3 s) and is
    // retried; every --admit_every iterations the members admit waiting joiners.
    collserve::client::ReconfigureOptions ro;
    ro.join_window = absl::Seconds(absl::GetFlag(FLAGS_join_window_s));
    collserve::client::ElasticGroup eg;
    if (absl::GetFlag(FLAGS_elastic_join)) {
      auto joined = collserve::client::JoinRunningGroup(*options, ro);
      if (!joined.ok()) {
        std::printf("join: %s\n", StatusLine(joined.status()).c_str());
        return 3;
      }
      eg = std::move(*joined);
    } else {
      auto first = collserve::client::InitProcessGroup(*options);
      if (!first.ok()) {
        std::printf("init: %s\n", StatusLine(first.status()).c_str());
        return 3;
      }
      eg.group = std::move(*first);
    }
    const int64_t iters = absl::GetFlag(FLAGS_iters);
    int64_t i = 0;
    int failures = 0;
    // After each formation the new rank 0's iteration is everyone's (a failed collective
    // may have completed on some ranks; a joiner knows none): the state the survivors hold.
    auto formed = [&]() {
      std::vector<int64_t> at = {i};
      absl::Status s = eg.group->Broadcast(at, 0)->Wait();
      if (s.ok()) i = at[0];
      std::printf("formed: rank %d of %d (generation %lld) as group \"%s\" generation %lld at iter %lld: %s\n",
                  eg.group->GetRank(), eg.group->GetWorldSize(), static_cast<long long>(eg.generation),
                  eg.group->group_name().c_str(), static_cast<long long>(eg.group->generation()),
                  static_cast<long long>(i), StatusLine(s).c_str());
      return s;
    };
    if (!formed().ok()) return 3;
    while (i < iters) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_delay_ms)));  // --delay_ms paces the steps
      absl::Status s = absl::OkStatus();
      if (i > 0 && i % absl::GetFlag(FLAGS_admit_every) == 0) {
        auto admit = collserve::client::ShouldReconfigure(eg, *options, ro);
        s = admit.status();
        if (admit.ok() && *admit) s = absl::UnavailableError("joiners are waiting");
      }
      std::vector<int64_t> one = {1};
      if (s.ok()) s = eg.group->AllReduce(one)->Wait();
      if (s.ok() && one[0] != eg.group->GetWorldSize()) {
        std::printf("WRONG at iter %lld: %lld != %d\n", static_cast<long long>(i), static_cast<long long>(one[0]),
                    eg.group->GetWorldSize());
        return 4;
      }
      if (s.ok()) {
        std::printf("iter %lld ok\n", static_cast<long long>(i));
        ++i;
        continue;
      }
      if (++failures > 5) {
        std::printf("giving up at iter %lld: %s\n", static_cast<long long>(i), StatusLine(s).c_str());
        return 3;
      }
      std::printf("iter %lld: %s; reconfiguring\n", static_cast<long long>(i), StatusLine(s).c_str());
      const int64_t mine = eg.group->last_completed_seq();
      auto next = collserve::client::Reconfigure(std::move(eg), *options, ro);
      if (!next.ok()) {
        std::printf("reconfigure: %s\n", StatusLine(next.status()).c_str());
        return 3;
      }
      eg = std::move(*next);
      std::printf("reconfigured: last common seq %lld, this rank's last completed seq %lld\n",
                  static_cast<long long>(eg.last_common_seq), static_cast<long long>(mine));
      if (!formed().ok()) return 3;
    }
    std::printf("done: rank %d of %d\n", eg.group->GetRank(), eg.group->GetWorldSize());
    return 0;
  }
  std::unique_ptr<collserve::testing::StoreRankCommFactory> fake_nccl;
  collserve::testing::NullRankCommFactory null_nccl;
  if (mode == "rank_nccl_burst") {
    options->cuda_path = collserve::client::InitOptions::CudaPath::kNccl;
    collserve::client::SetRankCommFactoryForTesting(&null_nccl);
  } else if (absl::StartsWith(mode, "rank_nccl")) {
    options->cuda_path = collserve::client::InitOptions::CudaPath::kNccl;
    collserve::client::StoreClientOptions so;
    so.job = options->job;
    so.token = options->token;
    so.tls = options->tls;
    const std::string address = options->coordinator_address;
    fake_nccl = std::make_unique<collserve::testing::StoreRankCommFactory>(
        [address, so] { return collserve::client::StoreClient::Connect(address, so); });
    collserve::client::SetRankCommFactoryForTesting(fake_nccl.get());
  }
  auto pg = collserve::client::InitProcessGroup(*options);
  if (!pg.ok()) {
    std::printf("init: %s\n", StatusLine(pg.status()).c_str());
    return 3;
  }
  if (mode == "init") {
    std::printf("init: OK: hosts=%d local=%d\n", (*pg)->num_hosts(), (*pg)->local_world_size());
    return 0;
  }
  if (mode == "rank_nccl") return RankNcclMode(**pg, *fake_nccl);
  if (mode == "rank_nccl_burst") return RankNcclBurstMode(**pg);
  if (mode == "rank_nccl_desync") return RankNcclDesyncMode(**pg, *fake_nccl);
  if (mode == "rank_nccl_lost_sidecar") {
    // One all_reduce (the communicator is made), then "ready"; the test kills host1's sidecar,
    // and every rank's communicator must end, once drained, naming why.
    std::vector<float> a(4, 1.0f);
    absl::Status s = (*pg)->AllReduceCuda(a.data(), 4, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
    std::printf("all_reduce: %s\nready\n", StatusLine(s).c_str());
    std::fflush(stdout);
    const bool ended = collserve::testing::WaitFor([&] { return !fake_nccl->LastAbortHow().empty(); },
                                                   absl::Seconds(60));
    std::printf("aborted (%s): %s\n", fake_nccl->LastAbortHow().c_str(),
                ended ? StatusLine(fake_nccl->LastFailure()).c_str() : "no");
    std::printf("next call: %s\n",
                StatusLine((*pg)->AllReduceCuda(a.data(), 4, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait())
                    .c_str());
    return s.ok() && ended ? 0 : 4;
  }
  if (mode == "rank_nccl_hang") {
    // One all_reduce, which waits in the stand-in for a rank that never calls (as NCCL
    // would) until the op timeout.
    std::vector<float> a(4, 1.0f);
    absl::Status s = (*pg)->AllReduceCuda(a.data(), 4, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
    std::printf("all_reduce: %s\n", StatusLine(s).c_str());
    return 0;
  }
  if (mode == "idle") {
    // Joins, then calls nothing for --iters seconds (the rank that never calls).
    std::printf("init: OK\n");
    std::fflush(stdout);
    absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_iters)));  // the idleness the mode is about
    return 0;
  }
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  if (!ParseDtype(absl::GetFlag(FLAGS_dtype), &dtype) || !ParseOp(absl::GetFlag(FLAGS_op), &op)) {
    std::printf("bad --dtype or --op\n");
    return 2;
  }
  if (mode == "single") {
    std::vector<char> buf(static_cast<size_t>(std::max<int64_t>(absl::GetFlag(FLAGS_count), 0)) *
                          collserve::ElementSize(dtype) + 1);
    absl::Status s = (*pg)->AllReduce(buf.data(), absl::GetFlag(FLAGS_count), dtype, op)->Wait();
    std::printf("status: %s\n", StatusLine(s).c_str());
    return s.ok() ? 0 : 3;
  }
  if (mode == "cuda_on_host_memory") {
    // The CUDA calls on host memory (or in a build or on a machine without CUDA): a clear
    // error in the Work, and the group stays usable.
    std::vector<float> buf(16, 1.0f);
    absl::Status s = (*pg)->AllReduceCuda(buf.data(), 16, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
    std::printf("cuda: %s\n", StatusLine(s).c_str());
    // The piece-wise CUDA calls (this is rank 0 of 1: the root), and their argument checks.
    std::vector<float> out(16, 0.0f);
    const std::vector<absl::Status> pieces = {
        (*pg)->AllToAllSingleCuda(out.data(), 16, buf.data(), 16, {}, {}, DataType::kFloat32, nullptr)->Wait(),
        (*pg)->GatherCuda(out.data(), buf.data(), 16, {16}, DataType::kFloat32, 0, nullptr)->Wait(),
        (*pg)->ScatterCuda(out.data(), 16, buf.data(), {16}, DataType::kFloat32, 0, nullptr)->Wait(),
        (*pg)->GatherCuda(out.data(), buf.data(), 16, {8, 8}, DataType::kFloat32, 0, nullptr)->Wait(),
        (*pg)->ScatterCuda(out.data(), 16, buf.data(), {16}, DataType::kFloat32, 1, nullptr)->Wait()};
    for (const absl::Status& p : pieces) std::printf("cuda piece-wise: %s\n", StatusLine(p).c_str());
    // send / recv: a peer out of range is refused first, then the memory as above.
    std::printf("cuda send: %s\n",
                StatusLine((*pg)->SendCuda(buf.data(), 16, DataType::kFloat32, 1, 0, nullptr)->Wait()).c_str());
    std::printf("cuda recv: %s\n",
                StatusLine((*pg)->RecvCuda(out.data(), 16, DataType::kFloat32, -1, 0, nullptr)->Wait()).c_str());
    if (!pieces[0].ok() && pieces[0].code() != s.code()) return 3;
    absl::Status after = (*pg)->AllReduce(buf.data(), 16, DataType::kFloat32, ReduceOp::kSum)->Wait();
    std::printf("after: %s %g\n", StatusLine(after).c_str(), buf[0]);
    return s.ok() || !after.ok() ? 3 : 0;
  }
  if (mode == "loop") {
    const int64_t iters = absl::GetFlag(FLAGS_iters);
    std::vector<char> buf(static_cast<size_t>(absl::GetFlag(FLAGS_count)) * collserve::ElementSize(dtype));
    for (int64_t i = 0; iters == 0 || i < iters; ++i) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_delay_ms)));  // --delay_ms paces the steps
      const absl::Time start = absl::Now();
      absl::Status s = (*pg)->AllReduce(buf.data(), absl::GetFlag(FLAGS_count), dtype, op)->Wait();
      if (!s.ok()) {
        std::printf("error after %lld ms at iter %lld: %s\n",
                    static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - start)),
                    static_cast<long long>(i), StatusLine(s).c_str());
        std::fflush(stdout);
        absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_hold_s)));  // --hold_s: stays alive for the test to look
        return 3;
      }
      std::printf("iter %lld ok\n", static_cast<long long>(i));
    }
    return 0;
  }
  if (mode == "ring_leave") {
    const int rank = (*pg)->GetRank();
    const int world = (*pg)->GetWorldSize();
    const int right = (rank + 1) % world, left = (rank + world - 1) % world;
    for (int64_t it = 0; it < std::max<int64_t>(absl::GetFlag(FLAGS_iters), 1); ++it) {
      std::vector<float> send(4), recv(4), accum(4);
      for (int i = 0; i < 4; ++i) send[i] = accum[i] = static_cast<float>(i + 10 * rank + it);
      for (int step = 0; step < world - 1; ++step) {
        std::shared_ptr<collserve::client::Work> s = (*pg)->Send(send.data(), 4, DataType::kFloat32, right);
        absl::Status r = (*pg)->Recv(recv.data(), 4, DataType::kFloat32, left)->Wait();
        if (!r.ok()) {
          std::printf("recv: %s\n", StatusLine(r).c_str());
          return 3;
        }
        absl::Status w = s->Wait();
        if (!w.ok()) {
          std::printf("send: %s\n", StatusLine(w).c_str());
          return 3;
        }
        for (int i = 0; i < 4; ++i) accum[i] += recv[i];
        send = recv;
      }
      for (int i = 0; i < 4; ++i) {
        float want = 0;
        for (int r = 0; r < world; ++r) want += static_cast<float>(i + 10 * r + it);
        if (accum[i] != want) {
          std::printf("wrong sum %g != %g\n", accum[i], want);
          return 1;
        }
      }
    }
    std::printf("ring_leave: OK\n");
    std::fflush(stdout);
    pg->reset();  // destroy_process_group: the session ends, with no barrier before it
    return 0;
  }
  if (mode == "leave_queued") {
    const int rank = (*pg)->GetRank();
    int64_t x = 1;
    if (rank == 2) {
      // Its all_reduce is queued on its host (rank 0 there has not called yet) when it leaves.
      std::shared_ptr<collserve::client::Work> queued = (*pg)->AllReduce(&x, 1, DataType::kInt64, ReduceOp::kSum);
      // A pause, not an ordering: time for the request to reach the sidecar before the leave
      // (a leave that overtakes it gives the same error to the others).
      absl::SleepFor(absl::Milliseconds(300));
      pg->reset();
      std::printf("leave_queued: left\n");
      return 0;
    }
    // The late rank the mode is about: rank 2's all_reduce waits queued for it.
    if (rank == 0) absl::SleepFor(absl::Milliseconds(1500));
    absl::Status ar = (*pg)->AllReduce(&x, 1, DataType::kInt64, ReduceOp::kSum)->Wait();
    std::printf("all_reduce: %s\n", StatusLine(ar).c_str());
    if (ar.ok() || !absl::StrContains(ar.message(), "rank 2")) return 3;
    std::printf("leave_queued: OK\n");
    return 0;
  }
  if (mode == "leave_early") {
    const int rank = (*pg)->GetRank();
    const int world = (*pg)->GetWorldSize();
    if (rank == 0) {
      pg->reset();
      std::printf("leave_early: left\n");
      return 0;
    }
    int64_t token = 0;
    if (rank > 1) {
      absl::Status s = (*pg)->Recv(&token, 1, DataType::kInt64, rank - 1)->Wait();
      if (!s.ok()) {
        std::printf("recv: %s\n", StatusLine(s).c_str());
        return 3;
      }
    }
    // Rank 1 starts the chain once rank 0 surely left (its session end reached the sidecar,
    // which no call of the SDK's can see: a pause; the chain's result is the same when it
    // starts sooner, only the path through the sidecar differs).
    if (rank == 1) absl::SleepFor(absl::Milliseconds(500));
    token += rank;
    if (rank + 1 < world) {
      absl::Status s = (*pg)->Send(&token, 1, DataType::kInt64, rank + 1)->Wait();
      if (!s.ok()) {
        std::printf("send: %s\n", StatusLine(s).c_str());
        return 3;
      }
    } else if (token != int64_t{world} * (world - 1) / 2) {
      std::printf("wrong token %lld\n", static_cast<long long>(token));
      return 1;
    }
    int64_t x = 1;
    absl::Status ar = (*pg)->AllReduce(&x, 1, DataType::kInt64, ReduceOp::kSum)->Wait();
    absl::Status to0 = (*pg)->Send(&x, 1, DataType::kInt64, 0)->Wait();
    absl::Status from0 = (*pg)->Recv(&x, 1, DataType::kInt64, 0)->Wait();
    std::printf("all_reduce: %s\nsend to 0: %s\nrecv from 0: %s\n", StatusLine(ar).c_str(), StatusLine(to0).c_str(),
                StatusLine(from0).c_str());
    // "rank 0 left group \"world\" (...)" on its host, "rank 0 left the group (...)" from
    // another host's word.
    const bool named = !ar.ok() && absl::StrContains(ar.message(), "rank 0 left") && !to0.ok() &&
                       absl::StrContains(to0.message(), "rank 0 left") && !from0.ok() &&
                       absl::StrContains(from0.message(), "rank 0 left");
    if (!named) return 3;
    std::printf("leave_early: OK\n");
    return 0;
  }
  if (mode == "store_loop") {
    collserve::client::StoreClient* store = (*pg)->store();
    if (store == nullptr) {
      std::printf("store: unavailable\n");
      return 3;
    }
    const int rank = (*pg)->GetRank();
    const int world = (*pg)->GetWorldSize();
    const int64_t iters = absl::GetFlag(FLAGS_iters);
    const std::string p = absl::StrCat(absl::GetFlag(FLAGS_key_prefix), "/");
    const std::string mine = absl::StrCat(p, "r", rank, "/");
    auto fail = [&](int64_t i, const std::string& what, const absl::Status& s) {
      std::printf("error at iter %lld: %s: %s\n", static_cast<long long>(i), what.c_str(), StatusLine(s).c_str());
      return 3;
    };
    auto wrong = [&](int64_t i, const std::string& what) {
      std::printf("wrong at iter %lld: %s\n", static_cast<long long>(i), what.c_str());
      return 1;
    };
    for (int64_t i = 0; i < iters; ++i) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_delay_ms)));  // --delay_ms paces the steps
      std::vector<int64_t> v(64, rank + i + 1);
      absl::Status s = (*pg)->AllReduce(v.data(), v.size(), DataType::kInt64, ReduceOp::kSum)->Wait();
      if (!s.ok()) return fail(i, "all_reduce", s);
      const int64_t want = int64_t{world} * (i + 1) + int64_t{world} * (world - 1) / 2;
      for (int64_t x : v) {
        if (x != want) return wrong(i, absl::StrCat("all_reduce ", x, " != ", want));
      }
      absl::StatusOr<int64_t> n = store->Add(mine + "count", 1);
      if (!n.ok()) return fail(i, "add", n.status());
      if (*n != i + 1) return wrong(i, absl::StrCat("add returned ", *n, ", want ", i + 1));
      absl::StatusOr<int64_t> total = store->Add(p + "total", 1);
      if (!total.ok()) return fail(i, "add total", total.status());
      s = store->Set(mine + "last", absl::StrCat(i));
      if (!s.ok()) return fail(i, "set", s);
      absl::StatusOr<std::string> got = store->Get(mine + "last");
      if (!got.ok()) return fail(i, "get", got.status());
      if (*got != absl::StrCat(i)) return wrong(i, absl::StrCat("get returned ", *got));
      absl::StatusOr<std::string> cas =
          store->CompareSet(mine + "cas", i == 0 ? "" : absl::StrCat(i - 1), absl::StrCat(i));
      if (!cas.ok()) return fail(i, "compare_set", cas.status());
      if (*cas != absl::StrCat(i)) return wrong(i, absl::StrCat("compare_set returned ", *cas));
      s = store->Append(mine + "log", "x");
      if (!s.ok()) return fail(i, "append", s);
      if (i % 50 == 0) std::printf("iter %lld ok\n", static_cast<long long>(i));
    }
    // Every rank's adds are in once every rank passed this all_reduce.
    std::vector<int64_t> one(1, 1);
    absl::Status s = (*pg)->AllReduce(one.data(), 1, DataType::kInt64, ReduceOp::kSum)->Wait();
    if (!s.ok()) return fail(iters, "final all_reduce", s);
    absl::StatusOr<int64_t> total = store->Add(p + "total", 0);
    if (!total.ok()) return fail(iters, "add total", total.status());
    if (*total != world * iters) return wrong(iters, absl::StrCat("total ", *total, ", want ", world * iters));
    absl::StatusOr<std::string> log = store->Get(mine + "log");
    if (!log.ok()) return fail(iters, "get log", log.status());
    if (static_cast<int64_t>(log->size()) != iters) return wrong(iters, absl::StrCat("log has ", log->size()));
    std::printf("store_loop: OK\n");
    return 0;
  }
  if (mode == "async") {
    // Rank 1 arrives late; rank 0 checks Work semantics while waiting for it.
    const int rank = (*pg)->GetRank();
    if (rank == 1) absl::SleepFor(absl::Milliseconds(1500));  // the late arrival the mode is about
    std::vector<int32_t> v = {rank + 1, 10 * (rank + 1)};
    auto work = (*pg)->AllReduce(v, ReduceOp::kSum);
    // Shared with the callback, which may run after Wait() returns (waiters are woken
    // before callbacks run, as in c10::ivalue::Future::markCompleted).
    struct Seen {
      absl::Mutex mu;
      int callbacks = 0;
      absl::Status status = absl::UnknownError("callback never ran");
      absl::Notification done;
    };
    auto seen = std::make_shared<Seen>();
    work->OnCompletion([seen](const absl::Status& s) {
      {
        absl::MutexLock lock(&seen->mu);
        seen->status = s;
        ++seen->callbacks;
      }
      seen->done.Notify();
    });
    if (rank == 0) {
      absl::Status early = work->Wait(absl::Milliseconds(100));
      std::printf("early wait: %s; completed=%d\n", StatusLine(early).c_str(), work->IsCompleted() ? 1 : 0);
    }
    absl::Status s = work->Wait();
    std::printf("wait: %s; completed=%d; result=[%d, %d]\n", StatusLine(s).c_str(), work->IsCompleted() ? 1 : 0,
                v[0], v[1]);
    seen->done.WaitForNotificationWithTimeout(absl::Seconds(10));
    {
      absl::MutexLock lock(&seen->mu);
      std::printf("callbacks=%d status=%s\n", seen->callbacks, StatusLine(seen->status).c_str());
    }
    // A callback added after completion runs at once, on this thread.
    bool inline_ran = false;
    work->OnCompletion([&](const absl::Status&) { inline_ran = true; });
    std::printf("late callback ran inline=%d\n", inline_ran ? 1 : 0);
    // An op undefined for the dtype fails without reaching the sidecar.
    std::vector<float> f = {1.0f};
    std::printf("bxor on float: %s\n", StatusLine((*pg)->AllReduce(f, ReduceOp::kBxor)->Wait()).c_str());
    return s.ok() ? 0 : 3;
  }
  if (mode == "lanes") {
    // A collective's completion callback that waits for a recv to complete: the recv's
    // completion must not be stuck behind the collective's (they finish on separate
    // threads). World size 2; rank 1 sends once its all_reduce is done (so rank 0's
    // all_reduce completes first). Rank 0 posts the recv before the all_reduce: were the
    // all_reduce done before its callback is attached, the callback runs on this thread
    // and must not wait for a recv not yet posted.
    const int rank = (*pg)->GetRank();
    std::vector<float> big(1 << 20, 1.0f);  // a 4 MiB result to copy out
    int32_t msg = 0;
    auto recv_done = std::make_shared<absl::Notification>();
    auto waited = std::make_shared<std::atomic<bool>>(false);
    std::shared_ptr<collserve::client::Work> recv;
    if (rank == 0) {
      recv = (*pg)->Recv(&msg, 1, collserve::DataType::kInt32, 1);
      recv->OnCompletion([recv_done](const absl::Status&) { recv_done->Notify(); });
    }
    auto work = (*pg)->AllReduce(big, ReduceOp::kSum);
    if (rank == 0) {
      work->OnCompletion([recv_done, waited](const absl::Status&) {
        waited->store(recv_done->WaitForNotificationWithTimeout(absl::Seconds(20)));
      });
      absl::Status s = recv->Wait(absl::Seconds(30));
      std::printf("recv: %s value=%d\n", StatusLine(s).c_str(), msg);
    } else {
      std::printf("all_reduce first: %s\n", StatusLine(work->Wait(absl::Seconds(30))).c_str());
      absl::SleepFor(absl::Milliseconds(200));  // a late send, the mode's point: rank 0's callback waits for it
      msg = 42;
      std::printf("send: %s\n", StatusLine((*pg)->Send(&msg, 1, collserve::DataType::kInt32, 0)->Wait()).c_str());
    }
    absl::Status s = work->Wait(absl::Seconds(30));
    // The callback may still be running after Wait: give it the time it needs.
    if (rank == 0) collserve::testing::WaitFor([&] { return waited->load(); }, absl::Seconds(30), absl::Milliseconds(100));
    std::printf("all_reduce: %s big[0]=%g callback saw the recv=%d\n", StatusLine(s).c_str(), big[0],
                rank == 0 ? (waited->load() ? 1 : 0) : 1);
    return s.ok() ? 0 : 3;
  }
  if (mode == "surface") {
    // broadcast of every dtype with roots cycling over the ranks, then barriers.
    const int rank = (*pg)->GetRank(), world = (*pg)->GetWorldSize();
    int64_t checked = 0, wrong = 0;
    int salt = 1000;
    for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_counts), ',')) {
      size_t count;
      if (!absl::SimpleAtoi(c, &count)) return 2;
      for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
        const int root = salt++ % world;
        const size_t esz = collserve::ElementSize(d);
        std::vector<char> buf(count * esz + 1, static_cast<char>(0x5a + rank));
        std::vector<char> want(count * esz + 1, 0);
        for (size_t i = 0; i < count; ++i) {
          const uint64_t v = Mix((static_cast<uint64_t>(root) << 40) ^ (i * 7919) ^ static_cast<uint64_t>(salt));
          std::memcpy(want.data() + i * esz, &v, esz);
        }
        if (rank == root) std::memcpy(buf.data(), want.data(), count * esz);
        absl::Status st = (*pg)->Broadcast(buf.data(), static_cast<int64_t>(count), d, root)->Wait();
        if (!st.ok()) {
          std::printf("rank %d: broadcast(count=%zu, root=%d) failed: %s\n", rank, count, root, StatusLine(st).c_str());
          return 3;
        }
        if (std::memcmp(buf.data(), want.data(), count * esz) != 0) {
          std::printf("rank %d: broadcast(%s, count=%zu, root=%d) differs from the root's tensor\n", rank,
                      std::string(collserve::DataTypeName(d)).c_str(), count, root);
          ++wrong;
        }
        ++checked;
      }
    }
    // barrier: nobody leaves before everybody arrived (seen through the store).
    auto* store = (*pg)->store();
    if (store == nullptr) {
      std::printf("no store\n");
      return 3;
    }
    for (int round = 0; round < 3; ++round) {
      if (rank == round % world) absl::SleepFor(absl::Milliseconds(200));  // a straggler
      if (!store->Set(absl::StrCat("arrived/", round, "/", rank), "1").ok()) return 3;
      absl::Status st = (*pg)->Barrier()->Wait();
      if (!st.ok()) {
        std::printf("rank %d: barrier failed: %s\n", rank, StatusLine(st).c_str());
        return 3;
      }
      std::vector<std::string> keys;
      for (int r = 0; r < world; ++r) keys.push_back(absl::StrCat("arrived/", round, "/", r));
      auto all = store->Check(keys);
      if (!all.ok() || !*all) {
        std::printf("rank %d: left barrier %d before every rank arrived\n", rank, round);
        ++wrong;
      }
      ++checked;
    }
    std::printf("rank %d: surface done: %lld checked, %lld wrong\n", rank, static_cast<long long>(checked),
                static_cast<long long>(wrong));
    return wrong == 0 ? 0 : 1;
  }
  if (mode == "staging") {
    // Two ranks, ordinary (staged) memory of 1.5 MiB per tensor. Rank 0 issues all_reduce A,
    // a send to rank 1 and all_reduce B, then reports whether A had completed when issuing B
    // returned, and tells rank 1 through the store. Rank 1 issues its half after that word
    // (--iters=1) or after one second (--iters=0: rank 0 may be waiting for A inside B).
    const int rank = (*pg)->GetRank();
    auto* store = (*pg)->store();
    if (store == nullptr || (*pg)->GetWorldSize() != 2) return 2;
    const int64_t n = 3 << 17;  // float32 elements: 1.5 MiB
    std::vector<float> a(n, 1.0f + rank), b(n, 10.0f * (rank + 1)), p2p(n, rank == 0 ? 7.0f : 0.0f);
    std::vector<std::shared_ptr<collserve::client::Work>> works;
    if (rank == 0) {
      works.push_back((*pg)->AllReduce(a.data(), n, DataType::kFloat32, ReduceOp::kSum));
      works.push_back((*pg)->Send(p2p.data(), n, DataType::kFloat32, 1));
      works.push_back((*pg)->AllReduce(b.data(), n, DataType::kFloat32, ReduceOp::kSum));
      std::printf("issued B; A completed=%d\n", works[0]->IsCompleted() ? 1 : 0);
      if (!store->Set("staging/issued", "1").ok()) return 3;
    } else {
      if (absl::GetFlag(FLAGS_iters) == 1) {
        if (!store->Wait({"staging/issued"}, absl::Seconds(30)).ok()) return 3;
      } else {
        absl::SleepFor(absl::Seconds(1));  // --iters=2: the mode's unordered variant, rank 0 usually first
      }
      works.push_back((*pg)->AllReduce(a.data(), n, DataType::kFloat32, ReduceOp::kSum));
      works.push_back((*pg)->Recv(p2p.data(), n, DataType::kFloat32, 0));
      works.push_back((*pg)->AllReduce(b.data(), n, DataType::kFloat32, ReduceOp::kSum));
    }
    for (auto& w : works) {
      if (absl::Status st = w->Wait(); !st.ok()) {
        std::printf("rank %d: %s\n", rank, StatusLine(st).c_str());
        return 3;
      }
    }
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += (a[i] != 3.0f) + (b[i] != 30.0f) + (p2p[i] != 7.0f);
    std::printf("rank %d: staging done, %lld wrong\n", rank, static_cast<long long>(wrong));
    return wrong == 0 ? 0 : 1;
  }
  if (mode == "inflight") {
    // --iters rounds; each issues 64 all_reduces of --count float32 elements (ordinary
    // memory, so staged) back to back, then waits for them all and checks them. Rank 0
    // issues first, and the others only once it has issued its 64 (a store key per round):
    // none of rank 0's can complete before, so it has all 64 in flight every round.
    const int rank = (*pg)->GetRank();
    auto* store = (*pg)->store();
    if (store == nullptr) return 2;
    const int64_t n = absl::GetFlag(FLAGS_count);
    const int world = (*pg)->GetWorldSize();
    std::vector<std::vector<float>> tensors(64, std::vector<float>(static_cast<size_t>(n)));
    int64_t wrong = 0;
    for (int64_t round = 0; round < absl::GetFlag(FLAGS_iters); ++round) {
      std::vector<std::shared_ptr<collserve::client::Work>> works;
      const absl::Time start = absl::Now();
      for (size_t t = 0; t < tensors.size(); ++t) {
        std::fill(tensors[t].begin(), tensors[t].end(), static_cast<float>(rank + t));
        if (t == 0 && rank != 0 && !store->Wait({absl::StrCat("inflight/", round)}, absl::Seconds(60)).ok()) return 3;
        works.push_back((*pg)->AllReduce(tensors[t].data(), n, DataType::kFloat32, ReduceOp::kSum));
      }
      if (rank == 0) {
        std::printf("rank 0: issued %zu in %lld ms, %d completed\n", works.size(),
                    static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - start)),
                    static_cast<int>(std::count_if(works.begin(), works.end(), [](const auto& w) { return w->IsCompleted(); })));
        std::fflush(stdout);
      }
      if (rank == 0 && !store->Set(absl::StrCat("inflight/", round), "1").ok()) return 3;
      for (auto& w : works) {
        if (absl::Status st = w->Wait(); !st.ok()) {
          std::printf("rank %d: %s\n", rank, StatusLine(st).c_str());
          return 3;
        }
      }
      for (size_t t = 0; t < tensors.size(); ++t) {
        const float want = static_cast<float>(world * (world - 1) / 2 + world * static_cast<int>(t));
        for (float v : tensors[t]) wrong += v != want;
      }
    }
    std::printf("rank %d: inflight done, %lld wrong\n", rank, static_cast<long long>(wrong));
    return wrong == 0 ? 0 : 1;
  }
  if (mode == "bcast_root") {
    // broadcast whose root is --count's rank-dependent value: to provoke a root mismatch.
    std::vector<float> v(4, 1.0f);
    const int root = static_cast<int>(absl::GetFlag(FLAGS_iters));
    absl::Status st = (*pg)->Broadcast(v.data(), 4, DataType::kFloat32, root)->Wait();
    std::printf("status: %s\n", StatusLine(st).c_str());
    return st.ok() ? 0 : 3;
  }
  if (mode == "barrier") {
    if ((*pg)->GetRank() == 0 && absl::GetFlag(FLAGS_iters) > 0) {
      absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_iters)));  // arrive late (or never, before the timeout)
    }
    absl::Status st = (*pg)->Barrier()->Wait();
    std::printf("status: %s\n", StatusLine(st).c_str());
    return st.ok() ? 0 : 3;
  }
  if (mode != "sweep") {
    std::printf("unknown --mode\n");
    return 2;
  }
  int64_t collectives = 0, wrong = 0;
  int salt = 0;
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_counts), ',')) {
    size_t count;
    if (!absl::SimpleAtoi(c, &count)) return 2;
    for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
      for (int v = 1; v <= 8; ++v) {
        const ReduceOp o = static_cast<ReduceOp>(v);
        if (!collserve::ValidateReduce(d, o).ok()) continue;
        const int64_t w = CheckAny(**pg, d, o, count, ++salt);
        if (w < 0) return 3;
        wrong += w;
        ++collectives;
      }
    }
  }
  std::printf("rank %d: sweep done: %lld collectives, %lld wrong elements\n", (*pg)->GetRank(),
              static_cast<long long>(collectives), static_cast<long long>(wrong));
  return wrong == 0 ? 0 : 1;
}
