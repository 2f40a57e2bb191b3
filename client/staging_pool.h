// The SDK's shared memory on a session with its host's sidecar (client/session_process_group.h):
//
//   Arena        the group's SharedBuffers (ProcessGroup::AllocateShared) by address, so
//                that a tensor in one goes by reference (zero copy);
//   ArenaBuffer  one such buffer; HeapBuffer its stand-in without shared memory;
//   StagingPool  the staging segments that ordinary tensors are copied through: reused
//                best-fit, bounded by InitOptions::max_staging_bytes, paced by
//                InitOptions::staging_window_bytes (docs/guide.md "Staging").
//
// Sizes are bytes. Every class here is thread-safe.
#ifndef COLLSERVE_CLIENT_STAGING_POOL_H_
#define COLLSERVE_CLIENT_STAGING_POOL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/request_builder.h"
#include "collserve/client.h"
#include "common/shm.h"

namespace collserve::client {

// The arena of one group: its SharedBuffers by address. Shared with the buffers, which may
// outlive the group.
class Arena {
 public:
  void Add(const ShmSegment* seg);
  // Forgets `seg` and remembers its name for TakeReleased.
  void Remove(const ShmSegment* seg);
  // The segment holding all of [p, p + bytes), if any (an ArenaLookup).
  bool Find(const void* p, size_t bytes, ArenaRef* ref);
  // Appends the names of destroyed buffers the sidecar has not been told about yet.
  void TakeReleased(std::vector<std::string>* out);

 private:
  absl::Mutex mu_;
  std::map<uintptr_t, const ShmSegment*> by_start_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> released_ ABSL_GUARDED_BY(mu_);
};

// A SharedBuffer in the group's arena: registered with the sidecar, found by Arena::Find
// while it lives.
class ArenaBuffer : public SharedBuffer {
 public:
  ArenaBuffer(std::shared_ptr<Arena> arena, std::unique_ptr<ShmSegment> segment, size_t size);
  ~ArenaBuffer() override;
  void* data() override { return segment_->data(); }
  size_t size() const override { return size_; }

 private:
  std::shared_ptr<Arena> arena_;
  std::unique_ptr<ShmSegment> segment_;
  size_t size_;
};

// Without shared memory: ordinary (64-byte aligned, zeroed) memory.
class HeapBuffer : public SharedBuffer {
 public:
  explicit HeapBuffer(size_t size) : storage_(size + 64, 0), size_(size) {}
  void* data() override;
  size_t size() const override { return size_; }

 private:
  std::vector<char> storage_;
  size_t size_;
};

// The staging segments of one session.
class StagingPool {
 public:
  // Segments are rounded up to this, so tensors of similar size reuse one.
  static constexpr size_t kSegmentGranularity = 1 << 20;
  // Free segments kept for reuse: at most this many, and at most max_staging_bytes of them
  // (kDefaultFreeBytes when that is unbounded), so that the ops a caller keeps in flight
  // find their segments mapped and touched (on both sides) the next time round instead of
  // creating new ones: a new segment costs memfd_create, ftruncate, mmap and a page fault
  // per 4 KiB page in the rank and again in the sidecar. 128 is the default
  // max_staging_bytes in segments of the smallest size (kSegmentGranularity): every op in
  // flight under the default limit finds its segment again (32 made 1 MiB ops deeper than
  // 32 recreate theirs each round). With the sidecar's 1024 mapped segments per rank
  // (engine/buffers.h) this leaves room for the ops in flight and the shared buffers.
  static constexpr size_t kMaxFreeSegments = 128;
  static constexpr size_t kDefaultFreeBytes = size_t{128} << 20;

  // Makes a new segment of `bytes` that requests may name (the session registers it with
  // the sidecar); its errors are Acquire's.
  using NewSegment = std::function<absl::StatusOr<std::unique_ptr<ShmSegment>>(size_t bytes)>;

  // `max_staging_bytes`, `staging_window_bytes`: InitOptions' (0 or less = unbounded, off).
  StagingPool(int64_t max_staging_bytes, int64_t staging_window_bytes, NewSegment new_segment);

  // A staging segment of at least `bytes` (the smallest free one that fits, else a new one
  // of `bytes` rounded up to kSegmentGranularity), counted as in flight until Release.
  // With `may_wait`, a collective first waits briefly (InitOptions::kStagingWindowWait)
  // while the window is full and two or more collectives hold segments, then until
  // `deadline` for room under max_staging_bytes or for no other collective to hold a
  // segment: those complete without this thread's help, so the wait ends (a send/recv might
  // not, so nothing waits for them). Past `deadline` it goes over the limit. Errors: the
  // NewSegment's (the pool is unchanged then).
  absl::StatusOr<std::unique_ptr<ShmSegment>> Acquire(size_t bytes, bool collective, bool may_wait,
                                                      absl::Time deadline);
  // Returns a segment from Acquire (`collective` as given there) for reuse; beyond the free
  // limits the smallest free segments are dropped (TakeReleased names them).
  void Release(std::unique_ptr<ShmSegment> seg, bool collective);
  // Appends the names of dropped segments the sidecar has not been told about yet.
  void TakeReleased(std::vector<std::string>* out);

  // For tests: segments and bytes held by operations in flight, kept free, and the
  // Acquire calls waiting for room under max_staging_bytes.
  int in_flight_collectives() const;
  int waiting() const;
  size_t staged_bytes() const;
  size_t free_segments() const;

 private:
  const size_t cap_;     // max_staging_bytes (0: none)
  const size_t window_;  // staging_window_bytes (0: off)
  const NewSegment new_segment_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<ShmSegment>> free_segments_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> released_names_ ABSL_GUARDED_BY(mu_);  // dropped, not yet reported
  size_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;      // of free_segments_
  size_t staged_bytes_ ABSL_GUARDED_BY(mu_) = 0;    // of segments held by operations in flight
  int staged_collectives_ ABSL_GUARDED_BY(mu_) = 0;  // collectives holding one
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;             // in Acquire's wait for room
  // Tensor bytes of the collectives holding a segment (the pacing window), by segment.
  size_t window_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<const ShmSegment*, size_t> windowed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_STAGING_POOL_H_
