// Waiting for fds: for input on several at once (sockets, pipes, pidfds, eventfds,
// signalfds), or for room to write on one.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <vector>

namespace shmtensor::internal {

// Waits until one of `fds` is readable or hung up (POLLIN, POLLHUP, POLLERR), or `timeout`
// passes (nullopt: no limit; rounded up to whole milliseconds). Entries below 0 are skipped.
// Returns the indices of the ready fds, empty on timeout. EINTR is retried with the time
// left. Throws SystemError.
std::vector<std::size_t> wait_readable(std::span<const int> fds,
                                       std::optional<std::chrono::nanoseconds> timeout);

// Waits until `fd` is writable (POLLOUT; or POLLHUP/POLLERR, which the next write
// reports), or `timeout` passes. False on timeout. For a unix datagram socket, writable
// means its send buffer is at most a quarter full. EINTR is retried with the time left.
// Throws SystemError.
bool wait_writable(int fd, std::optional<std::chrono::nanoseconds> timeout);

// Whether `fd` is hung up or in error now (POLLHUP or POLLERR; a socket whose peer end's
// last copy closed): poll() without waiting, EINTR retried. False when poll fails. Never
// throws.
bool hung_up_now(int fd) noexcept;

}  // namespace shmtensor::internal
