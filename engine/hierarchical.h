// The data step of each collective, once every rank's arguments agree: local ranks'
// tensors are combined in shared memory (backends/local_ops.h), the hosts exchange one
// partial result each through the group's Communicator, and the result is written where
// every local rank reads it (docs/architecture.md, "The data flow of one all_reduce").
//
// Algorithms across hosts, per op:
//   all_reduce: "direct" (one all-gather of every host's partial sum, then a local
//     reduction in host order: one message step for (h-1) times the bytes) below
//     direct_max_bytes x (h-1); above, Gloo's ring (2(h-1) steps, 2(h-1)/h of the bytes,
//     pipelined with the local reduction) from ring_min_bytes, else Gloo's bcube.
//   reduce, reduce_scatter: local reduction, then all_reduce across hosts.
//   broadcast, scatter: the root's host broadcasts.
//   all_gather: an all-gather-v of each host's concatenated inputs.
//   gather, all_to_all: an all-to-all-v in which each host receives only its ranks' pieces
//     (backends without one: as all_gather).
//
// Thread safety: one thread (the group's executor) uses an object at a time.
#ifndef COLLSERVE_ENGINE_HIERARCHICAL_H_
#define COLLSERVE_ENGINE_HIERARCHICAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/local_ops.h"
#include "engine/collective_args.h"
#include "engine/link_scheduler.h"
#include "engine/submission.h"
#include "engine/topology.h"

namespace collserve::engine {

struct AlgorithmOptions {
  // All-reduce across hosts: "auto", "direct", "ring" or "bcube".
  std::string allreduce_algorithm = "auto";
  // "auto" sends directly while bytes x (hosts - 1) <= direct_max_bytes ...
  size_t direct_max_bytes = 1 << 20;
  // ... and takes the ring from ring_min_bytes up (bcube below).
  size_t ring_min_bytes = 1 << 20;
};

// INVALID_ARGUMENT unless `algorithm` is auto, direct, ring or bcube.
absl::Status ValidateAllReduceAlgorithm(const std::string& algorithm);

class Hierarchical {
 public:
  // `topology` and `pool` must outlive this object; `tenant` (the group's job in `pool`,
  // ThreadPool::Tenant; null: the pool's default) is whom its reductions and copies count for.
  Hierarchical(const Topology& topology, backends::ThreadPool* pool, AlgorithmOptions options,
               backends::PoolTenant* tenant = nullptr)
      : topology_(topology), pool_(pool), options_(std::move(options)), tenant_(tenant) {}

  // The communicator among the group's hosts (null with one host); must outlive the calls.
  void set_communicator(backends::Communicator* comm) { comm_ = comm; }

  // The host's scheduler of steps between hosts and the group's class in it (null: every
  // transfer goes whole). all_reduce (and reduce, reduce_scatter) and broadcast between
  // hosts then go in the pieces the exchanged arguments agree on (AgreedPieceBytes of each
  // rank's RankArgs::piece_bytes), each piece after the first once `link` gives the class
  // its turn. all_gather, gather, scatter and all_to_all go whole.
  void set_link(LinkScheduler* link, int priority) {
    link_ = link;
    priority_ = priority;
  }
  // How many pieces the last collective's transfer between hosts went in (1: whole).
  size_t last_pieces() const { return last_pieces_; }

  // A small all_reduce across hosts rides with the argument exchange (executor.cc): every
  // host appends its partial result, padded to kFusedBytes, to its ranks' arguments, so
  // once the arguments agree the data is already there (one exchange instead of two).
  // The choice depends only on the agreed arguments, so every host makes the same one.
  static constexpr size_t kFusedBytes = 1024;
  // Whether the agreed op `a` takes that path: ALL_REDUCE of at most kFusedBytes.
  static bool Fused(const RankArgs& a);
  // Writes this host's partial result (the local inputs reduced, PREMUL_SUM factors
  // applied) to `dst` (kFusedBytes) if the local ranks' requests `subs` are valid and agree
  // on a fused all_reduce; else leaves `dst` alone (the exchange then finds the
  // disagreement).
  void ReducePartial(std::map<int, Submission>& subs, char* dst);
  // After an exchange whose agreed op is Fused: reduces every host's partial (host h's at
  // partials + h * stride) in host order into every local rank's tensor; sets *algorithm.
  void FinishFused(const RankArgs& a, std::map<int, Submission>& subs, const char* partials, size_t stride,
                   const char** algorithm);

  // Runs the data step of the op in `all` (every rank's agreed arguments, by rank; `splits`
  // likewise for ops with NeedsSplits) over the local ranks' submissions `subs` (by rank).
  // On success every local output holds the result. Errors are the communicator's
  // (DEADLINE_EXCEEDED, UNAVAILABLE, FAILED_PRECONDITION); then outputs are undefined, as
  // after a failed NCCL collective. Sets *algorithm to how it ran ("local",
  // "local+gloo_ring", ...; a static string).
  absl::Status Run(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                   std::map<int, Submission>& subs, absl::Duration timeout, const char** algorithm);

 private:
  absl::Status RunReduce(const std::vector<RankArgs>& all, std::map<int, Submission>& subs, absl::Duration timeout);
  absl::Status RunBroadcast(const std::vector<RankArgs>& all, std::map<int, Submission>& subs,
                            absl::Duration timeout);
  absl::Status RunGatherLike(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                             std::map<int, Submission>& subs, absl::Duration timeout);
  // gather and all_to_all across hosts: one all-to-all-v in which each host sends every
  // other host only the pieces its ranks receive. UNIMPLEMENTED if the backend has none.
  absl::Status ExchangePieces(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                              std::map<int, Submission>& subs, absl::Duration timeout);
  absl::Status RunScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                          std::map<int, Submission>& subs, absl::Duration timeout);
  absl::Status RunReduceScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                std::map<int, Submission>& subs, absl::Duration timeout);
  // Across hosts: the local ranks' inputs (offset by `offset` bytes, scaled by PREMUL_SUM's
  // factors) reduced into `acc` (count elements), then all-reduced with the other hosts
  // (SUM for AVG/PREMUL_SUM; the caller divides). Sets algorithm_.
  absl::Status ReduceAcrossHosts(const RankArgs& a, std::map<int, Submission>& subs, size_t offset, char* acc,
                                 size_t count, absl::Duration timeout);
  // Runs `transfer(first, n)` over the pieces of `count` elements of `element_size` bytes
  // (piece_bytes_; one piece when 0), each after the first once link_ gives priority_ its
  // turn, every piece within what is left of `timeout`; stops at the first error.
  absl::Status InPieces(size_t count, size_t element_size, absl::Duration timeout,
                        const std::function<absl::Status(size_t first, size_t n, absl::Duration left)>& transfer);
  // Gloo's all_reduce algorithm for `bytes` across hosts; sets algorithm_.
  backends::AllReduceAlgorithm ChooseAllReduce(size_t bytes);
  // Whether an all_reduce of `bytes` across `num_hosts` takes the direct exchange.
  bool UseDirect(size_t bytes, int num_hosts) const;
  // The LocalReduce of `a`'s op over the local inputs (offset by `offset` bytes), count
  // elements, with no destinations yet; reuses local_reduce_.
  backends::LocalReduce& LocalReduceOf(const RankArgs& a, std::map<int, Submission>& subs, size_t offset,
                                       size_t count);

  const Topology& topology_;
  backends::ThreadPool* const pool_;
  const AlgorithmOptions options_;
  backends::PoolTenant* const tenant_;
  backends::Communicator* comm_ = nullptr;
  LinkScheduler* link_ = nullptr;
  int priority_ = 1;
  size_t piece_bytes_ = 0;  // the running collective's AgreedPieceBytes
  std::vector<int64_t> proposals_;  // its ranks' RankArgs::piece_bytes (reused)
  size_t last_pieces_ = 1;
  const char* algorithm_ = "local";
  // Reused by every collective so that repeated calls allocate no tensor-sized memory.
  backends::LocalReduce local_reduce_;
  std::vector<backends::CopyJob> copies_;
  std::vector<const void*> comm_inputs_;
  std::vector<void*> comm_outputs_;
  std::vector<const void*> piece_inputs_;  // comm_inputs_/comm_outputs_ at one piece's offset
  std::vector<void*> piece_outputs_;
  std::vector<char> scratch_a_, scratch_b_;
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_HIERARCHICAL_H_
