// A fixed set of threads for work that blocks, so that gRPC's callback threads never do.
//
// The coordinator's durable store acknowledges a write only after the fdatasync that covers
// it (store/memory_store.h, group commit). gRPC runs callback-API handlers on a few shared
// threads; a handler that waited there for the disk would hold one of them and let only as
// many writes share an fdatasync as there are such threads (measured: 1.1 writes per
// fdatasync with 16 clients). Handlers hand such writes to this pool instead and finish
// their call from the pool's thread.
//
// Thread safety: Run() may be called from any thread. The destructor runs every task
// already queued, then joins the threads; nothing may call Run() once it has started.
#ifndef COLLSERVE_SERVER_COMMON_BLOCKING_POOL_H_
#define COLLSERVE_SERVER_COMMON_BLOCKING_POOL_H_

#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace collserve::server {

class BlockingPool {
 public:
  // Starts `threads` (>= 1) threads: at most that many tasks run at once; later ones queue
  // (their memory is bounded by what queues them, e.g. gRPC's RPC memory quota).
  explicit BlockingPool(int threads) {
    for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~BlockingPool() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }
  BlockingPool(const BlockingPool&) = delete;
  BlockingPool& operator=(const BlockingPool&) = delete;

  // Queues `task`; a free thread runs it.
  void Run(absl::AnyInvocable<void() &&> task) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
  }

 private:
  void Loop() {
    for (;;) {
      absl::AnyInvocable<void() &&> task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](BlockingPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stopping_ || !p->queue_.empty(); },
            this));
        if (queue_.empty()) return;  // stopping, and every queued task has run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::move(task)();
    }
  }

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_BLOCKING_POOL_H_
