// Process identity: who this process is, and whether another one still lives.
//
// A pid alone names a process only until it is reaped: the kernel then recycles it. So a
// process is identified by its pid *and* its start time (field 22 of /proc/<pid>/stat), and
// every "is it alive?" below compares both. A zombie (exited, not yet reaped) counts as
// dead everywhere: it has released its memory and fds, so it holds nothing.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// getpid(): not cached by glibc, so right in a forked child; async-signal-safe.
pid_t own_pid() noexcept;
// 1 in a process that was not forked (after exec too), and one more than its parent's in a
// forked child (a child fork handler installed at load time, the first to run in the
// child: os/fork_handlers.h): state inherited by fork that records the generation it was
// made in is this process's own exactly when the values are equal (a pid can be reused by
// a descendant; a generation cannot). A relaxed load, for paths that ask on every message.
// Not for a child made without fork handlers (_Fork, clone) that does not exec.
std::uint32_t fork_generation() noexcept;
pid_t own_process_group() noexcept;
uid_t effective_uid() noexcept;

struct ProcessStatus {
  bool exists = false;           // /proc/<pid> exists and is not a zombie
  // /proc/<pid>/stat could not be read for another reason than the process being gone
  // (this process at its fd limit, no memory): whether it lives is not known, and callers
  // that judge processes dead must not take that as dead.
  bool unknown = false;
  std::uint64_t start_time = 0;  // clock ticks since boot
  pid_t parent = 0;
  pid_t process_group = 0;
  bool stopped = false;          // by a signal (SIGSTOP) or a tracer: state T or t
};
// Everything false / 0 when the process does not exist or is a zombie.
ProcessStatus read_process_status(pid_t pid) noexcept;

struct ProcessId {
  pid_t pid = 0;
  std::uint64_t start_time = 0;  // 0: the process does not exist (or is a zombie)
  friend bool operator==(const ProcessId&, const ProcessId&) = default;
};
ProcessId identify_process(pid_t pid) noexcept;
// This process, read once per pid (so a forked child reads its own).
ProcessId own_process_id() noexcept;
// True when id.pid lives, is not a zombie, and started at id.start_time.
bool is_alive(const ProcessId& id) noexcept;

// The 64-bit form of a ProcessId that holder tables in shared memory store (segment slots,
// queue holders): pid << 32 | low 32 bits of the start time; 0 means "nobody". Two
// processes with one pid whose start times differ by a multiple of 2^32 ticks (16 months
// at 100 Hz) would be confused.
constexpr std::uint64_t slot_owner(std::int32_t pid, std::uint64_t start_time) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(pid)) << 32) |
         (start_time & 0xffffffffu);
}
// slot_owner of this process (cached per pid, like own_process_id).
std::uint64_t current_slot_owner() noexcept;
// is_alive for a slot owner value.
bool slot_owner_alive(std::uint64_t owner) noexcept;

// True while some process (a zombie included) is in process group `pgid`: kill(-pgid, 0).
bool process_group_exists(pid_t pgid) noexcept;

// What /proc/self/fd/<fd> links to ("anon_inode:[eventfd]", "socket:[1234]", a path);
// empty when it cannot be read (no such fd). A peer-sent fd's kind is checked so.
std::string fd_target(int fd);
// Whether some fd of this process links to `path` (a scan of /proc/self/fd). False when
// none does or /proc cannot be read. Never throws.
bool has_fd_linking_to(const std::string& path) noexcept;

// pidfd_open(pid): readable (POLLIN) once the process has exited. Invalid when the kernel
// has no pidfds (before 5.3) or the process is gone; *unsupported says which.
UniqueFd open_pidfd(pid_t pid, bool* unsupported) noexcept;

}  // namespace shmtensor::internal
