#include "os/proc.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "os/fork_handlers.h"
#include "os/syscall.h"

namespace shmtensor::internal {

namespace {

ProcessStatus parse_stat(const char* buf) {
  ProcessStatus st;
  // The command name (field 2) may hold spaces and ')'; fields resume after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return st;
  char state = p[2];
  if (state == 'Z' || state == 'X' || state == 'x') return st;  // exited, not reaped
  st.stopped = state == 'T' || state == 't';
  int field = 2;
  for (++p; *p != '\0'; ++p) {
    if (*p != ' ') continue;
    ++field;
    if (field == 4) st.parent = static_cast<pid_t>(std::strtol(p + 1, nullptr, 10));
    if (field == 5) st.process_group = static_cast<pid_t>(std::strtol(p + 1, nullptr, 10));
    if (field == 22) {
      st.start_time = std::strtoull(p + 1, nullptr, 10);
      st.exists = true;
      break;
    }
  }
  return st;
}

std::uint64_t start_time_of(pid_t pid) noexcept { return read_process_status(pid).start_time; }

}  // namespace

pid_t own_pid() noexcept { return ::getpid(); }

namespace {
std::atomic<std::uint32_t> g_fork_generation{1};
void count_generation() noexcept { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
constexpr ForkHandlers kForkGenerationHandlers{nullptr, nullptr, count_generation};
// Installed when the library is loaded: every forked child counts one generation more
// than its parent.
[[maybe_unused]] const bool kForkGenerationInstalled = [] {
  install_fork_handlers(ForkStage::kForkGeneration, &kForkGenerationHandlers);
  return true;
}();
}  // namespace

std::uint32_t fork_generation() noexcept {
  return g_fork_generation.load(std::memory_order_relaxed);
}

pid_t own_process_group() noexcept { return ::getpgrp(); }
uid_t effective_uid() noexcept { return ::geteuid(); }

ProcessStatus read_process_status(pid_t pid) noexcept {
  if (pid <= 0) return {};
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  // Gone: ENOENT (no such pid) or ESRCH (it exited while we read). Any other failure says
  // nothing about the process.
  auto failed = [] {
    ProcessStatus st;
    st.unknown = errno != ENOENT && errno != ESRCH;
    return st;
  };
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd) return failed();
  char buf[1024];
  ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf, sizeof buf - 1); });
  if (n < 0) return failed();
  if (n == 0) return {};
  buf[n] = '\0';
  return parse_stat(buf);
}

ProcessId identify_process(pid_t pid) noexcept { return {pid, start_time_of(pid)}; }

ProcessId own_process_id() noexcept {
  // A forked child finds its parent's pid here and reads its own start time. A reader that
  // sees a pid (acquire) sees the start time stored before it; two threads that both miss
  // store the same value.
  static std::atomic<pid_t> cached_pid{0};
  static std::atomic<std::uint64_t> cached_start{0};
  const pid_t pid = own_pid();
  if (cached_pid.load(std::memory_order_acquire) != pid) {
    cached_start.store(start_time_of(pid), std::memory_order_relaxed);
    cached_pid.store(pid, std::memory_order_release);
  }
  return {pid, cached_start.load(std::memory_order_relaxed)};
}

bool is_alive(const ProcessId& id) noexcept {
  if (id.pid <= 0 || id.start_time == 0) return false;
  ProcessStatus st = read_process_status(id.pid);
  return st.unknown || (st.exists && st.start_time == id.start_time);
}

std::uint64_t current_slot_owner() noexcept {
  const ProcessId me = own_process_id();
  return slot_owner(me.pid, me.start_time);
}

bool slot_owner_alive(std::uint64_t owner) noexcept {
  const auto pid = static_cast<pid_t>(owner >> 32);
  if (pid <= 0) return false;
  const ProcessStatus st = read_process_status(pid);
  return st.unknown ||
         (st.start_time != 0 && (st.start_time & 0xffffffffu) == (owner & 0xffffffffu));
}

bool process_group_exists(pid_t pgid) noexcept {
  if (pgid <= 0) return false;
  // EPERM: it exists but belongs to someone else.
  return ::kill(-pgid, 0) == 0 || errno == EPERM;
}

std::string fd_target(int fd) {
  char path[40];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  char target[256];
  const ssize_t n = ::readlink(path, target, sizeof target);
  if (n <= 0) return {};
  return std::string(target, static_cast<std::size_t>(n));
}

bool has_fd_linking_to(const std::string& path) noexcept {
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    std::error_code link_ec;
    if (std::filesystem::read_symlink(it->path(), link_ec) == path) return true;
  }
  return false;
}

UniqueFd open_pidfd(pid_t pid, bool* unsupported) noexcept {
  *unsupported = false;
  // No glibc wrapper before 2.36. pidfds are always close-on-exec.
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) return UniqueFd(static_cast<int>(fd));
  // EPERM / EACCES: refused by a seccomp profile (old container runtimes): as missing.
  *unsupported = errno == ENOSYS || errno == EPERM || errno == EACCES;
  return UniqueFd();
}

}  // namespace shmtensor::internal
