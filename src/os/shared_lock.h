// A lock in memory that several processes map, built so that nothing another process
// writes into that memory can crash or hang the processes that use it
// (docs/transport.md, "What a peer that writes the shared memory can do").
//
// It is not a pthread robust mutex: glibc keeps pointers of its robust list inside such a
// mutex, follows them, and asserts on its owner field, so a peer's write into the mutex
// aborts or crashes whoever takes it next. Here the shared words are plain values that are
// only compared and exchanged:
//
//   state: owner pid (32 bits) | contended (1) | owner tid (31), or 0 when free
//   wake:  a counter the waiters sleep on (FUTEX_WAIT), bumped by an unlock that saw a
//          waiter
//
// The owner's pid and tid are taken together by one CAS, so whoever looks at a held lock
// knows exactly which thread holds it. Waiters sleep in slices (at most kLockSlice) and
// look at that thread between slices (/proc/<pid>/task/<tid>/stat):
//   - gone (exited, a zombie, or never there: a value a peer made up): the lock is taken
//     over, and the caller is told (Locked::kRecovered) so that its protocol repairs what
//     the holder left half done;
//   - stopped (SIGSTOP, a debugger): waited for, until the caller's deadline;
//   - alive: waited for, until the caller's deadline; and for a lock that its holders keep
//     for a few system calls only (LockHold::kBrief), one held by the same live thread for
//     more than kStuckAfter is reported as a ProtocolError: that thread is wedged, or a
//     peer wrote a live thread's ids over the lock.
// Zero bytes are a free lock, so a lock in a fresh (zero-filled) shared file needs no
// initialisation.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

namespace shmtensor::internal {

struct SharedLock {
  std::atomic<std::uint64_t> state;
  std::atomic<std::uint32_t> wake;
  std::uint32_t reserved;
};
static_assert(sizeof(SharedLock) == 16);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

// Bits of SharedLock::state (tests and the fuzz target write them as a peer would).
inline constexpr std::uint64_t kLockContended = std::uint64_t{1} << 31;
inline constexpr std::uint64_t kLockTidMask = kLockContended - 1;
constexpr std::uint64_t lock_state(std::uint32_t pid, std::uint32_t tid) {
  return std::uint64_t{pid} << 32 | (tid & kLockTidMask);
}

// How long a waiter sleeps before it looks at the holder again.
inline constexpr auto kLockSlice = std::chrono::milliseconds(10);
// How long a brief lock may be held by one live, running thread before a waiter reports it.
inline constexpr auto kStuckAfter = std::chrono::seconds(1);

enum class LockHold {
  kBrief,  // held for a few system calls: a holder that keeps it longer is wedged
  kLong,   // held while its holder waits for something (room in a queue): no such bound
};
enum class Locked { kYes, kRecovered, kTimeout };

// Takes the lock, waiting until `deadline` (nullopt: no time limit; a passed one: one
// try). kRecovered: its holder was gone, and this thread holds it now. kTimeout: the
// deadline passed first (not held). `what` names the lock in errors ("the queue's receive
// lock"). Throws ProtocolError for a brief lock held by one live thread past kStuckAfter.
Locked lock_shared(SharedLock& lock, std::optional<std::chrono::steady_clock::time_point> deadline,
                   LockHold hold, const char* what);
// Gives the lock back; does nothing when this thread does not hold it (it was taken over,
// or a peer wrote over it).
void unlock_shared(SharedLock& lock) noexcept;

// Unlocks on scope exit a lock the caller took.
class SharedLockGuard {
 public:
  explicit SharedLockGuard(SharedLock& lock) noexcept : lock_(lock) {}
  SharedLockGuard(const SharedLockGuard&) = delete;
  SharedLockGuard& operator=(const SharedLockGuard&) = delete;
  ~SharedLockGuard() { unlock_shared(lock_); }

 private:
  SharedLock& lock_;
};

}  // namespace shmtensor::internal
