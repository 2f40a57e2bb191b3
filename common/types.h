// Element types and reduction ops shared by the SDK, the sidecar and the backends: the
// public ones (collserve/types.h) and the checks the daemons apply to them.
#ifndef COLLSERVE_COMMON_TYPES_H_
#define COLLSERVE_COMMON_TYPES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collserve/types.h"

namespace collserve {

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
