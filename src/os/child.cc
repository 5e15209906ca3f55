#include "os/child.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "os/proc.h"
#include "os/syscall.h"

extern char** environ;  // NOLINT: POSIX global

namespace shmtensor::internal {

namespace {

int decode_status(int status) noexcept {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return 255;
}

}  // namespace

ChildProcess::ChildProcess(pid_t pid) : pid_(pid) {
  // Without a pidfd (kernel < 5.3, or refused by a seccomp profile) callers poll: correct,
  // but a dead child is noticed after a short interval instead of at once.
  bool unsupported = false;
  pidfd_ = open_pidfd(pid, &unsupported);
  if (!pidfd_ && !unsupported) {
    const int err = errno;
    kill_and_reap();
    throw_system_error(err, "pidfd_open", "pid=" + std::to_string(pid));
  }
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    kill_and_reap();
    pid_ = std::exchange(o.pid_, -1);
    pidfd_ = std::move(o.pidfd_);
    exitcode_ = std::exchange(o.exitcode_, std::nullopt);
  }
  return *this;
}

std::optional<int> ChildProcess::poll() {
  if (pid_ <= 0 || exitcode_) return exitcode_;
  int status = 0;
  pid_t rc = retry_eintr([&] { return ::waitpid(pid_, &status, WNOHANG); });
  if (rc == 0) return std::nullopt;
  if (rc == -1) {
    // ECHILD: someone else reaped it (SIGCHLD set to SIG_IGN, or a waitpid(-1) elsewhere);
    // its status is lost. Report it as a failure rather than hang or throw here.
    if (errno != ECHILD) throw_system_error(errno, "waitpid", "pid=" + std::to_string(pid_));
    exitcode_ = 255;
  } else {
    exitcode_ = decode_status(status);
  }
  pidfd_.reset();
  return exitcode_;
}

int ChildProcess::wait() {
  if (pid_ <= 0) return 255;
  if (exitcode_) return *exitcode_;
  int status = 0;
  pid_t rc = retry_eintr([&] { return ::waitpid(pid_, &status, 0); });
  if (rc == -1) {
    if (errno != ECHILD) throw_system_error(errno, "waitpid", "pid=" + std::to_string(pid_));
    exitcode_ = 255;
  } else {
    exitcode_ = decode_status(status);
  }
  pidfd_.reset();
  return *exitcode_;
}

bool ChildProcess::send_signal(int sig) noexcept {
  if (pid_ <= 0 || exitcode_) return false;
  // Safe against pid reuse: an unreaped child (even a zombie) keeps its pid.
  return ::kill(pid_, sig) == 0;
}

bool ChildProcess::terminate() noexcept { return send_signal(SIGTERM); }
bool ChildProcess::kill() noexcept { return send_signal(SIGKILL); }

void ChildProcess::kill_and_reap() noexcept {
  if (pid_ <= 0 || exitcode_) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) == -1 && errno == EINTR) {
  }
  exitcode_ = decode_status(status);
  pidfd_.reset();
}

namespace {
pid_t checked_fork(pid_t pid, const char* call) {
  if (pid == -1) throw_system_error(errno, call, "starting a child process",
                                    errno == EAGAIN ? "the process limit (ulimit -u) or "
                                                      "pid limit is reached"
                                                    : "");
  return pid;
}
}  // namespace

pid_t fork_process() {
  std::fflush(nullptr);
  return checked_fork(::fork(), "fork");
}

pid_t spawn_self(char* const* argv, char* const* envp, std::span<const int> inherit) {
  std::fflush(nullptr);
  posix_spawn_file_actions_t actions;
  if (int err = ::posix_spawn_file_actions_init(&actions))
    throw_system_error(err, "posix_spawn_file_actions_init", "/proc/self/exe");
  int err = 0;
  // A dup2 of an fd onto itself clears its close-on-exec flag (glibc 2.29 and later).
  for (int fd : inherit)
    if (err == 0) err = ::posix_spawn_file_actions_adddup2(&actions, fd, fd);
  pid_t pid = -1;
  if (err == 0) err = ::posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv, envp);
  ::posix_spawn_file_actions_destroy(&actions);
  if (err != 0)
    throw_system_error(err, "posix_spawn", "/proc/self/exe",
                       err == EAGAIN ? "the process limit (ulimit -u) or pid limit is reached"
                                     : "");
  return pid;
}

std::pair<UniqueFd, UniqueFd> make_report_pipe() {
  int fds[2];
  check_syscall("pipe2", "O_CLOEXEC", [&] { return ::pipe2(fds, O_CLOEXEC); });
  UniqueFd r(fds[0]), w(fds[1]);
  // Only the parent's end is non-blocking: the parent drains pipes while it waits on many
  // children; the child writes its report with ordinary blocking writes.
  int flags = check_syscall("fcntl", "F_GETFL", [&] { return ::fcntl(r.get(), F_GETFL); });
  check_syscall("fcntl", "F_SETFL O_NONBLOCK",
                [&] { return ::fcntl(r.get(), F_SETFL, flags | O_NONBLOCK); });
  return {std::move(r), std::move(w)};
}

bool read_available(int fd, std::string& out, std::size_t limit) {
  char buf[4096];
  for (;;) {
    ssize_t n = retry_eintr([&] { return ::read(fd, buf, sizeof buf); });
    if (n > 0) {
      std::size_t room = limit > out.size() ? limit - out.size() : 0;
      out.append(buf, std::min(room, static_cast<std::size_t>(n)));
      continue;
    }
    if (n == 0) return false;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

std::string signal_name(int sig) {
  // sigabbrev_np (glibc >= 2.32) gives "ABRT" for SIGABRT (never the alias "IOT").
  if (const char* abbrev = ::sigabbrev_np(sig)) return std::string("SIG") + abbrev;
  if (sig >= SIGRTMIN && sig <= SIGRTMAX) return "SIGRTMIN+" + std::to_string(sig - SIGRTMIN);
  return "<Unknown signal " + std::to_string(sig) + ">";
}

void set_cloexec(int fd, bool on) {
  int flags = check_syscall("fcntl", "F_GETFD fd=" + std::to_string(fd),
                            [&] { return ::fcntl(fd, F_GETFD); });
  int want = on ? (flags | FD_CLOEXEC) : (flags & ~FD_CLOEXEC);
  if (want != flags)
    check_syscall("fcntl", "F_SETFD fd=" + std::to_string(fd),
                  [&] { return ::fcntl(fd, F_SETFD, want); });
}

bool fd_is_open(int fd) noexcept { return fd >= 0 && ::fcntl(fd, F_GETFD) != -1; }

std::vector<std::string> self_cmdline() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::size_t start = 0;
  while (start < all.size()) {
    std::size_t end = all.find('\0', start);
    if (end == std::string::npos) end = all.size();
    args.emplace_back(all, start, end - start);
    start = end + 1;
  }
  return args;
}

std::vector<std::string> environment() {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

void die_with_parent(pid_t expected_parent, pid_t expected_thread) noexcept {
  ::syscall(SYS_prctl, PR_SET_PDEATHSIG, static_cast<unsigned long>(SIGKILL), 0UL, 0UL, 0UL);
  // The parent may have died between fork and prctl; then no signal will ever come and we
  // have been re-parented (to init or a subreaper).
  if (static_cast<pid_t>(::syscall(SYS_getppid)) != expected_parent) exit_raw(1);
  // The thread that started us may have ended before prctl: we were then handed to another
  // thread of the parent (getppid cannot tell), and the signal would wait for that one. A
  // thread's /proc entry goes when it ends (threads are reaped at once).
  char path[64] = "/proc/";  // "/proc/<pid>/task/<tid>", without snprintf (a forked child)
  std::size_t n = 6;
  auto append_number = [&](unsigned v) {
    char digits[16];
    int k = 0;
    do {
      digits[k++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0);
    while (k > 0) path[n++] = digits[--k];
  };
  append_number(static_cast<unsigned>(expected_parent));
  for (char c : {'/', 't', 'a', 's', 'k', '/'}) path[n++] = c;
  append_number(static_cast<unsigned>(expected_thread));
  path[n] = '\0';
  struct stat st {};
  if (::syscall(SYS_newfstatat, AT_FDCWD, path, &st, 0) != 0 && errno == ENOENT) exit_raw(1);
}

pid_t own_thread_id() noexcept { return static_cast<pid_t>(::syscall(SYS_gettid)); }

pid_t parent_pid() noexcept { return static_cast<pid_t>(::syscall(SYS_getppid)); }

void write_all_raw(int fd, const char* data, std::size_t n) noexcept {
  while (n > 0) {
    const long w = ::syscall(SYS_write, fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += w;
    n -= static_cast<std::size_t>(w);
  }
}

void exit_raw(int code) noexcept {
  ::syscall(SYS_exit_group, code);
  __builtin_unreachable();
}

void exit_now(int code) noexcept { ::_exit(code); }

}  // namespace shmtensor::internal
