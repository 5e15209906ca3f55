#include "os/shm_list.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>

#include "os/syscall.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

std::vector<ShmEntry> list_shm(const std::string& prefix, uid_t uid) {
  std::vector<ShmEntry> out;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/dev/shm"), ::closedir);
  DIR* d = dir.get();
  if (d == nullptr) {
    if (errno == ENOENT) return out;
    throw_system_error(errno, "opendir", "/dev/shm");
  }
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(st.st_mode) || st.st_uid != uid) continue;
    out.push_back({"/" + n, static_cast<std::uint64_t>(st.st_size), st.st_uid,
                   static_cast<std::int64_t>(st.st_mtim.tv_sec)});
  }
  std::sort(out.begin(), out.end(),
            [](const ShmEntry& a, const ShmEntry& b) { return a.name < b.name; });
  return out;
}

long peek_shm(const std::string& name, void* buf, std::size_t n, std::uint64_t* size) noexcept {
  UniqueFd fd(::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd) return -1;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return -1;
  *size = static_cast<std::uint64_t>(st.st_size);
  ssize_t r = retry_eintr([&] { return ::pread(fd.get(), buf, n, 0); });
  return r < 0 ? -1 : static_cast<long>(r);
}

std::uint64_t dev_shm_device() noexcept {
  struct stat st {};
  if (::stat("/dev/shm", &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_dev);
}

}  // namespace shmtensor::internal
