// Pool: the parent's side, a dispatcher thread that hands tasks to workers (processes
// running pool_worker_main, pool_worker.cc) and delivers their results. The protocol is in
// pool_protocol.h. The dispatcher is the only thread that touches the parent's ends of the
// connections and the workers after construction; other threads hand it tasks through
// pending_ (under mu_) and wake it through an eventfd.
//
// The dispatcher forks the replacement workers (after a death, or max_tasks_per_child), and
// Linux sends a child its PR_SET_PDEATHSIG when the *thread* that forked it ends. So the
// dispatcher ends only once every worker has exited: after close(), it stops the idle
// workers and waits for them; at terminate() it terminates them itself. Ending earlier
// would SIGKILL the replacements in the middle of their orderly exit.
#include "shmtensor/pool.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <thread>
#include <unordered_map>

#include "os/child.h"
#include "os/code_address.h"
#include "os/event_fd.h"
#include "os/poll.h"
#include "process/child_side.h"
#include "process/pool_protocol.h"
#include "process/process_state.h"
#include "process/shutdown.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"

namespace shmtensor {

TaskError::TaskError(const std::string& text, int pid) : Error(text), pid_(pid) {
  auto colon = text.find(": ");
  type_name_ = text.substr(0, colon);
  message_ = colon == std::string::npos ? std::string() : text.substr(colon + 2);
}

namespace detail {
void throw_task_failure(const TaskFailure& f) {
  switch (f.kind) {
    case TaskFailure::Kind::kRaised:
      throw TaskError(f.text, f.pid);
    case TaskFailure::Kind::kWorkerDied:
      throw ProcessExitedException(f.text, f.index, f.pid, f.exit_code, f.signal_name);
    case TaskFailure::Kind::kError:
      break;
  }
  throw Error(f.text);
}
}  // namespace detail

namespace internal {

using Clock = std::chrono::steady_clock;

class PoolCore {
 public:
  PoolCore(int processes, PoolOptions options);
  ~PoolCore();

  void submit(detail::PoolTask task);
  void close();
  void join();
  void terminate();
  int processes() const noexcept { return static_cast<int>(workers_.size()); }
  std::vector<int> pids() const {
    std::lock_guard lock(mu_);
    return pids_;
  }

 private:
  struct Task {
    std::uint64_t id = 0;
    Encoder message;
    std::function<void(Decoder&)> on_result;
    std::function<void(detail::TaskFailure)> on_error;
  };
  struct Worker {
    Process process;
    Connection connection;  // the parent's end
    std::optional<Task> running;
    bool alive = true;
    bool stopped = false;   // kStop sent
    bool retiring = false;  // stopped after max_tasks_per_child tasks: replaced once it exits
    std::size_t completed = 0;
  };

  Worker start_worker(int index);
  void run() noexcept;
  void dispatch();
  void retire_exhausted_workers();
  void stop(Worker& w) noexcept;  // sends kStop
  void read_replies(std::size_t i);
  void handle_reply(Worker& w, Decoder& d);
  void handle_death(std::size_t i);
  void fail_everything(const detail::TaskFailure& failure);
  void end_workers() noexcept;  // SIGTERM (SIGKILL after 5 s) to those alive; reaps them
  void set_broken(std::string why);
  const CodeAddress& address_of(std::uintptr_t address);

  PoolOptions options_;
  std::vector<Worker> workers_;
  UniqueFd wake_;
  std::thread thread_;
  std::atomic<std::uint64_t> next_id_{1};

  mutable std::mutex mu_;  // guards the fields below
  std::deque<Task> pending_;
  std::vector<int> pids_;
  bool closed_ = false;
  bool terminating_ = false;
  bool joined_ = false;
  std::optional<std::string> broken_;  // why no worker is left; fails later submissions
  std::unordered_map<std::uintptr_t, CodeAddress> addresses_;
};

PoolCore::PoolCore(int processes, PoolOptions options) : options_(options) {
  if (processes < 0) throw Error("Pool: processes must be >= 0, got " + std::to_string(processes));
  if (processes == 0)
    processes = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  wake_ = make_event_fd();
  try {
    for (int i = 0; i < processes; ++i) {
      workers_.push_back(start_worker(i));
      pids_.push_back(workers_.back().process.pid());
    }
  } catch (...) {
    for (Worker& w : workers_) w.process.kill();
    workers_.clear();
    throw;
  }
  thread_ = std::thread([this] { run(); });
}

PoolCore::~PoolCore() {
  try {
    if (!joined_) terminate();
  } catch (...) {
  }
}

PoolWorker start_pool_worker(int index, StartMethod method, std::vector<int> siblings) {
  auto [mine, theirs] = shmtensor::pipe();
  WorkerChannel channel{std::make_shared<Connection>(std::move(theirs))};
  detail::LaunchSpec spec = detail::make_launch<true>(index, pool_worker_main, channel);
  siblings.push_back(mine.native_handle());
  close_in_forked_child(spec, std::move(siblings));
  Process process = detail::ProcessAccess::make(std::move(spec));
  channel.connection.reset();
  process.set_daemon(true);
  process.set_start_method(method);
  // start() drops the callable and its arguments: afterwards only the worker holds its end,
  // so its death is an EOF here.
  process.start();
  return PoolWorker{std::move(process), std::move(mine)};
}

PoolCore::Worker PoolCore::start_worker(int index) {
  // Called by the constructor, then only by the dispatcher: the fds are current.
  std::vector<int> siblings;
  for (const Worker& w : workers_)
    if (w.connection.valid()) siblings.push_back(w.connection.native_handle());
  PoolWorker started = start_pool_worker(index, options_.start_method, std::move(siblings));
  return Worker{std::move(started.process), std::move(started.connection), std::nullopt};
}

const CodeAddress& PoolCore::address_of(std::uintptr_t address) {
  std::lock_guard lock(mu_);
  auto it = addresses_.find(address);
  if (it == addresses_.end()) it = addresses_.emplace(address, code_address_of(address)).first;
  return it->second;
}

void PoolCore::submit(detail::PoolTask task) {
  {
    std::lock_guard lock(mu_);
    if (closed_ || terminating_)
      throw Error("Pool: no tasks can be added after close() or terminate()");
    if (broken_) throw Error(*broken_);
  }
  CodeAddress entry = address_of(reinterpret_cast<std::uintptr_t>(task.entry));
  CodeAddress fn = address_of(task.fn);
  Task t;
  t.id = next_id_.fetch_add(1, std::memory_order_relaxed);
  t.message.encode(t.id);
  t.message.encode(entry.module);
  t.message.encode(static_cast<std::uint64_t>(entry.offset));
  t.message.encode(fn.module);
  t.message.encode(static_cast<std::uint64_t>(fn.offset));
  task.encode_args(t.message);
  t.on_result = std::move(task.on_result);
  t.on_error = std::move(task.on_error);
  {
    std::lock_guard lock(mu_);
    if (closed_ || terminating_)
      throw Error("Pool: no tasks can be added after close() or terminate()");
    pending_.push_back(std::move(t));
  }
  signal_event_fd(wake_.get());
}

void PoolCore::close() {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
  }
  signal_event_fd(wake_.get());
}

void PoolCore::join() {
  {
    std::lock_guard lock(mu_);
    if (!closed_ && !terminating_) throw Error("Pool::join: call close() or terminate() first");
  }
  // The dispatcher ends once every worker has exited (and was reaped by it).
  if (thread_.joinable()) thread_.join();
  joined_ = true;
}

void PoolCore::terminate() {
  {
    std::lock_guard lock(mu_);
    terminating_ = true;
  }
  signal_event_fd(wake_.get());
  // The dispatcher terminates the workers before it ends (end_workers).
  if (thread_.joinable()) thread_.join();
  workers_.clear();
  joined_ = true;
}

void PoolCore::end_workers() noexcept {
  std::vector<Process> processes;
  for (Worker& w : workers_) {
    if (!w.alive) continue;
    w.alive = false;
    w.connection.close();
    processes.push_back(std::move(w.process));
  }
  try {
    terminate_processes(processes, std::chrono::seconds(5), /*warn=*/false);
  } catch (...) {
    // The Process destructors below SIGKILL and reap whatever is left.
  }
}

void PoolCore::fail_everything(const detail::TaskFailure& failure) {
  std::deque<Task> pending;
  {
    std::lock_guard lock(mu_);
    pending.swap(pending_);
  }
  for (Task& t : pending) t.on_error(failure);
  for (Worker& w : workers_)
    if (w.running) {
      w.running->on_error(failure);
      w.running.reset();
    }
}

void PoolCore::set_broken(std::string why) {
  std::lock_guard lock(mu_);
  if (!broken_) broken_ = std::move(why);
}

namespace {
detail::TaskFailure error_failure(std::string text) {
  detail::TaskFailure f;
  f.kind = detail::TaskFailure::Kind::kError;
  f.text = std::move(text);
  return f;
}
}  // namespace

void PoolCore::dispatch() {
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (!w.alive || w.stopped || w.running) continue;
    std::optional<Task> task;
    {
      std::lock_guard lock(mu_);
      if (pending_.empty()) return;
      task.emplace(std::move(pending_.front()));
      pending_.pop_front();
    }
    w.running = std::move(task);
    try {
      ConnectionAccess::send(w.connection, std::move(w.running->message));
    } catch (...) {
      // The worker is gone (EPIPE): the task fails as one its worker died running.
      handle_death(i);
    }
  }
}

void PoolCore::retire_exhausted_workers() {
  if (options_.max_tasks_per_child == 0) return;
  for (Worker& w : workers_) {
    if (!w.alive || w.stopped || w.running || w.completed < options_.max_tasks_per_child) continue;
    stop(w);  // it exits; handle_death then starts its replacement
    w.retiring = true;
  }
}

void PoolCore::stop(Worker& w) noexcept {
  Encoder message;
  message.encode(kStop);
  try {
    ConnectionAccess::send(w.connection, std::move(message));
  } catch (...) {
    // Already gone: handle_death sees that too.
  }
  w.stopped = true;
}

void PoolCore::handle_reply(Worker& w, Decoder& d) {
  auto id = d.decode<std::uint64_t>();
  auto ok = d.decode<std::uint8_t>();
  if (!w.running || w.running->id != id || ok > 1)
    throw ProtocolError("Pool: worker " + std::to_string(w.process.pid()) +
                        " replied to a task it was not running");
  Task task = std::move(*w.running);
  w.running.reset();
  ++w.completed;
  if (ok == 1) {
    try {
      task.on_result(d);
    } catch (...) {
      // The result could not be decoded (a malformed message): the task fails with why.
      task.on_error(error_failure("Pool: the result of a task could not be received: " +
                                  describe_current_exception()));
    }
  } else {
    detail::TaskFailure f;
    f.kind = detail::TaskFailure::Kind::kRaised;
    f.text = d.decode<std::string>();
    f.pid = w.process.pid();
    d.finish();
    task.on_error(std::move(f));
  }
}

void PoolCore::read_replies(std::size_t i) {
  Worker& w = workers_[i];
  while (w.alive && w.connection.poll(std::chrono::nanoseconds(0))) {
    try {
      Decoder d = ConnectionAccess::recv(w.connection, std::chrono::nanoseconds(0));
      handle_reply(w, d);
    } catch (const ConnectionClosed&) {
      handle_death(i);
    } catch (...) {
      // A malformed reply: this worker cannot be trusted any more.
      w.process.kill();
      handle_death(i);
    }
  }
}

void PoolCore::handle_death(std::size_t i) {
  Worker& w = workers_[i];
  if (!w.alive) return;
  w.alive = false;
  w.connection.close();
  if (!w.process.join(std::chrono::seconds(5))) {
    w.process.kill();  // its connection closed but it lingers: it is of no use any more
    w.process.join();
  }
  const int pid = w.process.pid();
  const int code = w.process.exitcode().value_or(255);
  if (w.running) {
    std::string how =
        code < 0 ? "signal " + signal_name(-code) : "exit code " + std::to_string(code);
    std::string msg = "pool worker " + std::to_string(i) + " (pid " + std::to_string(pid) +
                      ") terminated with " + how + " while running this task";
    detail::TaskFailure f;
    f.kind = detail::TaskFailure::Kind::kWorkerDied;
    f.text = std::move(msg);
    f.pid = pid;
    f.index = static_cast<int>(i);
    f.exit_code = code;
    if (code < 0) f.signal_name = signal_name(-code);
    w.running->on_error(std::move(f));
    w.running.reset();
  } else if (w.stopped && !w.retiring) {
    return;  // exited as asked
  } else if (w.completed == 0) {
    // It died before doing anything: starting another would likely fail the same way.
    std::string error = w.process.error();
    set_broken("Pool: worker " + std::to_string(pid) + " ended before running a task (" +
               (code < 0 ? signal_name(-code) : "exit code " + std::to_string(code)) + ")" +
               (error.empty() ? std::string() : ": " + error));
    return;
  }
  {
    std::lock_guard lock(mu_);
    // After close() with nothing left to run, no task needs a replacement.
    if (terminating_ || (closed_ && pending_.empty())) return;
  }
  try {
    workers_[i] = start_worker(static_cast<int>(i));
    std::lock_guard lock(mu_);
    pids_[i] = workers_[i].process.pid();
  } catch (...) {
    set_broken("Pool: cannot start a replacement worker: " + describe_current_exception());
  }
}

void PoolCore::run() noexcept {
  try {
    for (;;) {
      bool closed;
      {
        std::lock_guard lock(mu_);
        if (terminating_) break;
        closed = closed_;
      }
      retire_exhausted_workers();
      dispatch();
      bool any_alive = false, any_usable = false, any_running = false;
      for (Worker& w : workers_) {
        any_alive = any_alive || w.alive;
        any_usable = any_usable || (w.alive && (!w.stopped || w.retiring));
        any_running = any_running || w.running.has_value();
      }
      bool pending_empty;
      {
        std::lock_guard lock(mu_);
        pending_empty = pending_.empty();
      }
      if (closed && pending_empty && !any_running) {
        // Every task is done: stop the workers (none is replaced any more) and wait for
        // them to exit before this thread ends (see the file comment).
        for (Worker& w : workers_) {
          if (w.alive && !w.stopped) stop(w);
          w.retiring = false;
        }
        if (!any_alive) break;
      } else if (!any_usable) {
        set_broken("Pool: no worker is left");
        std::string why;
        {
          std::lock_guard lock(mu_);
          why = *broken_;
        }
        fail_everything(error_failure(why));
        if (closed) continue;  // nothing is left to run now: the branch above ends
      }

      std::vector<int> fds{wake_.get()};
      bool polling = false;
      for (Worker& w : workers_) {
        if (!w.alive) continue;
        ProcessState* s = detail::ProcessAccess::state(w.process);
        fds.push_back(w.connection.native_handle());
        fds.push_back(s->pidfd());
        polling = polling || s->needs_polling();
      }
      std::optional<std::chrono::nanoseconds> timeout;
      if (polling) timeout = std::chrono::milliseconds(10);
      wait_readable(fds, timeout);
      drain_event_fd(wake_.get());
      for (std::size_t i = 0; i < workers_.size(); ++i) {
        read_replies(i);
        // A reply sent just before death was read above; now the death itself.
        if (workers_[i].alive && !workers_[i].process.is_alive()) {
          read_replies(i);
          handle_death(i);
        }
      }
    }
  } catch (...) {
    set_broken("Pool: the dispatcher failed: " + describe_current_exception());
  }
  // After terminate() (or a failure of this thread): the workers end here, from the thread
  // that started the replacements, so that they get SIGTERM like the others.
  end_workers();
  fail_everything(error_failure("Pool: terminated before this task finished"));
}

}  // namespace internal

Pool::Pool(int processes, PoolOptions options)
    : core_(std::make_unique<internal::PoolCore>(processes, options)) {}
Pool::~Pool() = default;
void Pool::submit(detail::PoolTask task) { core_->submit(std::move(task)); }
void Pool::close() { core_->close(); }
void Pool::join() { core_->join(); }
void Pool::terminate() { core_->terminate(); }
int Pool::processes() const noexcept { return core_->processes(); }
std::vector<int> Pool::pids() const { return core_->pids(); }

}  // namespace shmtensor
