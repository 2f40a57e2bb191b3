// WorkImpl: the Work of one operation of a session (client/session_process_group.h), completed
// once by the thread that reads its answer, or failed at issue.
#ifndef COLLSERVE_CLIENT_WORK_IMPL_H_
#define COLLSERVE_CLIENT_WORK_IMPL_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collserve/client.h"

namespace collserve::client {

// Thread-safe. Wait gives up at `deadline` (the op timeout plus a grace: the sidecar answers
// every request by its op deadline) with DEADLINE_EXCEEDED; Complete runs the callbacks of
// OnCompletion on the completing thread, once.
class WorkImpl : public Work {
 public:
  explicit WorkImpl(absl::Time deadline) : deadline_(deadline) {}

  static std::shared_ptr<WorkImpl> Failed(absl::Status status) {
    auto w = std::make_shared<WorkImpl>(absl::InfiniteFuture());
    w->Complete(std::move(status));
    return w;
  }

  absl::Status Wait(absl::Duration timeout) override {
    std::function<absl::Status()> after_wait;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time user_deadline =
          timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
      const absl::Time until = std::min(user_deadline, deadline_);
      mu_.AwaitWithDeadline(absl::Condition(&done_), until);
      if (done_ && (!status_.ok() || !after_wait_)) return status_;
      if (done_) {
        after_wait = after_wait_;
      } else {
        return TimedOut(until, timeout);
      }
    }
    // CUDA: the caller's stream waits for the sidecar's done event.
    return after_wait();
  }

  // Runs after every successful Wait (before it returns). Set before the Work is shared.
  void SetAfterWait(std::function<absl::Status()> f) {
    absl::MutexLock lock(&mu_);
    after_wait_ = std::move(f);
  }

  absl::Status TimedOut(absl::Time until, absl::Duration timeout) const {
    if (until == deadline_) {
      return absl::DeadlineExceededError(
          "no answer from the sidecar within the op timeout (plus grace); the sidecar may be "
          "hung or overloaded");
    }
    return absl::DeadlineExceededError(absl::StrCat("Work::Wait timed out after ",
                                                    absl::FormatDuration(timeout),
                                                    "; the operation is still running"));
  }

  bool IsCompleted() override {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  int SourceRank() override {
    absl::MutexLock lock(&mu_);
    return done_ && status_.ok() ? source_ : -1;
  }
  void SetSourceRank(int source) {
    absl::MutexLock lock(&mu_);
    source_ = source;
  }
  std::string Algorithm() override {
    absl::MutexLock lock(&mu_);
    return done_ && status_.ok() ? algorithm_ : std::string();
  }
  void SetAlgorithm(std::string algorithm) {
    absl::MutexLock lock(&mu_);
    algorithm_ = std::move(algorithm);
  }

  void OnCompletion(std::function<void(const absl::Status&)> callback) override {
    {
      absl::MutexLock lock(&mu_);
      if (!done_) {
        callbacks_.push_back(std::move(callback));
        return;
      }
    }
    callback(status_);
  }

  void Complete(absl::Status status) {
    std::vector<std::function<void(const absl::Status&)>> callbacks;
    {
      absl::MutexLock lock(&mu_);
      if (done_) return;
      status_ = std::move(status);
      done_ = true;
      callbacks.swap(callbacks_);
    }
    for (auto& cb : callbacks) cb(status_);
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_;  // written once before done_ is set
  int source_ ABSL_GUARDED_BY(mu_) = -1;
  std::string algorithm_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(const absl::Status&)>> callbacks_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status()> after_wait_ ABSL_GUARDED_BY(mu_);
  const absl::Time deadline_;
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_WORK_IMPL_H_
