// The transport's side of include/shmtensor/busy_poll.h: the budget of this thread's next
// poll, what the poll found, and the busy-poll loop every receive runs (poll_then_wait).
#pragma once

#include <algorithm>
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

// The busy-poll loop of every receive: a Queue's ring, a Connection's ring, a socket's
// datagrams. With a budget to poll (busy_poll_budget(set)), it looks (`look()`, which does
// not wait) until something arrives, spinning between looks (`spin(until)`: true once
// something may have changed, false when `until` came first), for up to the budget and
// never past the deadline; then, or at once without a budget, it waits as usual (`wait()`,
// until the deadline). look() and wait() return one type, true when something arrived (an
// item, or the end of the channel). The time from the start to that, or nothing arriving,
// adapts the thread's next budget (busy_poll_observe). A receive whose deadline has passed
// (a zero timeout: get_nowait, a drain) neither polls nor teaches the adaptation anything;
// the clock is read only when polling or given a deadline. Always inlined: a receive whose
// message is already there pays no call for the loop.
template <class Look, class Spin, class Wait>
[[gnu::always_inline]] inline auto poll_then_wait(
    const std::optional<std::chrono::steady_clock::time_point>& deadline,
    std::optional<std::chrono::nanoseconds> set, Look&& look, Spin&& spin, Wait&& wait) {
  using Clock = std::chrono::steady_clock;
  if (deadline && Clock::now() >= *deadline) return wait();
  const auto budget = busy_poll_budget(set);
  if (budget.count() <= 0) return wait();
  const auto start = Clock::now();
  auto until = start + std::chrono::duration_cast<Clock::duration>(budget);
  if (deadline) until = std::min(until, *deadline);
  // The clock before each spin: a watched word that keeps moving with nothing for us (a
  // kick, another process storing to it) must not keep us polling past the budget.
  auto got = look();
  while (!got && Clock::now() < until && spin(until)) got = look();
  if (!got) got = wait();
  busy_poll_observe(got ? std::optional<std::chrono::nanoseconds>(Clock::now() - start)
                        : std::nullopt,
                    set);
  return got;
}

}  // namespace shmtensor::internal
