#include "os/proc.h"

#include <unistd.h>

#include "os/proc_scan.h"

namespace shmtensor::internal {

pid_t current_pid() noexcept { return ::getpid(); }

std::uint64_t process_start_time(pid_t pid) noexcept {
  // A zombie (exited, not yet reaped) has released its memory and fds: it holds nothing,
  // so it counts as gone here, as it does for the manager (read_process_status).
  const ProcessStatus st = read_process_status(pid);
  return st.exists ? st.start_time : 0;
}

bool process_matches(pid_t pid, std::uint64_t start_time) noexcept {
  if (pid <= 0) return false;
  std::uint64_t now = process_start_time(pid);
  return now != 0 && now == start_time;
}

}  // namespace shmtensor::internal
