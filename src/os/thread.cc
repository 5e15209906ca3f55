#include "os/thread.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>

namespace shmtensor::internal {

static_assert(sizeof(pthread_t) <= sizeof(ThreadHandle::id));

bool start_thread(void* (*run)(void*), void* arg, std::size_t stack_bytes, const char* name,
                  ThreadHandle* started) noexcept {
  pthread_attr_t attr;
  if (::pthread_attr_init(&attr) != 0) return false;
  (void)::pthread_attr_setstacksize(&attr, stack_bytes);
  // The new thread inherits the mask it is created with.
  sigset_t all, old;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t handle{};
  bool ok = ::pthread_create(&handle, &attr, run, arg) == 0;
  // EINVAL for a stack too small to hold the static TLS: the default size.
  if (!ok) ok = ::pthread_create(&handle, nullptr, run, arg) == 0;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::pthread_attr_destroy(&attr);
  if (!ok) return false;
  (void)::pthread_setname_np(handle, name);
  started->id = static_cast<std::uint64_t>(handle);
  return true;
}

void join_thread(ThreadHandle thread) noexcept {
  ::pthread_join(static_cast<pthread_t>(thread.id), nullptr);
}

bool may_run_on_several_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return true;
  return CPU_COUNT(&set) > 1;
}

}  // namespace shmtensor::internal
