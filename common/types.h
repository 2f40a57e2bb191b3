// Element types and reduction ops shared by the SDK, the sidecar and the backends: the
// public ones (collserve/types.h) and the checks the daemons apply to them.
#ifndef COLLSERVE_COMMON_TYPES_H_
#define COLLSERVE_COMMON_TYPES_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collserve/types.h"

namespace collserve {

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
