#include "engine/buffers.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/types.h"
#include "engine/collective_args.h"

namespace collserve::engine {

size_t SegmentTable::mapped() {
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [](const std::weak_ptr<ShmSegment>& s) { return s.expired(); }),
                 retired_.end());
  return segments_.size() + retired_.size();
}

void SegmentTable::Retire(std::shared_ptr<ShmSegment> segment) {
  // Only the table held it: unmapped here. Else the requests that hold it unmap it.
  if (segment.use_count() > 1) retired_.push_back(segment);
}

absl::Status SegmentTable::Add(std::shared_ptr<ShmSegment> segment) {
  auto same = segments_.find(segment->name());
  // A replaced segment stays mapped while requests hold it.
  const bool replaced_stays = same != segments_.end() && same->second.use_count() > 1;
  const size_t after = mapped() + (same == segments_.end() || replaced_stays ? 1 : 0);
  if (after > kMaxMappedSegments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank holds ", after - 1, " shared-memory segments (", segments_.size(),
        " registered, the rest released or replaced but still used by its requests), the limit (",
        kMaxMappedSegments, ")"));
  }
  if (same != segments_.end()) {
    Retire(std::move(same->second));
    same->second = std::move(segment);
  } else {
    const std::string name = segment->name();
    segments_.emplace(name, std::move(segment));
  }
  return absl::OkStatus();
}

void SegmentTable::Release(const std::string& name) {
  auto it = segments_.find(name);
  if (it == segments_.end()) return;
  Retire(std::move(it->second));
  segments_.erase(it);
}

absl::StatusOr<char*> SegmentTable::Map(const BufferRef& b, size_t bytes, Submission& sub) {
  auto seg = segments_.find(b.segment);
  if (seg == segments_.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "segment \"", absl::CHexEscape(b.segment.substr(0, 64)),
        "\" was not registered by this session (segments are passed as descriptors, never by name)"));
  }
  const uint64_t size = seg->second->size();
  if (b.offset < 0 || static_cast<uint64_t>(b.offset) > size || bytes > size - static_cast<uint64_t>(b.offset)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor of ", bytes, " bytes at offset ", b.offset,
                                                   " does not fit segment ", b.segment, " of ", size, " bytes"));
  }
  sub.segments.push_back(seg->second);
  return seg->second->data() + b.offset;
}

absl::Status ResolveBuffers(SegmentTable& segments, Submission& sub, EngineObserver* observer,
                            InlineBudget* budget) {
  Request& c = sub.args;
  const CollectiveOp op = c.op;
  if (op == CollectiveOp::kBarrier || op == CollectiveOp::kMonitoredBarrier) return absl::OkStatus();
  const size_t es = ElementSize(static_cast<DataType>(c.dtype));
  // RECV's tensor is its output; SEND's its input.
  const bool in_place = IsInPlace(op);
  sub.in_bytes = op == CollectiveOp::kRecv ? 0 : static_cast<size_t>(c.count) * es;
  // SEND has no output (whatever its output_count says: a fuzzer's SEND with an output_count
  // of 2^39 once made the sidecar allocate a 1 TB inline result).
  sub.out_bytes = in_place || op == CollectiveOp::kSend
                      ? 0
                      : static_cast<size_t>(op == CollectiveOp::kRecv ? c.count : c.output_count) * es;
  if (c.buffer.segment.empty()) {
    // Inline: the input arrives in the request, the result goes back in the completion.
    if (c.buffer.inline_data.size() != sub.in_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("inline tensor holds ", c.buffer.inline_data.size(),
                                                     " bytes, but count and dtype need ", sub.in_bytes));
    }
    if (sub.out_bytes > kMaxInlineBytes) {
      return absl::InvalidArgumentError(absl::StrCat("an inline result of ", sub.out_bytes, " bytes exceeds the ",
                                                     kMaxInlineBytes, "-byte limit of one message"));
    }
    // Both sizes are at most kMaxInlineBytes (the input arrived in one message): no overflow.
    const int64_t held = static_cast<int64_t>(sub.in_bytes + sub.out_bytes);
    if (budget != nullptr) {
      const InlineBudget* refused = nullptr;
      if (!budget->TryReserve(held, &refused)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "an inline request of ", held, " bytes (input and result) would put ", refused->what(), " in flight at ",
            refused->in_use() + held, ", over its limit (", refused->limit_name(), " ", refused->limit(),
            "); use shared memory on the sidecar's host, or fewer inline requests at once"));
      }
      sub.inline_charge = InlineCharge(budget, held);
    }
    sub.inline_mode = true;
    sub.inline_in = std::make_unique<std::string>(std::move(c.buffer.inline_data));
    sub.in = sub.inline_in->data();
    sub.inline_out = std::make_unique<std::string>(sub.out_bytes, '\0');
    sub.out = sub.inline_out->data();
    if (observer != nullptr) observer->OnTensorBytes(BytePath::kInline, sub.in_bytes + sub.out_bytes);
    return absl::OkStatus();
  }
  if (sub.in_bytes > 0) {
    COLLSERVE_ASSIGN_OR_RETURN(sub.in, segments.Map(c.buffer, sub.in_bytes, sub));
    if (c.buffer.fill_offset > 0) {
      // The count of bytes written so far: an aligned word inside the segment, outside the tensor.
      const ShmSegment& seg = *sub.segments.back();
      const uint64_t at = static_cast<uint64_t>(c.buffer.fill_offset);
      const uint64_t begin = static_cast<uint64_t>(c.buffer.offset);
      if (at % sizeof(uint64_t) != 0 || seg.size() < sizeof(uint64_t) || at > seg.size() - sizeof(uint64_t) ||
          (at + sizeof(uint64_t) > begin && at < begin + sub.in_bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fill_offset ", at, " must be a multiple of 8 with its 8 bytes inside segment ", c.buffer.segment, " of ",
            seg.size(), " bytes and outside the tensor's bytes [", begin, ", ", begin + sub.in_bytes, ")"));
      }
      sub.fill = reinterpret_cast<const uint64_t*>(seg.data() + at);
    }
  }
  if (sub.out_bytes > 0) {
    COLLSERVE_ASSIGN_OR_RETURN(sub.out, segments.Map(c.output, sub.out_bytes, sub));
  }
  if (observer != nullptr) {
    if (sub.in_bytes > 0) observer->OnTensorBytes(c.buffer.arena ? BytePath::kArena : BytePath::kStaged, sub.in_bytes);
    if (sub.out_bytes > 0) {
      observer->OnTensorBytes(c.output.arena ? BytePath::kArena : BytePath::kStaged, sub.out_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace collserve::engine
