// collserve-membw: this machine's memory bandwidth, measured the way bench/RESULTS.md's
// bound for the one-host all_reduce needs it (Google Benchmark; one process, no service).
//
//   BM_Memcpy             single-thread memcpy of a 64 MiB buffer; bytes_per_second =
//                         bytes copied per second (each byte is read once and written once).
//   BM_Sum/threads:T      c[i] = a[i] + b[i] over float32 buffers of 64 MiB each, the
//                         elements split among T threads; bytes_per_second = bytes of c
//                         produced per second (2 bytes read and 1 written for each).
//   BM_LocalAllReduce     the sidecar's in-place all_reduce kernel (backends/local_ops.h)
//     /ranks/threads      over `ranks` separate 64 MiB float32 tensors on a pool of
//                         `threads`; bytes_per_second = tensor bytes per second, i.e. the
//                         algbw the service could reach if nothing but this kernel ran.
//
// Run: build/bench/collserve-membw [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <cstring>
#include <thread>
#include <vector>

#include "backends/local_ops.h"

namespace {

constexpr size_t kBytes = 64 << 20;

std::vector<float> Filled(float v) { return std::vector<float>(kBytes / sizeof(float), v); }

void BM_Memcpy(benchmark::State& state) {
  std::vector<char> src(kBytes, 1), dst(kBytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kBytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBytes);
}
BENCHMARK(BM_Memcpy)->UseRealTime()->Unit(benchmark::kMillisecond);

// Every thread of the benchmark sums its own slice of shared buffers.
std::vector<float> sum_a = Filled(1.0f), sum_b = Filled(2.0f), sum_c = Filled(0.0f);

void BM_Sum(benchmark::State& state) {
  const size_t n = sum_a.size();
  const size_t per = n / static_cast<size_t>(state.threads());
  const size_t first = per * static_cast<size_t>(state.thread_index());
  const float* a = sum_a.data() + first;
  const float* b = sum_b.data() + first;
  float* c = sum_c.data() + first;
  for (auto _ : state) {
    for (size_t i = 0; i < per; ++i) c[i] = a[i] + b[i];
    benchmark::DoNotOptimize(c);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(per * sizeof(float)));
}
BENCHMARK(BM_Sum)->Threads(1)->Threads(2)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_LocalAllReduce(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  collserve::backends::ThreadPool pool(static_cast<int>(state.range(1)));
  std::vector<std::vector<float>> tensors;
  for (int r = 0; r < ranks; ++r) tensors.push_back(Filled(1.0f));
  collserve::backends::LocalReduce op;
  op.dtype = collserve::DataType::kFloat32;
  op.op = collserve::ReduceOp::kSum;
  op.count = kBytes / sizeof(float);
  for (auto& t : tensors) {
    op.srcs.push_back(reinterpret_cast<const char*>(t.data()));
    op.dsts.push_back(reinterpret_cast<char*>(t.data()));
  }
  for (auto _ : state) {
    collserve::backends::RunLocalReduce(pool, op);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBytes);
}
BENCHMARK(BM_LocalAllReduce)
    ->ArgNames({"ranks", "threads"})
    ->Args({4, 1})
    ->Args({4, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
