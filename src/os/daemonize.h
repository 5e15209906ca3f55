// Starting a program as a daemon that outlives its starter, and the few things a daemon
// does to itself (signals as an fd, stderr to a log file).
#pragma once

#include <string>
#include <vector>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// The fd number at which a spawned daemon finds the write end of its notify pipe.
inline constexpr int kDaemonNotifyFd = 3;

// Starts `path` with `args` (argv[1..]) as a daemon, detached from the caller:
//  - two forks with _Fork (no pthread_atfork handler runs: the daemon must not take over
//    the caller's shared-memory counts), setsid() in between, so the daemon is in its own
//    session and process group (Ctrl-C and SIGHUP of the caller's terminal do not reach it)
//    and is reparented away from the caller (no zombie for the caller to reap);
//  - stdin/stdout/stderr on /dev/null, every other fd closed except the write end of a
//    pipe at kDaemonNotifyFd, signal mask emptied, then execve with the caller's environ.
// The intermediate child is reaped before returning. Returns the pipe's read end: the
// daemon reports on it; if execve fails, the child writes "EXEC <errno>\n" there.
// Only async-signal-safe calls happen between fork and exec, all of them raw system calls
// (daemonize.cc says why). Throws SystemError.
UniqueFd spawn_detached(const std::string& path, const std::vector<std::string>& args);

// Reads one line (without '\n') from `fd`, waiting at most timeout_ms in total.
// Returns what was read before EOF or the timeout; *timed_out tells which.
std::string read_line(int fd, int timeout_ms, bool* timed_out);

// Writes all of `text` to `fd`, ignoring errors (for a notify pipe whose reader left).
void write_all_noexcept(int fd, const std::string& text) noexcept;

// Blocks SIGTERM, SIGINT and SIGHUP and returns a signalfd that reads them; ignores
// SIGPIPE. For a daemon's poll loop.
UniqueFd termination_signal_fd();
// Consumes one pending signal from termination_signal_fd(); returns its number (0 if none).
int read_signal(int signal_fd) noexcept;

// Points stderr at `path` (O_APPEND, created 0600), truncating it first if it is larger
// than max_bytes. Failure leaves stderr as it is.
void redirect_stderr_to_log(const std::string& path, long max_bytes) noexcept;

}  // namespace shmtensor::internal
