#include "os/shared_lock.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "os/futex.h"
#include "os/proc.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t owner_of(std::uint64_t state) { return state & ~kLockContended; }
constexpr std::uint32_t pid_of(std::uint64_t state) {
  return static_cast<std::uint32_t>((state >> kLockIdBits) & kLockIdMask);
}
constexpr std::uint32_t tid_of(std::uint64_t state) {
  return static_cast<std::uint32_t>(state & kLockIdMask);
}
constexpr std::uint64_t start_of(std::uint64_t state) { return state >> kLockStartShift; }

// A thread's /proc/<pid>/task/<tid>/stat: its state letter and start time (field 22).
struct ThreadStat {
  enum { kMissing, kUnreadable, kRead } outcome = kMissing;
  char state = '?';
  std::uint64_t start = 0;
};
ThreadStat read_thread_stat(std::uint32_t pid, std::uint32_t tid) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/task/%u/stat", pid, tid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {errno == ENOENT || errno == ESRCH ? ThreadStat::kMissing : ThreadStat::kUnreadable};
  char buf[1024];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof buf - 1);
  } while (n < 0 && errno == EINTR);
  const int read_errno = errno;
  ::close(fd);
  if (n == 0 || (n < 0 && read_errno == ESRCH)) return {ThreadStat::kMissing};
  if (n < 0) return {ThreadStat::kUnreadable};
  buf[n] = '\0';
  // "tid (comm) S ppid ...": fields after the last ')' (comm may hold one), the state
  // being field 3 and the start time field 22.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return {ThreadStat::kUnreadable};
  ThreadStat st{ThreadStat::kRead, p[2], 0};
  for (int field = 3; field <= 22 && p != nullptr; ++field) p = std::strchr(p + 1, ' ');
  if (p != nullptr) st.start = std::strtoull(p + 1, nullptr, 10);
  return st;
}

// This thread's state, read once per thread and fork generation (a forked child's only
// thread has new ids).
std::uint64_t own_lock_state() noexcept {
  struct Ids {
    std::uint32_t generation = 0;
    std::uint64_t state = 0;
  };
  thread_local Ids ids;
  const std::uint32_t generation = fork_generation();
  if (ids.state == 0 || ids.generation != generation) [[unlikely]] {
    ids.generation = generation;
    ids.state = thread_lock_state(static_cast<std::uint32_t>(::getpid()),
                                  static_cast<std::uint32_t>(::syscall(SYS_gettid)));
  }
  return ids.state;
}

enum class Holder { kGone, kStopped, kAlive };

// The thread a held lock names, from /proc/<pid>/task/<tid>/stat. Ids that name no thread
// of that process (it exited, or a peer made them up), or one that started at another time
// (the ids were reused), are gone; so is a zombie. A stat that cannot be read for another
// reason (this process at its fd limit) is taken as alive.
Holder look_at_holder(std::uint64_t state) noexcept {
  const std::uint32_t pid = pid_of(state), tid = tid_of(state);
  if (pid == 0 || tid == 0) return Holder::kGone;
  const ThreadStat st = read_thread_stat(pid, tid);
  if (st.outcome == ThreadStat::kMissing) return Holder::kGone;
  if (st.outcome == ThreadStat::kUnreadable) return Holder::kAlive;
  if (start_of(state) != 0 && start_of(state) != (st.start & kLockStartMask)) return Holder::kGone;
  switch (st.state) {
    case 'Z':
    case 'X':
    case 'x':
      return Holder::kGone;
    case 'T':
    case 't':
      return Holder::kStopped;
    default:
      return Holder::kAlive;
  }
}

[[noreturn]] void throw_stuck(const char* what, std::uint64_t state) {
  throw ProtocolError(std::string(what) + " has been held by other threads for more than " +
                      std::to_string(kStuckAfter.count()) +
                      " s while this thread waited for it (last by thread " +
                      std::to_string(tid_of(state)) + " of process " +
                      std::to_string(pid_of(state)) +
                      "), which its holders never do: a process is wedged, or another process "
                      "wrote over the lock in shared memory");
}

}  // namespace

std::uint64_t thread_lock_state(std::uint32_t pid, std::uint32_t tid) noexcept {
  const ThreadStat st = read_thread_stat(pid, tid);
  return lock_state(pid, tid, st.outcome == ThreadStat::kRead ? st.start : 0);
}

Locked lock_shared(SharedLock& lock, std::optional<Clock::time_point> deadline, LockHold hold,
                   const char* what) {
  const std::uint64_t me = own_lock_state();
  std::uint64_t seen = 0;
  if (lock.state.compare_exchange_strong(seen, me, std::memory_order_acquire)) [[likely]]
    return Locked::kYes;
  // A short spin: an honest holder keeps a brief lock for a few system calls.
  for (int i = 0; i < 64 && seen != 0; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    seen = lock.state.load(std::memory_order_relaxed);
    if (seen == 0 && lock.state.compare_exchange_strong(seen, me, std::memory_order_acquire))
      return Locked::kYes;
  }
  // How long live, running threads other than this one have held the lock while this one
  // waited: kStuckAfter of it, for a brief lock, is reported. It adds up across holders and
  // across unlocks seen (the wake counter moving): a peer can name one live thread after
  // another, or bump the counter, and an honest brief lock is held for microseconds at a
  // time. Time while the holder is stopped does not count; a holder is looked at in /proc
  // once it has held the lock for a slice, then once a slice.
  std::chrono::nanoseconds held{0};
  std::uint64_t holder = 0;
  Clock::time_point since{};   // when `holder` was first seen holding
  Clock::time_point looked{};  // when /proc was last read for `holder`
  Holder judged = Holder::kAlive;
  Clock::time_point last = Clock::now();
  for (;;) {
    seen = lock.state.load(std::memory_order_acquire);
    const auto now = Clock::now();
    if (judged != Holder::kStopped) held += now - last;
    last = now;
    if (seen == 0) {
      // Taken as contended: others may sleep, and our unlock must wake them.
      if (lock.state.compare_exchange_strong(seen, me | kLockContended,
                                             std::memory_order_acquire))
        return Locked::kYes;
      continue;
    }
    if (owner_of(seen) != holder) {
      holder = owner_of(seen);
      since = now;
      looked = {};
      judged = Holder::kAlive;
    }
    // A state that names this thread, which does not hold the lock, was written by a peer.
    constexpr std::uint64_t kIds = (std::uint64_t{1} << (2 * kLockIdBits)) - 1;
    if ((holder & kIds) == (me & kIds)) {
      judged = Holder::kGone;
    } else if ((now - since >= kLockSlice && now - looked >= kLockSlice) ||
               ((pid_of(seen) == 0 || tid_of(seen) == 0) && looked == Clock::time_point{})) {
      judged = look_at_holder(seen);
      looked = now;
    }
    if (judged == Holder::kGone) {
      if (lock.state.compare_exchange_strong(seen, me | kLockContended,
                                             std::memory_order_acquire))
        return Locked::kRecovered;
      continue;  // the state changed: a new holder is judged afresh, the same one is gone still
    }
    if (judged == Holder::kAlive && hold == LockHold::kBrief && held >= kStuckAfter)
      throw_stuck(what, seen);
    if (deadline && now >= *deadline) return Locked::kTimeout;
    if ((seen & kLockContended) == 0 &&
        !lock.state.compare_exchange_strong(seen, seen | kLockContended,
                                            std::memory_order_relaxed))
      continue;
    const std::uint32_t ticket = lock.wake.load(std::memory_order_acquire);
    if (lock.state.load(std::memory_order_acquire) != (seen | kLockContended)) continue;
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kLockSlice);
    if (deadline) slice = std::min(slice, std::chrono::duration_cast<std::chrono::nanoseconds>(*deadline - now));
    futex_wait(&lock.wake, ticket, slice);
  }
}

void unlock_shared(SharedLock& lock) noexcept {
  const std::uint64_t me = own_lock_state();
  std::uint64_t seen = lock.state.load(std::memory_order_relaxed);
  while (owner_of(seen) == me) {
    if (lock.state.compare_exchange_weak(seen, 0, std::memory_order_release)) {
      if ((seen & kLockContended) != 0) {
        lock.wake.fetch_add(1, std::memory_order_release);
        futex_wake(&lock.wake, 1);
      }
      return;
    }
  }
}

}  // namespace shmtensor::internal
