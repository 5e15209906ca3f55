// The worker's side of the DataLoader protocol (shmtensor/internal/data_worker.h has the
// message layout) and what a worker process knows about itself.
#include <deque>

#include "data/spin_wait.h"
#include "shmtensor/data_loader.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/current_exception.h"
#include "shmtensor/internal/data_worker.h"

namespace shmtensor {

namespace {
// Set once in a worker process (by its WorkerPort) before any dataset code runs there;
// the process is single-threaded until then, and datasets only read it.
std::optional<WorkerInfo> g_worker_info;
}  // namespace

std::optional<WorkerInfo> get_worker_info() { return g_worker_info; }

namespace internal {

WorkerFailure current_failure(std::int64_t index, const char* stage) {
  return WorkerFailure{index, stage, describe_current_exception()};
}

struct WorkerPort::State {
  Connection& connection;
  WorkerConfig config;
  std::deque<Task> tasks;
  bool stop = false;
  AdaptiveSpin spin;

  void parse(Decoder& d) {
    if (d.decode<WorkerOp>() == WorkerOp::kStop) {
      stop = true;
      return;
    }
    auto n = d.decode<std::uint32_t>();
    for (std::uint32_t i = 0; i < n; ++i) {
      Task t;
      t.id = d.decode<std::uint64_t>();
      t.reset = d.decode<bool>();
      t.indices = d.decode<std::vector<std::int64_t>>();
      tasks.push_back(std::move(t));
    }
    d.finish();
  }
  // Reads every message that has arrived, without waiting (and without a syscall for a ring
  // that has none: the end of the stream is seen by the blocking receive).
  void drain() {
    while (!stop && ConnectionAccess::has_message(connection)) {
      std::optional<Decoder> d;
      try {
        d = internal::ConnectionAccess::try_recv(connection, std::chrono::nanoseconds(0));
      } catch (const ConnectionClosed&) {
        stop = true;  // the main process closed its end: the loader is done with us
        return;
      } catch (const SystemError&) {
        stop = true;  // ECONNRESET: the main process is gone
        return;
      }
      if (!d) return;
      parse(*d);
    }
  }
};

WorkerPort::WorkerPort(Connection& connection, const WorkerConfig& config)
    : state_(std::make_unique<State>(State{connection, config, {}, false, {}})) {
  g_worker_info = WorkerInfo{config.id, config.num_workers, config.base_seed + static_cast<std::uint64_t>(config.id)};
}

WorkerPort::~WorkerPort() = default;

const WorkerConfig& WorkerPort::config() const noexcept { return state_->config; }

std::optional<WorkerPort::Task> WorkerPort::next_task() {
  State& s = *state_;
  if (s.tasks.empty()) s.drain();
  if (s.tasks.empty() && !s.stop) {
    // The main process sends the next task as it takes a batch: spun for, it costs neither
    // side a syscall (a sleeping worker must be woken).
    Connection* const end = &s.connection;
    if (s.spin.spin(std::span(&end, 1), std::nullopt)) s.drain();
  }
  while (s.tasks.empty() && !s.stop) {
    try {
      Decoder d = internal::ConnectionAccess::recv(s.connection, std::nullopt);
      s.parse(d);
    } catch (const ConnectionClosed&) {
      s.stop = true;
    } catch (const SystemError&) {
      s.stop = true;
    }
  }
  if (s.stop) return std::nullopt;
  Task t = std::move(s.tasks.front());
  s.tasks.pop_front();
  return t;
}

void WorkerPort::send(Encoder&& message) { internal::ConnectionAccess::send(state_->connection, std::move(message)); }

}  // namespace internal
}  // namespace shmtensor
