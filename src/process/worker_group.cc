#include "shmtensor/internal/worker_group.h"

#include <algorithm>
#include <utility>

#include "os/child.h"
#include "os/poll.h"
#include "process/child_side.h"
#include "process/process_state.h"
#include "process/shutdown.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/process_access.h"

namespace shmtensor::internal {

WorkerGroup::WorkerGroup(StartMethod method, Launch launch)
    : method_(method), launch_(std::move(launch)) {}

WorkerGroup::~WorkerGroup() = default;

void WorkerGroup::start(std::size_t index) {
  auto [mine, theirs] = shmtensor::pipe();
  WorkerLink link{std::make_shared<Connection>(std::move(theirs))};
  LaunchSpec spec = launch_(static_cast<int>(index), link);
  std::vector<int> ours = ConnectionAccess::fds(mine);
  for (std::size_t i = 0; i < connections_.size(); ++i)
    if (i != index && connections_[i].valid())
      for (const int fd : ConnectionAccess::fds(connections_[i])) ours.push_back(fd);
  close_in_forked_child(spec, std::move(ours));
  Process process = ProcessAccess::make(std::move(spec));
  // From here only the launch spec holds the worker's end; start() drops it, so that the
  // worker's exit reads as EOF on ours.
  link.connection.reset();
  process.set_daemon(true);
  process.set_start_method(method_);
  process.start();
  if (index == processes_.size()) {
    processes_.push_back(std::move(process));
    connections_.push_back(std::move(mine));
  } else {
    processes_[index] = std::move(process);
    connections_[index] = std::move(mine);
  }
}

std::vector<int> WorkerGroup::pids() const {
  std::vector<int> out;
  out.reserve(processes_.size());
  for (const Process& p : processes_) out.push_back(p.pid());
  return out;
}

std::vector<bool> WorkerGroup::wait(std::optional<Clock::time_point> deadline, int extra_fd) {
  // Two fds per worker, so that fd k / 2 is worker k's: its connection, its pidfd. A
  // connection's readiness fd is signalled only while we wait here (begin_wait), so its
  // worker pays no syscall for the messages it sends while we are busy.
  std::vector<int> fds;
  fds.reserve(2 * processes_.size() + 1);
  struct EndWaits {
    std::vector<Connection*> waiting;
    ~EndWaits() {
      for (Connection* c : waiting) ConnectionAccess::end_wait(*c);
    }
  } end_waits;
  end_waits.waiting.reserve(processes_.size());
  bool polling = false;
  for (std::size_t i = 0; i < processes_.size(); ++i) {
    ProcessState* s = ProcessAccess::state(processes_[i]);
    const bool reaped = s->ended() && !connections_[i].valid();
    int fd = -1;
    if (!reaped && connections_[i].valid()) {
      fd = ConnectionAccess::begin_wait(connections_[i]);
      end_waits.waiting.push_back(&connections_[i]);
    }
    fds.push_back(fd);
    fds.push_back(reaped ? -1 : s->pidfd());
    polling = polling || s->needs_polling();
  }
  fds.push_back(extra_fd);
  std::optional<std::chrono::nanoseconds> timeout;
  if (deadline) timeout = std::max(*deadline - Clock::now(), Clock::duration::zero());
  if (polling && (!timeout || *timeout > kPollInterval)) timeout = kPollInterval;
  std::vector<bool> may_have_ended(processes_.size(), polling);
  for (std::size_t k : wait_readable(fds, timeout))
    if (k % 2 == 1 && k / 2 < processes_.size()) may_have_ended[k / 2] = true;
  return may_have_ended;
}

WorkerExit WorkerGroup::reap(std::size_t i, Duration grace) {
  Process& p = processes_[i];
  connections_[i].close();
  if (!p.join(grace)) {
    p.kill();
    p.join();
  }
  WorkerExit exit;
  exit.pid = p.pid();
  exit.exit_code = p.exitcode().value_or(-9);
  if (exit.exit_code < 0) exit.signal_name = signal_name(-exit.exit_code);
  exit.error = p.error();
  return exit;
}

void WorkerGroup::stop(const std::function<void(Connection&)>& goodbye, Duration patience,
                       Duration grace) noexcept {
  for (Connection& c : connections_) {
    if (goodbye && c.valid()) {
      try {
        goodbye(c);
      } catch (...) {
        // Gone already: closing below and the signals after it end it all the same.
      }
    }
    c.close();
  }
  try {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(patience);
    while (!all_ended(processes_) && Clock::now() < deadline) {
      wait_any(processes_, deadline);
      poll_processes(processes_);
    }
    terminate_processes(processes_, std::chrono::duration_cast<Clock::duration>(grace),
                        /*warn=*/false);
  } catch (...) {
    // The Process destructors still SIGKILL and reap whatever is left.
  }
}

}  // namespace shmtensor::internal
