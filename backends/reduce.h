// Element-wise reduction kernels used by the intra-host reducer and the Gloo backend.
// Plain loops the compiler vectorizes; callers split work across threads.
#ifndef COLLSERVE_BACKENDS_REDUCE_H_
#define COLLSERVE_BACKENDS_REDUCE_H_

#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace collserve::backends {

// out[i] = a[i] op b[i] for i < count. `out` may alias `a` or `b`.
// REQUIRES: ValidateReduce(dtype, op).ok() and op != kAvg (reduce with kSum, then
// DivideInPlace). Thread-safe (touches only the given memory).
void Reduce(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t count);

// data[i] /= divisor for i < count; integer types truncate toward zero. REQUIRES divisor > 0.
void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_REDUCE_H_
