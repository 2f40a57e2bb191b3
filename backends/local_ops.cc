#include "backends/local_ops.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>

#include "absl/memory/memory.h"

#include "backends/reduce.h"

namespace collserve::backends {

struct ThreadPool::Loop {
  const std::function<void(size_t)>* fn = nullptr;
  size_t n = 0;
  PoolTenant* tenant = nullptr;
  bool bulk = false;   // in the bulk lane (its tenant was of the bulk class when it was queued)
  uint64_t order = 0;  // arrival, the last tie-breaker
  std::chrono::steady_clock::time_point queued;
  size_t next = 0;     // the next unclaimed index; guarded by the pool's mu_
  std::atomic<size_t> finished{0};
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
};

namespace {
int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

ThreadPool::ThreadPool(int threads, NowNs now_ns, int bulk_nice)
    : now_ns_(now_ns != nullptr ? now_ns : &SteadyNowNs), bulk_nice_(threads > 1 ? std::max(bulk_nice, 0) : 0) {
  {
    absl::MutexLock lock(&mu_);
    default_tenant_ = tenants_.emplace("", absl::WrapUnique(new PoolTenant(""))).first->second.get();
  }
  const Lane lane = bulk_lane() ? Lane::kOther : Lane::kAny;
  for (int i = 1; i < std::max(threads, 1); ++i) workers_.emplace_back([this, lane] { WorkerMain(lane); });
  if (bulk_lane()) {
    for (int i = 1; i < threads; ++i) {
      bulk_workers_.emplace_back([this] {
        (void)EnterBulkLane();  // on failure (no such limit is known) it runs at the pool's priority
        WorkerMain(Lane::kBulk);
      });
    }
  }
}

absl::Status ThreadPool::EnterBulkLane() const {
  if (!bulk_lane()) return absl::OkStatus();
  const id_t tid = static_cast<id_t>(syscall(SYS_gettid));
  errno = 0;
  const int now = getpriority(PRIO_PROCESS, tid);
  if (now == -1 && errno != 0) return absl::ErrnoToStatus(errno, "getpriority");
  if (setpriority(PRIO_PROCESS, tid, std::min(now + bulk_nice_, 19)) != 0) {
    return absl::ErrnoToStatus(errno, "setpriority");
  }
  return absl::OkStatus();
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
  for (std::thread& t : bulk_workers_) t.join();
}

PoolTenant* ThreadPool::Tenant(const std::string& name, int priority, int weight, int max_threads) {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(name);
  if (it == tenants_.end()) {
    if (tenants_.size() >= kMaxTenants) {
      // Past the bound, every new name shares one tenant of the default class.
      auto [others, made] = tenants_.try_emplace("(others)");
      if (made) others->second = absl::WrapUnique(new PoolTenant("(others)"));
      return others->second.get();
    }
    it = tenants_.emplace(name, absl::WrapUnique(new PoolTenant(name))).first;
  }
  PoolTenant* t = it->second.get();
  t->priority_ = std::clamp(priority, PoolTenant::kLatencyCritical, PoolTenant::kBulk);
  t->weight_ = std::clamp(weight, 1, 1000);
  t->max_threads_ = std::max(max_threads, 0);
  return t;
}

std::vector<ThreadPool::TenantUsage> ThreadPool::Usage() {
  std::vector<TenantUsage> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, t] : tenants_) {
    if (t->chunks() == 0) continue;
    out.push_back(TenantUsage{name, t->priority_, t->weight_, t->used_ns(), t->chunks(), t->loops(), t->wait_ns()});
  }
  return out;
}

int64_t ThreadPool::VirtualRuntimeNs(const PoolTenant* tenant) {
  absl::MutexLock lock(&mu_);
  return tenant->vruntime_ns_;
}

std::shared_ptr<ThreadPool::Loop> ThreadPool::PickLocked(Lane lane) {
  std::shared_ptr<Loop> best;
  for (const std::shared_ptr<Loop>& l : loops_) {
    if (lane != Lane::kAny && l->bulk != (lane == Lane::kBulk)) continue;  // the other lane's
    const PoolTenant& t = *l->tenant;
    if (t.max_threads_ > 0 && t.running_ >= t.max_threads_) continue;  // at its quota
    if (best == nullptr) {
      best = l;
      continue;
    }
    const PoolTenant& a = *l->tenant;
    const PoolTenant& b = *best->tenant;
    if (std::tie(a.priority_, a.vruntime_ns_, l->order) < std::tie(b.priority_, b.vruntime_ns_, best->order)) best = l;
  }
  return best;
}

size_t ThreadPool::ClaimLocked(Loop* loop) {
  if (loop->next == 0) {
    const auto waited = std::chrono::steady_clock::now() - loop->queued;
    loop->tenant->loops_.fetch_add(1, std::memory_order_relaxed);
    loop->tenant->wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(),
                                     std::memory_order_relaxed);
  }
  const size_t i = loop->next++;
  ++loop->tenant->running_;  // until ChargeLocked
  if (loop->next == loop->n) {
    loops_.erase(std::find_if(loops_.begin(), loops_.end(), [&](const auto& l) { return l.get() == loop; }));
    --loop->tenant->active_loops_;
  }
  return i;
}

int64_t ThreadPool::RunChunk(Loop* loop, size_t i) {
  const int64_t start = now_ns_();
  (*loop->fn)(i);
  const int64_t ns = now_ns_() - start;
  // The last chunk to finish wakes the loop's caller, which may then return (fn goes away).
  if (loop->finished.fetch_add(1, std::memory_order_acq_rel) + 1 == loop->n) {
    absl::MutexLock lock(&loop->mu);
    loop->done = true;
  }
  return ns;
}

void ThreadPool::ChargeLocked(PoolTenant* tenant, int64_t ns) {
  --tenant->running_;
  tenant->vruntime_ns_ += std::max<int64_t>(ns / tenant->weight_, 1);
  tenant->used_ns_.fetch_add(ns, std::memory_order_relaxed);
  tenant->chunks_.fetch_add(1, std::memory_order_relaxed);
}

void ThreadPool::WorkerMain(Lane lane) {
  PoolTenant* charge = nullptr;  // the chunk this thread ran last, charged at its next pick
  int64_t ns = 0;
  for (;;) {
    std::shared_ptr<Loop> loop;
    size_t i;
    {
      absl::MutexLock lock(&mu_);
      if (charge != nullptr) ChargeLocked(charge, ns);
      charge = nullptr;
      // A loop it may take: one with an unclaimed chunk whose tenant is under its quota.
      auto ready = [this, lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || PickLocked(lane) != nullptr; };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      loop = PickLocked(lane);  // the same one: the condition held with the lock, still held
      i = ClaimLocked(loop.get());
    }
    charge = loop->tenant;
    ns = RunChunk(loop.get(), i);
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn, PoolTenant* tenant) {
  if (n == 0) return;
  PoolTenant* const mine = tenant != nullptr ? tenant : default_tenant_;
  if (n == 1 || workers_.empty()) {
    const int64_t start = now_ns_();
    for (size_t i = 0; i < n; ++i) fn(i);
    const int64_t ns = now_ns_() - start;
    absl::MutexLock lock(&mu_);
    ++mine->running_;  // (ChargeLocked ends it)
    ChargeLocked(mine, ns);
    return;
  }
  auto loop = std::make_shared<Loop>();
  loop->fn = &fn;
  loop->n = n;
  loop->tenant = mine;
  Lane lane = Lane::kAny;
  {
    absl::MutexLock lock(&mu_);
    loop->bulk = mine->priority_ == PoolTenant::kBulk;
    // The caller takes chunks of its own loop's lane only: a bulk executor (a nicer thread)
    // never holds a better class's chunk, nor another's thread a bulk one.
    if (bulk_lane()) lane = loop->bulk ? Lane::kBulk : Lane::kOther;
    loop->order = next_order_++;
    loop->queued = std::chrono::steady_clock::now();
    if (mine->active_loops_ == 0) {
      // Waking: no credit for the time it had nothing queued (the least virtual runtime of
      // its class's queued tenants, if that is more than its own; it was the most of them,
      // which put a waking job behind every busy one of its class once there were three).
      int64_t least = std::numeric_limits<int64_t>::max();
      for (const std::shared_ptr<Loop>& l : loops_) {
        if (l->tenant->priority_ == mine->priority_ && l->tenant != mine) {
          least = std::min(least, l->tenant->vruntime_ns_);
        }
      }
      if (least != std::numeric_limits<int64_t>::max()) mine->vruntime_ns_ = std::max(mine->vruntime_ns_, least);
    }
    ++mine->active_loops_;
    loops_.push_back(loop);
  }
  // Until its own loop is claimed, the caller runs the best loop's chunks (its own or another's).
  PoolTenant* charge = nullptr;
  int64_t ns = 0;
  for (;;) {
    std::shared_ptr<Loop> run;
    size_t i;
    {
      absl::MutexLock lock(&mu_);
      if (charge != nullptr) ChargeLocked(charge, ns);
      charge = nullptr;
      if (loop->next >= loop->n) break;
      // Its own loop's tenant may be at its quota (other threads run its chunks): then it
      // waits until a chunk may be taken, or its loop is all claimed.
      auto can = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return loop->next >= loop->n || PickLocked(lane) != nullptr;
      };
      mu_.Await(absl::Condition(&can));
      if (loop->next >= loop->n) break;
      run = PickLocked(lane);
      i = ClaimLocked(run.get());
    }
    charge = run->tenant;
    ns = RunChunk(run.get(), i);
  }
  absl::MutexLock lock(&loop->mu);
  loop->mu.Await(absl::Condition(&loop->done));
}

namespace {

// A chunk is reduced in blocks of this many bytes (see RunLocalReduce).
constexpr size_t kL1BlockBytes = 1024;

// Per-thread scratch blocks of kL1BlockBytes (the running result and a scaled input), on
// the heap: a thread_local array would be static TLS, which glibc carves out of every
// thread's stack, so libraries that start threads with small stacks (civetweb, behind the
// metrics endpoint: 100 KiB) could no longer start them.
struct ScratchBlocks {
  struct alignas(64) Block {
    char bytes[kL1BlockBytes];
  };
  std::unique_ptr<Block[]> blocks = std::make_unique<Block[]>(2);
};
char* Scratch(int which) {
  static thread_local ScratchBlocks scratch;
  return scratch.blocks[which].bytes;
}

// Copies get larger pieces than reductions: they have no scratch block to keep in cache.
constexpr size_t kCopyChunkBytes = 256 * 1024;

}  // namespace

void RunLocalReduce(ThreadPool& pool, const LocalReduce& r, PoolTenant* tenant) {
  if (r.count == 0 || r.srcs.empty() || r.dsts.empty()) return;
  const size_t es = ElementSize(r.dtype);
  const size_t per_chunk = kLocalChunkBytes / es;
  const size_t chunks = (r.count + per_chunk - 1) / per_chunk;
  const ReduceOp op = (r.op == ReduceOp::kAvg || r.op == ReduceOp::kPremulSum) ? ReduceOp::kSum : r.op;
  const bool scaled = !r.premul.empty();
  // Each chunk in 1 KiB blocks: every source and destination advances 1 KiB at a time, so
  // the hardware prefetchers see all of them as concurrent sequential streams, and the
  // running result (read and rewritten once per source) never leaves L1. Measured with
  // collserve-membw (4 x 64 MiB, 2 threads): 6.0-6.8 GB/s algbw with 8 and 64 KiB blocks,
  // 9.2-9.7 with 512 B to 1 KiB.
  const size_t per_block = std::max<size_t>(kL1BlockBytes / es, 1);
  pool.ParallelFor(chunks, [&](size_t c) {
    const size_t chunk_first = c * per_chunk;
    const size_t chunk_end = std::min(chunk_first + per_chunk, r.count);
    for (size_t first = chunk_first; first < chunk_end; first += per_block) {
    const size_t n = std::min(per_block, chunk_end - first);
    const size_t off = first * es;
    const size_t bytes = n * es;
    char* acc = Scratch(0);
    size_t j = 0;
    if (!scaled && r.srcs.size() >= 2) {
      Reduce(r.dtype, op, acc, r.srcs[0] + off, r.srcs[1] + off, n);
      j = 2;
    }
    for (; j < r.srcs.size(); ++j) {
      const char* src = r.srcs[j] + off;
      if (scaled) {
        char* tmp = j == 0 ? acc : Scratch(1);
        std::memcpy(tmp, src, bytes);
        ScaleInPlace(r.dtype, tmp, n, r.premul[j]);
        src = tmp;
      }
      if (j == 0) {
        if (src != acc) std::memcpy(acc, src, bytes);
      } else {
        Reduce(r.dtype, op, acc, acc, src, n);
      }
    }
    if (r.divisor > 1) DivideInPlace(r.dtype, acc, n, r.divisor);
    for (char* dst : r.dsts) std::memcpy(dst + off, acc, bytes);
    }
  }, tenant);
}

void RunCopies(ThreadPool& pool, const std::vector<CopyJob>& jobs, PoolTenant* tenant) {
  // Chunk i of the whole list: find its job by the prefix sums of the jobs' chunk counts.
  std::vector<size_t> first_chunk(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    // A copy onto itself (a rank's own piece of an in-place all_gather) has nothing to do: it
    // gets no chunks.
    const size_t bytes = jobs[j].dst == jobs[j].src ? 0 : jobs[j].bytes;
    first_chunk[j + 1] = first_chunk[j] + (bytes + kCopyChunkBytes - 1) / kCopyChunkBytes;
  }
  pool.ParallelFor(first_chunk.back(), [&](size_t c) {
    const size_t j = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), c) -
                                         first_chunk.begin()) - 1;
    const size_t off = (c - first_chunk[j]) * kCopyChunkBytes;
    std::memcpy(jobs[j].dst + off, jobs[j].src + off, std::min(kCopyChunkBytes, jobs[j].bytes - off));
  }, tenant);
}

}  // namespace collserve::backends
