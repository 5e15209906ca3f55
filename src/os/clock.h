// Clocks that std::chrono does not offer.
#pragma once

#include <cstdint>

namespace shmtensor::internal {

// CLOCK_MONOTONIC_COARSE, in nanoseconds: a word the kernel updates at each tick (a few
// milliseconds), read without the TSC (the fine clock costs ~30 instructions more and a
// serialising TSC read). For checks that run on every message and need only the tick.
// Never throws.
std::int64_t coarse_monotonic_ns() noexcept;

}  // namespace shmtensor::internal
