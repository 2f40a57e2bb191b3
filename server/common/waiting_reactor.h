// A unary callback-API reactor for RPCs that park until an event (a key appears, a group
// forms) without holding a server thread. The RPC body registers an asynchronous wait
// and calls Finish() from the event's callback; OnCancel() withdraws the wait.
//
// Lifetime: the object deletes itself once (a) gRPC has called OnDone() and (b) the
// starting code has called Started() after registering its wait, whichever is last, so
// a wait that completes inline (before its id is known) is safe.
#ifndef COLLSERVE_SERVER_COMMON_WAITING_REACTOR_H_
#define COLLSERVE_SERVER_COMMON_WAITING_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>

#include "absl/synchronization/mutex.h"

namespace collserve::server {

class WaitingReactor : public grpc::ServerUnaryReactor {
 public:
  // Sets the function OnCancel() runs to withdraw the wait (e.g. Store::CancelWait(id)).
  // Call once, after registering the wait, and then Started().
  void SetCancel(std::function<void()> cancel) {
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      cancel_ = std::move(cancel);
      cancelled = cancelled_;
    }
    if (cancelled && cancel_) cancel_();
  }
  void Started() { Release(); }

  void OnCancel() override {
    std::function<void()> cancel;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      cancel = cancel_;
    }
    if (cancel) cancel();
  }
  void OnDone() override { Release(); }

 private:
  void Release() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }
  std::atomic<int> refs_{2};
  absl::Mutex mu_;
  bool cancelled_ = false;
  std::function<void()> cancel_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_WAITING_REACTOR_H_
