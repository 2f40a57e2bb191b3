// Peer reads on the client side (docs/architecture.md "Peer reads"): a result the sidecar
// left in another local rank's segment (collserve.v1.PeerSource) is copied straight out of
// that segment, which this rank maps read-only over the descriptor channel
// (fdchannel::OpenPeerSegment). The mappings are cached, oldest evicted first, so that the
// few segments a job cycles through (a root's reused staging segments) stay mapped.
//
// Sizes are bytes. PeerReader is thread-safe (one copy at a time: an eviction never unmaps
// what is being read); CopyResultRange is pure.
#ifndef COLLSERVE_CLIENT_PEER_READS_H_
#define COLLSERVE_CLIENT_PEER_READS_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "collserve/v1/collectives.pb.h"
#include "common/shm.h"

namespace collserve::client {

// Where a result goes: `outputs` (pointer, bytes) filled in order, `bytes` in all (their
// sum, or less: outputs past `bytes` are left alone).
struct ResultTarget {
  const std::vector<std::pair<void*, size_t>>* outputs = nullptr;
  size_t bytes = 0;
};

// Copies bytes [from, to) of a result that starts at `result` into `target`'s outputs (the
// result's byte k goes to the output holding byte k of their concatenation). `to` <=
// target.bytes. Pure.
void CopyResultRange(const ResultTarget& target, const char* result, size_t from, size_t to);

// Peers' segments a rank keeps mapped at most (bytes and count).
inline constexpr size_t kMaxPeerBytes = size_t{512} << 20;
inline constexpr size_t kMaxPeerSegments = 256;

class PeerReader {
 public:
  // Opens local rank `rank`'s segment `name` for reading: a descriptor the reader takes
  // over (fdchannel::OpenPeerSegment in the SDK; a dup of a local segment in tests), or the
  // error the copy fails with.
  using Opener = std::function<absl::StatusOr<int>(int rank, const std::string& name)>;

  explicit PeerReader(Opener open, size_t max_bytes = kMaxPeerBytes, size_t max_segments = kMaxPeerSegments);

  // Copies the result `source` names into `target` (source.bytes() must equal
  // target.bytes), mapping the peer's segment first unless it is mapped. When
  // source.fill_offset() > 0 the owner is still writing its bytes: the copy follows its
  // progress count (a uint64 at that offset of the segment, release-stored by the owner;
  // collserve.v1.Buffer.fill_offset), yielding then napping (at most 1 ms) while it waits.
  // Errors: INTERNAL for a source that does not fit the result or the segment (sizes,
  // offsets, a misaligned or overlapping fill count: a confused or hostile sidecar);
  // DEADLINE_EXCEEDED when the owner has not written every byte within `op_timeout`
  // (naming the bytes written); else the opener's or the mapping's error, naming the rank.
  absl::Status Copy(const v1::PeerSource& source, const ResultTarget& target, absl::Duration op_timeout);

  // What is mapped now.
  size_t mapped_bytes() const;
  size_t mapped_segments() const;

 private:
  // Unmaps the oldest segments until `incoming` more bytes fit under max_bytes_ (and one
  // more segment under max_segments_).
  void EvictLocked(size_t incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Opener open_;
  const size_t max_bytes_, max_segments_;
  mutable absl::Mutex mu_;  // held through a copy
  std::map<std::pair<int, std::string>, std::unique_ptr<ShmSegment>> segments_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<int, std::string>> order_ ABSL_GUARDED_BY(mu_);  // oldest first
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_PEER_READS_H_
