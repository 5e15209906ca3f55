#include "os/daemonize.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>

#include "os/syscall.h"

extern char** environ;

namespace shmtensor::internal {

namespace {

// The children of spawn_detached make raw system calls through syscall(2) instead of the
// libc wrappers (only _Fork stays: it resets libc's own per-thread state in the child).
// The reason is sanitizers. _Fork, unlike fork(), runs no pthread_atfork handler (see
// daemonize.h), and so it also skips what a sanitizer runtime does around fork(): GCC 12's
// TSan intercepts fork() and takes its internal locks across it, but it does not intercept
// _Fork. A child of a multithreaded caller can then inherit a sanitizer lock that another
// thread held, and its first intercepted call blocks on it for ever. Seen under `make tsan`:
// the intermediate child hung in TSan's _exit interceptor, which finalizes and locks the
// thread registry (ManagerTest.ThreadsCreatingAndForkingConcurrentlyLeaveNothing).
// open, dup2, close, write and sigprocmask are intercepted too; syscall(2) is not. Without a
// sanitizer this changes nothing: the wrappers make the same system calls.
[[noreturn]] void raw_exit(int status) {
  ::syscall(SYS_exit_group, status);
  __builtin_unreachable();
}

// Async-signal-safe: the decimal digits of v into buf (which has room for 24).
int format_uint(unsigned v, char* buf) {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  for (int i = 0; i < n; ++i) buf[i] = tmp[n - 1 - i];
  return n;
}

[[noreturn]] void child_fail(int notify_fd, int err) {
  char msg[40] = "EXEC ";
  int n = 5 + format_uint(static_cast<unsigned>(err), msg + 5);
  msg[n++] = '\n';
  ::syscall(SYS_write, notify_fd, msg, static_cast<size_t>(n));
  raw_exit(127);
}

// In the grandchild: everything here is async-signal-safe, and a raw system call.
[[noreturn]] void exec_daemon(int notify_w, const char* path, char* const* argv) {
  // The notify pipe goes to fd 3 (dup3 clears close-on-exec on the copy).
  if (notify_w == kDaemonNotifyFd) {
    ::syscall(SYS_fcntl, kDaemonNotifyFd, F_SETFD, 0);
  } else if (::syscall(SYS_dup3, notify_w, kDaemonNotifyFd, 0) == -1) {
    child_fail(notify_w, errno);
  }
  // stdio to /dev/null: the daemon must not hold the caller's pipes (a test runner
  // waiting for EOF on a test's stdout would wait for the daemon's whole life).
  int null_fd = static_cast<int>(::syscall(SYS_openat, AT_FDCWD, "/dev/null", O_RDWR));
  if (null_fd < 0) child_fail(kDaemonNotifyFd, errno);
  for (int fd = 0; fd < 3; ++fd) {
    if (null_fd != fd && ::syscall(SYS_dup3, null_fd, fd, 0) == -1)
      child_fail(kDaemonNotifyFd, errno);
  }
  // Every other inherited fd (the caller's sockets, pipes, files without O_CLOEXEC).
  if (::syscall(SYS_close_range, kDaemonNotifyFd + 1, ~0U, 0) == -1) {
    for (int fd = kDaemonNotifyFd + 1; fd < 65536; ++fd) ::syscall(SYS_close, fd);
  }
  // The kernel's sigset_t is _NSIG bits (glibc's is larger); an empty one unblocks all.
  std::uint64_t none[(_NSIG + 63) / 64] = {};
  ::syscall(SYS_rt_sigprocmask, SIG_SETMASK, none, nullptr, static_cast<size_t>(_NSIG / 8));
  ::syscall(SYS_execve, path, argv, environ);
  child_fail(kDaemonNotifyFd, errno);
}

}  // namespace

UniqueFd spawn_detached(const std::string& path, const std::vector<std::string>& args) {
  // Everything the children need is prepared before fork: they may not allocate.
  std::vector<std::string> storage;
  storage.push_back(path);
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);

  int fds[2];
  check_syscall("pipe2", "manager notify pipe", [&] { return ::pipe2(fds, O_CLOEXEC); });
  UniqueFd read_end(fds[0]);
  UniqueFd write_end(fds[1]);

  pid_t child = ::_Fork();
  if (child == -1) throw_system_error(errno, "fork", "starting " + path);
  if (child == 0) {
    ::syscall(SYS_setsid);
    pid_t grandchild = ::_Fork();
    if (grandchild == -1) child_fail(write_end.get(), errno);
    if (grandchild == 0) exec_daemon(write_end.get(), path.c_str(), argv.data());
    raw_exit(0);
  }
  write_end.reset();
  int status = 0;
  // ECHILD: the caller ignores SIGCHLD or reaped it already; either way it is gone.
  retry_eintr([&] { return static_cast<int>(::waitpid(child, &status, 0)); });
  return read_end;
}

std::string read_line(int fd, int timeout_ms, bool* timed_out) {
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string line;
  *timed_out = false;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      *timed_out = true;
      return line;
    }
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) throw_system_error(errno, "poll", "manager notify pipe");
    if (n <= 0) continue;
    char c;
    ssize_t r = retry_eintr([&] { return ::read(fd, &c, 1); });
    if (r < 0) throw_system_error(errno, "read", "manager notify pipe");
    if (r == 0 || c == '\n') return line;
    line.push_back(c);
    if (line.size() > 4096) return line;
  }
}

void write_all_noexcept(int fd, const std::string& text) noexcept {
  std::size_t off = 0;
  while (off < text.size()) {
    ssize_t n = retry_eintr([&] { return ::write(fd, text.data() + off, text.size() - off); });
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

UniqueFd termination_signal_fd() {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  check_syscall("sigprocmask", "SIGTERM|SIGINT|SIGHUP",
                [&] { return ::sigprocmask(SIG_BLOCK, &set, nullptr); });
  // A signal ignored by the starter stays ignored across execve, and an ignored signal is
  // discarded even while blocked: restore the default so that the signalfd sees it.
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGHUP, SIG_DFL);
  return UniqueFd(check_syscall("signalfd", "SIGTERM|SIGINT|SIGHUP",
                                [&] { return ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK); }));
}

int read_signal(int signal_fd) noexcept {
  signalfd_siginfo info{};
  ssize_t n = retry_eintr([&] { return ::read(signal_fd, &info, sizeof info); });
  return n == static_cast<ssize_t>(sizeof info) ? static_cast<int>(info.ssi_signo) : 0;
}

void redirect_stderr_to_log(const std::string& path, long max_bytes) noexcept {
  struct stat st {};
  int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC;
  if (::stat(path.c_str(), &st) == 0 && st.st_size > max_bytes) flags |= O_TRUNC;
  UniqueFd fd(::open(path.c_str(), flags, 0600));
  if (fd) ::dup2(fd.get(), STDERR_FILENO);
}

}  // namespace shmtensor::internal
