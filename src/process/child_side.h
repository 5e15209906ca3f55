// What runs inside a child before and after the user's function: reporting an escaped
// exception through the report pipe, flushing stdio, and the exec child's hand-over.
//
// Report pipe protocol (child -> parent, one pipe per child, bytes until EOF):
//   [kStartedMarker]            written by an exec child once init() has taken over
//   [kErrorMarker <text>]       "<type>: <what()>" of the exception that ended the child
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "shmtensor/internal/current_exception.h"
#include "shmtensor/internal/launch.h"

namespace shmtensor::internal {

inline constexpr char kStartedMarker = 'S';
inline constexpr char kErrorMarker = 'E';
// The environment variable that tells a re-executed process what to run.
inline constexpr const char* kExecChildEnv = "SHMTENSOR_EXEC_CHILD";

// Reports `text` to the parent as what ended this child (kErrorMarker + text).
void report_error(int report_fd, const std::string& text) noexcept;

// Flushes C and C++ stdio, which _exit would otherwise drop: a child's output is not lost.
void flush_stdio() noexcept;

// In a forked child: arms the parent-death signal (for the thread `parent_thread` of
// `parent_pid`, which forked it), runs body, reports an escaped exception, flushes stdio and
// _exits (0, or 1 after an exception).
[[noreturn]] void run_forked_child(const std::function<void()>& body, int report_fd,
                                   int parent_pid, int parent_thread) noexcept;

// Makes a forked child (spec.fork_body) close `fds` before anything else: the parent's ends
// of the connection to this child and of those to its siblings. A forked child inherits
// them; while it holds a copy of the parent's end of its own connection, or a sibling holds
// one, the parent's close() is no EOF for the child, which then waits for a message
// forever. The fds are the parent's, owned by the calling thread and open until the fork.
// An exec'd child inherits none of them (close-on-exec), so only fork_body changes.
void close_in_forked_child(LaunchSpec& spec, std::vector<int> fds);

// Called when a process is about to start a child while it is itself an exec child whose
// init() never ran (the program does not call shmtensor::init at the top of main): reports
// that to its own parent and exits, so the program cannot re-execute itself without end.
[[noreturn]] void fail_exec_child_without_init() noexcept;

}  // namespace shmtensor::internal
