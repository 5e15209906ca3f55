// What /proc says about other processes: whether one lives (a zombie does not), when it
// started (to tell it from a recycled pid), and which of them map which /dev/shm names.
// Also pidfds, which let a poll loop learn of a process's exit at once.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "os/unique_fd.h"

namespace shmtensor::internal {

struct ProcessStatus {
  bool exists = false;           // /proc/<pid> exists and is not a zombie (exited, not yet reaped)
  std::uint64_t start_time = 0;  // field 22 of /proc/<pid>/stat
  pid_t parent = 0;
  pid_t process_group = 0;
};
ProcessStatus read_process_status(pid_t pid) noexcept;

// A process identified across pid reuse.
struct ProcessId {
  pid_t pid = 0;
  std::uint64_t start_time = 0;
  friend bool operator==(const ProcessId&, const ProcessId&) = default;
};
// The live process `pid` (start_time 0 when it does not exist or is a zombie).
ProcessId identify_process(pid_t pid) noexcept;
// True when pid lives, is not a zombie, and started at id.start_time.
bool is_alive(const ProcessId& id) noexcept;

// Maps each /dev/shm name starting with `prefix` (e.g. "shmtensor_") that some process maps
// to the processes that map it, from /proc/<pid>/maps of every process this process may
// read (all, for root; else those of its uid), except `exclude`. A process that exits or
// cannot be read during the scan is skipped. Names are returned with a leading '/', as
// shm_open spells them ("/shmtensor_1_ab_0").
std::unordered_map<std::string, std::vector<ProcessId>> scan_shm_mappers(const std::string& prefix,
                                                                         pid_t exclude);

// True when process `pid` maps the /dev/shm object `name` ("/shmtensor_..."), from its
// /proc/<pid>/maps. False when it does not, or cannot be read.
bool process_maps_shm(pid_t pid, const std::string& name);

// True when process `pid` maps the file with this device and inode (as fstat gives them),
// from its /proc/<pid>/maps. False when it does not, or cannot be read.
bool process_maps_file(pid_t pid, std::uint64_t device, std::uint64_t inode);

// True while some process (a zombie included) is in process group `pgid`: kill(-pgid, 0).
bool process_group_exists(pid_t pgid) noexcept;

// pidfd_open(pid): readable (POLLIN) once the process has exited. Invalid when the kernel
// has no pidfds (before 5.3) or the process is gone; *unsupported says which.
UniqueFd open_pidfd(pid_t pid, bool* unsupported) noexcept;

// geteuid().
uid_t effective_uid() noexcept;
// getpid() (not cached by glibc; async-signal-safe).
pid_t own_pid() noexcept;
// getpgrp().
pid_t own_process_group() noexcept;

}  // namespace shmtensor::internal
