// Element-type dispatch, element conversion and strided iteration for the tensor ops.
#pragma once

#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "shmtensor/dims.h"
#include "shmtensor/dtype.h"

namespace shmtensor::internal {

template <class T>
inline constexpr bool kIsComplex = false;
template <class V>
inline constexpr bool kIsComplex<std::complex<V>> = true;

// Half and BFloat16 compute through float.
template <class T>
inline constexpr bool kIsReducedFloat = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// Calls f(std::type_identity<T>{}) with T the element type of dtype, so that one generic
// lambda serves all 12 dtypes.
template <class F>
decltype(auto) dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBool:
      return f(std::type_identity<bool>{});
    case DType::kUInt8:
      return f(std::type_identity<std::uint8_t>{});
    case DType::kInt8:
      return f(std::type_identity<std::int8_t>{});
    case DType::kInt16:
      return f(std::type_identity<std::int16_t>{});
    case DType::kInt32:
      return f(std::type_identity<std::int32_t>{});
    case DType::kInt64:
      return f(std::type_identity<std::int64_t>{});
    case DType::kFloat16:
      return f(std::type_identity<Half>{});
    case DType::kBFloat16:
      return f(std::type_identity<BFloat16>{});
    case DType::kFloat32:
      return f(std::type_identity<float>{});
    case DType::kFloat64:
      return f(std::type_identity<double>{});
    case DType::kComplex64:
      return f(std::type_identity<std::complex<float>>{});
    case DType::kComplex128:
      return f(std::type_identity<std::complex<double>>{});
  }
  // Reached only for a value cast from outside the enum.
  throw std::invalid_argument("invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

// Reads element o of p. A bool is read through its byte: the bytes may come from another
// process or from uninitialised memory, and loading a byte other than 0 or 1 as bool is
// undefined behaviour; any nonzero byte reads as true.
template <class T>
T load(const T* p, std::int64_t o) {
  if constexpr (std::is_same_v<T, bool>) {
    return reinterpret_cast<const unsigned char*>(p)[o] != 0;
  } else {
    return p[o];
  }
}

// Float to integer: a plain static_cast is undefined behaviour out of range, so saturate
// (NaN gives 0) and truncate toward zero otherwise.
template <class To>
To saturating_cast(double v) {
  constexpr auto kMin = std::numeric_limits<To>::min();
  constexpr auto kMax = std::numeric_limits<To>::max();
  if (std::isnan(v)) return To(0);
  if (v <= static_cast<double>(kMin)) return kMin;
  // static_cast<double>(kMax) rounds up to 2^N for 64-bit types, hence >=.
  if (v >= static_cast<double>(kMax)) return kMax;
  return static_cast<To>(v);
}

// One element of type From as To, with torch's meaning: to bool is != 0, complex to real
// takes the real part, real to complex has imaginary part 0.
template <class To, class From>
To convert(const From& v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (kIsReducedFloat<From>) {
    return convert<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    if constexpr (kIsComplex<From>) {
      return v.real() != 0 || v.imag() != 0;
    } else {
      return v != 0;
    }
  } else if constexpr (kIsComplex<To>) {
    using V = typename To::value_type;
    if constexpr (kIsComplex<From>) {
      return To(static_cast<V>(v.real()), static_cast<V>(v.imag()));
    } else {
      return To(static_cast<V>(v), V(0));
    }
  } else if constexpr (kIsComplex<From>) {
    return convert<To>(v.real());
  } else if constexpr (kIsReducedFloat<To>) {
    return To(static_cast<float>(v));
  } else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<From>) {
    return saturating_cast<To>(static_cast<double>(v));
  } else {
    return static_cast<To>(v);
  }
}

// Calls f(offset_a, offset_b) for every index of `sizes` in row-major order, where the
// offsets (in elements, relative to element 0) follow strides_a and strides_b. Nothing is
// called when an extent is 0; once for a 0-d shape.
template <class F>
void for_each_offset2(std::span<const std::int64_t> sizes,
                      std::span<const std::int64_t> strides_a,
                      std::span<const std::int64_t> strides_b, F&& f) {
  const std::size_t nd = sizes.size();
  for (std::int64_t s : sizes) {
    if (s == 0) return;
  }
  if (nd == 0) {
    f(std::int64_t{0}, std::int64_t{0});
    return;
  }
  Dims index(nd, 0);
  std::int64_t a = 0;
  std::int64_t b = 0;
  const std::int64_t inner = sizes[nd - 1];
  const std::int64_t inner_a = strides_a[nd - 1];
  const std::int64_t inner_b = strides_b[nd - 1];
  for (;;) {
    for (std::int64_t i = 0; i < inner; ++i) f(a + i * inner_a, b + i * inner_b);
    // Odometer over the outer dimensions.
    std::size_t d = nd - 1;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++index[d] < sizes[d]) {
        a += strides_a[d];
        b += strides_b[d];
        break;
      }
      a -= (sizes[d] - 1) * strides_a[d];
      b -= (sizes[d] - 1) * strides_b[d];
      index[d] = 0;
    }
  }
}

template <class F>
void for_each_offset(std::span<const std::int64_t> sizes, std::span<const std::int64_t> strides,
                     F&& f) {
  for_each_offset2(sizes, strides, strides, [&f](std::int64_t a, std::int64_t /*b*/) { f(a); });
}

// Row-major strides of a contiguous tensor of `sizes`.
Dims contiguous_strides(std::span<const std::int64_t> sizes);

// dim wrapped into [0, ndim) (negative counts from the end). Throws std::out_of_range when
// out of range, and always for ndim == 0 (callers that accept 0-d tensors check first).
std::int64_t wrap_dim(std::int64_t dim, std::int64_t ndim);

// Product of sizes; throws std::invalid_argument for a negative size or on overflow of
// numel * element_size (so that byte counts always fit in int64).
std::int64_t checked_numel(std::span<const std::int64_t> sizes, std::size_t element_size);

// a * b and a + b, throwing std::out_of_range on overflow. Views use them where the strides
// of an empty tensor or of a size-1 dim, which from_storage cannot bound, enter arithmetic.
std::int64_t checked_mul(std::int64_t a, std::int64_t b);
std::int64_t checked_add(std::int64_t a, std::int64_t b);

std::string sizes_to_string(std::span<const std::int64_t> sizes);

}  // namespace shmtensor::internal
