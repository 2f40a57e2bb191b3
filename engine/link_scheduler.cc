#include "engine/link_scheduler.h"

#include <algorithm>
#include <utility>

namespace collserve::engine {

LinkScheduler::LinkScheduler(LinkSchedulerOptions options, std::function<absl::Time()> now)
    : options_(options), now_(now ? std::move(now) : [] { return absl::Now(); }) {
  last_ended_.fill(absl::InfinitePast());
}

int LinkScheduler::Clamp(int priority) { return std::clamp(priority, 0, kNumClasses - 1); }

LinkScheduler::Active& LinkScheduler::Active::operator=(Active&& other) noexcept {
  if (this != &other) {
    End();
    scheduler_ = std::exchange(other.scheduler_, nullptr);
    priority_ = other.priority_;
  }
  return *this;
}

void LinkScheduler::Active::End() {
  LinkScheduler* s = std::exchange(scheduler_, nullptr);
  if (s == nullptr) return;
  absl::MutexLock lock(&s->mu_);
  --s->active_[priority_];
  s->last_ended_[priority_] = s->now_();
}

LinkScheduler::Active LinkScheduler::Begin(int priority) {
  priority = Clamp(priority);
  absl::MutexLock lock(&mu_);
  ++active_[priority];
  return Active(this, priority);
}

bool LinkScheduler::BetterActiveLocked(int priority) const {
  for (int c = 0; c < priority; ++c) {
    if (active_[c] > 0) return true;
  }
  return false;
}

size_t LinkScheduler::ProposedPieceBytes(int priority) {
  priority = Clamp(priority);
  if (options_.piece_bytes == 0) return 0;
  absl::MutexLock lock(&mu_);
  if (BetterActiveLocked(priority)) return options_.piece_bytes;
  const absl::Time now = now_();
  for (int c = 0; c < priority; ++c) {
    if (now - last_ended_[c] <= options_.recent) return options_.piece_bytes;
  }
  return 0;
}

absl::Duration LinkScheduler::AwaitTurn(int priority) {
  priority = Clamp(priority);
  absl::MutexLock lock(&mu_);
  if (!BetterActiveLocked(priority)) return absl::ZeroDuration();
  const absl::Time start = absl::Now();
  ++waiting_;
  const auto clear = [this, priority]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !BetterActiveLocked(priority); };
  mu_.AwaitWithTimeout(absl::Condition(&clear), options_.max_wait);
  --waiting_;
  const absl::Duration waited = absl::Now() - start;
  counters_[priority].waits++;
  counters_[priority].waited += waited;
  return waited;
}

void LinkScheduler::RecordCut(int priority, size_t pieces) {
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[Clamp(priority)];
  c.cut++;
  c.pieces += pieces;
}

int LinkScheduler::Waiting() {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

int LinkScheduler::Running(int priority) {
  absl::MutexLock lock(&mu_);
  return active_[Clamp(priority)];
}

LinkScheduler::Counters LinkScheduler::CountersOf(int priority) {
  absl::MutexLock lock(&mu_);
  return counters_[Clamp(priority)];
}

size_t AgreedPieceBytes(const std::vector<int64_t>& piece_bytes) {
  size_t agreed = 0;
  for (int64_t p : piece_bytes) {
    if (p <= 0) continue;
    if (agreed == 0 || static_cast<size_t>(p) < agreed) agreed = static_cast<size_t>(p);
  }
  return agreed == 0 ? 0 : std::max(agreed, kMinPieceBytes);
}

size_t ElementsPerPiece(size_t count, size_t element_size, size_t piece_bytes) {
  if (piece_bytes == 0 || element_size == 0) return count;
  return std::min(count, std::max<size_t>(piece_bytes / element_size, 1));
}

}  // namespace collserve::engine
