#include "os/fork_handlers.h"

#include <pthread.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <utility>

namespace shmtensor::internal {

namespace {

std::array<std::atomic<const ForkHandlers*>, kForkStageCount> g_installed{};

// What this fork's prepare ran, for its parent and child handlers. Per thread: two threads
// may fork at once (each then waits in some stage's prepare for the other's locks), and a
// forked child's only thread is a copy of the forking one, so it inherits this.
thread_local std::array<const ForkHandlers*, kForkStageCount> t_prepared{};
thread_local int t_errno_before_fork = 0;

void run_prepare() {
  t_errno_before_fork = errno;
  for (int i = 0; i < kForkStageCount; ++i) {
    // acquire: pairs with the release in install_fork_handlers, so the handler's own state
    // (set up before it installed itself) is visible here.
    const ForkHandlers* h = g_installed[i].load(std::memory_order_acquire);
    t_prepared[i] = h;
    if (h != nullptr && h->prepare != nullptr) h->prepare();
  }
  // glibc runs the parent handlers after a failed fork too, and tells the two apart only
  // through errno, which a failed fork sets (EAGAIN, ENOMEM, ENOSYS). So errno leaves
  // here at 0, whatever the handlers did to it.
  errno = 0;
}

void run_parent() {
  const int err = errno;
  const bool fork_failed = err == EAGAIN || err == ENOMEM || err == ENOSYS;
  for (int i = kForkStageCount - 1; i >= 0; --i) {
    const ForkHandlers* h = std::exchange(t_prepared[i], nullptr);
    if (h != nullptr && h->parent != nullptr) h->parent(fork_failed);
  }
  errno = fork_failed ? err : t_errno_before_fork;
}

void run_child() {
  for (int i = kForkStageCount - 1; i >= 0; --i) {
    const ForkHandlers* h = std::exchange(t_prepared[i], nullptr);
    if (h != nullptr && h->child != nullptr) h->child();
  }
  errno = t_errno_before_fork;
}

}  // namespace

void install_fork_handlers(ForkStage stage, const ForkHandlers* handlers) noexcept {
  static std::once_flag once;
  // pthread_atfork fails only with ENOMEM, and nothing better can be done then than to
  // run without handlers.
  std::call_once(once, [] { ::pthread_atfork(run_prepare, run_parent, run_child); });
  g_installed[static_cast<int>(stage)].store(handlers, std::memory_order_release);
}

}  // namespace shmtensor::internal
