#include "engine/collective_args.h"

#include <cstring>
#include <map>
#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/types.h"

namespace collserve::engine {
namespace {

bool UsesDtype(CollectiveOp op) { return op != CollectiveOp::kBarrier && op != CollectiveOp::kMonitoredBarrier; }
bool UsesReduceOp(CollectiveOp op) { return op == CollectiveOp::kAllReduce || op == CollectiveOp::kReduce || op == CollectiveOp::kReduceScatter; }
bool UsesRoot(CollectiveOp op) {
  return op == CollectiveOp::kBroadcast || op == CollectiveOp::kReduce || op == CollectiveOp::kGather || op == CollectiveOp::kScatter;
}
// Ops whose count must be equal on every rank.
bool SameCount(CollectiveOp op) {
  return op == CollectiveOp::kAllReduce || op == CollectiveOp::kBroadcast || op == CollectiveOp::kReduce || op == CollectiveOp::kReduceScatter;
}

// The sum of non-negative splits, saturating at INT64_MAX (splits come from clients).
int64_t Sum(const std::vector<int64_t>& v) {
  int64_t sum = 0;
  for (int64_t x : v) {
    if (x < 0) continue;  // CheckSplits rejects it
    if (x > INT64_MAX - sum) return INT64_MAX;
    sum += x;
  }
  return sum;
}

absl::Status CheckSplits(const char* name, const std::vector<int64_t>& splits,
                         int world_size) {
  if (splits.size() != static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", splits.size(), " entries but world_size is ", world_size));
  }
  for (size_t i = 0; i < splits.size(); ++i) {
    if (splits[i] < 0) return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "] = ", splits[i], " < 0"));
  }
  return absl::OkStatus();
}

std::string DescribeValue(const char* field, int64_t v) {
  if (std::strcmp(field, "dtype") == 0 && IsValidDataType(static_cast<int>(v))) {
    return std::string(DataTypeName(static_cast<DataType>(v)));
  }
  if (std::strcmp(field, "reduce_op") == 0 && IsValidReduceOp(static_cast<int>(v))) {
    return std::string(ReduceOpName(static_cast<ReduceOp>(v)));
  }
  if (std::strcmp(field, "op") == 0) return OpName(static_cast<int>(v));
  if (std::strcmp(field, "device") == 0) {
    return v == 0 ? "cpu" : v == 1 ? "cuda" : v == 2 ? "cuda with NCCL in the rank (COLLSERVE_CUDA_PATH=nccl)" : absl::StrCat(v);
  }
  return absl::StrCat(v);
}

std::string Vec(const std::vector<int64_t>& v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

}  // namespace

std::string OpName(int op) { return CollectiveOpName(op); }

bool IsInPlace(CollectiveOp op) { return op == CollectiveOp::kAllReduce || op == CollectiveOp::kBroadcast || op == CollectiveOp::kReduce; }

bool NeedsSplits(CollectiveOp op) {
  return op == CollectiveOp::kAllGather || op == CollectiveOp::kGather || op == CollectiveOp::kScatter || op == CollectiveOp::kReduceScatter ||
         op == CollectiveOp::kAllToAll;
}

RankArgs ArgsOf(int rank, const Request& c, bool valid) {
  RankArgs a;
  a.rank = rank;
  a.valid = valid ? 1 : 0;
  a.op = static_cast<int64_t>(c.op);
  if (UsesDtype(c.op)) {
    a.dtype = c.dtype;
    a.count = c.count;
    a.output_count = IsInPlace(c.op) ? 0 : c.output_count;
  }
  if (UsesReduceOp(c.op)) a.reduce_op = c.reduce_op;
  if (UsesRoot(c.op)) a.root = c.root;
  a.device = c.in_rank ? 2 : c.OnDevice() ? 1 : 0;
  if (ChecksCallSite(c.op)) a.call_site = CallSiteFingerprint(c.call_site);
  return a;
}

bool ChecksCallSite(CollectiveOp op) {
  return op != CollectiveOp::kBarrier && op != CollectiveOp::kMonitoredBarrier && op != CollectiveOp::kSend &&
         op != CollectiveOp::kRecv;
}

int64_t CallSiteFingerprint(absl::string_view call_site) {
  if (call_site.empty()) return 0;
  uint64_t h = 14695981039346656037ull;  // FNV-1a, 64 bits
  for (unsigned char c : call_site) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h == 0 ? 1 : static_cast<int64_t>(h);
}

std::map<int64_t, std::vector<int64_t>> CallSiteDisagreement(const std::vector<RankArgs>& all) {
  std::map<int64_t, std::vector<int64_t>> by_site;
  for (const RankArgs& a : all) {
    if (a.valid && a.arrived && a.call_site != 0) by_site[a.call_site].push_back(a.rank);
  }
  if (by_site.size() < 2) by_site.clear();
  return by_site;
}

absl::Status ValidateRequest(const Request& c, int rank, int world_size) {
  const CollectiveOp op = c.op;
  if (static_cast<int>(op) < static_cast<int>(CollectiveOp::kAllReduce) ||
      static_cast<int>(op) > static_cast<int>(CollectiveOp::kRecv)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown collective op ", static_cast<int>(op)));
  }
  if (c.buffer.fill_offset != 0 || c.output.fill_offset != 0) {
    if (c.buffer.fill_offset < 0 || c.output.fill_offset != 0 || op != CollectiveOp::kBroadcast || c.root != rank ||
        c.buffer.segment.empty() || c.buffer.arena || c.OnDevice()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fill_offset ", c.buffer.fill_offset != 0 ? c.buffer.fill_offset : c.output.fill_offset,
          " (bytes written after the request) is only for a broadcast root's input staged in a segment; this is ",
          OpName(op), " root ", c.root, " from rank ", rank));
    }
  }
  if (c.in_rank) {
    if (op == CollectiveOp::kBarrier || op == CollectiveOp::kMonitoredBarrier || op == CollectiveOp::kSend ||
        op == CollectiveOp::kRecv) {
      return absl::InvalidArgumentError(absl::StrCat(
          "in_rank records a collective with tensors that the rank runs itself (COLLSERVE_CUDA_PATH=nccl), not ",
          OpName(op)));
    }
    const auto names_memory = [](const BufferRef& b) {
      return !b.segment.empty() || !b.inline_data.empty() || !b.cuda_ipc_handle.empty() || b.fill_offset != 0;
    };
    if (names_memory(c.buffer) || names_memory(c.output) || !c.cuda_ready_event.empty() ||
        !c.cuda_done_event.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "an in_rank record of ", OpName(op), " names a tensor or an event: the rank runs it itself, so it names none"));
    }
  }
  if (op == CollectiveOp::kBarrier || op == CollectiveOp::kMonitoredBarrier) {
    if (c.count != 0) return absl::InvalidArgumentError("a barrier takes no tensor");
    return absl::OkStatus();
  }
  if (!IsValidDataType(c.dtype)) return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", c.dtype));
  if (c.count < 0) return absl::InvalidArgumentError(absl::StrCat("count ", c.count, " < 0"));
  if (c.output_count < 0) return absl::InvalidArgumentError(absl::StrCat("output_count ", c.output_count, " < 0"));
  // Sizes in bytes must be representable: count x element size must not wrap around.
  const int64_t max_elements = kMaxTensorBytes / static_cast<int64_t>(ElementSize(static_cast<DataType>(c.dtype)));
  if (c.count > max_elements || c.output_count > max_elements) {
    return absl::InvalidArgumentError(absl::StrCat("count ", std::max(c.count, c.output_count), " of ",
                                                   DataTypeName(static_cast<DataType>(c.dtype)),
                                                   " exceeds the largest tensor, ", kMaxTensorBytes, " bytes"));
  }
  if (UsesReduceOp(op)) {
    if (absl::Status s = ValidateReduce(static_cast<DataType>(c.dtype), static_cast<ReduceOp>(c.reduce_op));
        !s.ok()) {
      return s;
    }
  }
  if (UsesRoot(op) && (c.root < 0 || c.root >= world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(OpName(op), " root ", c.root, " is out of range for world_size ", world_size));
  }
  const bool is_root = c.root == rank;
  switch (op) {
    case CollectiveOp::kAllGather:
    case CollectiveOp::kGather:
      if (op == CollectiveOp::kGather && !is_root) {
        if (!c.output_splits.empty() || c.output_count != 0) {
          return absl::InvalidArgumentError("gather: only the destination rank passes outputs");
        }
        break;
      }
      if (absl::Status s = CheckSplits("output_splits", c.output_splits, world_size); !s.ok()) return s;
      if (c.output_splits[rank] != c.count) {
        return absl::InvalidArgumentError(absl::StrCat(OpName(op), ": rank ", rank, " sends ", c.count,
                                                       " elements but its own output slot holds ",
                                                       c.output_splits[rank]));
      }
      if (Sum(c.output_splits) != c.output_count) {
        return absl::InvalidArgumentError("output_count is not the sum of output_splits");
      }
      break;
    case CollectiveOp::kScatter:
      if (!is_root) {
        if (!c.input_splits.empty() || c.count != 0) {
          return absl::InvalidArgumentError("scatter: only the source rank passes inputs");
        }
        break;
      }
      if (absl::Status s = CheckSplits("input_splits", c.input_splits, world_size); !s.ok()) return s;
      if (Sum(c.input_splits) != c.count) return absl::InvalidArgumentError("count is not the sum of input_splits");
      if (c.input_splits[rank] != c.output_count) {
        return absl::InvalidArgumentError(absl::StrCat("scatter: the source's own piece has ", c.input_splits[rank],
                                                       " elements but its output holds ", c.output_count));
      }
      break;
    case CollectiveOp::kReduceScatter:
      if (absl::Status s = CheckSplits("input_splits", c.input_splits, world_size); !s.ok()) return s;
      if (Sum(c.input_splits) != c.count) return absl::InvalidArgumentError("count is not the sum of input_splits");
      if (c.input_splits[rank] != c.output_count) {
        return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: rank ", rank, "'s piece has ",
                                                       c.input_splits[rank], " elements but its output holds ",
                                                       c.output_count));
      }
      break;
    case CollectiveOp::kAllToAll:
      if (absl::Status s = CheckSplits("input_splits", c.input_splits, world_size); !s.ok()) return s;
      if (absl::Status s = CheckSplits("output_splits", c.output_splits, world_size); !s.ok()) return s;
      if (Sum(c.input_splits) != c.count) return absl::InvalidArgumentError("count is not the sum of input_splits");
      if (Sum(c.output_splits) != c.output_count) {
        return absl::InvalidArgumentError("output_count is not the sum of output_splits");
      }
      break;
    case CollectiveOp::kSend:
    case CollectiveOp::kRecv:
      if (c.peer == rank) return absl::InvalidArgumentError(absl::StrCat(OpName(op), " to/from itself (rank ", rank, ")"));
      if ((op == CollectiveOp::kSend || c.peer != -1) && (c.peer < 0 || c.peer >= world_size)) {
        return absl::InvalidArgumentError(
            absl::StrCat(OpName(op), " peer rank ", c.peer, " is out of range for world_size ", world_size));
      }
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

std::string Disagreement(const std::vector<RankArgs>& all) {
  std::vector<std::string> parts;
  std::vector<int64_t> invalid;
  for (const RankArgs& a : all) {
    if (a.arrived && !a.valid) invalid.push_back(a.rank);
  }
  if (!invalid.empty()) {
    parts.push_back(absl::StrCat("ranks [", absl::StrJoin(invalid, ", "), "] sent invalid requests"));
  }
  struct Field {
    const char* name;
    int64_t RankArgs::*member;
  };
  auto differ = [&](const Field& f) {
    std::map<int64_t, std::vector<int64_t>> by_value;
    for (const RankArgs& a : all) {
      if (a.valid && a.arrived) by_value[a.*(f.member)].push_back(a.rank);
    }
    if (by_value.size() <= 1) return false;
    std::vector<std::string> groups;
    for (const auto& [value, ranks] : by_value) {
      groups.push_back(absl::StrCat(f.name, "=", DescribeValue(f.name, value), " on ranks [",
                                    absl::StrJoin(ranks, ", "), "]"));
    }
    parts.push_back(absl::StrJoin(groups, " but "));
    return true;
  };
  if (!differ({"op", &RankArgs::op})) {
    CollectiveOp op = CollectiveOp::kUnspecified;
    for (const RankArgs& a : all) {
      if (a.valid && a.arrived) op = OpOf(a);
    }
    differ({"dtype", &RankArgs::dtype});
    if (SameCount(op)) differ({"count", &RankArgs::count});
    differ({"reduce_op", &RankArgs::reduce_op});
    differ({"root", &RankArgs::root});
    differ({"device", &RankArgs::device});
  }
  return absl::StrJoin(parts, "; ");
}

std::string SizeDisagreement(const std::vector<RankArgs>& args, const std::vector<RankSplits>& splits) {
  const int world = static_cast<int>(args.size());
  const CollectiveOp op = OpOf(args[0]);
  std::vector<int64_t> counts(world);
  for (int r = 0; r < world; ++r) counts[r] = args[r].count;
  std::vector<std::string> problems;
  constexpr size_t kMaxProblems = 4;
  switch (op) {
    case CollectiveOp::kAllGather:
    case CollectiveOp::kGather: {
      std::map<std::vector<int64_t>, std::vector<int>> expected;
      for (int r = 0; r < world; ++r) {
        if (op == CollectiveOp::kGather && r != args[r].root) continue;
        if (splits[r].output != counts) expected[splits[r].output].push_back(r);
      }
      for (const auto& [sizes, ranks] : expected) {
        problems.push_back(absl::StrCat("ranks [", absl::StrJoin(ranks, ", "), "] expect per-rank sizes ", Vec(sizes)));
      }
      if (!problems.empty()) {
        return absl::StrCat("ranks send counts ", Vec(counts), " but ", absl::StrJoin(problems, "; "));
      }
      return "";
    }
    case CollectiveOp::kScatter: {
      const int root = static_cast<int>(args[0].root);
      for (int r = 0; r < world && problems.size() < kMaxProblems; ++r) {
        if (splits[root].input[r] != args[r].output_count) {
          problems.push_back(absl::StrCat("rank ", root, " sends ", splits[root].input[r], " elements to rank ", r,
                                          ", but rank ", r, " expects ", args[r].output_count));
        }
      }
      break;
    }
    case CollectiveOp::kReduceScatter: {
      std::map<std::vector<int64_t>, std::vector<int>> by_splits;
      for (int r = 0; r < world; ++r) by_splits[splits[r].input].push_back(r);
      if (by_splits.size() > 1) {
        for (const auto& [sizes, ranks] : by_splits) {
          problems.push_back(absl::StrCat("input_splits=", Vec(sizes), " on ranks [", absl::StrJoin(ranks, ", "), "]"));
        }
        return absl::StrJoin(problems, " but ");
      }
      return "";
    }
    case CollectiveOp::kAllToAll:
      for (int i = 0; i < world && problems.size() < kMaxProblems; ++i) {
        for (int j = 0; j < world && problems.size() < kMaxProblems; ++j) {
          if (splits[i].input[j] != splits[j].output[i]) {
            problems.push_back(absl::StrCat("rank ", i, " sends ", splits[i].input[j], " elements to rank ", j,
                                            ", but rank ", j, " expects ", splits[j].output[i], " from rank ", i));
          }
        }
      }
      break;
    default:
      break;
  }
  return absl::StrJoin(problems, "; ");
}

}  // namespace collserve::engine
