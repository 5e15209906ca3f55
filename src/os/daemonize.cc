#include "os/daemonize.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>

#include "os/proc.h"
#include "os/syscall.h"

extern char** environ;

namespace shmtensor::internal {

namespace {

// How long spawn_detached waits for the program it started to fork its daemon and exit
// (detach_from_starter: an exec and a fork of a small program, a few milliseconds). A
// program that does not detach is left running, unreaped, after that.
constexpr int kDetachTimeoutMs = 10000;

// Waits up to timeout_ms in all for `child` to exit, and reaps it; one that does not exit in
// time is left as it is. Without a pidfd (a kernel before 5.3, a seccomp filter refusing
// pidfd_open, no fd left) it looks with WNOHANG every millisecond.
void reap_within(pid_t child, int timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto left_ms = [&] {
    return static_cast<int>(std::max<std::int64_t>(
        0, std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  bool unsupported = false;
  UniqueFd pidfd = open_pidfd(child, &unsupported);
  int status = 0;
  for (;;) {
    // ECHILD: the caller ignores SIGCHLD or another thread reaped it; either way it is gone.
    const pid_t r = ::waitpid(child, &status, WNOHANG);
    if (r == child || (r == -1 && errno != EINTR)) return;
    if (r == -1) continue;
    const int left = left_ms();
    if (left == 0) return;
    if (pidfd) {
      pollfd p{pidfd.get(), POLLIN, 0};
      ::poll(&p, 1, left);  // EINTR or readiness: look again, with the time left
    } else {
      ::usleep(1000);
    }
  }
}

}  // namespace

UniqueFd spawn_detached(const std::string& path, const std::vector<std::string>& args) {
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

  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  if (int err = ::posix_spawn_file_actions_init(&actions))
    throw_system_error(err, "posix_spawn_file_actions_init", "starting " + path);
  if (int err = ::posix_spawnattr_init(&attr)) {
    ::posix_spawn_file_actions_destroy(&actions);
    throw_system_error(err, "posix_spawnattr_init", "starting " + path);
  }
  // The notify pipe at kDaemonNotifyFd (dup2 clears close-on-exec on the copy; a pipe
  // already there gets its flag cleared by glibc's dup2 of an fd onto itself); stdio on
  // /dev/null, so the daemon holds none of the caller's pipes (a test runner waiting for EOF
  // on a test's stdout would wait for the daemon's whole life); every other fd closed (the
  // caller's sockets, pipes and files without O_CLOEXEC). Signal mask emptied; a session of
  // its own.
  sigset_t none;
  sigemptyset(&none);
  int err = ::posix_spawn_file_actions_adddup2(&actions, write_end.get(), kDaemonNotifyFd);
  for (int fd = 0; err == 0 && fd < 3; ++fd)
    err = ::posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_RDWR, 0);
  if (err == 0) err = ::posix_spawn_file_actions_addclosefrom_np(&actions, kDaemonNotifyFd + 1);
  if (err == 0) err = ::posix_spawnattr_setsigmask(&attr, &none);
  if (err == 0)
    err = ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSID);
  pid_t child = -1;
  if (err == 0) err = ::posix_spawn(&child, path.c_str(), &actions, &attr, argv.data(), environ);
  ::posix_spawnattr_destroy(&attr);
  ::posix_spawn_file_actions_destroy(&actions);
  if (err == EAGAIN || err == ENOMEM) throw_system_error(err, "posix_spawn", "starting " + path);
  if (err != 0) {
    // The program could not be executed (glibc reaped the child): the line its exec's
    // failure gives, as the daemon's own lines come, for the caller to read.
    write_all_noexcept(write_end.get(), "EXEC " + std::to_string(err) + "\n");
    return read_end;
  }
  write_end.reset();
  reap_within(child, kDetachTimeoutMs);
  return read_end;
}

void detach_from_starter() {
  const pid_t child = ::fork();
  if (child == -1) throw_system_error(errno, "fork", "detaching the daemon from its starter");
  if (child > 0) ::_exit(0);
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
