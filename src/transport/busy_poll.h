// The transport's side of include/shmtensor/busy_poll.h: the budget of this thread's next
// poll, and what the poll found.
#pragma once

#include <chrono>
#include <optional>

namespace shmtensor::internal {

// How long this thread's next receive may poll; zero: do not poll (off, or this process
// may run on one CPU only). Every 64th call returns the whole budget set (a probe: a pair
// of receivers that both block wait longer than a budget could cover, and would never
// find out that polling on both sides makes the wait short).
//
// `set` is the budget this receive follows in place of the process's: a queue handle's own
// (Queue::set_busy_poll); nullopt: the process's. The thread's adaptation is shared by
// both and clamped to the one followed.
std::chrono::nanoseconds busy_poll_budget(
    std::optional<std::chrono::nanoseconds> set = std::nullopt) noexcept;
// Adapts this thread's budget to how long its last receive waited for a datagram, from
// the start of the receive, polling or blocked; nullopt: none came before its deadline.
// A wait the budget set could have covered sets the next budget to twice that wait (a
// poll that long would have caught it); a longer wait, or none, halves the budget, never
// below 1/64 of the one set.
void busy_poll_observe(std::optional<std::chrono::nanoseconds> waited,
                       std::optional<std::chrono::nanoseconds> set = std::nullopt) noexcept;
// How long a blocking receive that found nothing spins (watching one word of the ring, no
// syscall) before it sleeps, whether or not busy polling is on: a few microseconds, less
// than a sleep and wake-up cost (a FUTEX_WAKE for the sender, 5 to 50 microseconds for the
// sleeper on a VM), so that a sender that is producing right now never has to wake its
// receiver. Zero when this thread may run on one CPU only (its peer needs that CPU).
std::chrono::nanoseconds spin_before_sleep() noexcept;
// When that spin ends for a receive with `deadline` (the earlier of the two), or nullopt
// when this thread does not spin.
std::optional<std::chrono::steady_clock::time_point> spin_before_sleep_until(
    const std::optional<std::chrono::steady_clock::time_point>& deadline) noexcept;
// SHMTENSOR_BUSY_POLL_US's value in nanoseconds: nullopt when unset, empty or invalid (not
// a whole number of microseconds from 0 to 1,000,000).
std::optional<std::chrono::nanoseconds> parse_busy_poll_us(const char* text) noexcept;

}  // namespace shmtensor::internal
