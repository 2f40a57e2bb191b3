// ThreadSanitizer annotations for Debian's (uninstrumented) absl synchronization library
// and gRPC completion queues.
//
// Debian's libabsl_synchronization.so is not built with -fsanitize=thread, so TSan cannot
// see absl::Mutex, absl::CondVar or absl::Notification synchronize anything: every access
// that collserve guards with an absl::Mutex is reported as a data race (see
// tests/sanitizers/README.md). absl annotates these primitives for TSan
// itself (ABSL_TSAN_MUTEX_*), but only when absl is compiled with TSan.
//
// This library puts those annotations back. It defines the out-of-line absl member functions
// that collserve and absl itself call (same mangled names, declared by absl's own headers),
// forwards each to the real one in libabsl_synchronization.so (dlsym RTLD_NEXT) and tells
// TSan what happened with its mutex annotation API, the way absl's mutex.cc does under TSan.
// It must come before libabsl_synchronization.so in symbol lookup: the top-level
// CMakeLists.txt links it into every target of a COLLSERVE_SANITIZE=thread build.
//
// gRPC: an operation started with grpc_call_start_batch(tag) completes on another thread,
// which gets `tag` back from grpc_completion_queue_next/pluck (the callback API's
// "nexting" threads and the synchronous API do). gRPC core orders the two with atomics TSan
// cannot see, so TSan reported a race between, say, StartWrite filling in grpcpp's CallOpSet
// and the completion thread finishing it. Start-batch releases `tag`, a completion acquires it.
// Likewise grpc::Server::Shutdown() waits (UnrefAndWaitLocked) until every callback RPC has
// run its reactor's OnDone() and dropped its server reference (UnrefWithPossibleNotify), with
// an atomic count in libgrpc++: each unref releases the server, the wait acquires it.
//
// The real functions are looked up by their mangled names in Debian 12's absl (inline
// namespace debian3): another absl fails the static_assert below, or aborts at the first
// call naming the symbol it did not find, instead of silently interposing nothing.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/base/config.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpc/grpc.h"
#include "grpcpp/server.h"

static_assert(ABSL_LTS_RELEASE_VERSION == 20220623, "written against absl 20220623 (Debian 12)");

extern "C" {
// sanitizer/tsan_interface.h; weak so that this library loads into any process.
void __tsan_mutex_pre_lock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_post_lock(void* addr, unsigned flags, int recursion) __attribute__((weak));
int __tsan_mutex_pre_unlock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_post_unlock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_acquire(void* addr) __attribute__((weak));
void __tsan_release(void* addr) __attribute__((weak));
}

namespace {

constexpr unsigned kRead = 1 << 3;        // __tsan_mutex_read_lock
constexpr unsigned kTry = 1 << 4;         // __tsan_mutex_try_lock
constexpr unsigned kTryFailed = 1 << 5;   // __tsan_mutex_try_lock_failed

bool Active() { return __tsan_mutex_pre_lock != nullptr; }

// absl calls its own public functions (AwaitWithTimeout calls AwaitWithDeadline, Notify locks
// its mutex): only the outermost call on a thread is annotated, nested ones go straight to
// absl (annotating them again would report an "unlock of an unlocked mutex").
thread_local int depth = 0;
struct Outermost {
  Outermost() : outer(depth++ == 0) {}
  ~Outermost() { --depth; }
  const bool outer;
};

template <typename Fn>
Fn Real(Fn, const char* symbol) {
  void* p = dlsym(RTLD_NEXT, symbol);
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_annotations: %s not found after this library: %s\n", symbol, dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(p);
}

// The real function, looked up once. `sig` is the function type as a free function taking
// `this` first (the Itanium C++ ABI passes it that way).
#define REAL(sig, mangled)                                         \
  static const auto real = Real(static_cast<sig>(nullptr), mangled)

void PreLock(void* mu, unsigned flags) {
  if (Active()) __tsan_mutex_pre_lock(mu, flags);
}
void PostLock(void* mu, unsigned flags) {
  if (Active()) __tsan_mutex_post_lock(mu, flags, 0);
}
void PreUnlock(void* mu, unsigned flags) {
  if (Active()) __tsan_mutex_pre_unlock(mu, flags);
}
void PostUnlock(void* mu, unsigned flags) {
  if (Active()) __tsan_mutex_post_unlock(mu, flags);
}
// A wait that gives `mu` up and holds it again on return (Await, CondVar::Wait).
void PreWait(void* mu) {
  PreUnlock(mu, 0);
  PostUnlock(mu, 0);
  PreLock(mu, 0);
}

// Notification: Notify() stores notified_yet_ in uninstrumented code, and HasBeenNotified()
// (inline, so instrumented) loads it with acquire order. Release on its address in Notify()
// and acquire it after a wait returns notified.
void* NotifiedYet(const absl::Notification* n) {
  static_assert(sizeof(absl::Notification) == 2 * sizeof(absl::Mutex), "layout: Mutex mutex_; atomic<bool>");
  return const_cast<char*>(reinterpret_cast<const char*>(n) + sizeof(absl::Mutex));
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// Not Mutex::~Mutex(): a __tsan_mutex_destroy there races (for TSan) with the last unlock
// in another thread whenever the two are ordered only by uninstrumented code, e.g. the
// reference counts of the gRPC objects that own the mutex. Without it TSan forgets the
// mutex when its memory is freed.

void Mutex::Lock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex4LockEv");
  const Outermost call;
  if (!call.outer) return real(this);
  PreLock(this, 0);
  real(this);
  PostLock(this, 0);
}

void Mutex::Unlock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex6UnlockEv");
  const Outermost call;
  if (!call.outer) return real(this);
  PreUnlock(this, 0);
  real(this);
  PostUnlock(this, 0);
}

bool Mutex::TryLock() {
  REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex7TryLockEv");
  const Outermost call;
  if (!call.outer) return real(this);
  PreLock(this, kTry);
  const bool locked = real(this);
  PostLock(this, locked ? kTry : kTry | kTryFailed);
  return locked;
}

void Mutex::ReaderLock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex10ReaderLockEv");
  const Outermost call;
  if (!call.outer) return real(this);
  PreLock(this, kRead);
  real(this);
  PostLock(this, kRead);
}

void Mutex::ReaderUnlock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  const Outermost call;
  if (!call.outer) return real(this);
  PreUnlock(this, kRead);
  real(this);
  PostUnlock(this, kRead);
}

bool Mutex::ReaderTryLock() {
  REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  const Outermost call;
  if (!call.outer) return real(this);
  PreLock(this, kRead | kTry);
  const bool locked = real(this);
  PostLock(this, locked ? kRead | kTry : kRead | kTry | kTryFailed);
  return locked;
}

void Mutex::LockWhen(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  const Outermost call;
  if (!call.outer) return real(this, cond);
  PreLock(this, 0);
  real(this, cond);
  PostLock(this, 0);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  const Outermost call;
  if (!call.outer) return real(this, cond);
  PreLock(this, kRead);
  real(this, cond);
  PostLock(this, kRead);
}

// The *WithTimeout/*WithDeadline variants hold the mutex on return whatever they return.
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, Duration),
       "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const Outermost call;
  if (!call.outer) return real(this, cond, timeout);
  PreLock(this, 0);
  const bool r = real(this, cond, timeout);
  PostLock(this, 0);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, Time),
       "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const Outermost call;
  if (!call.outer) return real(this, cond, deadline);
  PreLock(this, 0);
  const bool r = real(this, cond, deadline);
  PostLock(this, 0);
  return r;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, Duration),
       "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const Outermost call;
  if (!call.outer) return real(this, cond, timeout);
  PreLock(this, kRead);
  const bool r = real(this, cond, timeout);
  PostLock(this, kRead);
  return r;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, Time),
       "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const Outermost call;
  if (!call.outer) return real(this, cond, deadline);
  PreLock(this, kRead);
  const bool r = real(this, cond, deadline);
  PostLock(this, kRead);
  return r;
}

// Await*: called with the mutex held (collserve holds it exclusively); absl releases it
// while waiting and holds it again on return.
void Mutex::Await(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  const Outermost call;
  if (!call.outer) return real(this, cond);
  PreWait(this);
  real(this, cond);
  PostLock(this, 0);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, Duration),
       "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const Outermost call;
  if (!call.outer) return real(this, cond, timeout);
  PreWait(this);
  const bool r = real(this, cond, timeout);
  PostLock(this, 0);
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, Time),
       "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const Outermost call;
  if (!call.outer) return real(this, cond, deadline);
  PreWait(this);
  const bool r = real(this, cond, deadline);
  PostLock(this, 0);
  return r;
}

void CondVar::Wait(Mutex* mu) {
  REAL(void (*)(CondVar*, Mutex*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  const Outermost call;
  if (!call.outer) return real(this, mu);
  PreWait(mu);
  real(this, mu);
  PostLock(mu, 0);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  REAL(bool (*)(CondVar*, Mutex*, Duration), "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  const Outermost call;
  if (!call.outer) return real(this, mu, timeout);
  PreWait(mu);
  const bool r = real(this, mu, timeout);
  PostLock(mu, 0);
  return r;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  REAL(bool (*)(CondVar*, Mutex*, Time), "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  const Outermost call;
  if (!call.outer) return real(this, mu, deadline);
  PreWait(mu);
  const bool r = real(this, mu, deadline);
  PostLock(mu, 0);
  return r;
}

void Notification::Notify() {
  REAL(void (*)(Notification*), "_ZN4absl7debian312Notification6NotifyEv");
  const Outermost call;
  if (!call.outer) return real(this);
  if (Active()) __tsan_release(NotifiedYet(this));
  real(this);
}

void Notification::WaitForNotification() const {
  REAL(void (*)(const Notification*), "_ZNK4absl7debian312Notification19WaitForNotificationEv");
  const Outermost call;
  if (!call.outer) return real(this);
  real(this);
  if (Active()) __tsan_acquire(NotifiedYet(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  REAL(bool (*)(const Notification*, Duration),
       "_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const Outermost call;
  if (!call.outer) return real(this, timeout);
  const bool r = real(this, timeout);
  if (r && Active()) __tsan_acquire(NotifiedYet(this));
  return r;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  REAL(bool (*)(const Notification*, Time),
       "_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const Outermost call;
  if (!call.outer) return real(this, deadline);
  const bool r = real(this, deadline);
  if (r && Active()) __tsan_acquire(NotifiedYet(this));
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl

namespace grpc {

void Server::UnrefWithPossibleNotify() {
  REAL(void (*)(Server*), "_ZN4grpc6Server23UnrefWithPossibleNotifyEv");
  if (Active()) __tsan_release(this);
  real(this);
}

void Server::UnrefAndWaitLocked() {
  REAL(void (*)(Server*), "_ZN4grpc6Server18UnrefAndWaitLockedEv");
  real(this);
  if (Active()) __tsan_acquire(this);
}

}  // namespace grpc

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag, void* reserved) {
  REAL(grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*, void*), "grpc_call_start_batch");
  if (tag != nullptr && Active()) __tsan_release(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline, void* reserved) {
  REAL(grpc_event (*)(grpc_completion_queue*, gpr_timespec, void*), "grpc_completion_queue_next");
  const grpc_event ev = real(cq, deadline, reserved);
  if (ev.type == GRPC_OP_COMPLETE && ev.tag != nullptr && Active()) __tsan_acquire(ev.tag);
  return ev;
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag, gpr_timespec deadline, void* reserved) {
  REAL(grpc_event (*)(grpc_completion_queue*, void*, gpr_timespec, void*), "grpc_completion_queue_pluck");
  const grpc_event ev = real(cq, tag, deadline, reserved);
  if (ev.type == GRPC_OP_COMPLETE && ev.tag != nullptr && Active()) __tsan_acquire(ev.tag);
  return ev;
}

}  // extern "C"
