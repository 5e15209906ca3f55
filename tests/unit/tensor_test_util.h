// Helpers for the tensor tests: element values in logical order, exact comparisons that
// treat Half/BFloat16 by bits, and the list of all element types.
#pragma once

#include <gtest/gtest.h>

#include <complex>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "shmtensor/tensor.h"

namespace shmtensor::testing {

using AllElementTypes =
    ::testing::Types<bool, std::uint8_t, std::int8_t, std::int16_t, std::int32_t, std::int64_t,
                     Half, BFloat16, float, double, std::complex<float>, std::complex<double>>;

// x as an element of type T (exact for the small values the tests use).
template <class T>
T make(double x) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T(static_cast<float>(x));
  } else if constexpr (std::is_same_v<T, bool>) {
    return x != 0;
  } else {
    return static_cast<T>(x);
  }
}

template <class T>
bool same(const T& a, const T& b) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return a.bits == b.bits;
  } else {
    return a == b;
  }
}

// The elements of t in row-major logical order (any strides).
template <class T>
std::vector<T> values(const Tensor& t) {
  Tensor c = t.contiguous();
  const T* p = c.data_ptr<T>();
  return std::vector<T>(p, p + c.numel());
}

inline std::vector<double> doubles(const Tensor& t) {
  return values<double>(t.to(DType::kFloat64));
}
inline std::vector<std::int64_t> ints(const Tensor& t) {
  return values<std::int64_t>(t.to(DType::kInt64));
}

}  // namespace shmtensor::testing
