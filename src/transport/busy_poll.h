// The transport's side of include/shmtensor/busy_poll.h: the budget of this thread's next
// poll, and what the poll found.
#pragma once

#include <chrono>
#include <optional>

namespace shmtensor::internal {

// How long this thread's next receive may poll; zero: do not poll (off, or this process
// may run on one CPU only).
std::chrono::nanoseconds busy_poll_budget() noexcept;
// Adapts this thread's budget to what its last poll found.
void busy_poll_done(bool found) noexcept;
// SHMTENSOR_BUSY_POLL_US's value in nanoseconds: nullopt when unset, empty or invalid (not
// a whole number of microseconds from 0 to 1,000,000).
std::optional<std::chrono::nanoseconds> parse_busy_poll_us(const char* text) noexcept;

}  // namespace shmtensor::internal
