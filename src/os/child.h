// Child processes: fork, exec of our own binary, pidfds, reaping, signals, and the pipes
// that carry a child's error text back. The process layer (src/process/) builds Process,
// spawn and Pool on these; nothing else calls fork/exec/waitpid/kill.
//
// Functions marked "async-signal-safe" may be called between fork and exec in a child of a
// multithreaded parent: they allocate nothing, take no lock and only make system calls.
#pragma once

#include <sys/types.h>

#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// Move-only owner of a child process that this process forked and has not yet reaped.
// Holds a pidfd when the kernel offers one (Linux >= 5.3), which becomes readable when the
// child ends; without one, callers poll(). Until it is reaped the child's pid cannot be
// recycled, so kill() and waitpid() on it are safe.
//
// The destructor never leaves a zombie: a child still running is SIGKILLed and reaped.
// Higher layers decide politer endings (join, SIGTERM first) before that. Not thread-safe.
class ChildProcess {
 public:
  ChildProcess() noexcept = default;
  // Takes over `pid`, a child of this process, and opens its pidfd. Throws SystemError
  // (EMFILE...) after killing and reaping the child.
  explicit ChildProcess(pid_t pid);
  ChildProcess(ChildProcess&& o) noexcept
      : pid_(std::exchange(o.pid_, -1)),
        pidfd_(std::move(o.pidfd_)),
        exitcode_(std::exchange(o.exitcode_, std::nullopt)) {}
  ChildProcess& operator=(ChildProcess&& o) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() { kill_and_reap(); }

  pid_t pid() const noexcept { return pid_; }
  bool valid() const noexcept { return pid_ > 0; }
  // Readable once the child has ended; -1 without pidfd support (or once reaped).
  int pidfd() const noexcept { return pidfd_.get(); }
  bool reaped() const noexcept { return exitcode_.has_value(); }
  // Exit status once reaped: the exit code (>= 0), or minus the signal that killed it.
  std::optional<int> exitcode() const noexcept { return exitcode_; }

  // Reaps the child if it has ended (never blocks). Returns exitcode().
  std::optional<int> poll();
  // Blocks until the child has ended; reaps it.
  int wait();
  // Send `sig` (terminate: SIGTERM, kill: SIGKILL) unless the child was already reaped;
  // false if it was.
  bool send_signal(int sig) noexcept;
  bool terminate() noexcept;
  bool kill() noexcept;
  // SIGKILL and reap, if not reaped yet.
  void kill_and_reap() noexcept;

 private:
  pid_t pid_ = -1;
  UniqueFd pidfd_;
  std::optional<int> exitcode_;
};

// fork() after flushing this process's stdio (so buffered output is not written twice).
// Returns 0 in the child, the child's pid in the parent. Throws SystemError.
pid_t fork_process();
// Starts /proc/self/exe (this program, again) with argv and envp by posix_spawn (glibc's
// clone with CLONE_VM and CLONE_VFORK): the child copies none of this process's page tables
// (a fork of a process of a few GB takes tens of milliseconds, and leaves every page this
// process writes afterwards to a copy-on-write fault) and runs no pthread_atfork handler
// (the library's would give it a hold of every block and a count of every named segment
// this process has, which exec drops without giving back). The fds in `inherit` lose
// close-on-exec in the child only. Returns the child's pid. Throws SystemError when no
// process could be made or the program could not be executed.
pid_t spawn_self(char* const* argv, char* const* envp, std::span<const int> inherit);

// A pipe, both ends O_CLOEXEC; the read end is made O_NONBLOCK. {read, write}.
std::pair<UniqueFd, UniqueFd> make_report_pipe();
// Appends what is available on the non-blocking `fd` to `out`, at most `limit` bytes in
// all. Returns false at end of file (or on an error), true if the writer may send more.
bool read_available(int fd, std::string& out, std::size_t limit);

// "SIGABRT" for SIGABRT; "<Unknown signal N>" for a number without a name (torch's text).
std::string signal_name(int sig);

// Sets or clears FD_CLOEXEC. Throws SystemError.
void set_cloexec(int fd, bool on);
// True when fd is an open descriptor of this process.
bool fd_is_open(int fd) noexcept;

// NUL-separated /proc/self/cmdline split into arguments.
std::vector<std::string> self_cmdline();
// The environment as "NAME=value" strings.
std::vector<std::string> environment();

// ---- async-signal-safe, for the child side ----------------------------------------------

// These make system calls through syscall(2), never through an intercepted libc wrapper
// (a forked child of a multithreaded parent could block on a sanitizer lock another thread
// of the parent held).
// PR_SET_PDEATHSIG(SIGKILL), then: if our parent is no longer `expected_parent` (it died
// before prctl took effect), ends this process with exit_group(1). Kept across execve.
// Note that the signal comes when the parent *thread* that started us ends: it also ends
// this process when `expected_thread`, that thread's id, has ended already (the child was
// then handed to another thread of the parent, which the signal would follow, and getppid
// cannot tell).
void die_with_parent(pid_t expected_parent, pid_t expected_thread) noexcept;
// The calling thread's id (gettid).
pid_t own_thread_id() noexcept;
// This process's parent (getppid).
pid_t parent_pid() noexcept;
// write() all of [data, data + n); gives up on errors other than EINTR.
void write_all_raw(int fd, const char* data, std::size_t n) noexcept;
// Ends every thread of the process at once (exit_group), running no atexit handler and
// flushing no stdio buffer: in a forked child those are copies of the parent's.
[[noreturn]] void exit_raw(int code) noexcept;
// _exit(code) (through libc: a forked child's sanitizer finishes its reports).
[[noreturn]] void exit_now(int code) noexcept;

}  // namespace shmtensor::internal
