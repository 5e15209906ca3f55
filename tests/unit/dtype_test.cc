// DType names and sizes; Half and BFloat16 conversions: known values, round-to-nearest-even
// ties, inf/NaN/subnormals, and exhaustive round trips of every 16-bit pattern.
#include "shmtensor/dtype.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "support/expect_error.h"

namespace shmtensor {
namespace {

std::uint16_t half_bits(float f) { return Half(f).bits; }
std::uint16_t bf16_bits(float f) { return BFloat16(f).bits; }
float from_half(std::uint16_t bits) {
  Half h;
  h.bits = bits;
  return static_cast<float>(h);
}
float from_bf16(std::uint16_t bits) {
  BFloat16 b;
  b.bits = bits;
  return static_cast<float>(b);
}

TEST(DTypeTest, ElementSizes) {
  EXPECT_EQ(element_size(DType::kBool), 1u);
  EXPECT_EQ(element_size(DType::kUInt8), 1u);
  EXPECT_EQ(element_size(DType::kInt8), 1u);
  EXPECT_EQ(element_size(DType::kInt16), 2u);
  EXPECT_EQ(element_size(DType::kInt32), 4u);
  EXPECT_EQ(element_size(DType::kInt64), 8u);
  EXPECT_EQ(element_size(DType::kFloat16), 2u);
  EXPECT_EQ(element_size(DType::kBFloat16), 2u);
  EXPECT_EQ(element_size(DType::kFloat32), 4u);
  EXPECT_EQ(element_size(DType::kFloat64), 8u);
  EXPECT_EQ(element_size(DType::kComplex64), 8u);
  EXPECT_EQ(element_size(DType::kComplex128), 16u);
}

TEST(DTypeTest, NamesRoundTrip) {
  const char* names[] = {"bool",    "uint8",    "int8",    "int16",   "int32",     "int64",
                         "float16", "bfloat16", "float32", "float64", "complex64", "complex128"};
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto dtype = static_cast<DType>(i);
    EXPECT_EQ(to_string(dtype), names[i]);
    EXPECT_EQ(dtype_from_string(names[i]), dtype);
  }
}

TEST(DTypeTest, UnknownNameThrowsNamingValidValues) {
  try {
    dtype_from_string("float");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'float'"), std::string::npos) << what;
    EXPECT_NE(what.find("bool"), std::string::npos) << what;
    EXPECT_NE(what.find("bfloat16"), std::string::npos) << what;
    EXPECT_NE(what.find("complex128"), std::string::npos) << what;
  }
  EXPECT_ERROR(dtype_from_string(""), std::invalid_argument, "unknown dtype \'\'");
  EXPECT_ERROR(dtype_from_string("Float32"), std::invalid_argument, "unknown dtype \'Float32\'");
}

TEST(DTypeTest, ValueOutsideTheEnumThrows) {
  EXPECT_ERROR(element_size(static_cast<DType>(12)), std::invalid_argument,
               "invalid DType value 12");
  EXPECT_ERROR(to_string(static_cast<DType>(255)), std::invalid_argument,
               "invalid DType value 255");
}

TEST(DTypeTest, DTypeOfMapsTypes) {
  EXPECT_EQ(dtype_of_v<Half>, DType::kFloat16);
  EXPECT_EQ(dtype_of_v<std::complex<float>>, DType::kComplex64);
  EXPECT_EQ(dtype_of_v<bool>, DType::kBool);
}

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(half_bits(0.0f), 0x0000);
  EXPECT_EQ(half_bits(-0.0f), 0x8000);
  EXPECT_EQ(half_bits(1.0f), 0x3C00);
  EXPECT_EQ(half_bits(-2.0f), 0xC000);
  EXPECT_EQ(half_bits(0.5f), 0x3800);
  EXPECT_EQ(half_bits(0.1f), 0x2E66);
  EXPECT_EQ(half_bits(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(half_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -14)), 0x0400);         // smallest normal
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(half_bits(1023 * std::ldexp(1.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(from_half(0x3C00), 1.0f);
  EXPECT_EQ(from_half(0x7BFF), 65504.0f);
  EXPECT_EQ(from_half(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(from_half(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(from_half(0xC000), -2.0f);
  EXPECT_TRUE(std::signbit(from_half(0x8000)));
}

TEST(HalfTest, RoundsToNearestEven) {
  EXPECT_EQ(half_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, down to even
  EXPECT_EQ(half_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie, up to even
  EXPECT_EQ(half_bits(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(half_bits(2049.0f), 0x6800);  // 2048
  EXPECT_EQ(half_bits(2051.0f), 0x6802);  // 2052
  EXPECT_EQ(half_bits(65519.0f), 0x7BFF);
  EXPECT_EQ(half_bits(65520.0f), 0x7C00);  // tie between 65504 and 2^16 goes to inf
  EXPECT_EQ(half_bits(1e6f), 0x7C00);
  EXPECT_EQ(half_bits(-1e6f), 0xFC00);
  // Subnormal ties: 2^-25 is halfway between 0 and 2^-24.
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(half_bits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(half_bits(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie to even 2
  EXPECT_EQ(half_bits(std::ldexp(5.0f, -25)), 0x0002);  // 2.5 units: tie to even 2
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(half_bits(-std::ldexp(1.0f, -26)), 0x8000);
  EXPECT_EQ(half_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
  // Largest subnormal + half a unit rounds up into the smallest normal.
  EXPECT_EQ(half_bits(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
}

TEST(HalfTest, InfAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(half_bits(inf), 0x7C00);
  EXPECT_EQ(half_bits(-inf), 0xFC00);
  EXPECT_EQ(from_half(0x7C00), inf);
  EXPECT_EQ(from_half(0xFC00), -inf);
  const std::uint16_t nan = half_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x03FF, 0);
  // A NaN whose payload lives only in the low bits must not become inf.
  const std::uint16_t low_payload = half_bits(std::bit_cast<float>(0x7F800001u));
  EXPECT_NE(low_payload & 0x03FF, 0);
  EXPECT_TRUE(std::isnan(from_half(0x7E00)));
  EXPECT_TRUE(std::isnan(from_half(0xFC01)));
}

TEST(HalfTest, EveryHalfRoundTripsThroughFloat) {
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float f = from_half(static_cast<std::uint16_t>(bits));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(from_half(half_bits(f)))) << bits;
    } else {
      ASSERT_EQ(half_bits(f), bits) << "bits " << bits << " float " << f;
    }
  }
}

#ifdef __FLT16_MAX__
// The compiler's own conversion (libgcc/compiler-rt, IEEE round-to-nearest-even) as oracle,
// over a spread of float bit patterns that covers every exponent and many mantissas.
TEST(HalfTest, MatchesCompilerFloat16) {
  for (std::uint64_t i = 0; i <= 0xFFFFFFFFull; i += 0x1001) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(i));
    if (std::isnan(f)) continue;
    const auto expected = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    ASSERT_EQ(half_bits(f), expected) << "float bits " << i;
  }
}
#endif

TEST(BFloat16Test, KnownValues) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(bf16_bits(3.140625f), 0x4049);
  EXPECT_EQ(bf16_bits(3.14159265f), 0x4049);
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie, down to even
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3F818000u)), 0x3F82);  // tie, up to even
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(from_bf16(0x4049), 3.140625f);
  EXPECT_EQ(from_bf16(0x0001), std::bit_cast<float>(0x00010000u));  // subnormal kept
  EXPECT_TRUE(std::isnan(from_bf16(bf16_bits(std::bit_cast<float>(0x7F800001u)))));
  EXPECT_TRUE(std::isnan(from_bf16(bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(BFloat16Test, EveryBFloat16RoundTripsThroughFloat) {
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float f = from_bf16(static_cast<std::uint16_t>(bits));
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f), bits << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(from_bf16(bf16_bits(f)))) << bits;
    } else {
      ASSERT_EQ(bf16_bits(f), bits) << bits;
    }
  }
}

}  // namespace
}  // namespace shmtensor
