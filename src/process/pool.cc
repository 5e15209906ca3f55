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
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/pool.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "os/code_address.h"
#include "os/event_fd.h"
#include "process/pool_protocol.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/current_exception.h"
#include "shmtensor/internal/worker_group.h"

namespace shmtensor {

TaskError::TaskError(const std::string& text, int pid) : Error(text), pid_(pid) {
  auto colon = text.find(": ");
  type_name_ = text.substr(0, colon);
  message_ = colon == std::string::npos ? std::string() : text.substr(colon + 2);
}

namespace internal {
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

class PoolCore {
 public:
  PoolCore(int processes, PoolOptions options);
  ~PoolCore();

  void submit(PoolTask task);
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
    std::function<void(Decoder&, int)> on_result;
    std::function<void(TaskFailure)> on_error;
  };
  // The pool's view of worker i of group_.
  struct Worker {
    std::optional<Task> running;
    bool alive = true;
    bool stopped = false;   // kStop sent
    bool retiring = false;  // stopped after max_tasks_per_child tasks: replaced once it exits
    std::size_t completed = 0;
  };

  void run() noexcept;
  void dispatch();
  void retire_exhausted_workers();
  void stop(std::size_t i) noexcept;  // sends kStop
  void read_replies(std::size_t i);
  void handle_reply(std::size_t i, Decoder& d);
  void handle_death(std::size_t i);
  void fail_everything(const TaskFailure& failure);
  void set_broken(std::string why);
  const CodeAddress& address_of(std::uintptr_t address);

  PoolOptions options_;
  WorkerGroup group_;
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

PoolCore::PoolCore(int processes, PoolOptions options)
    : options_(options), group_(options.start_method, [](int index, WorkerLink link) {
        return make_launch<true>(index, pool_worker_main, std::move(link));
      }) {
  if (processes < 0) throw Error("Pool: processes must be >= 0, got " + std::to_string(processes));
  if (processes == 0)
    processes = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  wake_ = make_event_fd();
  try {
    for (std::size_t i = 0; i < static_cast<std::size_t>(processes); ++i) {
      group_.start(i);
      workers_.emplace_back();
      pids_.push_back(group_.pid(i));
    }
  } catch (...) {
    for (std::size_t i = 0; i < group_.size(); ++i) group_.kill(i);
    throw;
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    // A system failure like any other (EAGAIN: the thread limit), so an Error; group_'s
    // destructor ends the workers.
    throw SystemError(e.code().value(), "pthread_create", "the Pool's dispatcher thread");
  }
}

PoolCore::~PoolCore() {
  try {
    if (!joined_) terminate();
  } catch (...) {
  }
}

const CodeAddress& PoolCore::address_of(std::uintptr_t address) {
  std::lock_guard lock(mu_);
  auto it = addresses_.find(address);
  if (it == addresses_.end()) it = addresses_.emplace(address, code_address_of(address)).first;
  return it->second;
}

void PoolCore::submit(PoolTask task) {
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
  // The dispatcher terminates the workers before it ends (at the end of run()).
  if (thread_.joinable()) thread_.join();
  workers_.clear();
  joined_ = true;
}

void PoolCore::fail_everything(const TaskFailure& failure) {
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
TaskFailure error_failure(std::string text) {
  TaskFailure f;
  f.kind = TaskFailure::Kind::kError;
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
      internal::ConnectionAccess::send(group_.connection(i), std::move(w.running->message));
    } catch (...) {
      // The worker is gone (EPIPE): the task fails as one its worker died running.
      handle_death(i);
    }
  }
}

void PoolCore::retire_exhausted_workers() {
  if (options_.max_tasks_per_child == 0) return;
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (!w.alive || w.stopped || w.running || w.completed < options_.max_tasks_per_child) continue;
    stop(i);  // it exits; handle_death then starts its replacement
    w.retiring = true;
  }
}

void PoolCore::stop(std::size_t i) noexcept {
  try {
    group_.connection(i).send(kStop);
  } catch (...) {
    // Already gone: handle_death sees that too.
  }
  workers_[i].stopped = true;
}

void PoolCore::handle_reply(std::size_t i, Decoder& d) {
  Worker& w = workers_[i];
  auto id = d.decode<std::uint64_t>();
  auto ok = d.decode<std::uint8_t>();
  if (!w.running || w.running->id != id || ok > 1)
    throw ProtocolError("Pool: worker " + std::to_string(group_.pid(i)) +
                        " replied to a task it was not running");
  Task task = std::move(*w.running);
  w.running.reset();
  ++w.completed;
  if (ok == 1) {
    try {
      task.on_result(d, group_.pid(i));
    } catch (...) {
      // The result could not be decoded (a malformed message): the task fails with why.
      task.on_error(error_failure("Pool: the result of a task could not be received: " +
                                  describe_current_exception()));
    }
  } else {
    TaskFailure f;
    f.kind = TaskFailure::Kind::kRaised;
    f.text = d.decode<std::string>();
    f.pid = group_.pid(i);
    d.finish();
    task.on_error(std::move(f));
  }
}

void PoolCore::read_replies(std::size_t i) {
  while (workers_[i].alive && group_.connection(i).poll(std::chrono::nanoseconds(0))) {
    try {
      Decoder d = internal::ConnectionAccess::recv(group_.connection(i), std::chrono::nanoseconds(0));
      handle_reply(i, d);
    } catch (const ConnectionClosed&) {
      handle_death(i);
    } catch (...) {
      // A malformed reply: this worker cannot be trusted any more.
      group_.kill(i);
      handle_death(i);
    }
  }
}

void PoolCore::handle_death(std::size_t i) {
  Worker& w = workers_[i];
  if (!w.alive) return;
  w.alive = false;
  // Its connection closed or its process ended; one that lingers is of no use any more.
  const WorkerExit exit = group_.reap(i, std::chrono::seconds(5));
  const int pid = exit.pid;
  const int code = exit.exit_code;
  if (w.running) {
    std::string how = code < 0 ? "signal " + exit.signal_name : "exit code " + std::to_string(code);
    std::string msg = "pool worker " + std::to_string(i) + " (pid " + std::to_string(pid) +
                      ") terminated with " + how + " while running this task";
    TaskFailure f;
    f.kind = TaskFailure::Kind::kWorkerDied;
    f.text = std::move(msg);
    f.pid = pid;
    f.index = static_cast<int>(i);
    f.exit_code = code;
    f.signal_name = exit.signal_name;
    w.running->on_error(std::move(f));
    w.running.reset();
  } else if (w.stopped && !w.retiring) {
    return;  // exited as asked
  } else if (w.completed == 0) {
    // It died before doing anything: starting another would likely fail the same way.
    set_broken("Pool: worker " + std::to_string(pid) + " ended before running a task (" +
               (code < 0 ? exit.signal_name : "exit code " + std::to_string(code)) + ")" +
               (exit.error.empty() ? std::string() : ": " + exit.error));
    return;
  }
  {
    std::lock_guard lock(mu_);
    // After close() with nothing left to run, no task needs a replacement.
    if (terminating_ || (closed_ && pending_.empty())) return;
  }
  try {
    group_.start(i);
    workers_[i] = Worker{};
    std::lock_guard lock(mu_);
    pids_[i] = group_.pid(i);
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
        for (std::size_t i = 0; i < workers_.size(); ++i) {
          if (workers_[i].alive && !workers_[i].stopped) stop(i);
          workers_[i].retiring = false;
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

      const std::vector<bool> may_have_ended = group_.wait(std::nullopt, wake_.get());
      drain_event_fd(wake_.get());
      for (std::size_t i = 0; i < workers_.size(); ++i) {
        read_replies(i);
        // A reply sent just before death was read above; now the death itself.
        if (workers_[i].alive && may_have_ended[i] && group_.ended(i)) {
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
  for (Worker& w : workers_) w.alive = false;
  group_.stop({}, Duration::zero(), std::chrono::seconds(5));
  fail_everything(error_failure("Pool: terminated before this task finished"));
}

}  // namespace internal

Pool::Pool(int processes, PoolOptions options)
    : core_(std::make_unique<internal::PoolCore>(processes, options)) {}
Pool::~Pool() = default;
void Pool::submit(internal::PoolTask task) { core_->submit(std::move(task)); }
void Pool::close() { core_->close(); }
void Pool::join() { core_->join(); }
void Pool::terminate() { core_->terminate(); }
int Pool::processes() const noexcept { return core_->processes(); }
std::vector<int> Pool::pids() const { return core_->pids(); }

}  // namespace shmtensor
