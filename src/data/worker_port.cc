// The worker's side of the DataLoader protocol (shmtensor/internal/data_worker.h has the
// message layout) and what a worker process knows about itself.
#include <deque>
#include <string>

#include "data/spin_wait.h"
#include "shmtensor/internal/task_board.h"
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
  TaskBoardReader board;
  std::deque<Task> in_messages;  // tasks that came as kTasks messages (their entries say so)
  bool stop = false;
  AdaptiveSpin spin;
  // Whether has_message() tells this end's messages without a syscall (a ringed end; a
  // socket-only one always says yes): looked at once, before anything can have come
  // (the main process writes tasks only once it has our board).
  bool peekable = !ConnectionAccess::has_message(connection);

  void parse(Decoder& d) {
    switch (d.decode<WorkerOp>()) {
      case WorkerOp::kStop:
        stop = true;
        return;
      case WorkerOp::kWake:
        break;
      case WorkerOp::kTasks: {
        auto n = d.decode<std::uint32_t>();
        for (std::uint32_t i = 0; i < n; ++i) {
          Task t;
          t.id = d.decode<std::uint64_t>();
          t.reset = d.decode<bool>();
          t.indices = d.decode<std::vector<std::int64_t>>();
          in_messages.push_back(std::move(t));
        }
        break;
      }
      default:
        throw ProtocolError("DataLoader worker: an unknown message from the main process");
    }
    d.finish();
  }
  // Waits for one message and reads it; stop at the end of the stream.
  void receive() {
    try {
      Decoder d = internal::ConnectionAccess::recv(connection, std::nullopt);
      parse(d);
    } catch (const ConnectionClosed&) {
      stop = true;  // the main process closed its end: the loader is done with us
    } catch (const SystemError&) {
      stop = true;  // ECONNRESET: the main process is gone
    }
  }
  // Reads every message that has arrived, without waiting (and without a syscall for a ring
  // that has none: the end of the stream is seen by the blocking receive).
  void drain() {
    while (!stop && ConnectionAccess::has_message(connection)) {
      std::optional<Decoder> d;
      try {
        d = internal::ConnectionAccess::try_recv(connection, std::chrono::nanoseconds(0));
      } catch (const ConnectionClosed&) {
        stop = true;
        return;
      } catch (const SystemError&) {
        stop = true;
        return;
      }
      if (!d) return;
      parse(*d);
    }
  }
  // Whether a message may wait, without a syscall.
  bool message() const noexcept { return peekable && ConnectionAccess::has_message(connection); }
};

WorkerPort::WorkerPort(Connection& connection, const WorkerConfig& config)
    : state_(std::make_unique<State>(State{
          connection,
          config,
          TaskBoardReader(task_board_shape(config.prefetch_factor, config.batch_size, config.iterable)),
          {},
          false,
          {}})) {
  g_worker_info = WorkerInfo{config.id, config.num_workers, config.base_seed + static_cast<std::uint64_t>(config.id)};
  Encoder e;
  e.encode(std::uint64_t{0});
  e.encode(EntryKind::kBoard);
  e.encode(state_->board.memory());
  e.encode(std::uint64_t{0});
  e.encode(EntryKind::kDone);
  send(std::move(e));
}

WorkerPort::~WorkerPort() = default;

const WorkerConfig& WorkerPort::config() const noexcept { return state_->config; }

bool WorkerPort::next_task(Task& task) {
  State& s = *state_;
  for (;;) {
    if (s.message()) s.drain();
    if (s.stop) return false;
    if (s.board.ready()) {
      const TaskBoardReader::Taken t = s.board.take(task.indices);
      if (t.scalar || t.none)  // torch's DataLoader's flags: this main process writes neither
        throw ProtocolError("DataLoader worker: a task board entry with flags " +
                            std::string(t.scalar ? "scalar" : "none") +
                            ", which the main process does not write");
      if (t.in_message) {
        // Sent before its entry was published: here already, or on its way.
        while (s.in_messages.empty() && !s.stop) s.receive();
        if (s.stop) return false;
        if (s.in_messages.front().id != t.id)
          throw ProtocolError("DataLoader worker: task " + std::to_string(t.id) +
                              "'s entry says it is in a message, and the message holds task " +
                              std::to_string(s.in_messages.front().id));
        task = std::move(s.in_messages.front());
        s.in_messages.pop_front();
        return true;
      }
      task.id = t.id;
      task.reset = t.reset;
      return true;
    }
    // The main process publishes the next task as it takes a batch: spun for, it costs
    // neither side a syscall. Then the sleep, which the main process interrupts with kWake
    // (or a kStop, or the end of the stream).
    if (s.spin.spin_until([&s] { return s.board.ready() || s.message(); })) continue;
    if (s.board.about_to_sleep()) continue;
    s.receive();
    s.board.woke();
  }
}

void WorkerPort::send(Encoder&& message) { internal::ConnectionAccess::send(state_->connection, std::move(message)); }

}  // namespace internal
}  // namespace shmtensor
