// The sidecar's budget for inline tensor bytes (requests whose tensors travel in the
// message, not in shared memory): InlineBudget and the charge a request holds in it.
#ifndef COLLSERVE_ENGINE_INLINE_BUDGET_H_
#define COLLSERVE_ENGINE_INLINE_BUDGET_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace collserve::engine {

// The bytes of inline requests (input and result, held in the sidecar's memory) received
// and not yet completed, against a limit: the engine's, across every session
// (EngineOptions::max_inline_bytes), and each job's under it (JobPolicy.max_inline_bytes,
// JobInlineBudgets). Without them, an authenticated remote rank could queue many small
// requests each asking for a large inline result (a RECV, a SCATTER off its root: ~50 bytes
// on the wire for up to kMaxInlineBytes each) and exhaust the host's memory, or one job
// could use the whole host's budget and leave its neighbors none. Thread-safe; never
// blocks.
class InlineBudget {
 public:
  // `limit` bytes (<= 0: no limit; the bytes are still counted). A budget with a `parent`
  // (which must outlive it) counts its bytes there too: a reservation must fit both.
  // Errors name what is counted (`what`) and the limit (`limit_name`).
  explicit InlineBudget(int64_t limit, InlineBudget* parent = nullptr,
                        std::string what = "the sidecar's inline bytes", std::string limit_name = "--max_inline_bytes")
      : limit_(limit), parent_(parent), what_(std::move(what)), limit_name_(std::move(limit_name)) {}
  InlineBudget(const InlineBudget&) = delete;
  InlineBudget& operator=(const InlineBudget&) = delete;

  // Counts `bytes` more here and in every parent if that keeps each within its limit (true),
  // else counts nothing (false) and, when `refused` is given, sets it to the budget whose
  // limit refused. Each true must be matched by one Release(bytes): InlineCharge does it.
  bool TryReserve(int64_t bytes, const InlineBudget** refused = nullptr) {
    int64_t now = in_use_.load(std::memory_order_relaxed);
    do {
      const int64_t limit = limit_.load(std::memory_order_relaxed);
      if (limit > 0 && bytes > limit - now) {
        if (refused != nullptr) *refused = this;
        return false;
      }
    } while (!in_use_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
    // Here first, then the parent: while a reservation the parent refuses is undone, only
    // this budget's (one job's) requests can see its bytes, never another job's.
    if (parent_ != nullptr && !parent_->TryReserve(bytes, refused)) {
      in_use_.fetch_sub(bytes, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  // Gives back `bytes` counted by a successful TryReserve, here and in every parent.
  void Release(int64_t bytes) {
    in_use_.fetch_sub(bytes, std::memory_order_relaxed);
    if (parent_ != nullptr) parent_->Release(bytes);
  }
  int64_t in_use() const { return in_use_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  // A new limit for later reservations (what is counted stays; it may now be over the limit).
  void set_limit(int64_t limit) { limit_.store(limit, std::memory_order_relaxed); }
  const std::string& what() const { return what_; }
  const std::string& limit_name() const { return limit_name_; }

 private:
  std::atomic<int64_t> limit_;
  InlineBudget* const parent_;
  const std::string what_;
  const std::string limit_name_;
  std::atomic<int64_t> in_use_{0};
};

// Each job's InlineBudget on one sidecar, under the engine's (its parent): a job's inline
// bytes in flight at most its JobPolicy.max_inline_bytes, so that one job's inline requests
// leave its neighbors their share of the host's. Budgets live as long as the table (groups
// hold pointers to them); past kMaxJobs names, every new job shares one budget,
// "(others)". Thread-safe.
class JobInlineBudgets {
 public:
  static constexpr size_t kMaxJobs = 4096;
  // `host` (the engine's budget) must outlive the table.
  explicit JobInlineBudgets(InlineBudget* host) : host_(host) {}
  // The budget of `job`, its limit set to `limit` (<= 0: none but the host's): the latest
  // policy the coordinator handed with an attach of the job's ranks wins.
  InlineBudget* For(const std::string& job, int64_t limit) {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) {
      const std::string name = jobs_.size() >= kMaxJobs ? std::string("(others)") : job;
      it = jobs_.try_emplace(name).first;
      if (it->second == nullptr) {
        it->second = std::make_unique<InlineBudget>(
            limit, host_, absl::StrCat("job \"", name, "\"'s inline bytes on this sidecar"),
            "its JobPolicy's max_inline_bytes");
      }
    }
    it->second->set_limit(limit);
    return it->second.get();
  }
  // The bytes `job` holds now (0 for a job not seen).
  int64_t InUse(const std::string& job) const {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    return it == jobs_.end() ? 0 : it->second->in_use();
  }

 private:
  InlineBudget* const host_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<InlineBudget>> jobs_ ABSL_GUARDED_BY(mu_);
};

// Bytes counted in an InlineBudget until Release() or destruction (a Submission holds one
// until its completion is handed to its session; the completion then holds its result's
// share until the answer is written to the client). Move-only; empty by default. Not
// thread-safe (its owner's thread).
class InlineCharge {
 public:
  InlineCharge() = default;
  InlineCharge(InlineBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
  InlineCharge(InlineCharge&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) { o.budget_ = nullptr; }
  InlineCharge& operator=(InlineCharge&& o) noexcept {
    if (this != &o) {
      Release();
      budget_ = o.budget_;
      bytes_ = o.bytes_;
      o.budget_ = nullptr;
    }
    return *this;
  }
  ~InlineCharge() { Release(); }
  int64_t bytes() const { return budget_ == nullptr ? 0 : bytes_; }
  // Keeps `bytes` of the charge (at most what it holds) in a new charge and gives the rest
  // back now; this one is empty afterwards. For a completed request whose result still
  // waits to be written to its client: the input's bytes are freed, the result's are not.
  InlineCharge Keep(int64_t bytes) {
    if (budget_ == nullptr) return InlineCharge();
    const int64_t kept = std::clamp<int64_t>(bytes, 0, bytes_);
    if (bytes_ > kept) budget_->Release(bytes_ - kept);
    InlineCharge out(kept > 0 ? budget_ : nullptr, kept);
    budget_ = nullptr;
    return out;
  }
  // Gives the bytes back now (once; later calls do nothing).
  void Release() {
    if (budget_ != nullptr) budget_->Release(bytes_);
    budget_ = nullptr;
  }
  InlineBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_INLINE_BUDGET_H_
