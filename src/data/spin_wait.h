// How long a DataLoader process spins on its rings before it sleeps (the main process
// waiting for a batch, a worker waiting for a task). Each side's work per batch is a few
// microseconds, so while both run a message comes within a spin and nobody makes a
// syscall for it; a side that waits longer (a slow dataset, a slow training step) stops
// spinning within a few waits and sleeps as before.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>

#include "shmtensor/internal/connection_access.h"
#include "transport/busy_poll.h"

namespace shmtensor::internal {

class AdaptiveSpin {
 public:
  using Clock = std::chrono::steady_clock;
  // Longest and shortest spin. Every kProbe-th wait spins the longest, so that a pair whose
  // spins shrank finds out when spinning would pay again.
  static constexpr std::chrono::nanoseconds kMost = std::chrono::microseconds(50);
  static constexpr std::chrono::nanoseconds kLeast = std::chrono::microseconds(2);
  static constexpr std::uint32_t kProbe = 64;

  // Spins on `ends` until one has a message (its index), `deadline` passes or the spin's
  // budget is spent (nullopt). No spin where this thread may run on one CPU only (its peer
  // needs that CPU: busy_poll.h).
  std::optional<std::size_t> spin(std::span<Connection* const> ends,
                                  std::optional<Clock::time_point> deadline) noexcept {
    if (spin_before_sleep().count() <= 0) return std::nullopt;
    const auto budget = ++waits_ % kProbe == 0 ? kMost : budget_;
    const auto start = Clock::now();
    auto until = start + std::chrono::duration_cast<Clock::duration>(budget);
    if (deadline) {
      if (start >= *deadline) return std::nullopt;
      until = std::min(until, *deadline);
    }
    const std::optional<std::size_t> found = ConnectionAccess::spin_for_message(ends, until);
    // A message caught makes the next spin four times as long as this one took (a long
    // wait caught once does not keep later spins long); a miss halves it.
    if (found)
      budget_ = std::clamp(
          std::chrono::duration_cast<std::chrono::nanoseconds>(4 * (Clock::now() - start)),
          std::chrono::nanoseconds(kLeast), std::chrono::nanoseconds(kMost));
    else
      budget_ = std::max(std::chrono::nanoseconds(kLeast), budget_ / 2);
    return found;
  }

 private:
  std::chrono::nanoseconds budget_ = kMost;
  std::uint32_t waits_ = 0;
};

}  // namespace shmtensor::internal
