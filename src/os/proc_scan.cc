#include "os/proc_scan.h"

#include <sys/sysmacros.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "os/syscall.h"

namespace shmtensor::internal {

namespace {

// Reads a whole (small or large) /proc file into `out`. False if it cannot be opened.
bool read_proc_file(int dir_fd, const char* path, std::string& out) {
  UniqueFd fd(::openat(dir_fd, path, O_RDONLY | O_CLOEXEC));
  if (!fd) return false;
  out.clear();
  char buf[65536];
  for (;;) {
    ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf, sizeof buf); });
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return true;
}

bool parse_pid(const char* s, pid_t* pid) {
  if (*s < '1' || *s > '9') return false;
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (*end != '\0' || v <= 0) return false;
  *pid = static_cast<pid_t>(v);
  return true;
}

}  // namespace

std::unordered_map<std::string, std::vector<ProcessId>> scan_shm_mappers(const std::string& prefix,
                                                                         pid_t exclude) {
  std::unordered_map<std::string, std::vector<ProcessId>> out;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/proc"), ::closedir);
  if (!dir) throw_system_error(errno, "opendir", "/proc");
  DIR* proc = dir.get();
  const uid_t me = effective_uid();
  const std::string needle = "/dev/shm/" + prefix;
  std::string maps;
  char path[64];
  while (dirent* e = ::readdir(proc)) {
    pid_t pid = 0;
    if (!parse_pid(e->d_name, &pid) || pid == exclude) continue;
    struct stat st {};
    if (::fstatat(::dirfd(proc), e->d_name, &st, 0) != 0) continue;
    if (me != 0 && st.st_uid != me) continue;
    std::snprintf(path, sizeof path, "%d/maps", static_cast<int>(pid));
    if (!read_proc_file(::dirfd(proc), path, maps)) continue;
    ProcessId id{};
    std::string last;
    for (std::size_t pos = maps.find(needle); pos != std::string::npos;
         pos = maps.find(needle, pos + 1)) {
      std::size_t begin = pos + sizeof("/dev/shm") - 1;  // keep the '/'
      std::size_t end = maps.find('\n', begin);
      if (end == std::string::npos) end = maps.size();
      std::string name = maps.substr(begin, end - begin);
      static constexpr char kDeleted[] = " (deleted)";
      if (name.size() > sizeof kDeleted - 1 &&
          name.compare(name.size() - (sizeof kDeleted - 1), std::string::npos, kDeleted) == 0)
        name.resize(name.size() - (sizeof kDeleted - 1));
      if (name == last) continue;  // one segment is often several adjacent lines
      last = name;
      if (id.pid == 0) {
        id = identify_process(pid);
        if (id.start_time == 0) break;  // exited meanwhile
      }
      auto& pids = out[name];
      if (pids.empty() || !(pids.back() == id)) pids.push_back(id);
    }
  }
  return out;
}

bool process_maps_shm(pid_t pid, const std::string& name) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/maps", static_cast<int>(pid));
  std::string maps;
  if (!read_proc_file(AT_FDCWD, path, maps)) return false;
  const std::string needle = "/dev/shm" + name;
  for (std::size_t pos = maps.find(needle); pos != std::string::npos;
       pos = maps.find(needle, pos + 1)) {
    char after = pos + needle.size() < maps.size() ? maps[pos + needle.size()] : '\n';
    if (after == '\n' || after == ' ') return true;  // not a longer name with this prefix
  }
  return false;
}

bool process_maps_file(pid_t pid, std::uint64_t device, std::uint64_t inode) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/maps", static_cast<int>(pid));
  std::string maps;
  if (!read_proc_file(AT_FDCWD, path, maps)) return false;
  // "start-end perms offset MAJ:MIN inode path": the kernel prints major and minor in hex.
  char want[64];
  std::snprintf(want, sizeof want, " %02x:%02x %llu ", major(static_cast<dev_t>(device)),
                minor(static_cast<dev_t>(device)), static_cast<unsigned long long>(inode));
  return maps.find(want) != std::string::npos;
}

}  // namespace shmtensor::internal
