// The sidecar's intra-host data path (backends/local_ops.h): the thread pool and the
// chunked reduction and copies, checked element by element against plain loops.
#include "backends/local_ops.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <set>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#include "backends/reduce.h"
#include "tests/testing/wait_for.h"

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

// Busy for `d` (a chunk of work that takes time on a core, not a sleep).
void Spin(std::chrono::microseconds d) {
  const auto end = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < end) {
  }
}

// Appends one letter per chunk, in the order the chunks start.
class ChunkLog {
 public:
  void Add(char c) {
    absl::MutexLock lock(&mu_);
    order_.push_back(c);
  }
  std::string Get() {
    absl::MutexLock lock(&mu_);
    return order_;
  }

 private:
  absl::Mutex mu_;
  std::string order_ ABSL_GUARDED_BY(mu_);
};

TEST(ThreadPoolSchedulingTest, ALatencyCriticalLoopRunsBeforeTheRestOfABulkLoop) {
  ThreadPool pool(2);
  PoolTenant* bulk = pool.Tenant("train", PoolTenant::kBulk, 1);
  PoolTenant* urgent = pool.Tenant("serve", PoolTenant::kLatencyCritical, 1);
  constexpr size_t kBulk = 400;
  constexpr size_t kUrgent = 20;
  ChunkLog log;
  std::atomic<int> bulk_started{0};
  std::thread b([&] {
    pool.ParallelFor(kBulk, [&](size_t) {
      log.Add('b');
      bulk_started.fetch_add(1);
      Spin(std::chrono::microseconds(50));
    }, bulk);
  });
  ASSERT_TRUE(testing::WaitFor([&] { return bulk_started.load() >= 4; }, absl::Seconds(10), absl::Milliseconds(1)));
  pool.ParallelFor(kUrgent, [&](size_t) {
    log.Add('u');
    Spin(std::chrono::microseconds(50));
  }, urgent);
  b.join();
  const std::string order = log.Get();
  ASSERT_EQ(order.size(), kBulk + kUrgent);
  const size_t first = order.find('u');
  ASSERT_NE(first, std::string::npos);
  // Once the urgent loop is queued, no thread claims a bulk chunk until every urgent chunk is
  // claimed. The log has chunks as they start, and a thread may be preempted between
  // claiming a chunk and starting it (at most one each: the worker and the two callers), so
  // up to 3 urgent chunks may show up late; up to the urgent loop's (kUrgent - 3)th chunk,
  // only the bulk chunks claimed before it was queued (one per thread that was running bulk
  // chunks: the worker and the bulk caller) may start.
  size_t last = first;
  for (size_t seen = 0; last < order.size(); ++last) {
    if (order[last] == 'u' && ++seen == kUrgent - 3) break;
  }
  const auto interleaved = std::count(order.begin() + first, order.begin() + last, 'b');
  EXPECT_LE(interleaved, 2) << order;
  // A worker charges a chunk when it next takes the pool's lock, just after the chunk.
  EXPECT_TRUE(testing::WaitFor([&] { return urgent->chunks() == static_cast<int64_t>(kUrgent); }, absl::Seconds(10)))
      << urgent->chunks();
  EXPECT_TRUE(testing::WaitFor([&] { return bulk->chunks() == static_cast<int64_t>(kBulk); }, absl::Seconds(10)))
      << bulk->chunks();
  EXPECT_GT(urgent->used_ns(), 0);
}

// Each thread's own fake clock: a chunk advances its thread's clock by what it "took", so the
// pool charges every chunk exactly that, whatever else the machine runs.
thread_local int64_t fake_now_ns = 0;
int64_t FakeNowNs() { return fake_now_ns; }

// Runs a weight-1 and a weight-3 loop of one class at once; returns the chunks each started
// while both were queued (light, heavy) and the order of all chunks.
std::tuple<int64_t, int64_t, std::string> ShareOfTwoLoops(ThreadPool& pool, PoolTenant* light, PoolTenant* heavy) {
  constexpr size_t kChunks = 1500;
  ChunkLog log;
  std::atomic<int> started{0};
  auto run = [&](PoolTenant* t, char c) {
    started.fetch_add(1);
    while (started.load() < 2) std::this_thread::yield();  // both queue at about the same time
    pool.ParallelFor(kChunks, [&](size_t) {
      log.Add(c);
      Spin(std::chrono::microseconds(20));  // real work, so that the two loops overlap
      fake_now_ns += 100000;                // charged as 100 us, whatever the machine's load
    }, t);
  };
  std::thread a([&] { run(light, 'l'); });
  std::thread b([&] { run(heavy, 'h'); });
  a.join();
  b.join();
  std::string order = log.Get();
  // While both ran: from the later one's first chunk until either had claimed all of its
  // chunks. The log has chunks as they start, and a thread may be preempted between claiming
  // a chunk and starting it (one per thread: the worker and the two callers), so the window
  // ends 3 chunks before either one's last.
  const size_t from = std::max(order.find('l'), order.find('h'));
  size_t l = 0, h = 0;
  for (size_t i = 0; i < from; ++i) (order[i] == 'l' ? l : h)++;
  size_t to = from;
  for (; to < order.size() && l < kChunks - 3 && h < kChunks - 3; ++to) (order[to] == 'l' ? l : h)++;
  return {std::count(order.begin() + from, order.begin() + to, 'l'),
          std::count(order.begin() + from, order.begin() + to, 'h'), order};
}

TEST(ThreadPoolSchedulingTest, JobsOfOneClassShareTheThreadsByWeight) {
  ThreadPool pool(2, &FakeNowNs);
  PoolTenant* light = pool.Tenant("a", PoolTenant::kDefault, 1);
  PoolTenant* heavy = pool.Tenant("b", PoolTenant::kDefault, 3);
  // A loaded machine may start one loop's thread after the other's loop is mostly done: up
  // to 5 tries for a window where both ran at least 100 chunks of the light one.
  int64_t lw = 0, hw = 0;
  std::string order;
  for (int attempt = 0; attempt < 5 && lw < 100; ++attempt) std::tie(lw, hw, order) = ShareOfTwoLoops(pool, light, heavy);
  ASSERT_GE(lw, 100) << order;
  // Weighted fair share: 3 to 1 in charged time, so in chunks (each thread's last chunk is
  // charged at its next pick, so a few chunks either way).
  const double ratio = static_cast<double>(hw) / static_cast<double>(lw);
  EXPECT_GT(ratio, 2.5) << order;
  EXPECT_LT(ratio, 3.5) << order;
  EXPECT_EQ(light->used_ns() % 100000, 0);
}

// A job that had nothing queued starts at the least virtual runtime of its class's jobs with
// loops queued (no credit for its idle time, and no debt either): with jobs at 1 ms and 10 ms
// queued, a waking one starts at 1 ms (it was put at the most, 10 ms: behind every busy job).
// Deterministic: every chunk blocks until the end, so nothing is charged meanwhile.
TEST(ThreadPoolSchedulingTest, AWakingJobStartsAtTheLeastVirtualRuntimeOfItsClass) {
  ThreadPool pool(2, &FakeNowNs);  // one worker and the callers
  PoolTenant* x = pool.Tenant("x", PoolTenant::kDefault, 1);
  PoolTenant* y = pool.Tenant("y", PoolTenant::kDefault, 1);
  PoolTenant* z = pool.Tenant("z", PoolTenant::kDefault, 1);
  // One chunk runs whole on its caller and is charged at once: x 1 ms, y 10 ms.
  pool.ParallelFor(1, [](size_t) { fake_now_ns += 1000000; }, x);
  pool.ParallelFor(1, [](size_t) { fake_now_ns += 10000000; }, y);
  ASSERT_EQ(pool.VirtualRuntimeNs(x), 1000000);
  ASSERT_EQ(pool.VirtualRuntimeNs(y), 10000000);
  ASSERT_EQ(pool.VirtualRuntimeNs(z), 0);
  absl::Notification release;
  std::atomic<int> blocked{0};
  const auto block = [&](size_t) {
    blocked.fetch_add(1);
    release.WaitForNotification();
  };
  // x's loop: its caller and the worker each hold one of its chunks, 8 stay queued.
  std::thread tx([&] { pool.ParallelFor(10, block, x); });
  ASSERT_TRUE(testing::WaitFor([&] { return blocked.load() == 2; }, absl::Seconds(10)));
  // y's loop queued: its caller takes x's next chunk (x is behind), y's 3 stay queued.
  std::thread ty([&] { pool.ParallelFor(3, block, y); });
  ASSERT_TRUE(testing::WaitFor([&] { return blocked.load() == 3; }, absl::Seconds(10)));
  // z wakes while x (1 ms) and y (10 ms) have loops queued.
  std::thread tz([&] { pool.ParallelFor(2, block, z); });
  ASSERT_TRUE(testing::WaitFor([&] { return blocked.load() == 4; }, absl::Seconds(10)));
  EXPECT_EQ(pool.VirtualRuntimeNs(z), 1000000);
  release.Notify();
  tx.join();
  ty.join();
  tz.join();
}

// Two jobs of one class and weight, each issuing a mix of loops (collectives of different
// sizes and per-chunk costs: 2 to 35 chunks of 10 to 99 us, 500 loops each, 1,000 in all)
// from two threads, each thread one loop at a time as a group's executor does: while both are
// busy, each gets within 20% of an equal share of the pool's time (no job starved by the
// other's mix). Both jobs run the same 500 loops in different orders, so that neither's mix
// makes it demand more than the other (a job with cheaper chunks asks for less time per chunk
// it queues: under a sanitizer's overhead that alone moved the shares to 0.75). A chunk busies
// its thread for its cost and the fake clock charges exactly that. (What this does not show:
// weights. A job that issues one loop at a time per thread has nothing queued between its
// loops, so the others' chunks run meanwhile and the shares follow what each job has queued,
// whatever the weights: 1:3 weights gave the same shares here, also with 1 or 8 threads per
// job, larger loops, and with a bounded credit for the gap at wake-up (tried: there is nothing
// queued to spend it on; not kept). JobsOfOneClassShareTheThreadsByWeight shows the weights
// between jobs that keep a loop queued.) Returns each job's charged microseconds in the window
// where both ran (from the later one's first chunk until either had 8 chunks left), and the
// jobs' order in it.
std::tuple<int64_t, int64_t, std::string> MixedShares(ThreadPool& pool, PoolTenant* a, PoolTenant* b) {
  constexpr int kThreadsPerJob = 2;
  constexpr int kLoops = 500;  // per job
  struct Chunk {
    char job;
    int64_t cost_us;
  };
  absl::Mutex mu;
  std::vector<Chunk> order;
  std::atomic<int> started{0};
  auto run = [&](PoolTenant* t, char job, int thread) {
    started.fetch_add(1);
    while (started.load() < 2 * kThreadsPerJob) std::this_thread::yield();
    for (int i = thread; i < kLoops; i += kThreadsPerJob) {
      // Job 'a' runs the loops in order, job 'b' in another (263 is prime to 500).
      const int k = job == 'a' ? i : (i * 263) % kLoops;
      const size_t chunks = 2 + (k * 7) % 34;
      const int64_t cost_us = 10 + (k * 37) % 90;
      pool.ParallelFor(chunks, [&](size_t) {
        {
          absl::MutexLock lock(&mu);
          order.push_back(Chunk{job, cost_us});
        }
        Spin(std::chrono::microseconds(cost_us));
        fake_now_ns += cost_us * 1000;
      }, t);
    }
  };
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreadsPerJob; ++th) {
    threads.emplace_back([&, th] { run(a, 'a', th); });
    threads.emplace_back([&, th] { run(b, 'b', th); });
  }
  for (std::thread& t : threads) t.join();
  size_t total[2] = {0, 0};
  for (const Chunk& c : order) ++total[c.job - 'a'];
  size_t first[2] = {order.size(), order.size()};
  for (size_t i = 0; i < order.size(); ++i) first[order[i].job - 'a'] = std::min(first[order[i].job - 'a'], i);
  const size_t from = std::max(first[0], first[1]);
  size_t seen[2] = {0, 0};
  for (size_t i = 0; i < from; ++i) ++seen[order[i].job - 'a'];
  int64_t used[2] = {0, 0};
  std::string jobs;
  for (size_t i = from; i < order.size() && seen[0] + 8 < total[0] && seen[1] + 8 < total[1]; ++i) {
    ++seen[order[i].job - 'a'];
    used[order[i].job - 'a'] += order[i].cost_us;
    jobs.push_back(order[i].job);
  }
  return {used[0], used[1], jobs};
}

TEST(ThreadPoolSchedulingTest, TwoJobsOfOneClassGetEqualSharesOverAThousandMixedLoops) {
  ThreadPool pool(2, &FakeNowNs);
  PoolTenant* a = pool.Tenant("job-a", PoolTenant::kDefault, 1);
  PoolTenant* b = pool.Tenant("job-b", PoolTenant::kDefault, 1);
  // A loaded machine may run one job's threads late: up to 3 tries for a window in which
  // each job was charged at least 50 ms.
  int64_t ua = 0, ub = 0;
  std::string order;
  for (int attempt = 0; attempt < 3 && std::min(ua, ub) < 50000; ++attempt) std::tie(ua, ub, order) = MixedShares(pool, a, b);
  ASSERT_GE(std::min(ua, ub), 50000) << order;
  const double share = static_cast<double>(ua) / static_cast<double>(ua + ub);
  EXPECT_GT(share, 0.4) << "job a " << ua << " us, job b " << ub << " us";
  EXPECT_LT(share, 0.6) << "job a " << ua << " us, job b " << ub << " us";
  std::printf("charged while both ran: job a %lld us, job b %lld us (share %.3f)\n",
              static_cast<long long>(ua), static_cast<long long>(ub), share);
}

// The most chunks of `tenant`'s loop of `n` that ran at once on `pool`, the loop run by one
// caller (each chunk busy for 200 us, so that the pool's threads overlap).
int MostAtOnce(ThreadPool& pool, PoolTenant* tenant, size_t n) {
  std::atomic<int> now{0}, most{0};
  pool.ParallelFor(n, [&](size_t) {
    const int at = now.fetch_add(1) + 1;
    int seen = most.load();
    while (at > seen && !most.compare_exchange_weak(seen, at)) {
    }
    Spin(std::chrono::microseconds(200));
    now.fetch_sub(1);
  }, tenant);
  return most.load();
}

TEST(ThreadPoolSchedulingTest, AThreadQuotaCapsTheThreadsRunningAJobsChunksAtOnce) {
  ThreadPool pool(4);
  PoolTenant* capped = pool.Tenant("capped", PoolTenant::kDefault, 1, /*max_threads=*/1);
  PoolTenant* pair = pool.Tenant("pair", PoolTenant::kDefault, 1, /*max_threads=*/2);
  PoolTenant* free = pool.Tenant("free", PoolTenant::kDefault, 1);
  EXPECT_EQ(MostAtOnce(pool, capped, 64), 1);  // its caller alone: no worker helps it
  EXPECT_LE(MostAtOnce(pool, pair, 64), 2);
  // Without a quota the workers join in (a loaded machine may not start them at once: up
  // to 20 tries for a window where they did).
  int most = 0;
  for (int attempt = 0; attempt < 20 && most < 2; ++attempt) most = MostAtOnce(pool, free, 256);
  EXPECT_GE(most, 2);
  EXPECT_EQ(pool.Tenant("capped", PoolTenant::kDefault, 1, 0), capped);  // the quota lifted
}

TEST(ThreadPoolSchedulingTest, WorkersPassOverAJobAtItsQuotaToServeItsNeighbors) {
  // A job capped at one thread and an uncapped one, busy at once: every chunk of both runs,
  // the capped job's never more than one at a time, and the workers serve the other one.
  ThreadPool pool(3);
  PoolTenant* capped = pool.Tenant("capped", PoolTenant::kBulk, 1, /*max_threads=*/1);
  PoolTenant* other = pool.Tenant("other", PoolTenant::kBulk, 1);
  int capped_most = 0, other_most = 0;
  std::thread a([&] { capped_most = MostAtOnce(pool, capped, 200); });
  std::thread b([&] { other_most = MostAtOnce(pool, other, 200); });
  a.join();
  b.join();
  EXPECT_EQ(capped_most, 1);
  EXPECT_GE(other_most, 1);
  // (A worker's last chunk is charged at its next pick, just after the loops return.)
  EXPECT_TRUE(testing::WaitFor([&] { return capped->chunks() + other->chunks() == 400; }, absl::Seconds(10)))
      << capped->chunks() << " + " << other->chunks();
}

// The calling thread's nice value.
int ThreadNice() { return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))); }

// With a bulk lane, a bulk job's loop (run by a caller that entered the lane, as a bulk
// group's executor does) and a latency-critical job's loop, at once: every bulk chunk runs on
// a thread 10 nicer than the process, every other chunk at the process's priority, and no
// thread runs chunks of both. Without a lane, EnterBulkLane changes nothing.
TEST(ThreadPoolSchedulingTest, BulkLoopsRunOnNicerThreadsOfTheirOwn) {
  const int base = ThreadNice();
  {
    ThreadPool plain(2);
    EXPECT_FALSE(plain.bulk_lane());
    std::thread t([&] {
      EXPECT_TRUE(plain.EnterBulkLane().ok());
      EXPECT_EQ(ThreadNice(), base);
    });
    t.join();
  }
  ThreadPool pool(3, nullptr, /*bulk_nice=*/10);
  ASSERT_TRUE(pool.bulk_lane());
  PoolTenant* bulk = pool.Tenant("train", PoolTenant::kBulk, 1);
  PoolTenant* urgent = pool.Tenant("serve", PoolTenant::kLatencyCritical, 1);
  struct Seen {
    absl::Mutex mu;
    std::set<int> nice;
    std::set<pid_t> threads;
  } bulk_seen, urgent_seen;
  auto record = [](Seen& s) {
    absl::MutexLock lock(&s.mu);
    s.nice.insert(ThreadNice());
    s.threads.insert(static_cast<pid_t>(syscall(SYS_gettid)));
  };
  // Both loops queued at about the same time, each chunk recording where it ran.
  std::atomic<int> started{0};
  auto run = [&](PoolTenant* tenant, Seen& seen) {
    started.fetch_add(1);
    while (started.load() < 2) std::this_thread::yield();
    pool.ParallelFor(300, [&](size_t) {
      record(seen);
      Spin(std::chrono::microseconds(20));
    }, tenant);
  };
  std::thread b([&] {
    EXPECT_TRUE(pool.EnterBulkLane().ok());  // (an ASSERT would leave the other loop waiting)
    run(bulk, bulk_seen);
  });
  run(urgent, urgent_seen);
  b.join();
  EXPECT_EQ(bulk_seen.nice, std::set<int>{std::min(base + 10, 19)});
  EXPECT_EQ(urgent_seen.nice, std::set<int>{base});
  for (pid_t t : bulk_seen.threads) EXPECT_EQ(urgent_seen.threads.count(t), 0u) << "thread " << t << " ran both";
  EXPECT_TRUE(testing::WaitFor([&] { return bulk->chunks() == 300 && urgent->chunks() == 300; }, absl::Seconds(10)));
}

TEST(ThreadPoolSchedulingTest, TenantsAreKeptByNameWithBoundedClassesWeightsAndNumber) {
  ThreadPool pool(1);
  PoolTenant* a = pool.Tenant("a", -5, 0);
  EXPECT_EQ(pool.Tenant("a", 99, 5000), a);
  EXPECT_EQ(a->name(), "a");
  pool.ParallelFor(3, [](size_t) {}, a);  // one thread: on the caller, charged once
  EXPECT_EQ(a->chunks(), 1);
  for (size_t i = 0; i < ThreadPool::kMaxTenants; ++i) pool.Tenant("job-" + std::to_string(i), 1, 1);
  PoolTenant* past = pool.Tenant("one-too-many", 0, 1);
  EXPECT_EQ(past->name(), "(others)");
  EXPECT_EQ(pool.Tenant("another", 0, 1), past);
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
