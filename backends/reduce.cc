#include "backends/reduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace collserve::backends {
namespace {

template <typename T, typename F>
void Apply(void* out, const void* a, const void* b, size_t count, F f) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = f(x[i], y[i]);
}

// 16-bit floating types: reduce in float32 and round back.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Reduce16(ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i) {
    const float p = ToF(x[i]);
    const float q = ToF(y[i]);
    float r;
    switch (op) {
      case ReduceOp::kProduct: r = p * q; break;
      case ReduceOp::kMin: r = std::isnan(p) ? p : std::min(p, q); break;
      case ReduceOp::kMax: r = std::isnan(p) ? p : std::max(p, q); break;
      default: r = p + q; break;
    }
    o[i] = FromF(r);
  }
}

void ReduceBool(ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  uint8_t* o = static_cast<uint8_t*>(out);
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  for (size_t i = 0; i < count; ++i) {
    const bool p = x[i] != 0;
    const bool q = y[i] != 0;
    bool r;
    switch (op) {
      case ReduceOp::kProduct:
      case ReduceOp::kMin:
      case ReduceOp::kBand: r = p && q; break;
      case ReduceOp::kBxor: r = p != q; break;
      default: r = p || q; break;  // SUM, MAX, BOR
    }
    o[i] = r ? 1 : 0;
  }
}

template <typename T>
void ReduceArith(ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
    case ReduceOp::kPremulSum:
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

template <typename T>
void Scale(void* data, size_t count, double factor) {
  T* d = static_cast<T*>(data);
  const T f = static_cast<T>(factor);
  for (size_t i = 0; i < count; ++i) d[i] = d[i] * f;
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Map16(void* data, size_t count, float mul, float div) {
  uint16_t* d = static_cast<uint16_t*>(data);
  for (size_t i = 0; i < count; ++i) d[i] = FromF(ToF(d[i]) * mul / div);
}

}  // namespace

void Reduce(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  switch (dtype) {
    case DataType::kFloat32: ReduceArith<float>(op, out, a, b, count); return;
    case DataType::kFloat64: ReduceArith<double>(op, out, a, b, count); return;
    case DataType::kInt32: ReduceInt<int32_t>(op, out, a, b, count); return;
    case DataType::kInt64: ReduceInt<int64_t>(op, out, a, b, count); return;
    case DataType::kInt8: ReduceInt<int8_t>(op, out, a, b, count); return;
    case DataType::kUInt8: ReduceInt<uint8_t>(op, out, a, b, count); return;
    case DataType::kFloat16: Reduce16<HalfToFloat, FloatToHalf>(op, out, a, b, count); return;
    case DataType::kBFloat16: Reduce16<BFloat16ToFloat, FloatToBFloat16>(op, out, a, b, count); return;
    case DataType::kBool: ReduceBool(op, out, a, b, count); return;
  }
}

void DivideInPlace(DataType dtype, void* data, size_t count, int64_t divisor) {
  switch (dtype) {
    case DataType::kFloat32: Divide<float>(data, count, divisor); return;
    case DataType::kFloat64: Divide<double>(data, count, divisor); return;
    case DataType::kInt32: Divide<int32_t>(data, count, divisor); return;
    case DataType::kInt64: Divide<int64_t>(data, count, divisor); return;
    case DataType::kInt8: Divide<int8_t>(data, count, divisor); return;
    case DataType::kUInt8: Divide<uint8_t>(data, count, divisor); return;
    case DataType::kFloat16:
      Map16<HalfToFloat, FloatToHalf>(data, count, 1.0f, static_cast<float>(divisor));
      return;
    case DataType::kBFloat16:
      Map16<BFloat16ToFloat, FloatToBFloat16>(data, count, 1.0f, static_cast<float>(divisor));
      return;
    case DataType::kBool: return;
  }
}

void ScaleInPlace(DataType dtype, void* data, size_t count, double factor) {
  switch (dtype) {
    case DataType::kFloat32: Scale<float>(data, count, factor); return;
    case DataType::kFloat64: Scale<double>(data, count, factor); return;
    case DataType::kFloat16:
      Map16<HalfToFloat, FloatToHalf>(data, count, static_cast<float>(factor), 1.0f);
      return;
    case DataType::kBFloat16:
      Map16<BFloat16ToFloat, FloatToBFloat16>(data, count, static_cast<float>(factor), 1.0f);
      return;
    default: return;
  }
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs < 0x33000000u) return sign;  // < 2^-25 rounds to zero
    const uint32_t mant = (abs & 0x7fffff) | 0x800000;
    const int shift = 113 - static_cast<int>(abs >> 23) + 13;  // 126 - e_f + 13 - ...
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((abs >> 23) - 112) << 10 | ((abs >> 13) & 0x3ff);
  const uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffff) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

}  // namespace collserve::backends
