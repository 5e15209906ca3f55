// Futexes on 32-bit words: in shared memory (shared operations), and in this process's own
// memory (FUTEX_PRIVATE operations, for a lock of this process alone).
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

// FUTEX_WAIT_PRIVATE with no time limit: sleeps while *word == expected; returns at once
// when it is not (EAGAIN), and on a signal or a spurious wake-up. FUTEX_WAKE_PRIVATE:
// wakes up to `count` sleepers. For a word only this process uses. Neither reports an
// error, and neither throws; errno may be changed.
void futex_wait_private(std::atomic<std::uint32_t>* word, std::uint32_t expected) noexcept;
void futex_wake_private(std::atomic<std::uint32_t>* word, int count) noexcept;

}  // namespace shmtensor::internal
