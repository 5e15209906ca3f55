#include "os/clock.h"

#include <time.h>

namespace shmtensor::internal {

std::int64_t coarse_monotonic_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace shmtensor::internal
