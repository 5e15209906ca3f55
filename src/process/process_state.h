// The parent's side of one started child: the child itself (pid, pidfd, reaping) and the
// read end of its report pipe. Process owns one; ProcessContext multiplexes several.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "os/child.h"
#include "os/unique_fd.h"
#include "shmtensor/process.h"

namespace shmtensor::internal {

// How often a child is polled when ProcessState::needs_polling(): without a pidfd (kernels
// before 5.3, old seccomp profiles) nothing becomes readable when it ends.
inline constexpr auto kPollInterval = std::chrono::milliseconds(10);

class ProcessState {
 public:
  // Starts a child running `spec`: a fork (kFork), or this program again by posix_spawn
  // (kExec). Throws Error when `method` cannot run the callable, SystemError when the OS
  // refuses.
  static std::unique_ptr<ProcessState> start(const LaunchSpec& spec, StartMethod method);

  int pid() const noexcept { return child_.pid(); }
  // fds that become readable when there is something to do: the pidfd (child ended) and the
  // report pipe (text to drain). -1 for those that are gone.
  int pidfd() const noexcept { return child_.pidfd(); }
  int report_fd() const noexcept { return report_.get(); }
  // True when poll() must be called periodically: no pidfd to wait on.
  bool needs_polling() const noexcept { return !child_.reaped() && child_.pidfd() < 0; }

  // Drains the report pipe and reaps the child if it ended. Never blocks. True once ended.
  bool poll();
  // Blocks until the child ended (draining the pipe meanwhile).
  void wait();
  bool ended() const noexcept { return child_.reaped(); }
  std::optional<int> exitcode() const noexcept { return child_.exitcode(); }
  bool terminate() noexcept { return child_.terminate(); }
  bool kill() noexcept { return child_.kill(); }

  // After the end: did the child fail (non-zero exit, a signal, or an exec child that never
  // ran its function), and the error text it reported ("<type>: <message>"), if any.
  bool failed() const;
  std::string error() const;

 private:
  ProcessState(ChildProcess child, UniqueFd report, bool exec)
      : child_(std::move(child)), report_(std::move(report)), exec_(exec) {}
  void drain() noexcept;

  ChildProcess child_;
  UniqueFd report_;
  std::string raw_;  // bytes read from the report pipe
  bool exec_ = false;
};

}  // namespace shmtensor::internal
