// A wake-up fd: one thread signals, another thread's poll() on it returns. Used by the
// Pool's dispatcher thread to hear about new tasks while it waits on worker sockets.
#pragma once

#include "os/unique_fd.h"

namespace shmtensor::internal {

// eventfd(EFD_CLOEXEC | EFD_NONBLOCK). Throws SystemError.
UniqueFd make_event_fd();
// Adds 1 (never blocks: the counter cannot realistically overflow). Never throws.
void signal_event_fd(int fd) noexcept;
// Resets the counter to 0. Never throws.
void drain_event_fd(int fd) noexcept;

}  // namespace shmtensor::internal
