// Element types and reduction ops shared by the SDK, the sidecar and the backends: the
// public ones (collserve/types.h) and the checks the daemons apply to them.
#ifndef COLLSERVE_COMMON_TYPES_H_
#define COLLSERVE_COMMON_TYPES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "collserve/types.h"

namespace collserve {

// Longest group name the SDK, the sidecar and the coordinator accept, in bytes: a nested
// subgroup's name is its parent's, '/' and an index, so this leaves room for deep nesting.
// Bounded because a group's name is stored with the group and is a label of its metric
// series (a name of megabytes once made every scrape of a sidecar megabytes per series).
inline constexpr size_t kMaxGroupNameBytes = 1024;

// OK for a group name: 1 to kMaxGroupNameBytes bytes, none of them an ASCII control
// character (names are printed in logs, errors and collservectl's tables); else
// INVALID_ARGUMENT naming the rule.
inline absl::Status ValidateGroupName(absl::string_view group) {
  if (group.empty()) return absl::InvalidArgumentError("empty group name");
  if (group.size() > kMaxGroupNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("group name of ", group.size(), " bytes is longer than the limit (",
                                                   kMaxGroupNameBytes, " bytes)"));
  }
  for (char c : group) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat("group name \"", absl::CHexEscape(group),
                                                     "\" holds a control character"));
    }
  }
  return absl::OkStatus();
}

// torch-style name of a collserve.v1.CollectiveOp value ("all_reduce", "reduce_scatter",
// ...); "op#<n>" for an unknown one. Shared by the engine's errors and the coordinator's
// ledger.
inline std::string CollectiveOpName(int op) {
  static constexpr const char* kNames[] = {nullptr,          "all_reduce", "broadcast",         "barrier", "reduce",
                                           "all_gather",     "gather",     "scatter",           "reduce_scatter",
                                           "all_to_all",     "monitored_barrier", "send",       "recv"};
  if (op > 0 && op < static_cast<int>(sizeof(kNames) / sizeof(kNames[0]))) return kNames[op];
  return absl::StrCat("op#", op);
}

// OK if `op` is defined for `dtype`; INVALID_ARGUMENT otherwise: bitwise ops on
// floating-point dtypes, PREMUL_SUM on non-floating dtypes, AVG on bool, unknown values.
// bool follows torch's ProcessGroupNCCL (getNcclReduceOp): SUM and MAX are logical or,
// PRODUCT and MIN logical and.
inline absl::Status ValidateReduce(DataType dtype, ReduceOp op) {
  if (!IsValidDataType(static_cast<int>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
  }
  if (!IsValidReduceOp(static_cast<int>(op))) {
    return absl::InvalidArgumentError(absl::StrCat("unknown reduce op ", static_cast<int>(op)));
  }
  if ((op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) &&
      IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("ReduceOp.", ReduceOpName(op),
                                                   " is defined for integer dtypes only, not ",
                                                   DataTypeName(dtype)));
  }
  if (op == ReduceOp::kPremulSum && !IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReduceOp.PREMUL_SUM is defined for floating-point dtypes only, not ", DataTypeName(dtype)));
  }
  if (op == ReduceOp::kAvg && dtype == DataType::kBool) {
    return absl::InvalidArgumentError("ReduceOp.AVG is not defined for bool");
  }
  return absl::OkStatus();
}

}  // namespace collserve

#endif  // COLLSERVE_COMMON_TYPES_H_
