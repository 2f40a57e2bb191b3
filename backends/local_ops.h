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
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/types.h"

namespace collserve::backends {

// Whom a loop's chunks are for: a job, with its operator-set priority class and weight
// (collserve.v1.JobPolicy.priority_class and share_weight). The pool keeps one per name, for
// its whole life (ThreadPool::Tenant).
class PoolTenant {
 public:
  // Classes, lowest served first.
  static constexpr int kLatencyCritical = 0;
  static constexpr int kDefault = 1;
  static constexpr int kBulk = 2;

  const std::string& name() const { return name_; }
  // Nanoseconds of pool threads' time (callers' included) its chunks took so far.
  int64_t used_ns() const { return used_ns_.load(std::memory_order_relaxed); }
  // Chunks of its loops run so far (a loop run whole on its caller, one chunk or a pool
  // without workers, counts once).
  int64_t chunks() const { return chunks_.load(std::memory_order_relaxed); }
  // Loops it ran on the pool's threads, and the nanoseconds they waited, summed, from being
  // queued to their first chunk's start (the time other jobs' chunks held the threads).
  int64_t loops() const { return loops_.load(std::memory_order_relaxed); }
  int64_t wait_ns() const { return wait_ns_.load(std::memory_order_relaxed); }

 private:
  friend class ThreadPool;
  explicit PoolTenant(std::string name) : name_(std::move(name)) {}

  const std::string name_;
  std::atomic<int64_t> used_ns_{0};
  std::atomic<int64_t> chunks_{0};
  std::atomic<int64_t> loops_{0};
  std::atomic<int64_t> wait_ns_{0};
  // Guarded by the pool's mutex.
  int priority_ = kDefault;
  int weight_ = 1;
  int max_threads_ = 0;      // the most threads running its chunks at once (0 = no limit)
  int running_ = 0;          // threads running one of its chunks now
  int64_t vruntime_ns_ = 0;  // used time / weight, moved up to the least queued one's on waking
  int active_loops_ = 0;
};

// A fixed set of worker threads for data-parallel loops, shared by every job of a host.
// Thread-safe: several callers may run loops at once, and their chunks interleave on the
// workers and on the callers themselves.
//
// Scheduling (docs/architecture.md "Scheduling between jobs"): each time a thread takes a
// chunk it takes it from the loop whose tenant has the lowest priority class and, among
// those, the least virtual runtime (its chunks' time divided by its weight): weighted fair
// queueing between jobs, as Linux CFS does between threads. A tenant that had no loop
// queued starts at the least virtual runtime of its class's tenants with loops queued, so
// idleness earns no credit. (So weights act between jobs that keep loops queued: a job that
// issues one loop at a time has none queued between them, and the others run meanwhile;
// bench/RESULTS.md "Fair share between two busy jobs".) A caller takes the best loop's
// chunk too, whoever's it is (of its lane, below), until its own loop is claimed: a default
// job's thread serves a latency-critical job's reduction before its own.
// Chunks are the unit (kLocalChunkBytes): a loop waits for at most one chunk per thread of
// another before it runs. Nothing waits on another loop's completion, so no loop can hold
// up another past the chunks already taken.
//
// A tenant's thread quota (max_threads, JobPolicy.max_data_threads) caps the threads running
// its chunks at once, workers and callers alike: while that many run them, a thread passes
// over its loops and takes another tenant's chunk or waits (a caller whose own loop is
// passed over waits until it may take a chunk, or its loop is all claimed: chunks never
// block, so the wait ends). A loop of one chunk, or any loop of a pool without workers,
// runs whole on its caller and is not held back.
//
// The bulk lane (bulk_nice > 0): the classes above order the chunks a thread takes, but not
// the CPU the operating system gives the threads, and a bulk job's reductions keep every core
// busy between its chunks' picks while a latency-critical job's ranks, sessions and executor
// wait for a core. With a bulk lane, bulk-class loops (the tenant's class when the loop was
// queued) run only on threads of their own at `bulk_nice` more than the process's nice value
// (threads - 1 bulk workers, and the executors of bulk jobs' groups: EnterBulkLane), and the
// other loops only on the other workers and callers: the kernel then gives the bulk threads
// the cores only when nothing of a better class wants them (a nice-10 thread gets about a
// tenth of a core beside a busy nice-0 one: the kernel's weights). Raising a thread's nice
// value needs no privilege; lowering it does, so a thread never leaves the bulk lane.
class ThreadPool {
 public:
  // `threads` >= 1 in total, the caller included (threads - 1 workers are started, and with
  // `bulk_nice` > 0 another threads - 1 for the bulk lane). `now_ns` (tests: a fake clock;
  // null = std::chrono::steady_clock) is the clock chunks are timed and charged with.
  using NowNs = int64_t (*)();
  explicit ThreadPool(int threads, NowNs now_ns = nullptr, int bulk_nice = 0);
  ~ThreadPool();  // joins the workers; no loop may be running
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Whether bulk-class loops have a lane of their own (bulk_nice > 0 and threads > 1).
  bool bulk_lane() const { return bulk_nice_ > 0; }
  // Moves the calling thread into the bulk lane: raises its nice value by bulk_nice (at most
  // 19); nothing without a bulk lane. For the threads that run bulk jobs' work outside the
  // pool (a bulk group's executor, which is also the caller of its loops). Irreversible for
  // an unprivileged process. OK, or the error of setpriority(2).
  absl::Status EnterBulkLane() const;

  // Most tenants the pool keeps; past them, new names share one tenant ("(others)").
  static constexpr size_t kMaxTenants = 4096;

  // The tenant named `name` (made on first use), with its class set to `priority`
  // (clamped to [kLatencyCritical, kBulk]), its weight to `weight` (clamped to [1, 1000])
  // and its thread quota to `max_threads` (0 or less: no limit). Valid for the pool's life.
  // Thread-safe.
  PoolTenant* Tenant(const std::string& name, int priority, int weight, int max_threads = 0);

  // One tenant's class, weight and counters (PoolTenant), for metrics.
  struct TenantUsage {
    std::string name;
    int priority = PoolTenant::kDefault;
    int weight = 1;
    int64_t used_ns = 0;
    int64_t chunks = 0;
    int64_t loops = 0;
    int64_t wait_ns = 0;
  };
  // Every tenant that ran a chunk, by name. Thread-safe.
  std::vector<TenantUsage> Usage();
  // `tenant`'s virtual runtime now (its charged nanoseconds / weight, moved up on waking),
  // the key the scheduler orders a class's tenants by. Thread-safe; for tests and debugging.
  int64_t VirtualRuntimeNs(const PoolTenant* tenant);

  // Calls fn(i) for every i in [0, n), each exactly once, on the pool and the calling
  // thread, and returns when all calls have returned. fn must not throw. `tenant` (null:
  // the pool's default tenant) is whom the chunks count for.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn, PoolTenant* tenant = nullptr);

 private:
  struct Loop;
  // Which loops a thread takes: every loop (no bulk lane), or only bulk ones / only others.
  enum class Lane { kAny, kBulk, kOther };
  void WorkerMain(Lane lane);
  // The loop of `lane` whose next chunk runs next (see the class comment); null when none
  // has an unclaimed chunk that may be taken (a tenant at its thread quota is passed over).
  std::shared_ptr<Loop> PickLocked(Lane lane) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Claims the next chunk of `loop`, dropping it from loops_ once every chunk is claimed.
  size_t ClaimLocked(Loop* loop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs chunk `i` of `loop` and returns the nanoseconds it took (charged by ChargeLocked).
  int64_t RunChunk(Loop* loop, size_t i);
  // Charges a chunk that took `ns` to `tenant` and ends its count as running.
  void ChargeLocked(PoolTenant* tenant, int64_t ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::vector<std::shared_ptr<Loop>> loops_ ABSL_GUARDED_BY(mu_);  // loops with unclaimed indices
  std::map<std::string, std::unique_ptr<PoolTenant>> tenants_ ABSL_GUARDED_BY(mu_);
  PoolTenant* default_tenant_;  // "" (set in the constructor)
  const NowNs now_ns_;
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int bulk_nice_ = 0;  // > 0: the bulk lane's threads run this much nicer
  std::vector<std::thread> workers_;       // every loop, or (bulk lane) the other classes'
  std::vector<std::thread> bulk_workers_;  // the bulk lane's
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
// `tenant` (null: the pool's default) is whom its chunks count for (ThreadPool::ParallelFor).
void RunLocalReduce(ThreadPool& pool, const LocalReduce& r, PoolTenant* tenant = nullptr);

// One copy of a list: dst[0..bytes) = src[0..bytes). Ranges must not overlap, or be the same
// range (dst == src: skipped).
struct CopyJob {
  char* dst;
  const char* src;
  size_t bytes;
};

// Runs every copy, cut into chunks of kLocalChunkBytes spread over `pool` (memcpy).
void RunCopies(ThreadPool& pool, const std::vector<CopyJob>& jobs, PoolTenant* tenant = nullptr);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_LOCAL_OPS_H_
