#include "os/thread.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>

#include <cstring>
#include <new>

namespace shmtensor::internal {

static_assert(sizeof(pthread_t) <= sizeof(ThreadHandle::id));

namespace {

// What a started thread runs first: it names itself, then runs `run`. Named by its creator
// after pthread_create, a thread could run (and read its name) before it had one.
struct Start {
  void* (*run)(void*);
  void* arg;
  char name[16];  // empty: a name too long to set (at most 15 characters)
};

void* named_start(void* p) {
  const Start start = *static_cast<const Start*>(p);
  delete static_cast<Start*>(p);
  if (start.name[0] != '\0') (void)::pthread_setname_np(::pthread_self(), start.name);
  return start.run(start.arg);
}

}  // namespace

bool start_thread(void* (*run)(void*), void* arg, std::size_t stack_bytes, const char* name,
                  ThreadHandle* started) noexcept {
  auto* start = new (std::nothrow) Start{run, arg, {}};
  if (start == nullptr) return false;
  if (const std::size_t n = std::strlen(name); n < sizeof start->name)
    std::memcpy(start->name, name, n + 1);
  pthread_attr_t attr;
  if (::pthread_attr_init(&attr) != 0) {
    delete start;
    return false;
  }
  (void)::pthread_attr_setstacksize(&attr, stack_bytes);
  // The new thread inherits the mask it is created with.
  sigset_t all, old;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t handle{};
  bool ok = ::pthread_create(&handle, &attr, named_start, start) == 0;
  // EINVAL for a stack too small to hold the static TLS: the default size.
  if (!ok) ok = ::pthread_create(&handle, nullptr, named_start, start) == 0;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::pthread_attr_destroy(&attr);
  if (!ok) {
    delete start;
    return false;
  }
  started->id = static_cast<std::uint64_t>(handle);
  return true;
}

void join_thread(ThreadHandle thread) noexcept {
  ::pthread_join(static_cast<pthread_t>(thread.id), nullptr);
}

bool may_run_on_several_cpus() noexcept {
  const int n = allowed_cpus();
  return n == 0 || n > 1;
}

int allowed_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  return CPU_COUNT(&set);
}

}  // namespace shmtensor::internal
