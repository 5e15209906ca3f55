// spawn / start_processes: run fn(index, args...) in nprocs child processes and propagate
// the first failure to the parent as an exception, like torch.multiprocessing.spawn.
//
//   auto ctx = shmtensor::spawn(train, /*nprocs=*/4, {.join = false}, queue);
//   while (!ctx.join()) {}   // or simply ctx.join(): without a timeout it waits for all
//
// When one child fails (an exception escaped fn, a non-zero exit code, or a signal), the
// others are sent SIGTERM, and SIGKILL if they are still alive after the grace period
// (default 30 s); a line "Terminating process <pid> via signal SIGTERM" goes to stderr for
// each. Then the first failure is thrown:
//  - ProcessRaisedException when fn threw. what() is
//      "\n\n-- Process <i> terminated with the following error:\n<type>: <what()>"
//    so it ends with the child exception's (demangled) type name and message.
//  - ProcessExitedException when the child ended otherwise:
//      "process <i> terminated with exit code <c>" or "process <i> terminated with signal
//      SIGABRT" (exit_code() is then minus the signal number, signal_name() "SIGABRT").
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shmtensor/error.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/process_access.h"
#include "shmtensor/internal/spawn.h"
#include "shmtensor/process.h"
#include "shmtensor/start_method.h"

namespace shmtensor {

// A child of spawn failed. error_index() is its index, pid() its pid.
class SHMTENSOR_API ProcessException : public Error {
 public:
  ProcessException(const std::string& what, int error_index, int pid)
      : Error(what), error_index_(error_index), pid_(pid) {}
  int error_index() const noexcept { return error_index_; }
  int pid() const noexcept { return pid_; }

 private:
  int error_index_;
  int pid_;
};

// The child's function threw; what() carries its type name and message.
class SHMTENSOR_API ProcessRaisedException : public ProcessException {
 public:
  using ProcessException::ProcessException;
};

// The child exited with a non-zero code or was killed by a signal (exit_code() < 0).
class SHMTENSOR_API ProcessExitedException : public ProcessException {
 public:
  ProcessExitedException(const std::string& what, int error_index, int pid, int exit_code,
                         std::string signal_name = {})
      : ProcessException(what, error_index, pid),
        exit_code_(exit_code),
        signal_name_(std::move(signal_name)) {}
  int exit_code() const noexcept { return exit_code_; }
  // "SIGABRT" etc. when killed by a signal; empty otherwise.
  const std::string& signal_name() const noexcept { return signal_name_; }

 private:
  int exit_code_;
  std::string signal_name_;
};

struct SpawnOptions {
  bool join = true;     // wait for all children (and throw on failure) before returning
  bool daemon = false;  // see Process::daemon
  StartMethod start_method = StartMethod::kFork;
};

// The children of one spawn. Used by one thread at a time. Destroying it while children
// run waits for them (daemons: SIGTERM, SIGKILL after 5 s) and reaps them; a failure seen
// only then is lost.
class SHMTENSOR_API ProcessContext {
 public:
  explicit ProcessContext(std::vector<Process> processes);
  ProcessContext(ProcessContext&&) noexcept;
  ProcessContext& operator=(ProcessContext&&) noexcept;
  ~ProcessContext();

  // Waits until every child has ended (true), a child has failed (throws, see above,
  // after terminating the others), or `timeout` has passed (false). With a grace_period,
  // the other children are first given that long to end by themselves before SIGTERM,
  // and that long again (instead of 30 s) before SIGKILL. A failure is thrown once, also
  // for a child already reaped through processes(). Once every child has ended (and any
  // failure was thrown) it returns true, also on later calls.
  //
  // Unlike torch, join() without a timeout waits for all children rather than returning
  // after the first one ends; `while (!ctx.join()) {}` works with both.
  bool join(Timeout timeout = std::nullopt, std::optional<Duration> grace_period = std::nullopt);

  std::vector<int> pids() const;  // pid_t values, in index order
  // The children. Reaping one through it (is_alive(), exitcode(), join()) does not hide its
  // failure from join(), which throws it all the same.
  std::vector<Process>& processes() noexcept { return processes_; }

 private:
  std::vector<Process> processes_;
  std::vector<bool> examined_;  // join() has looked at processes_[i] since it ended
};

// Runs fn(index, args...) for index in [0, nprocs) in child processes. Arguments are copied
// for each child (kFork) or encoded and sent to it (kExec). See the file comment.
template <class F, class... Args>
  requires std::is_invocable_v<std::decay_t<F>&, int, std::decay_t<Args>&...>
ProcessContext spawn(F&& fn, int nprocs = 1, SpawnOptions options = {}, Args&&... args) {
  if (nprocs < 1) throw Error("spawn: nprocs must be at least 1, got " + std::to_string(nprocs));
  std::vector<Process> processes;
  processes.reserve(static_cast<std::size_t>(nprocs));
  for (int i = 0; i < nprocs; ++i) {
    processes.push_back(internal::ProcessAccess::make(internal::make_launch<true>(i, fn, args...)));
  }
  return internal::start_all(std::move(processes), options);
}

// spawn with the start method given first (it overrides options.start_method).
template <class F, class... Args>
  requires std::is_invocable_v<std::decay_t<F>&, int, std::decay_t<Args>&...>
ProcessContext start_processes(StartMethod start_method, F&& fn, int nprocs = 1,
                               SpawnOptions options = {}, Args&&... args) {
  options.start_method = start_method;
  return spawn(std::forward<F>(fn), nprocs, options, std::forward<Args>(args)...);
}

}  // namespace shmtensor
