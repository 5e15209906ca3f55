// Threads the library starts for itself where std::thread does not do (a stack size, a
// signal mask, a name, and a handle that is plain data a forked child can copy), and the
// CPUs the calling thread may run on.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmtensor::internal {

// A started thread, to be joined once (its pthread_t).
struct ThreadHandle {
  std::uint64_t id = 0;
};

// Starts run(arg) on a new thread that blocks every signal (a signal for the process is
// never delivered to it), with a stack of `stack_bytes` (or the default size where glibc
// refuses that one: it carves the static TLS of the loaded libraries out of the stack), and
// named `name` before run starts (at most 15 characters; a longer name is not set).
// Returns false when no thread could be made: nothing was started and run will not be
// called. The
// calling thread's signal mask is its own again on return. Never throws.
bool start_thread(void* (*run)(void*), void* arg, std::size_t stack_bytes, const char* name,
                  ThreadHandle* started) noexcept;

// pthread_join: waits for the thread to end. Never throws.
void join_thread(ThreadHandle thread) noexcept;

// False when the calling thread's affinity mask (sched_getaffinity) allows one CPU only;
// true otherwise, and when the mask cannot be read. Never throws.
bool may_run_on_several_cpus() noexcept;
// How many CPUs the calling thread's affinity mask allows; 0 when it cannot be read.
// Never throws.
int allowed_cpus() noexcept;

}  // namespace shmtensor::internal
