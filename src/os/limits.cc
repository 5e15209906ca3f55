#include "os/limits.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "os/proc.h"
#include "os/unique_fd.h"

namespace shmtensor::internal {

namespace {

std::optional<std::uint64_t> read_number(const char* path) {
  std::ifstream in(path);
  std::uint64_t v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

// "always within_size advise [never] deny force" -> "never".
std::string selected_value(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return {};
  auto open = line.find('[');
  auto close = line.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return line;
  return line.substr(open + 1, close - open - 1);
}

std::uint64_t rlim_value(rlim_t v) {
  return v == RLIM_INFINITY ? UINT64_MAX : static_cast<std::uint64_t>(v);
}

}  // namespace

SystemLimits read_system_limits() {
  SystemLimits l;
  utsname u{};
  if (::uname(&u) == 0) {
    l.kernel_release = u.release;
    l.kernel_version = u.version;
  }
  if (UniqueFd fd(::memfd_create("shmtensor-doctor", MFD_CLOEXEC | MFD_ALLOW_SEALING)); fd) {
    l.memfd = true;
    l.memfd_sealing = ::ftruncate(fd.get(), 4096) == 0 &&
                      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0;
  } else {
    l.memfd = UniqueFd(::memfd_create("shmtensor-doctor", MFD_CLOEXEC)).valid();
  }
  bool no_pidfds = false;
  l.pidfd = open_pidfd(own_pid(), &no_pidfds).valid();
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) == 0) {
    l.dev_shm_total = static_cast<std::uint64_t>(vfs.f_blocks) * vfs.f_frsize;
    l.dev_shm_free = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  l.max_map_count = read_number("/proc/sys/vm/max_map_count");
  {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    std::uint64_t n = 0;
    while (std::getline(maps, line)) ++n;
    if (n > 0) l.map_count = n;
  }
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    l.nofile_soft = rlim_value(rl.rlim_cur);
    l.nofile_hard = rlim_value(rl.rlim_max);
  }
  l.thp_shmem = selected_value("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  {
    std::ifstream mi("/proc/meminfo");
    std::string key;
    std::uint64_t kib = 0;
    std::string unit;
    while (mi >> key >> kib >> unit) {
      if (key == "MemTotal:") {
        l.mem_total = kib * 1024;
        break;
      }
    }
  }
  return l;
}

std::uint64_t raise_open_files_limit() noexcept {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur != rl.rlim_max) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  return rlim_value(rl.rlim_cur);
}

std::uint64_t open_files_soft_limit() noexcept {
  rlimit rl{};
  return ::getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rlim_value(rl.rlim_cur) : 0;
}

}  // namespace shmtensor::internal
