// collserve-membw: this machine's memory bandwidth, measured the way bench/RESULTS.md's
// bound for the one-host all_reduce needs it (Google Benchmark; one process, no service).
//
//   BM_Memcpy             single-thread memcpy of a 128 MiB buffer; bytes_per_second =
//                         bytes copied per second (each byte is read once and written once).
//   BM_Sum/threads:T      c[i] = a[i] + b[i] over float32 buffers of 128 MiB each, the
//                         elements split among T threads; bytes_per_second = bytes of c
//                         produced per second (2 bytes read and 1 written for each).
//   BM_SumInPlace/        a[i] += b[i] over the same buffers; bytes_per_second = bytes of
//     threads:T           a updated per second. Exactly 3 bytes of memory traffic per byte
//                         (a and b read, a written back: a's lines are read anyway, so
//                         whether the CPU would read a line before overwriting it does not
//                         matter), the same read-then-write-in-place pattern as the
//                         sidecar's in-place all_reduce.
// Google Benchmark prints rates in binary units: "G/s" is 2^30 bytes per second.
//   BM_LocalAllReduce     the sidecar's in-place all_reduce kernel (backends/local_ops.h)
//     /ranks/threads      over `ranks` separate 64 MiB float32 tensors on a pool of
//                         `threads`; bytes_per_second = tensor bytes per second, i.e. the
//                         algbw the service could reach if nothing but this kernel ran.
//   BM_StagedHeapAllReduce the copies a one-host all_reduce of ordinary (heap) memory needs
//     /ranks:R            when ranks are processes with private memory and no process reads
//                         another's heap: R threads (the ranks) each copy their tensor
//                         (1 MiB and 64 MiB) into a segment at once, the local reduction of the R
//                         segments into one of them on a pool of 2 threads (the sidecar, as
//                         with peer reads: one result), then the R threads each copy that
//                         result into their tensor at once. bytes_per_second = tensor bytes
//                         per second (algbw; busbw = algbw x 2(R-1)/R) with no control path:
//                         the ceiling of the staged heap all_reduce on this machine.
//   BM_StagedHeapBroadcast the same for a broadcast: the root's thread copies its tensor
//     /ranks:R            into a segment, then R-1 threads copy it into theirs at once.
//   BM_BroadcastCopyOut   only the R-1 receivers' concurrent copies: what any design must do
//     /ranks:R            to fill R-1 private tensors (the ceiling of a heap broadcast that
//                         stages nothing at the root).
//   BM_PipelinedHeapBroadcast the staged broadcast with the root's copy hidden under the
//     /ranks:R            reads: the root's thread copies 1 MiB chunks into the segment and
//                         publishes how far it got (an atomic), the R-1 receivers copy each
//                         chunk out as soon as it is there (spinning with yield between
//                         chunks). The ceiling of "a chunked root copy-in that the readers follow".
//   BM_VmReadBroadcast    R-1 receivers read the root's tensor straight from its memory with
//     /ranks:R            process_vm_readv(2) (here the process reads itself: the kernel pins
//                         the pages and copies them the same way as from another process). The
//                         ceiling of a broadcast whose receivers may ptrace the root.
//
// Run: build/bench/collserve-membw [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "backends/local_ops.h"

namespace {

// The all_reduce's tensors.
constexpr size_t kBytes = 64 << 20;
// The bandwidth benchmarks' buffers: twice as large, so that each touches at least the
// all_reduce's 4 x 64 MiB. With 64 MiB buffers, sum's 192 MiB sometimes half fitted in the
// host's caches (a shared VM: twice the rate, depending on the neighbours) and the "bound"
// was the cache's, not memory's.
constexpr size_t kStreamBytes = 128 << 20;

std::vector<float> Filled(float v, size_t bytes = kBytes) { return std::vector<float>(bytes / sizeof(float), v); }

void BM_Memcpy(benchmark::State& state) {
  std::vector<char> src(kStreamBytes, 1), dst(kStreamBytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kStreamBytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kStreamBytes);
}
BENCHMARK(BM_Memcpy)->UseRealTime()->Unit(benchmark::kMillisecond);

// Runs `element(i)` for every i < n, the range split among state.range(0) threads (a
// ThreadPool, the benchmark's thread included), once per benchmark iteration; counts
// kStreamBytes per iteration.
template <typename F>
void SplitAmongThreads(benchmark::State& state, size_t n, const float* result, F element) {
  const int threads = static_cast<int>(state.range(0));
  collserve::backends::ThreadPool pool(threads);
  const size_t per = n / static_cast<size_t>(threads);
  for (auto _ : state) {
    pool.ParallelFor(static_cast<size_t>(threads), [&](size_t t) {
      for (size_t i = t * per; i < (t + 1) * per; ++i) element(i);
    });
    benchmark::DoNotOptimize(result);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kStreamBytes));
}

// c = a + b over 128 MiB float32 buffers.
void BM_Sum(benchmark::State& state) {
  std::vector<float> a = Filled(1.0f, kStreamBytes), b = Filled(2.0f, kStreamBytes), c = Filled(0.0f, kStreamBytes);
  SplitAmongThreads(state, a.size(), c.data(), [&](size_t i) { c[i] = a[i] + b[i]; });
}
BENCHMARK(BM_Sum)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

// a += b over 128 MiB float32 buffers.
void BM_SumInPlace(benchmark::State& state) {
  std::vector<float> a = Filled(1.0f, kStreamBytes), b = Filled(0.0f, kStreamBytes);
  SplitAmongThreads(state, a.size(), a.data(), [&](size_t i) { a[i] += b[i]; });
}
BENCHMARK(BM_SumInPlace)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

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

// The staged benchmarks' arguments: ranks, then tensor bytes (1 MiB and 64 MiB, the sizes of
// issue 20's targets). The ranks (processes in the service) are the threads of a pool of
// `ranks` threads that each phase spreads one copy per rank over.
void StagedArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "bytes"})->Args({4, 1 << 20})->Args({4, 64 << 20})->UseRealTime()->Unit(benchmark::kMicrosecond);
}

struct Tensors {
  Tensors(int ranks, size_t bytes) : bytes(bytes), pool(ranks) {
    for (int r = 0; r < ranks; ++r) heap.push_back(Filled(1.0f, bytes));
  }
  size_t bytes;
  collserve::backends::ThreadPool pool;
  std::vector<std::vector<float>> heap;
};

// See the file comment.
void BM_StagedHeapAllReduce(benchmark::State& state) {
  Tensors t(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  collserve::backends::ThreadPool sidecar(2);
  std::vector<std::vector<float>> segment;
  for (size_t r = 0; r < t.heap.size(); ++r) segment.push_back(Filled(0.0f, t.bytes));
  collserve::backends::LocalReduce op;
  op.dtype = collserve::DataType::kFloat32;
  op.op = collserve::ReduceOp::kSum;
  op.count = t.bytes / sizeof(float);
  for (auto& s : segment) op.srcs.push_back(reinterpret_cast<const char*>(s.data()));
  op.dsts.push_back(reinterpret_cast<char*>(segment[0].data()));  // the owner's segment
  for (auto _ : state) {
    t.pool.ParallelFor(t.heap.size(), [&](size_t r) { std::memcpy(segment[r].data(), t.heap[r].data(), t.bytes); });
    collserve::backends::RunLocalReduce(sidecar, op);
    t.pool.ParallelFor(t.heap.size(), [&](size_t r) { std::memcpy(t.heap[r].data(), segment[0].data(), t.bytes); });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(1));
}
BENCHMARK(BM_StagedHeapAllReduce)->Apply(StagedArgs);

// Receivers 1..R-1 copy `source` into their tensors at once.
void CopyOut(Tensors& t, const float* source) {
  t.pool.ParallelFor(t.heap.size() - 1, [&](size_t i) { std::memcpy(t.heap[i + 1].data(), source, t.bytes); });
}

void BM_StagedHeapBroadcast(benchmark::State& state) {
  Tensors t(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  std::vector<float> segment = Filled(0.0f, t.bytes);
  for (auto _ : state) {
    std::memcpy(segment.data(), t.heap[0].data(), t.bytes);
    CopyOut(t, segment.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(1));
}
BENCHMARK(BM_StagedHeapBroadcast)->Apply(StagedArgs);

void BM_BroadcastCopyOut(benchmark::State& state) {
  Tensors t(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    CopyOut(t, t.heap[0].data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(1));
}
BENCHMARK(BM_BroadcastCopyOut)->Apply(StagedArgs);

// See the file comment.
void BM_PipelinedHeapBroadcast(benchmark::State& state) {
  Tensors t(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  std::vector<float> segment = Filled(0.0f, t.bytes);
  constexpr size_t kChunk = 1 << 20;
  char* seg = reinterpret_cast<char*>(segment.data());
  for (auto _ : state) {
    std::atomic<size_t> filled{0};
    // Rank 0 (the root) copies in; ranks 1..R-1 follow.
    t.pool.ParallelFor(t.heap.size(), [&](size_t r) {
      if (r == 0) {
        const char* src = reinterpret_cast<const char*>(t.heap[0].data());
        for (size_t off = 0; off < t.bytes; off += kChunk) {
          const size_t n = std::min(kChunk, t.bytes - off);
          std::memcpy(seg + off, src + off, n);
          filled.store(off + n, std::memory_order_release);
        }
        return;
      }
      char* dst = reinterpret_cast<char*>(t.heap[r].data());
      size_t done = 0;
      while (done < t.bytes) {
        const size_t avail = filled.load(std::memory_order_acquire);
        if (avail == done) {
          std::this_thread::yield();
          continue;
        }
        std::memcpy(dst + done, seg + done, avail - done);
        done = avail;
      }
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(1));
}
BENCHMARK(BM_PipelinedHeapBroadcast)->Apply(StagedArgs);

// See the file comment.
void BM_VmReadBroadcast(benchmark::State& state) {
  Tensors t(static_cast<int>(state.range(0)), static_cast<size_t>(state.range(1)));
  const pid_t self = getpid();
  std::atomic<bool> failed{false};
  for (auto _ : state) {
    t.pool.ParallelFor(t.heap.size() - 1, [&](size_t i) {
      iovec local{t.heap[i + 1].data(), t.bytes};
      iovec remote{t.heap[0].data(), t.bytes};
      if (process_vm_readv(self, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(t.bytes)) failed = true;
    });
    benchmark::ClobberMemory();
  }
  if (failed) state.SkipWithError("process_vm_readv failed or was short");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(1));
}
BENCHMARK(BM_VmReadBroadcast)->Apply(StagedArgs);

}  // namespace

BENCHMARK_MAIN();
