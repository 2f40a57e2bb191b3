// The intra-host data path of a sidecar: reductions and copies among the shared-memory
// tensors of one host's ranks, cut into cache-sized chunks and spread over a thread pool.
//
// Each chunk is reduced into a per-thread scratch block that stays in cache and is then
// written to every destination, so an in-place all_reduce among n local ranks reads and
// writes each rank's tensor once (n reads + n writes of the tensor's bytes: the least any
// in-place all_reduce of n separate buffers can move; bench/RESULTS.md derives the
// bandwidth bound from it). Kernels are the element-wise loops of reduce.h, which the
// compiler vectorizes (-O3).
#ifndef COLLSERVE_BACKENDS_LOCAL_OPS_H_
#define COLLSERVE_BACKENDS_LOCAL_OPS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/types.h"

namespace collserve::backends {

// A fixed set of worker threads for data-parallel loops. Thread-safe: several callers may
// run loops at once (their chunks interleave on the workers). The calling thread works on
// its own loop too, so a pool of `threads` uses `threads` cores per loop.
class ThreadPool {
 public:
  // `threads` >= 1 in total, the caller included (threads - 1 workers are started).
  explicit ThreadPool(int threads);
  ~ThreadPool();  // joins the workers; no loop may be running
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) for every i in [0, n), each exactly once, on the pool and the calling
  // thread, and returns when all calls have returned. fn must not throw.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Loop;
  void WorkerMain();

  absl::Mutex mu_;
  std::vector<std::shared_ptr<Loop>> loops_ ABSL_GUARDED_BY(mu_);  // loops with unclaimed indices
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// Bytes per chunk: the unit of work one pool thread takes (RunLocalReduce walks it in 1 KiB
// blocks, every source and destination advancing together).
inline constexpr size_t kLocalChunkBytes = 64 * 1024;

// One element-wise reduction: dsts[k][i] = op over j of (srcs[j][i] * premul[j]), divided
// by `divisor`, for i < count and every destination k.
struct LocalReduce {
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // kAvg/kPremulSum reduce as kSum (use premul/divisor)
  std::vector<const char*> srcs;  // >= 1 inputs, count elements each
  std::vector<double> premul;     // empty, or one factor per src (PREMUL_SUM; floating dtypes)
  int64_t divisor = 1;            // > 1: divide the result (AVG); not for kBool
  std::vector<char*> dsts;        // >= 1 outputs; each may alias a src (in place)
  size_t count = 0;               // elements
};

// Runs `r` on `pool`. Sources are only read (a destination that aliases a source is read
// before it is written, chunk by chunk). Thread-safe for disjoint destinations.
// REQUIRES ValidateReduce(dtype, op).ok(); srcs and dsts non-null when count > 0.
void RunLocalReduce(ThreadPool& pool, const LocalReduce& r);

// One copy of a list: dst[0..bytes) = src[0..bytes). Ranges must not overlap.
struct CopyJob {
  char* dst;
  const char* src;
  size_t bytes;
};

// Runs every copy, cut into chunks of kLocalChunkBytes spread over `pool` (memcpy).
void RunCopies(ThreadPool& pool, const std::vector<CopyJob>& jobs);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_LOCAL_OPS_H_
