// Element types of tensors.
#pragma once

#include <complex>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shmtensor/export.h"
#include "shmtensor/internal/dtype_table.h"

namespace shmtensor {

enum class DType : std::uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kComplex64,
  kComplex128,
};

inline constexpr int kNumDTypes = 12;

// Size in bytes of one element. Throws std::invalid_argument for a value outside the enum.
inline std::size_t element_size(DType dtype) {
  const auto index = static_cast<std::size_t>(dtype);
  if (index >= static_cast<std::size_t>(kNumDTypes)) [[unlikely]]
    internal::throw_invalid_dtype(dtype);
  return internal::kElementSizes[index];
}

// "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
// "float64", "complex64", "complex128".
SHMTENSOR_API std::string to_string(DType dtype);
// Inverse of to_string; throws std::invalid_argument naming the valid values.
SHMTENSOR_API DType dtype_from_string(std::string_view name);

// IEEE half and bfloat16 as storage types: bit patterns with conversions to and from float.
struct SHMTENSOR_API Half {
  std::uint16_t bits = 0;
  Half() = default;
  explicit Half(float value);
  explicit operator float() const;
};
struct SHMTENSOR_API BFloat16 {
  std::uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float value);
  explicit operator float() const;
};

// The C++ type that holds one element of a dtype, and back.
template <class T>
struct DTypeOf;
// clang-format off: one specialization a line reads as the table it is
template <> struct DTypeOf<bool> { static constexpr DType value = DType::kBool; };
template <> struct DTypeOf<std::uint8_t> { static constexpr DType value = DType::kUInt8; };
template <> struct DTypeOf<std::int8_t> { static constexpr DType value = DType::kInt8; };
template <> struct DTypeOf<std::int16_t> { static constexpr DType value = DType::kInt16; };
template <> struct DTypeOf<std::int32_t> { static constexpr DType value = DType::kInt32; };
template <> struct DTypeOf<std::int64_t> { static constexpr DType value = DType::kInt64; };
template <> struct DTypeOf<Half> { static constexpr DType value = DType::kFloat16; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::kBFloat16; };
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };
template <> struct DTypeOf<std::complex<float>> { static constexpr DType value = DType::kComplex64; };
template <> struct DTypeOf<std::complex<double>> { static constexpr DType value = DType::kComplex128; };
// clang-format on

template <class T>
inline constexpr DType dtype_of_v = DTypeOf<T>::value;

}  // namespace shmtensor
