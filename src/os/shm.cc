#include "os/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <string>

#include "os/syscall.h"

namespace shmtensor::internal {

// Integer arithmetic, no iostream and no locale: formatting a double through
// std::ostringstream here crashed (SIGSEGV in libstdc++'s locale code) inside a pip torch
// 2.11 process on Ubuntu 24.04, the library built there with GCC 13; the cause was not
// pinned down further. Rounds to the nearest tenth, halves up.
std::string human_bytes(std::uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  std::uint64_t unit = 1;  // at most 2^40
  while (u < 4 && n / unit >= 1024) {
    unit *= 1024;
    ++u;
  }
  if (u == 0) return std::to_string(n) + " B";
  const std::uint64_t tenths = n / unit * 10 + (n % unit * 10 + unit / 2) / unit;
  return std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + " " + units[u];
}

UniqueFd create_sealed_memfd(std::size_t size) {
  UniqueFd fd(check_syscall("memfd_create", "size=" + std::to_string(size), [&] {
    return ::memfd_create("shmtensor", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  }));
  check_syscall("ftruncate", "memfd, size=" + std::to_string(size),
                [&] { return ::ftruncate(fd.get(), static_cast<off_t>(size)); });
  // F_SEAL_SEAL too: nobody (us included) can later add F_SEAL_WRITE or remove these.
  check_syscall("fcntl", "F_ADD_SEALS", [&] {
    return ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  });
  return fd;
}

std::vector<std::pair<std::size_t, std::size_t>> data_extents(int fd, std::size_t from,
                                                               std::size_t to) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t at = from; at < to;) {
    const off_t data = ::lseek(fd, static_cast<off_t>(at), SEEK_DATA);
    if (data < 0 && errno == ENXIO) break;  // no data from `at` on
    const off_t hole = data < 0 ? -1 : ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0) return {{from, to}};  // the file system cannot tell
    if (static_cast<std::size_t>(data) >= to) break;
    const std::size_t end = std::min(static_cast<std::size_t>(hole), to);
    out.emplace_back(static_cast<std::size_t>(data), end);
    at = end;
  }
  return out;
}

FdFacts inspect_fd(int fd) {
  struct stat st {};
  check_syscall("fstat", "received fd", [&] { return ::fstat(fd, &st); });
  FdFacts facts;
  facts.size = static_cast<std::size_t>(st.st_size);
  facts.device = st.st_dev;
  facts.inode = st.st_ino;
  int seals = ::fcntl(fd, F_GET_SEALS);
  facts.sealed_against_resize =
      seals != -1 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW);
  return facts;
}

ShmSpace dev_shm_space() {
  struct statvfs vfs {};
  check_syscall("statvfs", "/dev/shm", [&] { return ::statvfs("/dev/shm", &vfs); });
  return {static_cast<std::uint64_t>(vfs.f_blocks) * vfs.f_frsize,
          static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize};
}

namespace {

[[noreturn]] void throw_dev_shm_full(std::size_t size, const ShmSpace& space) {
  throw SharedMemoryFullError(
      "/dev/shm is too small for a file_system segment: asked for " + human_bytes(size) + " (" +
          std::to_string(size) + " bytes), " + human_bytes(space.free) + " free of " +
          human_bytes(space.total) +
          ". Fix: enlarge /dev/shm (docker run --shm-size=8g, or mount -o "
          "remount,size=8G /dev/shm), or call set_sharing_strategy(\"file_descriptor\"), "
          "whose memfd segments are not limited by /dev/shm",
      size, space.free);
}

}  // namespace

// A tmpfs mounted with size=0 has no limit and reports 0 blocks, and another filesystem
// may keep blocks for root that f_bavail leaves out: neither is a limit to go by.
std::optional<ShmSpace> dev_shm_limit() noexcept {
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC || fs.f_blocks == 0)
    return std::nullopt;
  const auto block = static_cast<std::uint64_t>(fs.f_bsize);
  return ShmSpace{static_cast<std::uint64_t>(fs.f_blocks) * block,
                  static_cast<std::uint64_t>(fs.f_bavail) * block};
}

UniqueFd create_named_shm(const std::string& name, std::size_t size) {
  // More than a limited tmpfs has free fails at once: posix_fallocate would take all that
  // is free (pages of RAM) before it fails, pressing every process of the machine for
  // memory meanwhile. The fallocate stays the authority (the space may go in between).
  if (auto space = dev_shm_limit(); space && size > space->free)
    throw_dev_shm_full(size, *space);
  UniqueFd fd(check_syscall("shm_open", name + ", O_CREAT|O_EXCL", [&] {
    return ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  }));
  // posix_fallocate returns the error instead of setting errno, and retries EINTR itself
  // only partially, so loop here.
  int rc;
  do {
    rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(size));
  } while (rc == EINTR);
  if (rc != 0) {
    ::shm_unlink(name.c_str());
    if (rc == ENOSPC || rc == EFBIG) {
      ShmSpace space{};
      try {
        space = dev_shm_space();
      } catch (const SystemError&) {
      }
      throw_dev_shm_full(size, space);
    }
    throw_system_error(rc, "posix_fallocate", name + ", size=" + std::to_string(size));
  }
  return fd;
}

UniqueFd open_named_shm(const std::string& name) {
  return UniqueFd(check_syscall(
      "shm_open", name, [&] { return ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600); }));
}

bool unlink_named_shm(const std::string& name) noexcept { return ::shm_unlink(name.c_str()) == 0; }

std::uint64_t random_u64() {
  std::uint64_t v = 0;
  check_syscall("getrandom", "8 bytes",
                [&] { return static_cast<int>(::getrandom(&v, sizeof v, 0)); });
  return v;
}

}  // namespace shmtensor::internal
