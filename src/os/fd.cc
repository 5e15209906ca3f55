#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "os/mapping.h"
#include "os/syscall.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

void UniqueFd::reset(int fd) noexcept {
  // close() is not retried: on Linux the fd is released even when EINTR is returned.
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

UniqueFd dup_cloexec(int fd) {
  return UniqueFd(check_syscall("fcntl", "F_DUPFD_CLOEXEC", [&] {
    return ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  }));
}

FileKind file_kind(int fd) noexcept {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return FileKind::kUnknown;
  if (S_ISREG(st.st_mode)) return FileKind::kRegular;
  if (S_ISFIFO(st.st_mode)) return FileKind::kFifo;
  if (S_ISSOCK(st.st_mode)) return FileKind::kSocket;
  if (S_ISDIR(st.st_mode)) return FileKind::kDirectory;
  return FileKind::kOther;
}

Mapping Mapping::map_shared(int fd, std::size_t size, const char* what) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw_system_error(err, "mmap",
                       std::string(what) + ", size=" + std::to_string(size),
                       err == ENOMEM ? "too many mappings or too little memory: see "
                                       "vm.max_map_count and free memory (`shmtensor doctor`)"
                                     : "");
  }
  return Mapping(p, size);
}

Mapping Mapping::map_anonymous_shared(std::size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_system_error(errno, "mmap", "anonymous shared, size=" +
                                                             std::to_string(size));
  return Mapping(p, size);
}

void Mapping::reset() noexcept {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  addr_ = nullptr;
  size_ = 0;
}

}  // namespace shmtensor::internal
