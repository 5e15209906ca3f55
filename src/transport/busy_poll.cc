#include "shmtensor/busy_poll.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "os/proc.h"
#include "os/thread.h"
#include "transport/busy_poll.h"

namespace shmtensor {

namespace {

constexpr std::int64_t kMaxBudgetNs = 1'000'000'000;
constexpr std::int64_t kUnset = -1;

// The budget set, in nanoseconds; kUnset until the first use reads the environment.
std::atomic<std::int64_t> g_budget_ns{kUnset};
// Bumped by every set_busy_poll, so that each thread restarts its adaptation from the new
// budget.
std::atomic<std::uint64_t> g_generation{0};

std::int64_t budget_set_ns() noexcept {
  std::int64_t b = g_budget_ns.load(std::memory_order_relaxed);
  if (b != kUnset) return b;
  auto env = internal::parse_busy_poll_us(std::getenv("SHMTENSOR_BUSY_POLL_US"));
  std::int64_t from_env = env ? env->count() : 0;
  g_budget_ns.compare_exchange_strong(b, from_env, std::memory_order_relaxed);
  return g_budget_ns.load(std::memory_order_relaxed);
}

// How many uses of a thread's state between two reads of its affinity mask (one
// sched_getaffinity: a process moved by `taskset -p`, or a thread that pins itself, is
// noticed within that many receives).
constexpr std::uint32_t kAffinityRereads = 1024;

struct ThreadState {
  std::uint64_t generation = ~std::uint64_t{0};
  std::int64_t budget_ns = 0;         // this thread's next poll
  std::uint32_t calls = 0;            // since the budget was set: every 64th is a probe
  std::uint32_t fork_generation = 0;  // of the process whose mask several_cpus is
  std::uint32_t affinity_age = 0;     // uses since the mask was read
  bool several_cpus = true;
};
thread_local ThreadState t_state;

// This thread's state, restarted when the budget was set anew (or on first use). The
// affinity mask is read then, in a forked child (whose copy of this thread's state is its
// parent's), and every kAffinityRereads uses.
ThreadState& state() noexcept {
  const std::uint64_t gen = g_generation.load(std::memory_order_acquire);
  const std::uint32_t forks = internal::fork_generation();
  if (t_state.generation != gen) {
    t_state.generation = gen;
    t_state.budget_ns = budget_set_ns();
    t_state.calls = 0;
    t_state.affinity_age = kAffinityRereads;  // read below
  }
  if (t_state.fork_generation != forks || ++t_state.affinity_age >= kAffinityRereads) {
    t_state.fork_generation = forks;
    t_state.affinity_age = 0;
    t_state.several_cpus = internal::may_run_on_several_cpus();
  }
  return t_state;
}

// The least a budget adapts down to: 1/64 of the one set (never 0, which would mean "off").
std::int64_t least_of(std::int64_t most) noexcept { return std::max<std::int64_t>(most / 64, 1); }

}  // namespace

void set_busy_poll(Duration budget) {
  const double ns = budget.count() * 1e9;
  if (!(ns >= 0) || ns > static_cast<double>(kMaxBudgetNs))
    throw std::invalid_argument("set_busy_poll: the budget must be from 0 to 1 second, not " +
                                std::to_string(budget.count()) + " s");
  g_budget_ns.store(static_cast<std::int64_t>(ns), std::memory_order_relaxed);
  g_generation.fetch_add(1, std::memory_order_release);  // publishes the budget stored above
}

Duration get_busy_poll() { return Duration(static_cast<double>(budget_set_ns()) / 1e9); }

namespace internal {

std::chrono::nanoseconds busy_poll_budget(std::optional<std::chrono::nanoseconds> set) noexcept {
  ThreadState& s = state();
  if (!s.several_cpus) return std::chrono::nanoseconds(0);
  const std::int64_t most = set ? set->count() : budget_set_ns();
  if (most <= 0) return std::chrono::nanoseconds(0);
  if (++s.calls % 64 == 0) return std::chrono::nanoseconds(most);
  return std::chrono::nanoseconds(std::clamp<std::int64_t>(s.budget_ns, least_of(most), most));
}

std::chrono::nanoseconds spin_before_sleep() noexcept {
  constexpr std::chrono::nanoseconds kSpin = std::chrono::microseconds(4);
  return state().several_cpus ? kSpin : std::chrono::nanoseconds(0);
}

std::optional<std::chrono::steady_clock::time_point> spin_before_sleep_until(
    const std::optional<std::chrono::steady_clock::time_point>& deadline) noexcept {
  const auto spin = spin_before_sleep();
  if (spin.count() <= 0) return std::nullopt;
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(spin);
  return deadline ? std::min(until, *deadline) : until;
}

void busy_poll_observe(std::optional<std::chrono::nanoseconds> waited,
                       std::optional<std::chrono::nanoseconds> set) noexcept {
  ThreadState& s = state();
  const std::int64_t most = set ? set->count() : budget_set_ns();
  if (most <= 0) return;  // turned off since this receive's budget was read
  const std::int64_t least = least_of(most);
  if (waited && waited->count() <= most)
    s.budget_ns = std::clamp<std::int64_t>(2 * waited->count(), least, most);
  else
    s.budget_ns = std::clamp<std::int64_t>(s.budget_ns / 2, least, most);
}

std::optional<std::chrono::nanoseconds> parse_busy_poll_us(const char* text) noexcept {
  if (text == nullptr || *text < '0' || *text > '9') return std::nullopt;  // strtoll skips spaces
  errno = 0;
  char* end = nullptr;
  const long long us = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || us < 0 || us > kMaxBudgetNs / 1000) return std::nullopt;
  return std::chrono::nanoseconds(us * 1000);
}

}  // namespace internal
}  // namespace shmtensor
