// Watching and ending groups of children: polling several at once, waiting on all their
// pidfds and report pipes in one poll(), and the SIGTERM-then-SIGKILL sequence used when a
// spawn fails and when Process / ProcessContext are destroyed.
#pragma once

#include <chrono>
#include <optional>
#include <span>
#include <vector>

#include "shmtensor/process.h"

namespace shmtensor::internal {

using Clock = std::chrono::steady_clock;

// Polls every started process once (draining report pipes, reaping); returns the indices
// of those that were found ended by this call, in index order.
std::vector<std::size_t> poll_processes(std::span<Process> processes);
// True when every started process has ended.
bool all_ended(std::span<Process> processes) noexcept;
// Blocks until a running process has something to report (ended, or text on its pipe) or
// `deadline` passes. Spurious returns are fine: callers poll again.
void wait_any(std::span<Process> processes, std::optional<Clock::time_point> deadline);

// SIGTERM to each running process (with the line "Terminating process <pid> via signal
// SIGTERM" on stderr when `warn`), wait up to `grace`, then SIGKILL those still running
// (warned the same way) and reap all.
void terminate_processes(std::span<Process> processes, Clock::duration grace, bool warn);

// What destructors do: wait for non-daemon children, terminate daemon ones (5 s grace),
// reap everything. Never throws.
void shutdown_processes(std::span<Process> processes) noexcept;

}  // namespace shmtensor::internal
