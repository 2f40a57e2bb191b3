// Element types and reduction ops of collserve's public API (the C++ SDK, collserve/client.h).
// Names and semantics follow torch.distributed (torch.float32, ReduceOp.SUM, ...).
#ifndef COLLSERVE_TYPES_H_
#define COLLSERVE_TYPES_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace collserve {

// Values equal collserve.v1.DataType's so conversion is a cast.
enum class DataType : int {
  kFloat32 = 1,
  kFloat64 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,   // IEEE-754 binary16
  kBFloat16 = 6,  // bfloat16: the upper 16 bits of a binary32
  kInt8 = 7,
  kUInt8 = 8,
  kBool = 9,      // one byte, 0 or 1 (any non-zero byte reads as true)
};

// Values equal collserve.v1.ReduceOp's so conversion is a cast.
enum class ReduceOp : int {
  kSum = 1,
  kAvg = 2,      // sum / world_size; integers truncate toward zero (NCCL's ncclAvg)
  kProduct = 3,
  kMin = 4,
  kMax = 5,
  kBand = 6,     // integer types only
  kBor = 7,      // integer types only
  kBxor = 8,     // integer types only
  // Each rank's tensor is multiplied by its own scalar factor, then summed (NCCL's
  // ncclRedOpCreatePreMulSum, torch's _make_nccl_premul_sum). Floating-point dtypes only.
  kPremulSum = 9,
};

// Bytes per element; 0 for an unknown value.
inline size_t ElementSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kBool: return 1;
  }
  return 0;
}

inline bool IsValidDataType(int v) { return v >= 1 && v <= 9; }
inline bool IsValidReduceOp(int v) { return v >= 1 && v <= 9; }
inline bool IsFloatingPoint(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64 || dtype == DataType::kFloat16 ||
         dtype == DataType::kBFloat16;
}

// torch-style names: "float32", "int64", ...
inline absl::string_view DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kBool: return "bool";
  }
  return "unknown_dtype";
}

// torch-style names: "SUM", "AVG", ...
inline absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
    case ReduceOp::kPremulSum: return "PREMUL_SUM";
  }
  return "unknown_op";
}

}  // namespace collserve

#endif  // COLLSERVE_TYPES_H_
