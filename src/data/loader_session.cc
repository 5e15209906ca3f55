// The main process's side of a DataLoader's workers: tasks out, batches in, in order.
//
// One thread drives everything from next(): it tops up tasks (at most prefetch_factor per
// worker not yet handed out) by writing them on each worker's task board (task_board.h: no
// message, and a wake-up message only for a worker that sleeps), then spins briefly on the
// workers' rings (spin_wait.h) and,
// if no batch came, waits in one poll() on every worker's socket and pidfd, so a result and
// a death are both seen at once, with no polling interval. While batches come within the
// spin, a batch costs no syscall: its reply is taken from the ring only when one is there
// (has_message), and the pidfds are looked at without waiting once per clock tick. Task ids grow
// across epochs; a reply for an id before the current epoch's first is decoded and dropped
// (persistent workers finish the tasks of an abandoned epoch).
#include <algorithm>
#include <cerrno>
#include <map>
#include <span>

#include "data/loader_errors.h"
#include "data/spin_wait.h"
#include "os/socket.h"
#include "shmtensor/internal/task_board.h"
#include "os/clock.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/current_exception.h"
#include "shmtensor/internal/worker_group.h"

namespace shmtensor::internal {

namespace {
using Clock = WorkerGroup::Clock;
// Workers get this long to exit by themselves once their connection is closed, then
// SIGTERM, then this long again before SIGKILL.
constexpr auto kStopGrace = std::chrono::seconds(1);
}  // namespace

struct LoaderSession::State {
  enum class Status { kPending, kReady, kFailed, kEnd };
  struct Task {
    int worker = 0;
    Status status = Status::kPending;
    WorkerFailure failure;
  };
  struct Worker {
    std::size_t load = 0;     // tasks of this epoch given to it and not handed out yet
    bool active = true;       // iterable: has more this epoch
    bool fresh_epoch = true;  // iterable: its next task starts the iteration over
    // Tasks written on its board, and answered (a batch, an error or an end came back),
    // over the session: posted - answered entries may still be unread, so at most the
    // board's slots.
    std::uint64_t posted = 0;
    std::uint64_t answered = 0;
    std::optional<TaskBoardWriter> board;  // its first reply
    // Tasks given to it before its board came: written there when it comes.
    struct Deferred {
      std::uint64_t id;
      bool reset;
      std::vector<std::int64_t> indices;
    };
    std::vector<Deferred> deferred;
    bool unpublished = false;  // written since the last publish
  };

  State(SessionOptions o, const Launch& launch, Decode d)
      : options(o), decode(std::move(d)), group(o.start_method, launch) {}

  SessionOptions options;
  Decode decode;
  WorkerGroup group;
  std::vector<Worker> workers;  // by worker id, as in group
  Source source;
  bool source_done = true;
  std::uint64_t next_id = 1;
  std::uint64_t epoch_first = 1;
  std::uint64_t next_out = 1;           // in_order: the id handed out next
  std::map<std::uint64_t, Task> tasks;  // this epoch's, not yet handed out
  std::size_t cursor = 0;               // round robin
  bool broken = false;
  std::vector<Connection*> ends;  // each worker's connection, for the spin
  AdaptiveSpin spin;
  std::vector<std::int64_t> scratch;  // fill()'s indices of a batch
  std::int64_t deaths_seen_at = -1;  // the clock tick (coarse_monotonic_ns) of the last look

  void start();
  void stop() noexcept;
  void fill();
  bool has_room(std::size_t w) const noexcept;
  void post(std::size_t w, std::uint64_t id, const std::vector<std::int64_t>& indices);
  void write(std::size_t w, std::uint64_t id, bool reset, std::span<const std::int64_t> indices);
  void publish(std::size_t w);
  // wait = false: nothing is sent when the connection is full (try_send).
  void send_to(std::size_t w, Encoder&& e, bool wait = true);
  std::optional<std::uint64_t> take_ready();
  void wait(std::optional<Clock::time_point> deadline);
  void sleep(std::optional<Clock::time_point> deadline);
  void look();
  void read(std::size_t w, bool only_ready = false);
  void handle(std::size_t w, Decoder& d);
  [[noreturn]] void died(std::size_t w);
  // In a catch block: the reply being read was not one; the exception says why.
  [[noreturn]] void malformed(std::size_t w);
  // A reply could not be taken whole because this process is at its open-file limit (its
  // fds were cut, or a named segment of it could not be opened): `e` says which. Nothing the
  // worker did: it is not blamed, but the reply is lost.
  [[noreturn]] void lost_at_fd_limit(std::size_t w, const std::exception& e);
  std::string loading(std::size_t w) const;
};

void LoaderSession::State::start() {
  for (int i = 0; i < options.num_workers; ++i) {
    group.start(static_cast<std::size_t>(i));
    workers.emplace_back();
  }
  for (std::size_t i = 0; i < group.size(); ++i) ends.push_back(&group.connection(i));
}

void LoaderSession::State::stop() noexcept {
  // kStop, then EOF. kStop is needed as well because other children of this process
  // (another loader's workers, a Pool) may hold copies of our ends, so that closing ours
  // is not always an EOF for the worker. Never blocks: a full socket means a stuck worker,
  // which SIGTERM ends.
  std::function<void(Connection&)> goodbye;
  if (!broken) goodbye = [](Connection& c) { (void)c.try_send(WorkerOp::kStop); };
  group.stop(goodbye, broken ? Duration::zero() : Duration(kStopGrace), kStopGrace);
  workers.clear();
}

void LoaderSession::State::fill() {
  // Top up in rounds: only once some worker is down to `low` tasks, so that with a deep
  // prefetch one message carries a quarter of it rather than one task per batch taken.
  const auto prefetch = static_cast<std::size_t>(options.prefetch_factor);
  const std::size_t low = prefetch - std::max<std::size_t>(1, prefetch / 4);
  if (!source_done &&
      std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.active; }) &&
      std::none_of(workers.begin(), workers.end(),
                   [&](const Worker& w) { return w.active && w.load <= low; }))
    return;
  std::vector<std::int64_t>& indices = scratch;
  const std::size_t n = workers.size();
  while (!source_done) {
    std::optional<std::size_t> pick;
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t w = (cursor + k) % n;
      if (!workers[w].active) continue;
      if (workers[w].load < static_cast<std::size_t>(options.prefetch_factor) && has_room(w))
        pick = w;
      // in_order keeps a strict rotation: a busy worker is waited for, not skipped.
      if (pick || options.in_order) break;
    }
    if (options.iterable &&
        std::none_of(workers.begin(), workers.end(), [](const Worker& w) { return w.active; })) {
      source_done = true;
      break;
    }
    if (!pick) break;
    if (!options.iterable && !source(indices)) {
      source_done = true;
      break;
    }
    const std::uint64_t id = next_id++;
    tasks.emplace(id, Task{static_cast<int>(*pick), Status::kPending, {}});
    ++workers[*pick].load;
    post(*pick, id, indices);
    cursor = (*pick + 1) % n;
  }
  for (std::size_t w = 0; w < n; ++w) publish(w);
}

// A worker whose board has not come yet has room as if it had (its tasks wait in
// `deferred`), so that which worker gets which task does not depend on when boards come.
bool LoaderSession::State::has_room(std::size_t w) const noexcept {
  const Worker& worker = workers[w];
  return worker.posted - worker.answered < static_cast<std::uint64_t>(options.prefetch_factor);
}

// Makes worker w's tasks written since the last publish visible, and wakes it if it sleeps.
void LoaderSession::State::publish(std::size_t w) {
  if (!std::exchange(workers[w].unpublished, false)) return;
  if (workers[w].board->publish()) {
    Encoder e;
    e.encode(WorkerOp::kWake);
    // Without waiting: a connection too full to take it holds messages the worker has not
    // read, for which it wakes anyway; and a worker that says it sleeps but never reads
    // its connection cannot block the main process here.
    send_to(w, std::move(e), false);
  }
}

// Gives task `id` to worker w: on its board (published at the end of fill()), or, before
// the board came, into `deferred`.
void LoaderSession::State::post(std::size_t w, std::uint64_t id,
                                const std::vector<std::int64_t>& indices) {
  Worker& worker = workers[w];
  const bool reset = options.iterable && std::exchange(worker.fresh_epoch, false);
  const std::span<const std::int64_t> mine =
      options.iterable ? std::span<const std::int64_t>() : std::span<const std::int64_t>(indices);
  ++worker.posted;
  if (!worker.board) {
    worker.deferred.push_back({id, reset, {mine.begin(), mine.end()}});
    return;
  }
  write(w, id, reset, mine);
}

// Writes a task's entry; one whose indices do not fit goes in a message first.
void LoaderSession::State::write(std::size_t w, std::uint64_t id, bool reset,
                                 std::span<const std::int64_t> indices) {
  Worker& worker = workers[w];
  if (!worker.board->post(id, reset, indices)) {
    Encoder e;
    e.encode(WorkerOp::kTasks);
    e.encode(std::uint32_t{1});
    e.encode(id);
    e.encode(reset);
    e.encode(std::vector<std::int64_t>(indices.begin(), indices.end()));
    send_to(w, std::move(e));
  }
  worker.unpublished = true;
}

void LoaderSession::State::send_to(std::size_t w, Encoder&& e, bool wait) {
  try {
    if (wait)
      internal::ConnectionAccess::send(group.connection(w), std::move(e));
    else
      (void)internal::ConnectionAccess::try_send(group.connection(w), std::move(e));
  } catch (const ConnectionClosed&) {
    died(w);  // EPIPE: it is gone
  } catch (const SystemError&) {
    died(w);
  }
}

std::optional<std::uint64_t> LoaderSession::State::take_ready() {
  for (;;) {
    auto it = options.in_order ? tasks.find(next_out)
                               : std::find_if(tasks.begin(), tasks.end(), [](const auto& t) {
                                   return t.second.status != Status::kPending;
                                 });
    if (it == tasks.end() || it->second.status == Status::kPending) return std::nullopt;
    const std::uint64_t id = it->first;
    Task task = std::move(it->second);
    tasks.erase(it);
    --workers[static_cast<std::size_t>(task.worker)].load;
    if (options.in_order) ++next_out;
    switch (task.status) {
      case Status::kReady:
        return id;
      case Status::kFailed:
        throw worker_error(task.worker, group.pid(static_cast<std::size_t>(task.worker)),
                           task.failure);
      default:
        continue;  // kEnd: that worker had nothing for this slot
    }
  }
}

void LoaderSession::State::wait(std::optional<Clock::time_point> deadline) {
  if (spin.spin(ends, deadline)) {
    for (std::size_t w = 0; w < workers.size(); ++w) read(w, true);
    return;
  }
  sleep(deadline);
}

void LoaderSession::State::sleep(std::optional<Clock::time_point> deadline) {
  const std::vector<bool> may_have_ended = group.wait(deadline);
  for (std::size_t w = 0; w < workers.size(); ++w) {
    read(w);
    // A batch sent just before the end was read above; now the end itself.
    if (may_have_ended[w] && group.ended(w)) died(w);
  }
}

// What next() does first: takes the replies that are there and, once per clock tick (a
// few milliseconds), looks at every worker's pidfd without waiting, so that a death is
// reported even while later batches are already here.
void LoaderSession::State::look() {
  const std::int64_t tick = coarse_monotonic_ns();
  if (tick != deaths_seen_at) {
    deaths_seen_at = tick;
    sleep(Clock::now());
    return;
  }
  for (std::size_t w = 0; w < workers.size(); ++w) read(w, true);
}

void LoaderSession::State::read(std::size_t w, bool only_ready) {
  for (;;) {
    // only_ready: no syscall to find the ring empty (try_recv looks at the socket then).
    if (only_ready && !ConnectionAccess::has_message(group.connection(w))) return;
    std::optional<Decoder> d;
    try {
      // A zero timeout: a ring message costs no syscall; finding none looks at the socket.
      d = internal::ConnectionAccess::try_recv(group.connection(w), std::chrono::nanoseconds(0));
      if (!d) return;
    } catch (const ConnectionClosed&) {
      died(w);  // it closed its socket by exiting
    } catch (const SystemError& e) {
      // This process's fd table is full: a named segment of the reply cannot be opened.
      if (e.error_code() == EMFILE || e.error_code() == ENFILE) lost_at_fd_limit(w, e);
      died(w);  // ECONNRESET: it exited without reading every task we sent
    } catch (const FdsCutError& e) {
      lost_at_fd_limit(w, e);  // the reply's fds did not fit this process's fd table (MSG_CTRUNC)
    } catch (const ProtocolError&) {
      malformed(w);  // a ring slot that is not a message: it writes our shared memory
    }
    try {
      handle(w, *d);
    } catch (const DataLoaderError&) {
      throw;
    } catch (...) {
      malformed(w);
    }
  }
}

void LoaderSession::State::malformed(std::size_t w) {
  // Nothing more from this worker can be trusted.
  broken = true;
  group.kill(w);
  throw DataLoaderError("DataLoader worker " + std::to_string(w) + " (pid " +
                        std::to_string(group.pid(w)) +
                        ") sent a reply that could not be decoded: " +
                        describe_current_exception());
}

void LoaderSession::State::lost_at_fd_limit(std::size_t w, const std::exception& e) {
  broken = true;
  throw DataLoaderError("DataLoader worker " + std::to_string(w) + " (pid " +
                        std::to_string(group.pid(w)) +
                        ")'s reply could not be received whole: " + e.what());
}

void LoaderSession::State::handle(std::size_t w, Decoder& d) {
  for (;;) {
    const auto id = d.decode<std::uint64_t>();
    const auto kind = d.decode<EntryKind>();
    if (kind == EntryKind::kDone) break;
    if (kind == EntryKind::kBoard) {
      if (workers[w].board) throw ProtocolError("a second task board");
      Worker& worker = workers[w];
      worker.board.emplace(d.decode<Tensor>(), task_board_shape(options.prefetch_factor,
                                                                options.batch_size,
                                                                options.iterable));
      for (const Worker::Deferred& t : worker.deferred) write(w, t.id, t.reset, t.indices);
      worker.deferred.clear();
      publish(w);
      continue;
    }
    // Every task is answered once (an init error answers none): its entry was read.
    if (kind != EntryKind::kInitError && workers[w].answered < workers[w].posted)
      ++workers[w].answered;
    auto it = id >= epoch_first ? tasks.find(id) : tasks.end();
    const bool current = it != tasks.end() && it->second.worker == static_cast<int>(w) &&
                         it->second.status == Status::kPending;
    switch (kind) {
      case EntryKind::kBatch:
        decode(id, d, current);
        if (current) it->second.status = Status::kReady;
        break;
      case EntryKind::kEnd:
        if (current) {
          it->second.status = Status::kEnd;
          workers[w].active = false;
        }
        break;
      case EntryKind::kError:
      case EntryKind::kInitError: {
        WorkerFailure f;
        f.index = d.decode<std::int64_t>();
        f.stage = d.decode<std::string>();
        f.text = d.decode<std::string>();
        if (kind == EntryKind::kInitError) {
          broken = true;  // the worker ends after this
          throw worker_error(static_cast<int>(w), group.pid(w), f);
        }
        if (current) {
          it->second.status = Status::kFailed;
          it->second.failure = std::move(f);
        }
        break;
      }
      default:
        throw ProtocolError("unknown reply kind");
    }
  }
  d.finish();
}

std::string LoaderSession::State::loading(std::size_t w) const {
  std::size_t pending = 0;
  for (const auto& [id, t] : tasks)
    if (t.worker == static_cast<int>(w) && t.status == Status::kPending) ++pending;
  if (pending == 0) return {};
  return std::to_string(pending) + (pending == 1 ? " batch" : " batches");
}

void LoaderSession::State::died(std::size_t w) {
  broken = true;
  // Its socket closed or its process ended, so it is on its way out.
  const std::string what = loading(w);
  throw worker_died(static_cast<int>(w), group.reap(w, kStopGrace), what);
}

LoaderSession::LoaderSession(SessionOptions options, const Launch& launch, Decode decode)
    : state_(std::make_unique<State>(options, launch, std::move(decode))) {
  try {
    state_->start();
  } catch (...) {
    state_->broken = true;
    state_->stop();
    throw;
  }
}

LoaderSession::~LoaderSession() { state_->stop(); }

void LoaderSession::begin_epoch(Source source) {
  State& s = *state_;
  s.source = std::move(source);
  s.source_done = false;
  s.tasks.clear();
  s.epoch_first = s.next_out = s.next_id;
  s.cursor = 0;
  for (State::Worker& w : s.workers) {
    w.load = 0;
    w.active = true;
    w.fresh_epoch = true;
  }
}

std::optional<std::uint64_t> LoaderSession::next() {
  State& s = *state_;
  if (s.broken)
    throw DataLoaderError("DataLoader: the workers were stopped after an error; begin a new epoch");
  std::optional<Clock::time_point> deadline;
  if (s.options.timeout && s.options.timeout->count() > 0) {
    // Clamped so that an absurdly long timeout cannot overflow the clock.
    const Duration limit = std::min(*s.options.timeout, Duration(3.0e7));
    deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
  }
  s.look();
  s.fill();
  for (;;) {
    if (auto id = s.take_ready()) {
      s.fill();
      return id;
    }
    if (s.source_done && s.tasks.empty()) return std::nullopt;
    if (deadline && Clock::now() >= *deadline) {
      s.broken = true;
      std::string what = "a batch";
      if (s.options.in_order) {
        auto it = s.tasks.find(s.next_out);
        if (it != s.tasks.end()) {
          const auto w = static_cast<std::size_t>(it->second.worker);
          what = "batch " + std::to_string(s.next_out - s.epoch_first) + " from worker " +
                 std::to_string(w) + " (pid " + std::to_string(s.group.pid(w)) + ")";
        }
      }
      throw loader_timeout(s.options.timeout->count(), what);
    }
    s.wait(deadline);
    s.fill();
  }
}

bool LoaderSession::broken() const noexcept { return state_->broken; }

std::vector<int> LoaderSession::pids() const { return state_->group.pids(); }

}  // namespace shmtensor::internal
