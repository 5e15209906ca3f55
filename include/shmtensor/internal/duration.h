// Timeouts (timeout.h) as the whole nanoseconds that the waits below the API take. Internal.
#pragma once

#include <chrono>
#include <cmath>
#include <optional>

#include "shmtensor/timeout.h"

namespace shmtensor::internal {

// Rounded up, so that a wait never ends before the time asked for; zero or less (and NaN)
// is 0 (only look); beyond what 64 bits of nanoseconds hold (292 years) is the maximum.
inline std::chrono::nanoseconds to_nanoseconds(Duration d) noexcept {
  const double ns = std::ceil(d.count() * 1e9);
  if (!(ns > 0)) return std::chrono::nanoseconds(0);
  if (ns >= 9.2e18) return std::chrono::nanoseconds::max();
  return std::chrono::nanoseconds(static_cast<std::chrono::nanoseconds::rep>(ns));
}

// std::nullopt (wait as long as it takes) stays std::nullopt.
inline std::optional<std::chrono::nanoseconds> to_nanoseconds(Timeout t) noexcept {
  if (!t) return std::nullopt;
  return to_nanoseconds(*t);
}

}  // namespace shmtensor::internal
