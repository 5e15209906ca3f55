// Futexes on 32-bit words in shared memory (shared, not FUTEX_PRIVATE, operations).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

namespace shmtensor::internal {

// Sleeps while *word == expected, up to timeout (nullopt: forever). Returns false on
// timeout. Spurious wake-ups are possible: callers re-check their condition.
bool futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                std::optional<std::chrono::nanoseconds> timeout);
void futex_wake(std::atomic<std::uint32_t>* word, int count) noexcept;

}  // namespace shmtensor::internal
