// Fuzz target: one Collective message from a client, as raw protobuf bytes, through the
// sidecar's translation (server/sidecar/translate.h), the request checks
// (engine/collective_args.h) and the resolution of its tensors (engine/buffers.h) against
// the one 4096-byte segment the session registered. Whatever passes must describe memory
// inside that segment or inline bytes of exactly the right size: the target writes every
// resolved byte, so AddressSanitizer reports any out-of-bounds range.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "collserve/v1/collectives.pb.h"
#include "common/shm.h"
#include "engine/buffers.h"
#include "engine/collective_args.h"
#include "server/sidecar/translate.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  collserve::v1::Collective c;
  if (!c.ParseFromArray(data, static_cast<int>(size))) return 0;
  // The session's one registered segment is named "seg"; any other name must be refused.
  static std::shared_ptr<collserve::ShmSegment> segment = [] {
    auto made = collserve::ShmSegment::Create(4096);
    if (!made.ok()) abort();
    auto mapped = collserve::ShmSegment::FromFd("seg", dup((*made)->fd()), 4096);
    if (!mapped.ok()) abort();
    return std::shared_ptr<collserve::ShmSegment>(std::move(*mapped));
  }();
  // The sidecar's budget for inline bytes (engine::InlineBudget), here 64 MiB: an inline
  // result past it is refused before its bytes are allocated (a 15-byte SCATTER asking for a
  // 1 GiB inline result once took 26 s under ASan to allocate and zero-fill). The previous
  // input's Submission is gone: it must have given its bytes back.
  static collserve::engine::InlineBudget budget(int64_t{64} << 20);
  if (budget.in_use() != 0) abort();
  collserve::engine::Submission sub;
  sub.args = collserve::server::FromProto(std::move(c));
  if (!collserve::engine::ValidateRequest(sub.args, /*rank=*/1, /*world_size=*/4).ok()) return 0;
  collserve::engine::SegmentTable table;
  if (!table.Add(segment).ok()) abort();
  if (!collserve::engine::ResolveBuffers(table, sub, nullptr, &budget).ok()) return 0;
  if (sub.in_bytes > 0) std::memset(sub.in, 0x5a, sub.in_bytes);
  if (sub.out_bytes > 0) std::memset(sub.out, 0xa5, sub.out_bytes);
  return 0;
}
