// Listing and peeking at named POSIX shm objects (/dev/shm) without mapping them, for the
// manager's sweeps and `shmtensor ls | gc`.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shmtensor::internal {

struct ShmEntry {
  std::string name;  // with the leading '/', as shm_open spells it
  std::uint64_t size = 0;
  uid_t uid = 0;
  std::int64_t mtime = 0;  // seconds since the epoch
};
// Regular files in /dev/shm whose name starts with `prefix` (without '/'), sorted by name.
// Only those owned by `uid`.
std::vector<ShmEntry> list_shm(const std::string& prefix, uid_t uid);

// Reads the first `n` bytes of the named object into buf with pread (no mapping, so the
// reader does not show up as a holder in /proc/<pid>/maps). Returns the bytes read, or -1
// when the name does not exist or cannot be opened; *size gets the object's size.
long peek_shm(const std::string& name, void* buf, std::size_t n, std::uint64_t* size) noexcept;

// st_dev of /dev/shm (0 if it is missing): which tmpfs the names live in. Processes in
// different mount namespaces may see different ones.
std::uint64_t dev_shm_device() noexcept;

}  // namespace shmtensor::internal
