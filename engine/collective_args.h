// Argument checking for the sidecar's collectives: what one rank's request must satisfy on
// its own (ValidateRequest), and what the ranks of a group must agree on (Disagreement,
// SizeDisagreement). The sidecars exchange every rank's RankArgs (and, for the ops with
// per-rank sizes, their splits) before any data moves, and every host computes the same
// verdict from the same table, so a desync gives every rank the same error instead of a
// hang (always-on desync detection, in the spirit of torch's TORCH_DISTRIBUTED_DEBUG=DETAIL
// collective fingerprints, https://pytorch.org/docs/stable/distributed.html).
#ifndef COLLSERVE_ENGINE_COLLECTIVE_ARGS_H_
#define COLLSERVE_ENGINE_COLLECTIVE_ARGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/types.h"

namespace collserve::engine {

// One rank's arguments as exchanged between hosts. Fixed layout, all int64 so it is the
// same on every host (hosts are one architecture). Fields an op does not use are zero, so
// they never show up as a disagreement.
struct RankArgs {
  int64_t rank = -1;    // -1 = padding
  int64_t valid = 0;    // 0 = the rank's request failed ValidateRequest
  int64_t arrived = 1;  // 0 = the rank did not call (MONITORED_BARRIER only)
  int64_t op = 0;
  int64_t dtype = 0;
  int64_t count = 0;
  int64_t output_count = 0;
  int64_t reduce_op = 0;
  int64_t root = 0;
  // Where the tensors live: 0 = host memory, 1 = CUDA through the sidecar (Request::OnDevice),
  // 2 = CUDA with NCCL in the rank (Request::in_rank: a record, no data step).
  int64_t device = 0;
  int64_t call_site = 0;  // CallSiteFingerprint(Request::call_site); 0 = unknown
  // When the request reached its sidecar (Unix ns, that host's clock; 0 = unknown): the
  // flight recorder's arrival times and skew. Not compared between ranks.
  int64_t arrived_ns = 0;
  // The piece size the rank's host proposes for this collective's transfers between hosts
  // (LinkScheduler::ProposedPieceBytes; 0 = none); every host cuts at AgreedPieceBytes of
  // all ranks'. Set by the exchange; not compared between ranks.
  int64_t piece_bytes = 0;
};
static_assert(sizeof(RankArgs) == 104, "RankArgs is exchanged as raw bytes");

// The largest call site a request may carry, in bytes (longer ones are cut).
inline constexpr size_t kMaxCallSiteBytes = 256;

// Whether `op`'s call sites are compared: every collective with data. Not barriers: torch
// programs pair barriers at different places on purpose ("if rank != 0: barrier() ...
// if rank == 0: barrier()", so that rank 0 downloads first); not send/recv, which are
// matched by peer and tag.
bool ChecksCallSite(CollectiveOp op);

// A fingerprint of a call site, the same on every host (64-bit FNV-1a); 0 for "" only.
int64_t CallSiteFingerprint(absl::string_view call_site);

// The call sites the ranks that gave one disagree on: fingerprint -> ranks, when there
// are at least two (else empty). Ranks with call_site 0, valid == 0 or arrived == 0 are
// not counted. Checked once Disagreement found nothing.
std::map<int64_t, std::vector<int64_t>> CallSiteDisagreement(const std::vector<RankArgs>& all);

// The op of exchanged args (a CollectiveOp value; remote bytes are checked by Disagreement).
inline CollectiveOp OpOf(const RankArgs& a) { return static_cast<CollectiveOp>(a.op); }

// The args of `rank`'s request with the fields its op does not use zeroed.
RankArgs ArgsOf(int rank, const Request& c, bool valid);

// Whether an op moves data between the sidecar and the client's buffers in place
// (ALL_REDUCE, BROADCAST, REDUCE) rather than from `buffer` to `output`.
bool IsInPlace(CollectiveOp op);
// Whether the ranks' splits must be exchanged to check and run the op.
bool NeedsSplits(CollectiveOp op);

// The largest tensor (input or output) one request may describe, in bytes (2^48 = 256 TiB:
// far above any real tensor, far below where byte arithmetic overflows).
inline constexpr int64_t kMaxTensorBytes = int64_t{1} << 48;

// The checks one rank's request must pass on its own: known op and dtype, the reduce op
// defined for the dtype, root in range, counts within kMaxTensorBytes, splits of world_size
// entries that sum to the counts (see collectives.proto); an in_rank record is a collective
// with tensors that names no buffer or event. INVALID_ARGUMENT with the reason.
absl::Status ValidateRequest(const Request& c, int rank, int world_size);

// "" if the ranks agree on op, and for that op on dtype, reduce_op, root and count (call
// sites: CallSiteDisagreement); else
// a message naming which ranks called what, e.g.
// "count=7 on ranks [1] but count=1000 on ranks [0, 2, 3]". Ranks with valid == 0 are
// named as having sent invalid requests; ranks with arrived == 0 are ignored.
std::string Disagreement(const std::vector<RankArgs>& all);

// Every rank's splits (input_splits, output_splits), indexed by rank. Empty = none given.
struct RankSplits {
  std::vector<int64_t> input;
  std::vector<int64_t> output;
};

// For ops with per-rank sizes (NeedsSplits), "" if the sizes fit together, else a message
// naming the ranks, e.g. "rank 0 sends 3 elements to rank 1, but rank 1 expects 4 from
// rank 0". `args` and `splits` are indexed by rank (world_size entries) and already agree
// per Disagreement.
std::string SizeDisagreement(const std::vector<RankArgs>& args, const std::vector<RankSplits>& splits);

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_COLLECTIVE_ARGS_H_
