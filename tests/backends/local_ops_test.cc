// The sidecar's intra-host data path (backends/local_ops.h): the thread pool and the
// chunked reduction and copies, checked element by element against plain loops.
#include "backends/local_ops.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "backends/reduce.h"

namespace collserve::backends {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexOnceWithSeveralCallersAtOnce) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.threads(), 3);
  constexpr size_t kN = 10000;
  std::vector<std::thread> callers;
  std::vector<std::vector<std::atomic<int>>> hits(4);
  for (auto& h : hits) h = std::vector<std::atomic<int>>(kN);
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] { pool.ParallelFor(kN, [&](size_t i) { hits[c][i].fetch_add(1); }); });
  }
  for (auto& t : callers) t.join();
  for (auto& h : hits) {
    for (size_t i = 0; i < kN; ++i) ASSERT_EQ(h[i].load(), 1) << i;
  }
  pool.ParallelFor(0, [](size_t) { FAIL() << "no index to run"; });
}

TEST(ThreadPoolTest, SingleThreadRunsOnTheCaller) {
  ThreadPool pool(1);
  const auto me = std::this_thread::get_id();
  pool.ParallelFor(5, [&](size_t) { EXPECT_EQ(std::this_thread::get_id(), me); });
}

// An odd count spanning several chunks, with a short last one.
constexpr size_t kCount = 3 * kLocalChunkBytes / sizeof(float) + 17;

TEST(LocalReduceTest, SumIntoEveryDestinationInPlace) {
  ThreadPool pool(2);
  std::vector<std::vector<float>> t(4, std::vector<float>(kCount));
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < kCount; ++i) t[r][i] = static_cast<float>((r + 1) * (i % 7));
  }
  LocalReduce op;
  op.count = kCount;
  for (auto& v : t) {
    op.srcs.push_back(reinterpret_cast<const char*>(v.data()));
    op.dsts.push_back(reinterpret_cast<char*>(v.data()));
  }
  RunLocalReduce(pool, op);
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(t[r][i], 10.0f * (i % 7)) << r << " " << i;
  }
}

TEST(LocalReduceTest, PremulAndAverageLeaveTheSourcesAlone) {
  ThreadPool pool(2);
  std::vector<double> a(kCount, 2.0), b(kCount, 4.0), out(kCount, -1.0);
  LocalReduce op;
  op.dtype = DataType::kFloat64;
  op.op = ReduceOp::kPremulSum;
  op.count = kCount;
  op.srcs = {reinterpret_cast<const char*>(a.data()), reinterpret_cast<const char*>(b.data())};
  op.premul = {0.5, 0.25};
  op.divisor = 2;
  op.dsts = {reinterpret_cast<char*>(out.data())};
  RunLocalReduce(pool, op);
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(out[i], (2.0 * 0.5 + 4.0 * 0.25) / 2) << i;
    ASSERT_EQ(a[i], 2.0);
    ASSERT_EQ(b[i], 4.0);
  }
}

TEST(LocalReduceTest, EveryDtypeAndOpMatchesThePairwiseKernel) {
  ThreadPool pool(2);
  for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64, DataType::kFloat16,
                     DataType::kBFloat16, DataType::kInt8, DataType::kUInt8, DataType::kBool}) {
    for (int v = 1; v <= 9; ++v) {
      const ReduceOp op = static_cast<ReduceOp>(v);
      if (!ValidateReduce(d, op).ok() || op == ReduceOp::kPremulSum || op == ReduceOp::kAvg) continue;
      const size_t es = ElementSize(d);
      const size_t n = 2 * kLocalChunkBytes / es + 5;
      std::vector<std::vector<char>> in(3, std::vector<char>(n * es));
      for (size_t k = 0; k < 3; ++k) {
        for (size_t i = 0; i < n * es; ++i) in[k][i] = static_cast<char>(d == DataType::kBool ? (i + k) % 2 : (i * 7 + k) % 3);
      }
      std::vector<char> want(n * es), got(n * es);
      Reduce(d, op, want.data(), in[0].data(), in[1].data(), n);
      Reduce(d, op, want.data(), want.data(), in[2].data(), n);
      LocalReduce r;
      r.dtype = d;
      r.op = op;
      r.count = n;
      for (auto& v : in) r.srcs.push_back(v.data());
      r.dsts = {got.data()};
      RunLocalReduce(pool, r);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size()), 0) << DataTypeName(d) << " " << ReduceOpName(op);
    }
  }
}

TEST(RunCopiesTest, CopiesEveryJobWhateverItsSize) {
  ThreadPool pool(2);
  std::vector<char> src(3 << 20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 31);
  std::vector<std::vector<char>> dst = {std::vector<char>(1), std::vector<char>(3 << 20), std::vector<char>(12345)};
  std::vector<CopyJob> jobs;
  for (auto& d : dst) jobs.push_back({d.data(), src.data(), d.size()});
  jobs.push_back({nullptr, src.data(), 0});
  RunCopies(pool, jobs);
  for (auto& d : dst) ASSERT_EQ(std::memcmp(d.data(), src.data(), d.size()), 0) << d.size();
}

}  // namespace
}  // namespace collserve::backends
