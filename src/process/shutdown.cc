#include "process/shutdown.h"

#include <cstdio>

#include "os/child.h"
#include "os/poll.h"
#include "process/process_state.h"
#include "shmtensor/internal/process_access.h"

namespace shmtensor::internal {

namespace {

ProcessState* state_of(Process& p) noexcept { return ProcessAccess::state(p); }

void wait_until_ended(std::span<Process> processes, Clock::time_point deadline) {
  for (;;) {
    poll_processes(processes);
    if (all_ended(processes) || Clock::now() >= deadline) return;
    wait_any(processes, deadline);
  }
}

void signal_running(std::span<Process> processes, bool kill, bool warn) {
  for (Process& p : processes) {
    ProcessState* s = state_of(p);
    if (s == nullptr || s->ended()) continue;
    if (warn) {
      // One write per line, so lines from several processes do not interleave.
      std::fprintf(stderr, "Terminating process %d via signal %s\n", s->pid(),
                   kill ? "SIGKILL" : "SIGTERM");
      std::fflush(stderr);
    }
    if (kill) {
      s->kill();
    } else {
      s->terminate();
    }
  }
}

}  // namespace

std::vector<std::size_t> poll_processes(std::span<Process> processes) {
  std::vector<std::size_t> ended;
  for (std::size_t i = 0; i < processes.size(); ++i) {
    ProcessState* s = state_of(processes[i]);
    if (s == nullptr) continue;
    bool was_ended = s->ended();
    if (s->poll() && !was_ended) ended.push_back(i);
  }
  return ended;
}

bool all_ended(std::span<Process> processes) noexcept {
  for (Process& p : processes) {
    ProcessState* s = state_of(p);
    if (s != nullptr && !s->ended()) return false;
  }
  return true;
}

void wait_any(std::span<Process> processes, std::optional<Clock::time_point> deadline) {
  std::vector<int> fds;
  bool polling = false;
  for (Process& p : processes) {
    ProcessState* s = state_of(p);
    if (s == nullptr || s->ended()) continue;
    fds.push_back(s->pidfd());
    fds.push_back(s->report_fd());
    polling = polling || s->needs_polling();
  }
  if (fds.empty()) return;
  std::optional<std::chrono::nanoseconds> timeout;
  if (deadline) timeout = std::max(*deadline - Clock::now(), Clock::duration::zero());
  if (polling && (!timeout || *timeout > kPollInterval)) timeout = kPollInterval;
  wait_readable(fds, timeout);
}

void terminate_processes(std::span<Process> processes, Clock::duration grace, bool warn) {
  poll_processes(processes);
  signal_running(processes, /*kill=*/false, warn);
  wait_until_ended(processes, Clock::now() + grace);
  signal_running(processes, /*kill=*/true, warn);
  for (Process& p : processes)
    if (ProcessState* s = state_of(p)) s->wait();
}

void shutdown_processes(std::span<Process> processes) noexcept {
  try {
    for (Process& p : processes) {
      ProcessState* s = state_of(p);
      if (s != nullptr && !s->ended() && p.daemon()) s->terminate();
    }
    auto deadline = Clock::now() + std::chrono::seconds(5);
    for (;;) {
      poll_processes(processes);
      bool daemons_left = false, others_left = false;
      for (Process& p : processes) {
        ProcessState* s = state_of(p);
        if (s == nullptr || s->ended()) continue;
        (p.daemon() ? daemons_left : others_left) = true;
      }
      if (!daemons_left && !others_left) return;
      if (daemons_left && Clock::now() >= deadline) {
        for (Process& p : processes) {
          ProcessState* s = state_of(p);
          if (s != nullptr && p.daemon()) s->kill();
        }
      }
      wait_any(processes, daemons_left ? std::optional(deadline) : std::nullopt);
    }
  } catch (...) {
    // Errors from poll/waitpid here are not actionable; the ChildProcess destructors will
    // SIGKILL and reap whatever is left.
  }
}

}  // namespace shmtensor::internal
