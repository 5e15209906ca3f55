// A wake-up fd: one thread or process signals, another's poll() (or epoll) on it returns.
// The Pool's dispatcher thread hears about new tasks through one, the manager client's
// watch thread is stopped through one, and a Connection or Queue says through one that it
// has a message (its readiness fd).
#pragma once

#include <string>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// eventfd(EFD_CLOEXEC | EFD_NONBLOCK). Throws SystemError("eventfd", context, advice).
UniqueFd make_event_fd(const std::string& context = "EFD_CLOEXEC|EFD_NONBLOCK",
                       const std::string& advice = {});
// The same, never throwing: invalid (errno set) when no fd could be had.
UniqueFd try_make_event_fd() noexcept;
// Adds 1 (never blocks: a full counter, 2^64 - 2 signals nobody read, is readable all the
// same, so EAGAIN changes nothing). Never throws.
void signal_event_fd(int fd) noexcept;
// Resets the counter to 0. Never throws.
void drain_event_fd(int fd) noexcept;

// For a readiness fd received from a peer: throws ProtocolError unless `fd` is an eventfd
// ("received <what> fd is not an eventfd") and non-blocking ("received <what> eventfd is
// not non-blocking": a flag of the open file that every holder shares, and a receiver that
// clears it must not wait in read()). `what` names it, e.g. "queue readiness".
void require_event_fd(int fd, const std::string& what);

}  // namespace shmtensor::internal
