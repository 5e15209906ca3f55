// The library's fork handlers: the one pthread_atfork registration of the library (its
// torch bridge included), which runs every layer's handlers in one fixed order.
//
// Each layer that keeps per-process state a forked child must see consistently installs
// its handlers here, under its ForkStage. Before fork, prepare handlers run in the order of
// ForkStage; after it, parent and child handlers run in the reverse order (the last lock
// taken is the first released). A stage's handlers run only if they were installed before
// the fork began (the prepare of a stage installed during a fork never ran, so neither do
// its parent or child handlers). The registration is made by the first install, which
// os/proc.cc makes when the library is loaded.
//
// Handlers run in the forking thread. Child handlers run in a child that has that one
// thread, before fork() returns there: they must not wait for anything another thread
// would do. errno is saved across all of them and restored (glibc reports a failed fork
// through errno after the parent handlers ran). spawn_self and spawn_detached use
// posix_spawn, which runs no handler (os/child.h says why).
#pragma once

#include "shmtensor/export.h"

namespace shmtensor::internal {

// The order, and why:
//  1. kManagerClient. Its prepare may connect to the manager daemon, or start one, to
//     announce the fork: I/O that can take seconds. It runs before the memory layer takes
//     its locks, so that threads allocating or freeing shared memory are not stopped
//     behind it. It is also the order the rest of the library keeps: the manager client's
//     lock is never held while a memory lock is taken (arena.cc creates segments outside
//     its lock for this reason), so taking it first cannot deadlock.
//  2. kMemory. Locks the arena, then the registry (that layer's lock order), and adds the
//     child's count of every block and named segment this process holds; the child turns
//     them into holds of its own (registry.cc).
//  3. kQueues. Claims a holder slot for the child in every live queue, so that no holder
//     can drain a queue between fork and the child's start. Its lock and the memory
//     layer's are never held together, so its place is free; it comes after them as the
//     higher layer.
//  4. kHangupWatch (transport/hangup_watch.h). Takes the watch's lock, so that a child
//     copies its table whole, and the child closes the fds of its parent's watch thread.
//     The watch's lock is held with no other (its thread wakes futex sleepers under it).
//  5. kTorchCache (src/torch/torch_storage.cc, in libshmtensor_torch). Takes the torch
//     bridge's two locks (share, then cache), so that a child never inherits them locked.
//     No lock of the library below is taken while they are held, so their place is free;
//     the bridge is the layer above all others, and is loaded after the library.
//  6. kCudaDriver (cuda/driver.cc). A child handler only: the child knows it was forked
//     (and whether CUDA was loaded before the fork, which CUDA does not survive).
//  7. kForkGeneration (os/proc.h). A child handler only: the child counts one generation
//     more than its parent. Last, so that its child handler is the first: every other
//     child handler sees the child's own generation.
// After a fork, then: parent handlers from kTorchCache down to kManagerClient, and child
// handlers from kForkGeneration down to kManagerClient.
enum class ForkStage : int {
  kManagerClient,
  kMemory,
  kQueues,
  kHangupWatch,
  kTorchCache,
  kCudaDriver,
  kForkGeneration
};
inline constexpr int kForkStageCount = static_cast<int>(ForkStage::kForkGeneration) + 1;

struct ForkHandlers {
  void (*prepare)() noexcept = nullptr;
  // fork_failed: fork() returned -1 (no child exists; counts added for it go back).
  void (*parent)(bool fork_failed) noexcept = nullptr;
  void (*child)() noexcept = nullptr;
};

// Installs `handlers` (static storage: the pointer is kept) for `stage`, replacing what was
// there. The first call registers the one pthread_atfork. Thread-safe; never throws.
SHMTENSOR_API void install_fork_handlers(ForkStage stage, const ForkHandlers* handlers) noexcept;

}  // namespace shmtensor::internal
