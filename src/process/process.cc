#include "shmtensor/process.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>

#include "os/child.h"
#include "os/poll.h"
#include "process/process_state.h"
#include "process/shutdown.h"

namespace shmtensor {

Process::Process(internal::LaunchSpec spec) : spec_(std::move(spec)) {}
Process::Process(Process&&) noexcept = default;

Process& Process::operator=(Process&& other) noexcept {
  if (this != &other) {
    internal::shutdown_processes(std::span<Process>(this, 1));
    spec_ = std::move(other.spec_);
    daemon_ = other.daemon_;
    start_method_ = other.start_method_;
    state_ = std::move(other.state_);
  }
  return *this;
}

Process::~Process() { internal::shutdown_processes(std::span<Process>(this, 1)); }

void Process::start() {
  if (state_) throw Error("Process::start: a process can be started only once");
  state_ = internal::ProcessState::start(spec_, start_method_);
  // Like Python's Process.start: drop the callable and its arguments. Whatever they hold
  // (a connection end meant for the child, a large buffer) is released here rather than
  // kept, and inherited by later children, for the Process's lifetime.
  spec_ = internal::LaunchSpec{};
}

bool Process::join(Timeout timeout) {
  if (!state_) throw Error("Process::join: the process was not started");
  if (!timeout) {
    state_->wait();
    return true;
  }
  using clock = std::chrono::steady_clock;
  // Clamped so that an absurdly long timeout cannot overflow the clock's representation.
  const Duration limit = std::min(std::max(*timeout, Duration::zero()), Duration(3.0e7));
  auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(limit);
  for (;;) {
    if (state_->poll()) return true;
    auto left = deadline - clock::now();
    if (left <= clock::duration::zero()) return false;
    if (state_->needs_polling()) left = std::min<clock::duration>(left, internal::kPollInterval);
    std::array<int, 2> fds{state_->pidfd(), state_->report_fd()};
    internal::wait_readable(fds, left);
  }
}

bool Process::is_alive() { return state_ && !state_->poll(); }

std::optional<int> Process::exitcode() {
  if (!state_) return std::nullopt;
  state_->poll();
  return state_->exitcode();
}

int Process::pid() const {
  if (!state_) throw Error("Process::pid: the process was not started");
  return state_->pid();
}

void Process::terminate() {
  if (state_) state_->terminate();
}

void Process::kill() {
  if (state_) state_->kill();
}

void Process::set_daemon(bool daemon) {
  if (state_) throw Error("Process::set_daemon: the process was already started");
  daemon_ = daemon;
}

void Process::set_start_method(StartMethod method) {
  if (state_) throw Error("Process::set_start_method: the process was already started");
  start_method_ = method;
}

std::string Process::error() const { return state_ ? state_->error() : std::string(); }

}  // namespace shmtensor
