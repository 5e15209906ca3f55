// What dtype.h's inline element_size reads: the element sizes by enumerator, and the error
// for a value outside the enum. Internal.
#pragma once

#include <cstdint>

#include "shmtensor/export.h"

namespace shmtensor {

enum class DType : std::uint8_t;

namespace internal {

// Element sizes by enumerator (dtype.cc checks them against the names' table).
inline constexpr std::uint8_t kElementSizes[] = {1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16};
// Throws std::invalid_argument naming a DType value outside the enum (a caller's cast).
[[noreturn]] SHMTENSOR_API void throw_invalid_dtype(DType dtype);

}  // namespace internal
}  // namespace shmtensor
