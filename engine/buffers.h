// Sessions' buffers: the shared-memory segments one local rank has registered (the RPC
// layer maps the descriptors the client passed, common/fd_channel.h), kept until the client
// releases them, and the resolution of a request's tensors to memory the engine may read
// and write. A request can only name segments its own session registered.
#ifndef COLLSERVE_ENGINE_BUFFERS_H_
#define COLLSERVE_ENGINE_BUFFERS_H_

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/shm.h"
#include "engine/interfaces.h"
#include "engine/submission.h"

namespace collserve::engine {

// Segments one rank may have mapped at once: the SDK keeps a few free staging ones, one per
// collective in flight and one per SharedBuffer, and reports the ones it drops. Counted with
// the ones it released or replaced that queued requests still hold (each is a mapping).
inline constexpr size_t kMaxMappedSegments = 1024;

// Largest result returned inline (in the completion message): one gRPC message's limit.
inline constexpr size_t kMaxInlineBytes = size_t{1} << 30;

// One rank's registered segments, by name. Not thread-safe (the group's lock guards it).
class SegmentTable {
 public:
  // Adds a segment the rank registered (replacing one of the same name). RESOURCE_EXHAUSTED
  // when the rank would hold more than kMaxMappedSegments mappings: the registered ones and
  // those released or replaced that requests still hold (a client that re-registered one
  // name under a request that never completes once made the sidecar map without bound).
  absl::Status Add(std::shared_ptr<ShmSegment> segment);
  // The address of `bytes` at `b.offset` of the registered segment named `b.segment`;
  // keeps the mapping alive in `sub`. PERMISSION_DENIED (this session registered no such
  // segment), INVALID_ARGUMENT (the range does not fit the segment's real size).
  absl::StatusOr<char*> Map(const BufferRef& b, size_t bytes, Submission& sub);
  // Unmaps a segment the client released (a queued request that uses it keeps its mapping,
  // which still counts against kMaxMappedSegments until that request is done).
  void Release(const std::string& name);
  // Mappings the rank holds: registered, and released or replaced ones still in use.
  size_t mapped();
  // The registered segment named `name`, or null.
  std::shared_ptr<ShmSegment> Find(const std::string& name) const {
    auto it = segments_.find(name);
    return it == segments_.end() ? nullptr : it->second;
  }
  // Bytes of the registered segments.
  size_t bytes() const {
    size_t total = 0;
    for (const auto& [name, s] : segments_) total += s->size();
    return total;
  }

 private:
  // Drops `segment` from the table: kept in retired_ while a request still holds it.
  void Retire(std::shared_ptr<ShmSegment> segment);

  std::map<std::string, std::shared_ptr<ShmSegment>> segments_;
  // Released or replaced segments, while requests hold them (at most kMaxMappedSegments).
  std::vector<std::weak_ptr<ShmSegment>> retired_;
};

// Sets sub.in/in_bytes and sub.out/out_bytes from the request's buffers: the mapped
// segments (local sessions) or the inline bytes (moved out of the request; the result's
// bytes are allocated, zero-filled, only once they were counted in `budget`, which may be
// null: not counted). Requires ValidateRequest(sub.args).ok(). Reports the bytes to
// `observer` (may be null). INVALID_ARGUMENT if an inline tensor's size does not match count
// and dtype, or an inline result would exceed kMaxInlineBytes, or a fill_offset
// (BufferRef::fill_offset: then sub.fill points at the count) is not an aligned word inside
// the segment and outside the tensor; RESOURCE_EXHAUSTED naming max_inline_bytes when the
// inline input and result would take `budget` past its limit; else as Map.
absl::Status ResolveBuffers(SegmentTable& segments, Submission& sub, EngineObserver* observer,
                            InlineBudget* budget = nullptr);

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_BUFFERS_H_
