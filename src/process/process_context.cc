#include <chrono>
#include <string>

#include "os/child.h"
#include "process/process_state.h"
#include "process/shutdown.h"
#include "shmtensor/internal/process_access.h"
#include "shmtensor/spawn.h"

namespace shmtensor {

namespace {

using internal::Clock;

// torch's default: how long the others get after SIGTERM before SIGKILL.
constexpr auto kDefaultGracePeriod = std::chrono::seconds(30);

Clock::duration to_clock(Duration d) {
  if (d <= Duration::zero()) return Clock::duration::zero();
  if (d > std::chrono::hours(24 * 365)) return std::chrono::hours(24 * 365);
  return std::chrono::duration_cast<Clock::duration>(d);
}

[[noreturn]] void throw_failure(std::vector<Process>& processes, std::size_t index) {
  internal::ProcessState* s = internal::ProcessAccess::state(processes[index]);
  const int i = static_cast<int>(index);
  const int pid = s->pid();
  std::string error = s->error();
  if (!error.empty())
    throw ProcessRaisedException(
        "\n\n-- Process " + std::to_string(i) + " terminated with the following error:\n" + error,
        i, pid);
  const int code = s->exitcode().value_or(255);
  if (code < 0) {
    std::string name = internal::signal_name(-code);
    throw ProcessExitedException("process " + std::to_string(i) + " terminated with signal " + name,
                                 i, pid, code, name);
  }
  throw ProcessExitedException(
      "process " + std::to_string(i) + " terminated with exit code " + std::to_string(code), i, pid,
      code);
}

}  // namespace

ProcessContext::ProcessContext(std::vector<Process> processes)
    : processes_(std::move(processes)), examined_(processes_.size(), false) {}
ProcessContext::ProcessContext(ProcessContext&&) noexcept = default;

ProcessContext& ProcessContext::operator=(ProcessContext&& other) noexcept {
  if (this != &other) {
    internal::shutdown_processes(processes_);
    processes_ = std::move(other.processes_);
    examined_ = std::move(other.examined_);
  }
  return *this;
}

ProcessContext::~ProcessContext() { internal::shutdown_processes(processes_); }

bool ProcessContext::join(Timeout timeout, std::optional<Duration> grace_period) {
  std::optional<Clock::time_point> deadline;
  if (timeout) deadline = Clock::now() + to_clock(*timeout);
  std::optional<std::size_t> failed;
  examined_.resize(processes_.size(), false);  // processes() is the caller's to change
  for (;;) {
    // Every process that has ended and was not examined yet, in index order; the first
    // failure is the one reported. Not only those poll_processes() finds ended now: the
    // caller may have reaped a child already through processes()[i].
    internal::poll_processes(processes_);
    for (std::size_t i = 0; i < processes_.size(); ++i) {
      internal::ProcessState* s = internal::ProcessAccess::state(processes_[i]);
      if (s == nullptr || !s->ended() || examined_[i]) continue;
      examined_[i] = true;
      if (s->failed()) {
        failed = i;
        break;
      }
    }
    if (failed) break;
    if (internal::all_ended(processes_)) return true;
    if (deadline && Clock::now() >= *deadline) return false;
    internal::wait_any(processes_, deadline);
  }

  // A child failed: give the others grace_period to end by themselves (if one was given),
  // then SIGTERM, then SIGKILL after grace_period (default 30 s).
  if (grace_period) {
    auto until = Clock::now() + to_clock(*grace_period);
    for (;;) {
      internal::poll_processes(processes_);
      if (internal::all_ended(processes_) || Clock::now() >= until) break;
      internal::wait_any(processes_, until);
    }
  }
  internal::terminate_processes(
      processes_, grace_period ? to_clock(*grace_period) : Clock::duration(kDefaultGracePeriod),
      /*warn=*/true);
  // Every child has ended now; the first failure is reported, and only once: a later call
  // returns true.
  examined_.assign(processes_.size(), true);
  throw_failure(processes_, *failed);
}

std::vector<int> ProcessContext::pids() const {
  std::vector<int> out;
  for (const Process& p : processes_) {
    try {
      out.push_back(p.pid());
    } catch (const Error&) {
      out.push_back(0);
    }
  }
  return out;
}

namespace internal {

ProcessContext start_all(std::vector<Process> processes, const SpawnOptions& options) {
  for (Process& p : processes) {
    p.set_daemon(options.daemon);
    p.set_start_method(options.start_method);
  }
  std::size_t started = 0;
  try {
    for (; started < processes.size(); ++started) processes[started].start();
  } catch (...) {
    // Do not leave the first children running unattended.
    for (std::size_t i = 0; i < started; ++i) processes[i].kill();
    processes.clear();  // reaps them
    throw;
  }
  ProcessContext context(std::move(processes));
  if (options.join) {
    while (!context.join()) {
    }
  }
  return context;
}

}  // namespace internal
}  // namespace shmtensor
