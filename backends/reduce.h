// Element-wise reduction kernels used by the intra-host reducer and the Gloo backend.
// Plain loops the compiler vectorizes; callers split work across threads.
#ifndef COLLSERVE_BACKENDS_REDUCE_H_
#define COLLSERVE_BACKENDS_REDUCE_H_

#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace collserve::backends {

// out[i] = a[i] op b[i] for i < count. `out` may alias `a` or `b`.
// REQUIRES: ValidateReduce(dtype, op).ok(); kAvg and kPremulSum reduce as kSum (callers
// scale before and divide after). float16/bfloat16 compute in float32 and round to
// nearest even; bool follows torch's NCCL mapping (SUM/MAX = or, PRODUCT/MIN = and). Thread-safe (touches only the given memory).
void Reduce(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t count);

// data[i] /= divisor for i < count; integer types truncate toward zero; float16 and
// bfloat16 divide in float32 and round to nearest even. REQUIRES divisor > 0, dtype != kBool.
void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor);

// data[i] *= factor for i < count (PREMUL_SUM's pre-multiplication), computed in double for
// float64 and in float32 otherwise. REQUIRES IsFloatingPoint(dtype).
void ScaleInPlace(DataType dtype, void* data, size_t count, double factor);

// IEEE-754 binary16 and bfloat16 conversions, round to nearest even (NaN stays NaN).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_REDUCE_H_
