#include "backends/reduce.h"

#include <algorithm>

namespace collserve::backends {
namespace {

template <typename T, typename F>
void Apply(void* out, const void* a, const void* b, size_t count, F f) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = f(x[i], y[i]);
}

template <typename T>
void ReduceArith(ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      Apply<T>(out, a, b, count, [](T x, T y) { return static_cast<T>(x + y); });
      return;
    case ReduceOp::kProduct:
      Apply<T>(out, a, b, count, [](T x, T y) { return static_cast<T>(x * y); });
      return;
    case ReduceOp::kMin:
      Apply<T>(out, a, b, count, [](T x, T y) { return std::min(x, y); });
      return;
    case ReduceOp::kMax:
      Apply<T>(out, a, b, count, [](T x, T y) { return std::max(x, y); });
      return;
    default:
      return;
  }
}

template <typename T>
void ReduceInt(ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  // Integer SUM/PRODUCT wrap around like torch's (two's complement); compute unsigned to
  // keep that defined behaviour in C++.
  using U = std::make_unsigned_t<T>;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      Apply<T>(out, a, b, count,
               [](T x, T y) { return static_cast<T>(static_cast<U>(x) + static_cast<U>(y)); });
      return;
    case ReduceOp::kProduct:
      Apply<T>(out, a, b, count,
               [](T x, T y) { return static_cast<T>(static_cast<U>(x) * static_cast<U>(y)); });
      return;
    case ReduceOp::kBand:
      Apply<T>(out, a, b, count, [](T x, T y) { return static_cast<T>(x & y); });
      return;
    case ReduceOp::kBor:
      Apply<T>(out, a, b, count, [](T x, T y) { return static_cast<T>(x | y); });
      return;
    case ReduceOp::kBxor:
      Apply<T>(out, a, b, count, [](T x, T y) { return static_cast<T>(x ^ y); });
      return;
    default:
      ReduceArith<T>(op, out, a, b, count);
      return;
  }
}

template <typename T>
void Divide(void* data, size_t count, int64_t divisor) {
  T* d = static_cast<T*>(data);
  const T div = static_cast<T>(divisor);
  for (size_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] / div);
}

}  // namespace

void Reduce(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  switch (dtype) {
    case DataType::kFloat32: ReduceArith<float>(op, out, a, b, count); return;
    case DataType::kFloat64: ReduceArith<double>(op, out, a, b, count); return;
    case DataType::kInt32: ReduceInt<int32_t>(op, out, a, b, count); return;
    case DataType::kInt64: ReduceInt<int64_t>(op, out, a, b, count); return;
  }
}

void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor) {
  switch (dtype) {
    case DataType::kFloat32: Divide<float>(data, count, divisor); return;
    case DataType::kFloat64: Divide<double>(data, count, divisor); return;
    case DataType::kInt32: Divide<int32_t>(data, count, divisor); return;
    case DataType::kInt64: Divide<int64_t>(data, count, divisor); return;
  }
}

}  // namespace collserve::backends
