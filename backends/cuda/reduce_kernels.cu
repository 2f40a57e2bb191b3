// See reduce_kernels.h. A grid-stride loop over 16-byte packs (vectorized loads and stores
// where every pointer is 16-byte aligned), then a scalar tail; accumulation in the element
// type, in float for float16 and bfloat16 (as NCCL does for its own reductions).
#include "backends/cuda/reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace collserve::backends::cuda {
namespace {

struct Pointers {
  const void* in[kMaxReducePointers];
  void* out[kMaxReducePointers];
};

template <typename T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };

template <typename A> __device__ __forceinline__ A Load(A v) { return v; }
__device__ __forceinline__ float Load(__half v) { return __half2float(v); }
__device__ __forceinline__ float Load(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T, typename A> __device__ __forceinline__ T Store(A v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half Store<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 Store<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ bool Store<bool, bool>(bool v) { return v; }

template <KernelOp Op, typename A> __device__ __forceinline__ A Combine(A a, A b) {
  if constexpr (std::is_same_v<A, bool>) {
    if constexpr (Op == KernelOp::kSum || Op == KernelOp::kMax) return a || b;
    return a && b;
  } else {
    if constexpr (Op == KernelOp::kSum) return static_cast<A>(a + b);
    if constexpr (Op == KernelOp::kProduct) return static_cast<A>(a * b);
    if constexpr (Op == KernelOp::kMin) return b < a ? b : a;
    return a < b ? b : a;
  }
}

template <typename T, KernelOp Op, bool Scale>
__device__ __forceinline__ T ReduceOne(const Pointers& p, int n_in, size_t i, typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  A acc = Load(static_cast<const T*>(p.in[0])[i]);
  for (int k = 1; k < n_in; ++k) acc = Combine<Op>(acc, Load(static_cast<const T*>(p.in[k])[i]));
  if constexpr (Scale) acc = acc * scale;
  return Store<T, A>(acc);
}

// Packs of 16 bytes: each thread reduces kPer elements per pack.
template <typename T, KernelOp Op, bool Scale>
__global__ void ReduceKernel(Pointers p, int n_in, int n_out, size_t count, size_t packs,
                             typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  constexpr int kPer = 16 / sizeof(T);
  struct alignas(16) Pack { T v[kPer]; };
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < packs; j += stride) {
    Pack in = static_cast<const Pack*>(p.in[0])[j];
    A acc[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = Load(in.v[e]);
    for (int k = 1; k < n_in; ++k) {
      Pack x = static_cast<const Pack*>(p.in[k])[j];
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] = Combine<Op>(acc[e], Load(x.v[e]));
    }
    Pack out;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if constexpr (Scale) acc[e] = acc[e] * scale;
      out.v[e] = Store<T, A>(acc[e]);
    }
    for (int k = 0; k < n_out; ++k) static_cast<Pack*>(p.out[k])[j] = out;
  }
  // The tail past the last whole pack.
  const size_t first = packs * kPer;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first + tid < count) {
    const T v = ReduceOne<T, Op, Scale>(p, n_in, first + tid, scale);
    for (int k = 0; k < n_out; ++k) static_cast<T*>(p.out[k])[first + tid] = v;
  }
}

// Scalar version for pointers that are not 16-byte aligned.
template <typename T, KernelOp Op, bool Scale>
__global__ void ReduceKernelScalar(Pointers p, int n_in, int n_out, size_t count, typename Acc<T>::type scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const T v = ReduceOne<T, Op, Scale>(p, n_in, i, scale);
    for (int k = 0; k < n_out; ++k) static_cast<T*>(p.out[k])[i] = v;
  }
}

template <typename T, KernelOp Op, bool Scale>
cudaError_t Launch(const Pointers& p, int n_in, int n_out, size_t count, double scale, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  constexpr int kThreads = 512;
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  bool aligned = true;
  for (int k = 0; k < n_in; ++k) aligned = aligned && reinterpret_cast<uintptr_t>(p.in[k]) % 16 == 0;
  for (int k = 0; k < n_out; ++k) aligned = aligned && reinterpret_cast<uintptr_t>(p.out[k]) % 16 == 0;
  const size_t per = 16 / sizeof(T);
  const size_t work = aligned ? count / per : count;
  // Enough blocks to fill the GPU several times over, never more than the work needs.
  size_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > static_cast<size_t>(sms) * 8) blocks = static_cast<size_t>(sms) * 8;
  if (blocks == 0) blocks = 1;
  if (aligned) {
    ReduceKernel<T, Op, Scale><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, n_in, n_out, count,
                                                                                       count / per, static_cast<A>(scale));
  } else {
    ReduceKernelScalar<T, Op, Scale><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, n_in, n_out, count,
                                                                                             static_cast<A>(scale));
  }
  return cudaGetLastError();
}

template <typename T, bool Scale>
cudaError_t ByOp(KernelOp op, const Pointers& p, int n_in, int n_out, size_t count, double scale,
                 cudaStream_t stream) {
  switch (op) {
    case KernelOp::kSum: return Launch<T, KernelOp::kSum, Scale>(p, n_in, n_out, count, scale, stream);
    case KernelOp::kProduct: return Launch<T, KernelOp::kProduct, Scale>(p, n_in, n_out, count, scale, stream);
    case KernelOp::kMin: return Launch<T, KernelOp::kMin, Scale>(p, n_in, n_out, count, scale, stream);
    case KernelOp::kMax: return Launch<T, KernelOp::kMax, Scale>(p, n_in, n_out, count, scale, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t ByScale(KernelOp op, const Pointers& p, int n_in, int n_out, size_t count, double scale,
                    cudaStream_t stream) {
  if (scale != 1.0) return ByOp<T, true>(op, p, n_in, n_out, count, scale, stream);
  return ByOp<T, false>(op, p, n_in, n_out, count, scale, stream);
}

template <typename T>
cudaError_t Unscaled(KernelOp op, const Pointers& p, int n_in, int n_out, size_t count, double scale,
                     cudaStream_t stream) {
  if (scale != 1.0) return cudaErrorInvalidValue;  // integers: AVG is refused before this
  return ByOp<T, false>(op, p, n_in, n_out, count, scale, stream);
}

}  // namespace

cudaError_t LaunchReduce(const void* const* inputs, int n_in, void* const* outputs, int n_out, size_t count,
                         KernelType type, KernelOp op, double scale, cudaStream_t stream) {
  if (n_in < 1 || n_in > kMaxReducePointers || n_out < 1 || n_out > kMaxReducePointers) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  Pointers p{};
  for (int k = 0; k < n_in; ++k) p.in[k] = inputs[k];
  for (int k = 0; k < n_out; ++k) p.out[k] = outputs[k];
  switch (type) {
    case KernelType::kF32: return ByScale<float>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kF64: return ByScale<double>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kF16: return ByScale<__half>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kBF16: return ByScale<__nv_bfloat16>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kI32: return Unscaled<int32_t>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kI64: return Unscaled<int64_t>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kI8: return Unscaled<int8_t>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kU8: return Unscaled<uint8_t>(op, p, n_in, n_out, count, scale, stream);
    case KernelType::kBool: return Unscaled<bool>(op, p, n_in, n_out, count, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace collserve::backends::cuda
