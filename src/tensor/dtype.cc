#include "shmtensor/dtype.h"

#include <array>
#include <bit>
#include <stdexcept>
#include <string>

namespace shmtensor {

namespace {

struct DTypeInfo {
  std::string_view name;
  std::size_t size;
};

// Indexed by the enumerator's value; the order must follow the enum.
constexpr std::array<DTypeInfo, kNumDTypes> kInfo = {{
    {"bool", 1},
    {"uint8", 1},
    {"int8", 1},
    {"int16", 2},
    {"int32", 4},
    {"int64", 8},
    {"float16", 2},
    {"bfloat16", 2},
    {"float32", 4},
    {"float64", 8},
    {"complex64", 8},
    {"complex128", 16},
}};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);
static_assert(sizeof(std::complex<double>) == 16);

static_assert(std::size(internal::kElementSizes) == kInfo.size());
constexpr bool sizes_agree() {
  for (std::size_t i = 0; i < kInfo.size(); ++i)
    if (kInfo[i].size != internal::kElementSizes[i]) return false;
  return true;
}
static_assert(sizes_agree(), "internal/dtype_table.h's kElementSizes must follow kInfo");

// A DType outside the enum (a caller's cast; the decoder rejects such bytes from other
// processes itself) is rejected rather than used as an index.
const DTypeInfo& info(DType dtype) {
  const auto index = static_cast<std::size_t>(dtype);
  if (index >= kInfo.size()) internal::throw_invalid_dtype(dtype);
  return kInfo[index];
}

}  // namespace

void internal::throw_invalid_dtype(DType dtype) {
  throw std::invalid_argument("invalid DType value " +
                              std::to_string(static_cast<std::size_t>(dtype)));
}

std::string to_string(DType dtype) { return std::string(info(dtype).name); }

DType dtype_from_string(std::string_view name) {
  for (std::size_t i = 0; i < kInfo.size(); ++i) {
    if (kInfo[i].name == name) return static_cast<DType>(i);
  }
  std::string valid;
  for (const auto& entry : kInfo) {
    if (!valid.empty()) valid += ", ";
    valid += entry.name;
  }
  throw std::invalid_argument("unknown dtype '" + std::string(name) +
                              "'; valid values are: " + valid);
}

// float -> binary16 with round-to-nearest-even, done on the bit patterns so that the result
// does not depend on the FPU's rounding mode or on compiler support for _Float16.
Half::Half(float value) {
  const auto f = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (f >> 16) & 0x8000u;
  const std::uint32_t abs = f & 0x7fffffffu;
  std::uint32_t h;
  if (abs >= 0x7f800000u) {
    // inf stays inf; NaN keeps its top payload bits and is made quiet so that it cannot
    // collapse into inf.
    h = 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u);
  } else if (abs >= 0x477ff000u) {
    // >= 65520 = halfway between 65504 (max half, odd mantissa) and 2^16: rounds to inf.
    h = 0x7c00u;
  } else if (abs < 0x38800000u) {
    // Below 2^-14: a half subnormal (units of 2^-24) or zero. value = m * 2^(e - 150), so
    // the count of 2^-24 units is m >> (126 - e), rounded to nearest even.
    const std::uint32_t e = abs >> 23;
    if (e < 102) {  // < 2^-25: rounds to zero (float subnormals included)
      h = 0;
    } else {
      const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
      const std::uint32_t shift = 126 - e;  // 14..24
      h = m >> shift;
      const std::uint32_t rem = m & ((1u << shift) - 1);
      const std::uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (h & 1u))) ++h;  // may carry into 0x400: ok
    }
  } else {
    h = (((abs >> 23) - 112) << 10) | ((abs >> 13) & 0x3ffu);
    const std::uint32_t rem = abs & 0x1fffu;
    // A carry out of the mantissa correctly bumps the exponent.
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  }
  bits = static_cast<std::uint16_t>(sign | h);
}

Half::operator float() const {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  std::uint32_t f;
  if (exponent == 0x1f) {
    f = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {
    if (mantissa == 0) {
      f = sign;
    } else {
      // Subnormal half: normalise into a float normal.
      exponent = 113;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      f = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else {
    f = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(f);
}

BFloat16::BFloat16(float value) {
  const auto f = std::bit_cast<std::uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) {
    // Truncating a NaN could clear every payload bit left and make inf; force quiet.
    bits = static_cast<std::uint16_t>((f >> 16) | 0x40u);
  } else {
    // Round to nearest even on the dropped 16 bits; overflow carries into inf as IEEE wants.
    const std::uint32_t rounded = f + 0x7fffu + ((f >> 16) & 1u);
    bits = static_cast<std::uint16_t>(rounded >> 16);
  }
}

BFloat16::operator float() const {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

}  // namespace shmtensor
