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
  // spins shrank finds out when spinning would pay again. The shortest outlasts a wake-up by
  // futex (~15 µs on a 2-vCPU VM): with spins shorter than that, a pair that slept once kept
  // missing each other (each one's spin ended before the other woke) and slept at every
  // batch (docs/data_loader.md, "What a batch costs").
  static constexpr std::chrono::nanoseconds kMost = std::chrono::microseconds(50);
  static constexpr std::chrono::nanoseconds kLeast = std::chrono::microseconds(20);
  static constexpr std::uint32_t kProbe = 64;

  // Spins on `ends` until one has a message (its index), `deadline` passes or the spin's
  // budget is spent (nullopt). No spin where this thread may run on one CPU only (its peer
  // needs that CPU: busy_poll.h).
  std::optional<std::size_t> spin(std::span<Connection* const> ends,
                                  std::optional<Clock::time_point> deadline) noexcept {
    Clock::time_point start, until;
    if (!begin(deadline, start, until)) return std::nullopt;
    const std::optional<std::size_t> found = ConnectionAccess::spin_for_message(ends, until);
    learn(found.has_value(), start);
    return found;
  }

  // Spins until `ready()` (loads only, no syscall) holds or the spin's budget is spent.
  // Not inlined: a profile shows the spin apart from its caller's work.
  template <class Ready>
  [[gnu::noinline]] bool spin_until(Ready&& ready) noexcept {
    Clock::time_point start, until;
    if (!begin(std::nullopt, start, until)) return false;
    for (std::uint32_t i = 0;; ++i) {
      if (ready()) {
        learn(true, start);
        return true;
      }
      if (i % 32 == 31 && Clock::now() >= until) break;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    learn(false, start);
    return false;
  }

 private:
  // When this spin starts and ends; false: no spin at all.
  bool begin(std::optional<Clock::time_point> deadline, Clock::time_point& start,
             Clock::time_point& until) noexcept {
    if (spin_before_sleep().count() <= 0) return false;
    const auto budget = ++waits_ % kProbe == 0 ? kMost : budget_;
    start = Clock::now();
    until = start + std::chrono::duration_cast<Clock::duration>(budget);
    if (deadline) {
      if (start >= *deadline) return false;
      until = std::min(until, *deadline);
    }
    return true;
  }
  // A message caught makes the next spin four times as long as this one took (a long wait
  // caught once does not keep later spins long); a miss halves it.
  void learn(bool found, Clock::time_point start) noexcept {
    if (found)
      budget_ = std::clamp(
          std::chrono::duration_cast<std::chrono::nanoseconds>(4 * (Clock::now() - start)),
          std::chrono::nanoseconds(kLeast), std::chrono::nanoseconds(kMost));
    else
      budget_ = std::max(std::chrono::nanoseconds(kLeast), budget_ / 2);
  }

  std::chrono::nanoseconds budget_ = kMost;
  std::uint32_t waits_ = 0;
};

}  // namespace shmtensor::internal
