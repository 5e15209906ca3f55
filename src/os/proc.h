// Facts about processes: ids, start times (to tell a live pid from a recycled one).
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace shmtensor::internal {

pid_t current_pid() noexcept;
// Field 22 of /proc/<pid>/stat (clock ticks since boot); 0 if the process does not exist
// or is a zombie (exited and not yet reaped: it maps and holds nothing any more).
std::uint64_t process_start_time(pid_t pid) noexcept;
// True when `pid` is alive and started at `start_time` (so it is not a recycled pid).
bool process_matches(pid_t pid, std::uint64_t start_time) noexcept;

}  // namespace shmtensor::internal
