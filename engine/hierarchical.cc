#include "engine/hierarchical.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/types.h"

namespace collserve::engine {

absl::Status ValidateAllReduceAlgorithm(const std::string& algorithm) {
  if (algorithm == "auto" || algorithm == "direct" || algorithm == "ring" || algorithm == "bcube") {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("all_reduce algorithm \"", algorithm, "\": use auto, direct, ring or bcube"));
}

bool Hierarchical::Fused(const RankArgs& a) {
  const size_t es = ElementSize(static_cast<DataType>(a.dtype));
  return OpOf(a) == CollectiveOp::kAllReduce && a.device == 0 && a.count > 0 && es > 0 &&
         static_cast<uint64_t>(a.count) <= kFusedBytes / es;
}

void Hierarchical::ReducePartial(std::map<int, Submission>& subs, char* dst) {
  if (subs.empty()) return;
  const Request& first = subs.begin()->second.args;
  for (const auto& [rank, sub] : subs) {
    const Request& r = sub.args;
    if (!sub.error.ok() || r.OnDevice() || r.op != CollectiveOp::kAllReduce || r.dtype != first.dtype || r.count != first.count ||
        r.reduce_op != first.reduce_op) {
      return;
    }
  }
  const RankArgs a = ArgsOf(subs.begin()->first, first, true);
  if (!Fused(a)) return;
  backends::LocalReduce& partial = LocalReduceOf(a, subs, 0, static_cast<size_t>(a.count));
  partial.dsts.push_back(dst);
  backends::RunLocalReduce(*pool_, partial, tenant_);
}

void Hierarchical::FinishFused(const RankArgs& a, std::map<int, Submission>& subs, const char* partials,
                               size_t stride, const char** algorithm) {
  const ReduceOp op = static_cast<ReduceOp>(a.reduce_op);
  const ReduceOp wire_op = (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) ? ReduceOp::kSum : op;
  backends::LocalReduce& total = LocalReduceOf(a, subs, 0, static_cast<size_t>(a.count));
  total.op = wire_op;
  total.premul.clear();
  total.srcs.clear();
  for (int h = 0; h < topology_.num_hosts; ++h) total.srcs.push_back(partials + static_cast<size_t>(h) * stride);
  total.divisor = op == ReduceOp::kAvg ? topology_.world_size : 1;
  for (auto& [rank, sub] : subs) total.dsts.push_back(sub.in);
  backends::RunLocalReduce(*pool_, total, tenant_);
  *algorithm = "local+gloo_fused";
}

absl::Status Hierarchical::Run(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                               std::map<int, Submission>& subs, absl::Duration timeout, const char** algorithm) {
  algorithm_ = "local";
  last_pieces_ = 1;
  piece_bytes_ = 0;
  if (link_ != nullptr && topology_.num_hosts > 1) {
    proposals_.clear();
    for (const RankArgs& r : all) proposals_.push_back(r.piece_bytes);
    piece_bytes_ = AgreedPieceBytes(proposals_);
  }
  absl::Status status;
  switch (OpOf(all[0])) {
    case CollectiveOp::kBarrier:
    case CollectiveOp::kMonitoredBarrier:
      break;  // every rank's arguments arrived on every host: that is the barrier
    case CollectiveOp::kBroadcast:
      status = RunBroadcast(all, subs, timeout);
      break;
    case CollectiveOp::kAllReduce:
    case CollectiveOp::kReduce:
      status = RunReduce(all, subs, timeout);
      break;
    case CollectiveOp::kAllGather:
    case CollectiveOp::kGather:
    case CollectiveOp::kAllToAll:
      status = RunGatherLike(all, splits, subs, timeout);
      break;
    case CollectiveOp::kScatter:
      status = RunScatter(all, splits, subs, timeout);
      break;
    case CollectiveOp::kReduceScatter:
      status = RunReduceScatter(all, splits, subs, timeout);
      break;
    default:
      status = absl::InternalError(absl::StrCat("no runner for ", OpName(static_cast<int>(all[0].op))));
      break;
  }
  *algorithm = algorithm_;
  return status;
}

namespace {

size_t Bytes(const RankArgs& a, int64_t elements) {
  return static_cast<size_t>(elements) * ElementSize(static_cast<DataType>(a.dtype));
}

// Exclusive prefix sums of `v` (size n + 1).
std::vector<int64_t> Offsets(const std::vector<int64_t>& v) {
  std::vector<int64_t> out(v.size() + 1, 0);
  for (size_t i = 0; i < v.size(); ++i) out[i + 1] = out[i] + v[i];
  return out;
}

}  // namespace

absl::Status Hierarchical::InPieces(
    size_t count, size_t element_size, absl::Duration timeout,
    const std::function<absl::Status(size_t first, size_t n, absl::Duration left)>& transfer) {
  const size_t per_piece = ElementsPerPiece(count, element_size, piece_bytes_);
  last_pieces_ = per_piece == 0 ? 1 : (count + per_piece - 1) / per_piece;
  if (last_pieces_ <= 1) return transfer(0, count, timeout);
  if (link_ != nullptr) link_->RecordCut(priority_, last_pieces_);
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t first = 0; first < count; first += per_piece) {
    if (first > 0 && link_ != nullptr) link_->AwaitTurn(priority_);
    const absl::Duration left = std::max(deadline - absl::Now(), absl::Milliseconds(1));
    COLLSERVE_RETURN_IF_ERROR(transfer(first, std::min(per_piece, count - first), left));
  }
  return absl::OkStatus();
}

absl::Status Hierarchical::RunBroadcast(const std::vector<RankArgs>& all, std::map<int, Submission>& subs,
                                        absl::Duration timeout) {
  const RankArgs& a = all[0];
  const size_t bytes = Bytes(a, a.count);
  if (bytes == 0) return absl::OkStatus();
  const int root = static_cast<int>(a.root);
  auto local_root = subs.find(root);
  char* buf = local_root != subs.end() ? local_root->second.in : subs.begin()->second.in;
  if (topology_.num_hosts > 1) {
    const int root_host = topology_.rank_host[root];
    algorithm_ = "local+gloo_broadcast";
    COLLSERVE_RETURN_IF_ERROR(InPieces(bytes, 1, timeout, [&](size_t first, size_t n, absl::Duration left) {
      return comm_->Broadcast(buf + first, n, root_host, left);
    }));
  }
  copies_.clear();
  for (auto& [rank, sub] : subs) {
    // A peer reader copies the result out of the root's segment itself.
    if (sub.in != buf && sub.peer_rank < 0) copies_.push_back({sub.in, buf, bytes});
  }
  backends::RunCopies(*pool_, copies_, tenant_);
  return absl::OkStatus();
}

backends::LocalReduce& Hierarchical::LocalReduceOf(const RankArgs& a, std::map<int, Submission>& subs, size_t offset,
                                            size_t count) {
  backends::LocalReduce& r = local_reduce_;
  r.dtype = static_cast<DataType>(a.dtype);
  r.op = static_cast<ReduceOp>(a.reduce_op);
  r.count = count;
  r.divisor = 1;
  r.srcs.clear();
  r.premul.clear();
  r.dsts.clear();
  for (auto& [rank, sub] : subs) {
    r.srcs.push_back(sub.in + offset);
    if (r.op == ReduceOp::kPremulSum) r.premul.push_back(sub.args.premul_factor);
  }
  return r;
}

// Gloo's ring all-reduce moves 2(h-1)/h of the bytes per host in 2(h-1) steps per piece
// (pieces of at most ring_segment_bytes, overlapping the local reduction with the
// transfer); its bcube (recursive halving-doubling for base 2) the same bytes in 2 log2(h)
// steps, unpipelined. Below ring_min_bytes the steps' latency dominates and bcube wins.
bool Hierarchical::UseDirect(size_t bytes, int num_hosts) const {
  if (options_.allreduce_algorithm == "direct") return true;
  return options_.allreduce_algorithm == "auto" && bytes * static_cast<size_t>(num_hosts - 1) <= options_.direct_max_bytes;
}

backends::AllReduceAlgorithm Hierarchical::ChooseAllReduce(size_t bytes) {
  const bool ring = options_.allreduce_algorithm == "ring" ||
                    (options_.allreduce_algorithm != "bcube" && bytes >= options_.ring_min_bytes);
  algorithm_ = ring ? "local+gloo_ring" : "local+gloo_bcube";
  return ring ? backends::AllReduceAlgorithm::kRing : backends::AllReduceAlgorithm::kBcube;
}

absl::Status Hierarchical::ReduceAcrossHosts(const RankArgs& a, std::map<int, Submission>& subs, size_t offset, char* acc,
                                      size_t count, absl::Duration timeout) {
  const ReduceOp op = static_cast<ReduceOp>(a.reduce_op);
  const ReduceOp wire_op = (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) ? ReduceOp::kSum : op;
  backends::LocalReduce& r = LocalReduceOf(a, subs, offset, count);
  r.dsts.push_back(acc);
  backends::RunLocalReduce(*pool_, r, tenant_);
  const DataType dtype = static_cast<DataType>(a.dtype);
  const size_t element = ElementSize(dtype);
  const backends::AllReduceAlgorithm algorithm = ChooseAllReduce(Bytes(a, static_cast<int64_t>(count)));
  return InPieces(count, element, timeout, [&](size_t first, size_t n, absl::Duration left) {
    return comm_->AllReduce(acc + first * element, n, dtype, wire_op, left, algorithm);
  });
}

// ALL_REDUCE and REDUCE. One host: a single pass reduces the local inputs chunk by chunk
// and writes each chunk to every destination (every rank, or the root). Across hosts: the
// local ranks' partial result is all-reduced with the other hosts, then copied out.
// REDUCE leaves the other ranks' tensors untouched (they may be the caller's own memory).
absl::Status Hierarchical::RunReduce(const std::vector<RankArgs>& all, std::map<int, Submission>& subs, absl::Duration timeout) {
  const RankArgs& a = all[0];
  if (a.count == 0) return absl::OkStatus();
  const size_t count = static_cast<size_t>(a.count);
  const bool avg = static_cast<ReduceOp>(a.reduce_op) == ReduceOp::kAvg;
  auto root = OpOf(a) == CollectiveOp::kReduce ? subs.find(static_cast<int>(a.root)) : subs.end();
  if (topology_.num_hosts == 1) {
    backends::LocalReduce& r = LocalReduceOf(a, subs, 0, count);
    r.divisor = avg ? topology_.world_size : 1;
    if (OpOf(a) == CollectiveOp::kReduce) {
      r.dsts.push_back(root->second.in);
    } else {
      // A peer reader copies the result out of its owner's segment itself.
      for (auto& [rank, sub] : subs) {
        if (sub.peer_rank < 0) r.dsts.push_back(sub.in);
      }
    }
    backends::RunLocalReduce(*pool_, r, tenant_);
    return absl::OkStatus();
  }
  if (OpOf(a) == CollectiveOp::kAllReduce) {
    const ReduceOp op = static_cast<ReduceOp>(a.reduce_op);
    const ReduceOp wire_op = (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) ? ReduceOp::kSum : op;
    const size_t bytes = Bytes(a, a.count);
    if (UseDirect(bytes, topology_.num_hosts)) {
      // Direct exchange: one all-gather of every host's partial result (one message step
      // instead of the 2 log2(h) or 2(h-1) of bcube and ring, for (h-1) times the bytes),
      // then every host reduces the partials in host order, so all get the same bits.
      algorithm_ = "local+gloo_direct";
      scratch_a_.resize(bytes);
      scratch_b_.resize(bytes * static_cast<size_t>(topology_.num_hosts));
      backends::LocalReduce& partial = LocalReduceOf(a, subs, 0, count);
      partial.dsts.push_back(scratch_a_.data());
      backends::RunLocalReduce(*pool_, partial, tenant_);
      COLLSERVE_RETURN_IF_ERROR(comm_->AllGather(scratch_a_.data(), scratch_b_.data(), bytes, timeout));
      backends::LocalReduce& total = LocalReduceOf(a, subs, 0, count);
      total.op = wire_op;
      total.premul.clear();
      total.srcs.clear();
      for (int h = 0; h < topology_.num_hosts; ++h) total.srcs.push_back(scratch_b_.data() + static_cast<size_t>(h) * bytes);
      total.divisor = avg ? topology_.world_size : 1;
      for (auto& [rank, sub] : subs) total.dsts.push_back(sub.in);
      backends::RunLocalReduce(*pool_, total, tenant_);
      return absl::OkStatus();
    }
    // Every local tensor is an input and an output: Gloo reduces them into the first,
    // segment by segment, while the segments travel, and copies each reduced segment to
    // the others as it arrives. PREMUL_SUM scales the tensors first (they receive the
    // result anyway); AVG divides afterwards.
    comm_inputs_.clear();
    comm_outputs_.clear();
    for (auto& [rank, sub] : subs) {
      if (op == ReduceOp::kPremulSum) {
        backends::LocalReduce& scale = LocalReduceOf(a, subs, 0, count);
        scale.srcs.assign(1, sub.in);
        scale.premul.assign(1, sub.args.premul_factor);
        scale.dsts.push_back(sub.in);
        backends::RunLocalReduce(*pool_, scale, tenant_);
      }
      comm_inputs_.push_back(sub.in);
      comm_outputs_.push_back(sub.in);
    }
    const backends::AllReduceAlgorithm algorithm = ChooseAllReduce(bytes);
    const DataType dtype = static_cast<DataType>(a.dtype);
    const size_t element = ElementSize(dtype);
    COLLSERVE_RETURN_IF_ERROR(InPieces(count, element, timeout, [&](size_t first, size_t n, absl::Duration left) {
      piece_inputs_.clear();
      piece_outputs_.clear();
      for (const void* in : comm_inputs_) piece_inputs_.push_back(static_cast<const char*>(in) + first * element);
      for (void* out : comm_outputs_) piece_outputs_.push_back(static_cast<char*>(out) + first * element);
      return comm_->AllReduceLocal(piece_inputs_, piece_outputs_, n, dtype, wire_op, left, algorithm);
    }));
    if (avg) {
      backends::LocalReduce& div = LocalReduceOf(a, subs, 0, count);
      div.op = ReduceOp::kSum;
      div.srcs.assign(1, subs.begin()->second.in);
      div.premul.clear();
      div.divisor = topology_.world_size;
      for (auto& [rank, sub] : subs) div.dsts.push_back(sub.in);
      backends::RunLocalReduce(*pool_, div, tenant_);
    }
    return absl::OkStatus();
  }
  char* acc;
  if (root != subs.end()) {
    acc = root->second.in;
  } else {
    scratch_a_.resize(Bytes(a, a.count));
    acc = scratch_a_.data();
  }
  COLLSERVE_RETURN_IF_ERROR(ReduceAcrossHosts(a, subs, 0, acc, count, timeout));
  if (root != subs.end() && avg) {
    backends::LocalReduce& out = local_reduce_;
    out.op = ReduceOp::kSum;
    out.srcs.assign(1, acc);
    out.premul.clear();
    out.divisor = topology_.world_size;
    out.dsts.assign(1, acc);
    backends::RunLocalReduce(*pool_, out, tenant_);
  }
  return absl::OkStatus();
}

// ALL_GATHER, GATHER and ALL_TO_ALL: make every rank's input readable on this host (local
// ones in place; remote ones by an all-gather of each host's concatenated local inputs),
// then copy each local rank's pieces into its output.
absl::Status Hierarchical::RunGatherLike(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                  std::map<int, Submission>& subs, absl::Duration timeout) {
  const int world = topology_.world_size;
  const RankArgs& a = all[0];
  if (topology_.num_hosts > 1 && OpOf(a) != CollectiveOp::kAllGather) {
    // gather and all_to_all: each host receives only the pieces for its own ranks.
    absl::Status s = ExchangePieces(all, splits, subs, timeout);
    if (s.code() != absl::StatusCode::kUnimplemented) return s;
    // The backend has no all-to-all: every host gets every input (below).
  }
  std::vector<const char*> src(world, nullptr);
  for (const auto& [rank, sub] : subs) src[rank] = sub.in;
  if (topology_.num_hosts > 1) {
    const std::vector<std::vector<int>>& by_host = topology_.ranks_by_host;
    const int me = topology_.host_index;
    std::vector<size_t> host_bytes(topology_.num_hosts, 0);
    for (int h = 0; h < topology_.num_hosts; ++h) {
      for (int r : by_host[h]) host_bytes[h] += Bytes(a, all[r].count);
    }
    size_t total = 0;
    for (size_t b : host_bytes) total += b;
    scratch_a_.resize(std::max<size_t>(host_bytes[me], 1));
    scratch_b_.resize(std::max<size_t>(total, 1));
    size_t off = 0;
    copies_.clear();
    for (int r : by_host[me]) {
      const size_t b = Bytes(a, all[r].count);
      if (b > 0) copies_.push_back({scratch_a_.data() + off, subs.at(r).in, b});
      off += b;
    }
    backends::RunCopies(*pool_, copies_, tenant_);
    algorithm_ = "local+gloo_allgatherv";
    COLLSERVE_RETURN_IF_ERROR(comm_->AllGatherV(scratch_a_.data(), scratch_b_.data(), host_bytes, timeout));
    off = 0;
    for (int h = 0; h < topology_.num_hosts; ++h) {
      for (int r : by_host[h]) {
        if (h != me) src[r] = scratch_b_.data() + off;
        off += Bytes(a, all[r].count);
      }
    }
  }
  copies_.clear();
  for (auto& [rank, sub] : subs) {
    if (OpOf(a) == CollectiveOp::kGather && rank != a.root) continue;
    char* out = sub.out;
    if (OpOf(a) == CollectiveOp::kAllToAll) {
      const std::vector<int64_t>& mine = splits[rank].output;
      const std::vector<int64_t> out_off = Offsets(mine);
      for (int r = 0; r < world; ++r) {
        const std::vector<int64_t> in_off = Offsets(splits[r].input);
        const size_t b = Bytes(a, splits[r].input[rank]);
        if (b > 0) copies_.push_back({out + Bytes(a, out_off[r]), src[r] + Bytes(a, in_off[rank]), b});
      }
      continue;
    }
    size_t off = 0;
    for (int r = 0; r < world; ++r) {
      const size_t b = Bytes(a, all[r].count);
      if (b > 0) copies_.push_back({out + off, src[r], b});
      off += b;
    }
  }
  backends::RunCopies(*pool_, copies_, tenant_);
  return absl::OkStatus();
}

absl::Status Hierarchical::ExchangePieces(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                          std::map<int, Submission>& subs, absl::Duration timeout) {
  const RankArgs& a = all[0];
  const bool gather = OpOf(a) == CollectiveOp::kGather;
  const int root = static_cast<int>(a.root);
  // Prefix sums, for this host's ranks only (a world x world table would not fit large
  // groups): where each piece starts in a local rank's input and output.
  std::map<int, std::vector<int64_t>> in_prefix, out_prefix;
  std::vector<int64_t> count_prefix;
  if (gather) {
    count_prefix.assign(all.size() + 1, 0);
    for (size_t k = 0; k < all.size(); ++k) count_prefix[k + 1] = count_prefix[k] + all[k].count;
  } else {
    for (const auto& [rank, sub] : subs) {
      in_prefix[rank] = Offsets(splits[rank].input);
      out_prefix[rank] = Offsets(splits[rank].output);
    }
  }
  // The bytes rank i sends to rank j, and (for a local i) where they start in i's input.
  auto piece = [&](int i, int j, size_t* in_off) -> size_t {
    if (gather) {
      *in_off = 0;
      return j == root ? Bytes(a, all[i].count) : 0;
    }
    auto local = in_prefix.find(i);
    *in_off = local != in_prefix.end() ? Bytes(a, local->second[j]) : 0;
    return Bytes(a, splits[i].input[j]);
  };
  // Where rank i's piece goes in local rank j's output.
  auto out_offset = [&](int i, int j) -> size_t {
    return Bytes(a, gather ? count_prefix[i] : out_prefix.at(j)[i]);
  };
  const int hosts = topology_.num_hosts;
  const int me = topology_.host_index;
  const std::vector<std::vector<int>>& by_host = topology_.ranks_by_host;
  std::vector<size_t> send(hosts, 0), recv(hosts, 0);
  size_t in_off = 0;
  for (int g = 0; g < hosts; ++g) {
    if (g == me) continue;
    for (int i : by_host[me]) {
      for (int j : by_host[g]) send[g] += piece(i, j, &in_off);
    }
    for (int i : by_host[g]) {
      for (int j : by_host[me]) recv[g] += piece(i, j, &in_off);
    }
  }
  size_t total_send = 0, total_recv = 0;
  for (int h = 0; h < hosts; ++h) {
    total_send += send[h];
    total_recv += recv[h];
  }
  scratch_a_.resize(std::max<size_t>(total_send, 1));
  scratch_b_.resize(std::max<size_t>(total_recv, 1));
  // Pack: for each other host, its ranks' pieces from each local rank, in rank order.
  copies_.clear();
  size_t off = 0;
  for (int g = 0; g < hosts; ++g) {
    if (g == me) continue;
    for (int i : by_host[me]) {
      for (int j : by_host[g]) {
        const size_t b = piece(i, j, &in_off);
        if (b > 0) copies_.push_back({scratch_a_.data() + off, subs.at(i).in + in_off, b});
        off += b;
      }
    }
  }
  backends::RunCopies(*pool_, copies_, tenant_);
  algorithm_ = gather ? "local+gloo_alltoallv_to_root" : "local+gloo_alltoallv";
  COLLSERVE_RETURN_IF_ERROR(comm_->AllToAllV(scratch_a_.data(), send, scratch_b_.data(), recv, timeout));
  // Unpack what arrived, and copy the pieces among this host's own ranks.
  copies_.clear();
  off = 0;
  for (int h = 0; h < hosts; ++h) {
    if (h == me) continue;
    for (int i : by_host[h]) {
      for (int j : by_host[me]) {
        const size_t b = piece(i, j, &in_off);
        if (b > 0) copies_.push_back({subs.at(j).out + out_offset(i, j), scratch_b_.data() + off, b});
        off += b;
      }
    }
  }
  for (int i : by_host[me]) {
    for (int j : by_host[me]) {
      const size_t b = piece(i, j, &in_off);
      if (b > 0) copies_.push_back({subs.at(j).out + out_offset(i, j), subs.at(i).in + in_off, b});
    }
  }
  backends::RunCopies(*pool_, copies_, tenant_);
  return absl::OkStatus();
}

// SCATTER: the root's host broadcasts the root's input to the other hosts; each local
// rank copies its piece.
absl::Status Hierarchical::RunScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                               std::map<int, Submission>& subs, absl::Duration timeout) {
  const RankArgs& a = all[0];
  const int root = static_cast<int>(a.root);
  const size_t bytes = Bytes(a, all[root].count);
  const char* buf = nullptr;
  auto local_root = subs.find(root);
  if (local_root != subs.end()) buf = local_root->second.in;
  if (topology_.num_hosts > 1 && bytes > 0) {
    const int root_host = topology_.rank_host[root];
    // The root's input is only read: the other hosts receive into scratch, and the root's
    // host sends from a copy only because Gloo's broadcast takes one in/out buffer.
    scratch_a_.resize(bytes);
    char* data = scratch_a_.data();
    if (local_root != subs.end()) std::memcpy(data, local_root->second.in, bytes);
    algorithm_ = "local+gloo_broadcast";
    COLLSERVE_RETURN_IF_ERROR(comm_->Broadcast(data, bytes, root_host, timeout));
    buf = data;
  }
  const std::vector<int64_t> off = Offsets(splits[root].input);
  copies_.clear();
  for (auto& [rank, sub] : subs) {
    const size_t b = Bytes(a, splits[root].input[rank]);
    if (b > 0) copies_.push_back({sub.out, buf + Bytes(a, off[rank]), b});
  }
  backends::RunCopies(*pool_, copies_, tenant_);
  return absl::OkStatus();
}

// REDUCE_SCATTER. One host: each local rank's block is reduced straight from every rank's
// input into its output. Across hosts: the whole input is reduced (as all_reduce) into
// scratch, then each local rank copies its block. Inputs are only read.
absl::Status Hierarchical::RunReduceScatter(const std::vector<RankArgs>& all, const std::vector<RankSplits>& splits,
                                     std::map<int, Submission>& subs, absl::Duration timeout) {
  const RankArgs& a = all[0];
  if (a.count == 0) return absl::OkStatus();
  const bool avg = static_cast<ReduceOp>(a.reduce_op) == ReduceOp::kAvg;
  const std::vector<int64_t>& pieces = splits[subs.begin()->first].input;
  const std::vector<int64_t> off = Offsets(pieces);
  const char* acc = nullptr;
  if (topology_.num_hosts > 1) {
    scratch_a_.resize(Bytes(a, a.count));
    COLLSERVE_RETURN_IF_ERROR(
        ReduceAcrossHosts(a, subs, 0, scratch_a_.data(), static_cast<size_t>(a.count), timeout));
    acc = scratch_a_.data();
  }
  for (auto& [rank, sub] : subs) {
    const size_t n = static_cast<size_t>(pieces[rank]);
    if (n == 0) continue;
    const size_t block = Bytes(a, off[rank]);
    backends::LocalReduce& r = LocalReduceOf(a, subs, block, n);
    if (acc != nullptr) {  // already reduced: copy (and divide)
      r.op = ReduceOp::kSum;
      r.srcs.assign(1, acc + block);
      r.premul.clear();
    }
    r.divisor = avg ? topology_.world_size : 1;
    r.dsts.push_back(sub.out);
    backends::RunLocalReduce(*pool_, r, tenant_);
  }
  return absl::OkStatus();
}


}  // namespace collserve::engine
