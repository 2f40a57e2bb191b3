// The sidecar's local reduction on the GPU: one kernel reads the n inputs of the ranks of a
// host once and writes every output (backends/device.h, DeviceStream::Reduce). Plain C++
// interface (no absl) so that nvcc compiles only reduce_kernels.cu.
#ifndef COLLSERVE_BACKENDS_CUDA_REDUCE_KERNELS_H_
#define COLLSERVE_BACKENDS_CUDA_REDUCE_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>

namespace collserve::backends::cuda {

// Most inputs / outputs one launch takes; the caller folds more inputs in several launches.
inline constexpr int kMaxReducePointers = 16;

// Element types and ops, as common/types.h's DataType and ReduceOp values.
enum class KernelType { kF32, kF64, kF16, kBF16, kI32, kI64, kI8, kU8, kBool };
enum class KernelOp { kSum, kProduct, kMin, kMax };

// outputs[k][i] = scale * op(inputs[0][i], ..., inputs[n_in - 1][i]) for i < count, on
// `stream`. 1 <= n_in, n_out <= kMaxReducePointers. `scale` is applied only when != 1
// (floating types). Returns the launch's error (cudaErrorInvalidValue for bad arguments).
// Thread-safe.
cudaError_t LaunchReduce(const void* const* inputs, int n_in, void* const* outputs, int n_out, size_t count,
                         KernelType type, KernelOp op, double scale, cudaStream_t stream);

}  // namespace collserve::backends::cuda

#endif  // COLLSERVE_BACKENDS_CUDA_REDUCE_KERNELS_H_
