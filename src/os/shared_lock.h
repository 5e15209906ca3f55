// A lock in memory that several processes map, built so that nothing another process
// writes into that memory can crash or hang the processes that use it
// (docs/transport.md, "What a peer that writes the shared memory can do").
//
// It is not a pthread robust mutex: glibc keeps pointers of its robust list inside such a
// mutex, follows them, and asserts on its owner field, so a peer's write into the mutex
// aborts or crashes whoever takes it next. Here the shared words are plain values that are
// only compared and exchanged:
//
//   state: owner's start time (low 19 bits of its clock ticks) | contended (1) |
//          owner pid (22) | owner tid (22), or 0 when free
//   wake:  a counter the waiters sleep on (FUTEX_WAIT), bumped by an unlock that saw a
//          waiter
//
// The owner's ids and start time are taken together by one CAS, so whoever looks at a held
// lock knows exactly which thread holds it, and a thread that has the ids of a dead holder
// (pid and tid reused) does not pass for it. Waiters sleep in slices (at most kLockSlice) and
// look at that thread between slices (/proc/<pid>/task/<tid>/stat):
//   - gone (exited, a zombie, another start time, or never there: a value a peer made
//     up): the lock is taken
//     over, and the caller is told (Locked::kRecovered) so that its protocol repairs what
//     the holder left half done;
//   - stopped (SIGSTOP, a debugger): waited for, until the caller's deadline;
//   - alive: waited for, until the caller's deadline; and for a lock that its holders keep
//     for a few system calls only (LockHold::kBrief), a waiter that has seen it held by
//     live, running threads for more than kStuckAfter in all reports a ProtocolError: a
//     holder is wedged, or a peer wrote a live thread's ids over the lock. The time adds up
//     across holders and across unlocks seen (a peer can name one live thread after
//     another and bump `wake`), so a caller without a deadline waits at most that long
//     (and while a named holder is stopped).
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

// Bits of SharedLock::state (tests and the fuzz target write them as a peer would). pids
// and tids are below 2^22 (the kernel's PID_MAX_LIMIT). A start of 0 is "not known" (the
// owner could not read it): such a holder is judged by its ids alone.
inline constexpr int kLockIdBits = 22;
inline constexpr std::uint64_t kLockIdMask = (std::uint64_t{1} << kLockIdBits) - 1;
inline constexpr std::uint64_t kLockContended = std::uint64_t{1} << (2 * kLockIdBits);
inline constexpr int kLockStartShift = 2 * kLockIdBits + 1;
inline constexpr std::uint64_t kLockStartMask = (std::uint64_t{1} << (64 - kLockStartShift)) - 1;
constexpr std::uint64_t lock_state(std::uint32_t pid, std::uint32_t tid, std::uint64_t start) {
  return (start & kLockStartMask) << kLockStartShift | (pid & kLockIdMask) << kLockIdBits |
         (tid & kLockIdMask);
}
// The state that names thread `tid` of process `pid` as it is now (its start time read in
// /proc); its start is 0 when /proc does not say.
std::uint64_t thread_lock_state(std::uint32_t pid, std::uint32_t tid) noexcept;

// How long a waiter sleeps before it looks at the holder again.
inline constexpr auto kLockSlice = std::chrono::milliseconds(10);
// How long a waiter of a brief lock waits while live, running threads hold it (in all,
// whichever they are) before it reports the lock as wedged.
inline constexpr auto kStuckAfter = std::chrono::seconds(1);

enum class LockHold {
  kBrief,  // held for a few system calls: a holder that keeps it longer is wedged
  kLong,   // held while its holder waits for something (room in a queue): no such bound
};
enum class Locked { kYes, kRecovered, kTimeout };

// Takes the lock, waiting until `deadline` (nullopt: no time limit; a passed one: one
// try). kRecovered: its holder was gone, and this thread holds it now. kTimeout: the
// deadline passed first (not held). `what` names the lock in errors ("the queue's receive
// lock"). Throws ProtocolError for a brief lock held by live threads for kStuckAfter in
// all while this thread waited.
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
