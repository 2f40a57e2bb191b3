// CompletionLane: the SDK's completion lanes (client/session_process_group.h). Each lane is one
// thread that finishes the completions of a session in the order it is handed them.
#ifndef COLLSERVE_CLIENT_COMPLETION_LANE_H_
#define COLLSERVE_CLIENT_COMPLETION_LANE_H_

#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace collserve::client {

// One thread that runs `finish` on each pushed completion, in the order pushed. A session
// has two (collectives, send/recv): finishing one copies its result into the caller's
// tensors, completes its Work (running its callbacks) and returns its staging segment, so
// neither a large copy-out nor a slow callback holds up reading the stream or the other
// lane; within a lane completions keep their order (a group's collectives complete in issue
// order). Thread-safe; the destructor finishes what was pushed, then joins.
template <typename Done>
class CompletionLane {
 public:
  explicit CompletionLane(std::function<void(Done&)> finish) : finish_(std::move(finish)), thread_([this] { Main(); }) {}
  ~CompletionLane() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Push(Done done) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(done));
  }
  // Blocks until every pushed completion is finished (or `deadline`).
  void Drain(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
    mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  bool OnThisThread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void Main() {
    absl::MutexLock lock(&mu_);
    for (;;) {
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopped and drained
      Done done = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      mu_.Unlock();
      finish_(done);
      mu_.Lock();
      busy_ = false;
    }
  }

  const std::function<void(Done&)> finish_;
  absl::Mutex mu_;
  std::deque<Done> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_COMPLETION_LANE_H_
