// Shared-memory objects: memfd (file_descriptor strategy) and named POSIX shm
// (file_system strategy), plus the facts a receiver checks before mapping a peer's fd.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// memfd_create(MFD_CLOEXEC|MFD_ALLOW_SEALING), sized to `size`, then sealed with
// F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL so no holder can make another one SIGBUS.
// The pages are not reserved: tmpfs-backed memfds are not bound by /dev/shm's size.
UniqueFd create_sealed_memfd(std::size_t size);

// The byte ranges [first, second) of [from, to) where the file behind `fd` holds data
// (lseek SEEK_DATA / SEEK_HOLE; pages swapped out count as data), sorted. A hole reads as
// zeros and holds no memory; looking at it through a mapping of a tmpfs file would
// allocate its pages. Where the file system cannot tell (an error), the whole range.
// Moves the open file description's offset (nothing of ours reads these files by offset).
// Throws std::bad_alloc only.
std::vector<std::pair<std::size_t, std::size_t>> data_extents(int fd, std::size_t from,
                                                               std::size_t to);

struct FdFacts {
  std::size_t size = 0;
  bool sealed_against_resize = false;  // F_SEAL_SHRINK and F_SEAL_GROW are set
  std::uint64_t device = 0;            // st_dev and st_ino: what /proc/<pid>/maps shows
  std::uint64_t inode = 0;
};
// fstat + F_GET_SEALS. Throws SystemError.
FdFacts inspect_fd(int fd);

// shm_open(name, O_CREAT|O_EXCL|O_RDWR|O_CLOEXEC, 0600), then posix_fallocate of `size`
// so that a full /dev/shm is an error now (SharedMemoryFullError naming the size, the free
// space and the fix), never a SIGBUS later. A size above the free space of a /dev/shm that
// is a tmpfs with a size limit is refused before shm_open (the fallocate would first take
// all that is free). On failure nothing is left behind.
UniqueFd create_named_shm(const std::string& name, std::size_t size);
// shm_open(name, O_RDWR|O_CLOEXEC). Throws SystemError (ENOENT when it is gone).
UniqueFd open_named_shm(const std::string& name);
// shm_unlink; returns false if it was already gone.
bool unlink_named_shm(const std::string& name) noexcept;

// Free and total bytes of the filesystem behind /dev/shm.
struct ShmSpace {
  std::uint64_t total = 0;
  std::uint64_t free = 0;
};
ShmSpace dev_shm_space();
// The same where /dev/shm is a tmpfs with a size limit (Docker's 64 MB, --shm-size); nullopt
// otherwise: another filesystem, a tmpfs mounted with size=0 (no limit), or statfs failed.
std::optional<ShmSpace> dev_shm_limit() noexcept;

// "1.5 MiB": a size for messages to people (B, KiB, MiB, GiB, TiB; one decimal).
std::string human_bytes(std::uint64_t n);

// 64 random bits from getrandom.
std::uint64_t random_u64();

}  // namespace shmtensor::internal
