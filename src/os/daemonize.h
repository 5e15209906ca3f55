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
//  - by posix_spawn (glibc's clone with CLONE_VM and CLONE_VFORK): the caller's memory is
//    neither copied nor torn down, and no pthread_atfork handler runs (the daemon must not
//    take over the caller's shared-memory counts). From a process of a few hundred MB (torch
//    loaded), the two forks, the exec and the exit this replaced took ~20 ms;
//  - in a session and process group of its own (Ctrl-C and SIGHUP of the caller's terminal
//    do not reach it);
//  - stdin/stdout/stderr on /dev/null, every other fd closed except the write end of a
//    pipe at kDaemonNotifyFd, signal mask emptied, the caller's environ.
// The program must call detach_from_starter() first: the process spawned here exits there,
// and is reaped before this returns (waiting up to 10 s for it), so that the daemon is
// nobody's child in the caller (no zombie for it to reap) and no session leader. Returns
// the pipe's read end: the daemon reports on it; when the program cannot be executed, the
// line "EXEC <errno>" is there. Throws SystemError (no process could be made).
UniqueFd spawn_detached(const std::string& path, const std::vector<std::string>& args);

// In a program started by spawn_detached, before anything else (one thread, nothing
// open but what spawn_detached left): forks; the parent exits at once (spawn_detached
// reaps it) and the child goes on as the daemon. Throws SystemError if fork fails.
void detach_from_starter();

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
