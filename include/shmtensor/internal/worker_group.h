// A group of worker processes, each a daemon child with a duplex Connection to this
// process: what DataLoader (src/data) and Pool (src/process) have in common. Internal.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/connection.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/launch.h"
#include "shmtensor/process.h"
#include "shmtensor/start_method.h"

namespace shmtensor::internal {

// A worker's end of its connection, as an argument of the worker's function: copyable (a
// Process copies its arguments) and encodable (kExec sends it; the socket travels as an fd).
struct WorkerLink {
  std::shared_ptr<Connection> connection;
};

// How a worker ended.
struct WorkerExit {
  int pid = 0;
  int exit_code = 0;        // minus the signal number when killed by one
  std::string signal_name;  // "SIGKILL" when killed by a signal; empty otherwise
  std::string error;        // what escaped the worker's function (Process::error())
};

// Workers 0 .. size()-1. Every worker is started by start(), from this process's thread that
// owns the group; only that thread may call the group afterwards (a forked worker is
// SIGKILLed when the thread that started it ends: PR_SET_PDEATHSIG).
//
// A forked worker inherits this process's end of its own connection and of every other
// worker's; start() makes it close them first, so that closing this process's end is an EOF
// for the worker (which then exits), however many siblings there are.
class SHMTENSOR_API WorkerGroup {
 public:
  using Clock = std::chrono::steady_clock;
  // The launch of worker `index` whose end of its connection is `link` (make_launch).
  using Launch = std::function<LaunchSpec(int index, WorkerLink link)>;

  WorkerGroup(StartMethod method, Launch launch);
  // Workers still running are terminated by their Process's destructor (SIGTERM, SIGKILL
  // after 5 s) and reaped. Never throws.
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts worker `index`: a new one when index == size(), else a replacement for one that
  // ended. Throws what Process::start throws (the group is unchanged then).
  void start(std::size_t index);
  std::size_t size() const noexcept { return processes_.size(); }
  // This process's end of worker i's connection; closed once the worker was reaped.
  Connection& connection(std::size_t i) { return connections_[i]; }
  int pid(std::size_t i) const { return processes_[i].pid(); }
  std::vector<int> pids() const;
  // SIGKILL to worker i if it still runs.
  void kill(std::size_t i) { processes_[i].kill(); }

  // Blocks until a connection of a worker not yet reaped is readable, such a worker ended,
  // `extra_fd` (if >= 0) is readable, or `deadline` passes. Returns, per worker, whether it
  // may have ended (see ended()); spurious returns are fine.
  std::vector<bool> wait(std::optional<Clock::time_point> deadline, int extra_fd = -1);
  // Whether worker i's process has ended. Never blocks.
  bool ended(std::size_t i) { return !processes_[i].is_alive(); }
  // Closes this end of worker i's connection (an EOF for it), waits up to `grace` for it to
  // exit, SIGKILLs it if it lingers, and reaps it.
  WorkerExit reap(std::size_t i, Duration grace);
  // Ends every worker: `goodbye` (if set) is called with each connection still open, which
  // it must not block on; then this end of every connection is closed, the workers are
  // given `patience` to exit by themselves, then SIGTERM, `grace`, SIGKILL; all are reaped.
  // Never throws.
  void stop(const std::function<void(Connection&)>& goodbye, Duration patience,
            Duration grace) noexcept;

 private:
  StartMethod method_;
  Launch launch_;
  std::vector<Process> processes_;
  std::vector<Connection> connections_;
};

}  // namespace shmtensor::internal

namespace shmtensor {

template <>
struct Codec<internal::WorkerLink> {
  static void encode(Encoder& e, const internal::WorkerLink& l) { e.encode(*l.connection); }
  static internal::WorkerLink decode(Decoder& d) {
    return {std::make_shared<Connection>(d.decode<Connection>())};
  }
};

}  // namespace shmtensor
