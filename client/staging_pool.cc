#include "client/staging_pool.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace collserve::client {

void Arena::Add(const ShmSegment* seg) {
  absl::MutexLock lock(&mu_);
  by_start_[reinterpret_cast<uintptr_t>(seg->data())] = seg;
}

void Arena::Remove(const ShmSegment* seg) {
  absl::MutexLock lock(&mu_);
  by_start_.erase(reinterpret_cast<uintptr_t>(seg->data()));
  released_.push_back(seg->name());
}

bool Arena::Find(const void* p, size_t bytes, ArenaRef* ref) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  absl::MutexLock lock(&mu_);
  auto it = by_start_.upper_bound(a);
  if (it == by_start_.begin()) return false;
  --it;
  const ShmSegment* seg = it->second;
  if (a - it->first > seg->size() || bytes > seg->size() - (a - it->first)) return false;
  ref->segment = seg;
  ref->offset = a - it->first;
  return true;
}

void Arena::TakeReleased(std::vector<std::string>* out) {
  absl::MutexLock lock(&mu_);
  for (std::string& name : released_) out->push_back(std::move(name));
  released_.clear();
}

ArenaBuffer::ArenaBuffer(std::shared_ptr<Arena> arena, std::unique_ptr<ShmSegment> segment, size_t size)
    : arena_(std::move(arena)), segment_(std::move(segment)), size_(size) {
  arena_->Add(segment_.get());
}

ArenaBuffer::~ArenaBuffer() { arena_->Remove(segment_.get()); }

void* HeapBuffer::data() {
  const uintptr_t a = reinterpret_cast<uintptr_t>(storage_.data());
  return storage_.data() + ((64 - a % 64) % 64);
}

StagingPool::StagingPool(int64_t max_staging_bytes, int64_t staging_window_bytes, NewSegment new_segment)
    : cap_(static_cast<size_t>(std::max<int64_t>(max_staging_bytes, 0))),
      window_(static_cast<size_t>(std::max<int64_t>(staging_window_bytes, 0))),
      new_segment_(std::move(new_segment)) {}

absl::StatusOr<std::unique_ptr<ShmSegment>> StagingPool::Acquire(size_t bytes, bool collective, bool may_wait,
                                                                 absl::Time deadline) {
  const size_t rounded = (bytes + kSegmentGranularity - 1) / kSegmentGranularity * kSegmentGranularity;
  const size_t windowed = collective ? bytes : 0;  // counted in window_bytes_ while held
  {
    absl::MutexLock lock(&mu_);
    if (collective && window_ > 0 && may_wait) {
      // Pacing (InitOptions::staging_window_bytes): briefly, never until the deadline.
      auto paced = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return staged_collectives_ < 2 || window_bytes_ + bytes <= window_;
      };
      mu_.AwaitWithDeadline(absl::Condition(&paced), std::min(deadline, absl::Now() + InitOptions::kStagingWindowWait));
    }
    if (collective && cap_ > 0 && may_wait) {
      auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return staged_collectives_ == 0 || staged_bytes_ + rounded <= cap_;
      };
      ++waiting_;
      mu_.AwaitWithDeadline(absl::Condition(&room), deadline);
      --waiting_;
    }
    if (collective) ++staged_collectives_;
    auto best = free_segments_.end();
    for (auto it = free_segments_.begin(); it != free_segments_.end(); ++it) {
      if ((*it)->size() >= bytes && (best == free_segments_.end() || (*it)->size() < (*best)->size())) best = it;
    }
    window_bytes_ += windowed;
    if (best != free_segments_.end()) {
      std::unique_ptr<ShmSegment> seg = std::move(*best);
      free_segments_.erase(best);
      free_bytes_ -= seg->size();
      staged_bytes_ += seg->size();
      if (windowed > 0) windowed_[seg.get()] = windowed;
      return seg;
    }
    staged_bytes_ += rounded;
  }
  auto made = new_segment_(rounded);
  absl::MutexLock lock(&mu_);
  if (!made.ok()) {
    staged_bytes_ -= rounded;
    window_bytes_ -= windowed;
    if (collective) --staged_collectives_;
  } else if (windowed > 0) {
    windowed_[made->get()] = windowed;
  }
  return made;
}

void StagingPool::Release(std::unique_ptr<ShmSegment> seg, bool collective) {
  if (seg == nullptr) return;
  absl::MutexLock lock(&mu_);
  staged_bytes_ -= seg->size();
  if (collective) --staged_collectives_;
  if (auto it = windowed_.find(seg.get()); it != windowed_.end()) {
    window_bytes_ -= it->second;
    windowed_.erase(it);
  }
  free_bytes_ += seg->size();
  free_segments_.push_back(std::move(seg));
  const size_t free_cap = cap_ > 0 ? cap_ : kDefaultFreeBytes;
  while (free_segments_.size() > kMaxFreeSegments || (free_segments_.size() > 1 && free_bytes_ > free_cap)) {
    // Drop the smallest; the next request tells the sidecar to unmap it.
    auto smallest = std::min_element(free_segments_.begin(), free_segments_.end(),
                                     [](const auto& a, const auto& b) { return a->size() < b->size(); });
    released_names_.push_back((*smallest)->name());
    free_bytes_ -= (*smallest)->size();
    free_segments_.erase(smallest);
  }
}

void StagingPool::TakeReleased(std::vector<std::string>* out) {
  absl::MutexLock lock(&mu_);
  for (std::string& name : released_names_) out->push_back(std::move(name));
  released_names_.clear();
}

int StagingPool::in_flight_collectives() const {
  absl::MutexLock lock(&mu_);
  return staged_collectives_;
}

size_t StagingPool::staged_bytes() const {
  absl::MutexLock lock(&mu_);
  return staged_bytes_;
}

int StagingPool::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

size_t StagingPool::free_segments() const {
  absl::MutexLock lock(&mu_);
  return free_segments_.size();
}

}  // namespace collserve::client
