// The machine's limits that matter for sharing memory between processes, as read from the
// kernel (for `shmtensor doctor`). Each reader reports what it could not read instead of
// throwing.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace shmtensor::internal {

struct SystemLimits {
  std::string kernel_release;                  // uname -r
  std::string kernel_version;                  // uname -v
  bool memfd = false;                          // memfd_create works
  bool memfd_sealing = false;                  // MFD_ALLOW_SEALING + F_ADD_SEALS work
  bool pidfd = false;                          // pidfd_open works (kernel >= 5.3)
  std::optional<std::uint64_t> dev_shm_total;  // bytes; nullopt if /dev/shm is missing
  std::optional<std::uint64_t> dev_shm_free;
  std::optional<std::uint64_t> max_map_count;  // /proc/sys/vm/max_map_count
  std::optional<std::uint64_t> map_count;      // mappings of this process now
  std::uint64_t nofile_soft = 0;               // RLIMIT_NOFILE; UINT64_MAX = unlimited
  std::uint64_t nofile_hard = 0;
  std::string thp_shmem;  // the selected value of .../transparent_hugepage/shmem_enabled, or ""
  std::optional<std::uint64_t> mem_total;  // bytes, from /proc/meminfo
};

SystemLimits read_system_limits();

// The soft RLIMIT_NOFILE alone (UINT64_MAX: unlimited): one system call and no file, for a
// process that may be at that limit (read_system_limits opens files and pidfds).
std::uint64_t open_files_soft_limit() noexcept;

// Raises this process's soft RLIMIT_NOFILE to its hard limit (what a process may do without
// privileges) and returns the soft limit in force afterwards; UINT64_MAX = unlimited. A
// failure leaves the limit as it was. For the manager daemon, which holds the fds of every
// named channel and kept pickle of its user.
std::uint64_t raise_open_files_limit() noexcept;

}  // namespace shmtensor::internal
