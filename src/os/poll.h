// Waiting for input on several fds at once (sockets, pipes, pidfds, eventfds, signalfds).
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

}  // namespace shmtensor::internal
