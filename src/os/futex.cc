#include "os/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

#include "os/syscall.h"

namespace shmtensor::internal {

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

bool futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                std::optional<std::chrono::nanoseconds> timeout) {
  timespec ts{};
  if (timeout) {
    auto ns = timeout->count() < 0 ? 0 : timeout->count();
    ts.tv_sec = ns / 1000000000;
    ts.tv_nsec = ns % 1000000000;
  }
  // FUTEX_WAIT (not _PRIVATE): the word lives in memory shared between processes.
  long rc = ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected,
                      timeout ? &ts : nullptr, nullptr, 0);
  if (rc == -1) {
    if (errno == ETIMEDOUT) return false;
    if (errno == EAGAIN || errno == EINTR) return true;  // value changed / signal: re-check
    throw_system_error(errno, "futex", "FUTEX_WAIT");
  }
  return true;
}

void futex_wake(std::atomic<std::uint32_t>* word, int count) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, count, nullptr,
            nullptr, 0);
}

void futex_wait_private(std::atomic<std::uint32_t>* word, std::uint32_t expected) noexcept {
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_PRIVATE,
                  expected, nullptr, nullptr, 0);
}

void futex_wake_private(std::atomic<std::uint32_t>* word, int count) noexcept {
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE_PRIVATE, count,
                  nullptr, nullptr, 0);
}

}  // namespace shmtensor::internal
