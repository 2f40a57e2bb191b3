// The SDK's request builder: what a ProcessGroup call becomes on the session, computed
// without a sidecar, a socket or a thread (client/process_group.cc sends it).
//
//   Request        the call's tensors and arguments, checked as they are added;
//   PlanStaging    where its bytes go: by reference into the group's arena (zero copy), or
//                  into one staging segment laid out as [input region][pad to 64][output
//                  region] (in-place ops: the result comes back in the input region), plus
//                  the pipelined broadcast's fill count (collserve.v1.Buffer.fill_offset);
//   EncodeCollective / NameBuffers
//                  the collserve.v1.Collective message (proto/collserve/v1/collectives.proto
//                  documents every field).
//
// All of it is pure: no I/O, no locks; safe to call from any thread on distinct objects.
#ifndef COLLSERVE_CLIENT_REQUEST_BUILDER_H_
#define COLLSERVE_CLIENT_REQUEST_BUILDER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collserve/client.h"
#include "collserve/v1/collectives.pb.h"
#include "common/shm.h"

namespace collserve::client {

// One request, built by the public calls: inputs are concatenated into the input region
// of a segment (or the inline bytes); outputs are filled, in order, from the output region
// (in-place ops: the input region) when the sidecar answers. Counts are elements of
// `dtype`; byte sizes are count x ElementSize(dtype).
struct Request {
  Request(v1::CollectiveOp op, DataType dtype) : op(op), dtype(dtype) {}
  v1::CollectiveOp op;
  DataType dtype;
  ReduceOpArg reduce = static_cast<ReduceOp>(0);
  int root = 0;
  int peer = 0;
  int64_t tag = 0;
  bool wait_all_ranks = false;
  absl::Duration timeout = absl::ZeroDuration();  // 0 = the op timeout
  bool in_place = false;
  bool input_unused = false;  // the op ignores this rank's input bytes: stage without copying
  int64_t count = 0;          // input elements
  int64_t output_count = 0;   // output elements (out-of-place)
  std::vector<std::pair<const void*, size_t>> inputs;
  std::vector<std::pair<void*, size_t>> outputs;
  std::vector<int64_t> input_splits, output_splits;

  size_t Bytes(int64_t n) const { return static_cast<size_t>(n) * ElementSize(dtype); }
  // INVALID_ARGUMENT for an unknown dtype, a negative count, or null data with a non-zero
  // count.
  absl::Status Check(const void* p, int64_t n) const;
  // The one tensor of an in-place op (all_reduce, broadcast, reduce): input and output.
  void InPlace(void* data, int64_t n);
  // Appends an input (an output) tensor of `n` elements; Check's errors.
  absl::Status Input(const void* data, int64_t n);
  absl::Status Output(void* data, int64_t n);
  // One tensor per rank: INVALID_ARGUMENT naming `what` unless there are `world` of each;
  // then Input's (Output's) errors.
  absl::Status InputList(const std::vector<const void*>& ptrs, const std::vector<int64_t>& counts, int world,
                         const char* what);
  absl::Status OutputList(const std::vector<void*>& ptrs, const std::vector<int64_t>& counts, int world,
                          const char* what);
};

// A tensor inside the group's arena (ProcessGroup::AllocateShared): its segment and the
// byte offset in it.
struct ArenaRef {
  const ShmSegment* segment = nullptr;
  size_t offset = 0;
};

// Whether [p, p + bytes) lies wholly in one arena segment; fills `ref` if so.
using ArenaLookup = std::function<bool(const void* p, size_t bytes, ArenaRef* ref)>;

// What the session knows that the plan depends on.
struct PlanContext {
  int rank = 0;                      // this rank in the group
  bool shared_memory = false;        // tensors go through segments (else inline in the message)
  bool pipelined_broadcast = false;  // InitOptions::pipelined_broadcast
};

// Alignment of the output region and of the fill count in a staging segment (bytes).
inline constexpr size_t kStagingAlign = 64;

// Where a request's bytes go. Every size is in bytes.
struct StagingPlan {
  size_t in_bytes = 0;    // the inputs' bytes
  size_t out_bytes = 0;   // the outputs' bytes (in-place: the same tensor as the input)
  size_t out_region = 0;  // out-of-place: the outputs' bytes in the result; in-place: 0
  ArenaRef in_ref, out_ref;
  bool in_zero = false;   // the single input is an arena tensor, named by reference
  bool out_zero = false;  // the output is an arena tensor (in-place: as the input)
  size_t stage_in = 0;    // input bytes copied into the staging segment
  bool stage_out = false;
  size_t out_offset = 0;  // of the output region in the staging segment
  size_t total = 0;       // staging segment bytes needed (0: none)
  // A broadcast root of at least kPipelinedBroadcastMinBytes copies its tensor after the
  // request is sent, publishing its progress as a uint64 at fill_offset.
  bool fill_after_send = false;
  size_t fill_offset = 0;
  size_t result_bytes = 0;  // bytes to copy into the outputs when the answer comes
};

// The staging plan of `r` (already Check'ed) in a session `ctx`; `in_arena` looks tensors
// up in the group's arena (only consulted with shared memory).
StagingPlan PlanStaging(const Request& r, const PlanContext& ctx, const ArenaLookup& in_arena);

// Fills `c` with `r`'s operation and arguments (not its buffers, seq or call site);
// `op_timeout_ms` is the deadline unless the request has its own (monitored_barrier).
void EncodeCollective(const Request& r, int64_t op_timeout_ms, v1::Collective* c);

// Names the buffers of a shared-memory request in `c`: arena tensors by reference, the
// rest in `staging` (the plan's segment; null when the plan has no staged bytes).
void NameBuffers(const StagingPlan& plan, bool in_place, const ShmSegment* staging, v1::Collective* c);

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_REQUEST_BUILDER_H_
