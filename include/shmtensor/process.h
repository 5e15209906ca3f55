// Process: one child process running a callable, like Python's multiprocessing.Process.
//
//   shmtensor::Process p(work, 42, std::string("x"));  // runs work(42, "x") in a child
//   p.start();
//   p.join();
//   if (p.exitcode() != 0) std::cerr << p.error();
//
// The start method decides how the child begins (see start_method.h):
//  - kFork (default): any copyable callable; the callable and its arguments are copied
//    into the forked child together with the rest of the address space.
//  - kExec: a plain function or a captureless lambda (it is named by its offset in the
//    executable, which is the same in the re-executed program); its arguments must be
//    encodable values and travel over a connection. Other callables fail at start().
//
// In the child: an exception that escapes the callable is reported to the parent as
// "<type>: <what()>" (error()) and the child exits with code 1; otherwise it exits 0. Either
// way it flushes its stdio and ends with _exit: the parent's atexit handlers and static
// destructors never run in the child. The child is SIGKILLed when the thread that started
// it ends (PR_SET_PDEATHSIG: normally the main thread, so: when the parent dies).
//
// Thread safety: a Process is used by one thread at a time.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "shmtensor/error.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/launch.h"
#include "shmtensor/start_method.h"
#include "shmtensor/timeout.h"

namespace shmtensor {

namespace internal {
class ProcessState;
struct ProcessAccess;
}  // namespace internal

class SHMTENSOR_API Process {
 public:
  // Copies fn and args; nothing runs until start(). fn(args...) must be callable.
  template <class F, class... Args>
    requires(!std::is_same_v<std::remove_cvref_t<F>, Process> &&
             std::is_invocable_v<std::decay_t<F>&, std::decay_t<Args>&...>)
  explicit Process(F&& fn, Args&&... args)
      : Process(internal::make_launch<false>(0, std::forward<F>(fn), std::forward<Args>(args)...)) {}

  Process(Process&&) noexcept;
  Process& operator=(Process&&) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  // A child still running is waited for, or, for a daemon, sent SIGTERM and after 5 s
  // SIGKILL; then reaped. Never throws; never leaves a zombie.
  ~Process();

  // Starts the child. Throws Error (a callable kExec cannot run, start() called twice) or
  // SystemError (fork, pipe, posix_spawn: for kExec also a program that could not be
  // executed). Called once.
  void start();
  // Waits until the child ends or `timeout` passes. True if it has ended. Throws Error if
  // the process was never started.
  bool join(Timeout timeout = std::nullopt);
  // Started and not yet ended.
  bool is_alive();
  // nullopt while running or before start; the exit code once ended, or minus the signal
  // number that killed it (-9 for SIGKILL), as in Python.
  std::optional<int> exitcode();
  // The child's pid. Throws Error before start().
  int pid() const;
  // SIGTERM / SIGKILL to the child if it is still running (no-op otherwise).
  void terminate();
  void kill();

  // A daemon child is terminated, not waited for, when its Process is destroyed.
  bool daemon() const noexcept { return daemon_; }
  void set_daemon(bool daemon);
  StartMethod start_method() const noexcept { return start_method_; }
  void set_start_method(StartMethod method);

  // After the child ended: "<exception type>: <what()>" of what escaped the callable (or
  // why a kExec child never ran it); empty if nothing did.
  std::string error() const;

 private:
  explicit Process(internal::LaunchSpec spec);
  friend struct internal::ProcessAccess;

  internal::LaunchSpec spec_;
  bool daemon_ = false;
  StartMethod start_method_ = StartMethod::kFork;
  std::unique_ptr<internal::ProcessState> state_;
};

}  // namespace shmtensor
