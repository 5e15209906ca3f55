// Pool: a fixed set of worker processes that run tasks, like multiprocessing.Pool.
//
//   Tensor double_it(Tensor t) { return t.mul(2); }
//   shmtensor::Pool pool(4);
//   std::vector<Tensor> out = pool.map(double_it, inputs);  // results in input order
//   shmtensor::AsyncResult<int> f = pool.apply_async(add, 1, 2);  // f.get() == 3
//   for (Tensor t : pool.imap_unordered(double_it, inputs)) { ... }
//   std::vector<int> sq = pool.map(square, numbers, /*chunksize=*/64);  // 64 per message
//   std::vector<int> sums = pool.starmap(add, pairs);  // add(a, b) for each {a, b}
//   pool.close();
//   pool.join();
//
// Rules:
//  - A task is a plain function or a captureless lambda (the workers exist before the task
//    does, so the function is named by its address, or for kExec workers by its offset in
//    the executable). Its parameter and result types must be encodable (codec.h).
//  - Arguments and results travel as encoded messages: tensors by reference through shared
//    memory (moved there in place on first send), never copied.
//  - An exception thrown by a task is thrown by get() / map() / the result stream as
//    TaskError, whose what() is "<exception type>: <what()>".
//  - A worker that dies while running a task fails that task with ProcessExitedException
//    and is replaced. Workers are daemons: SIGKILLed with their parent (the thread that
//    started them), terminated by terminate() and by the destructor.
//
// Thread safety: apply_async/map/imap/imap_unordered may be called from several threads.
// close(), join() and terminate() by one thread. A dispatcher thread in the parent sends
// tasks to idle workers (one task per worker at a time) and delivers results.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/error.h"
#include "shmtensor/process.h"
#include "shmtensor/spawn.h"
#include "shmtensor/start_method.h"

namespace shmtensor {

// A task threw in a worker. what() is "<type>: <message>".
class TaskError : public Error {
 public:
  // `text` is "<type>: <message>" as reported by the worker.
  TaskError(const std::string& text, int pid);
  const std::string& type_name() const noexcept { return type_name_; }
  const std::string& message() const noexcept { return message_; }
  int pid() const noexcept { return pid_; }  // the worker that ran the task

 private:
  std::string type_name_;
  std::string message_;
  int pid_;
};

struct PoolOptions {
  StartMethod start_method = StartMethod::kFork;
  // A worker that has run this many tasks (a chunk counts as one) exits and is replaced by
  // a fresh process, as multiprocessing.Pool's maxtasksperchild: for tasks that leak. 0:
  // workers live as long as the pool.
  std::size_t max_tasks_per_child = 0;
};

namespace internal {
class PoolCore;
}

namespace detail {

// Runs in a worker: decodes the arguments, calls the function, encodes its result.
using PoolEntry = void (*)(std::uintptr_t fn, Decoder& args, Encoder& reply);

template <class FnPtr>
void pool_entry(std::uintptr_t fn_address, Decoder& d, Encoder& reply) {
  FnPtr fn = reinterpret_cast<FnPtr>(fn_address);
  using Params = typename FnTraits<FnPtr>::Params;
  auto args = d.template decode<Params>();
  d.finish();
  using R = typename FnTraits<FnPtr>::Result;
  if constexpr (std::is_void_v<R>) {
    std::apply([&](auto&... a) { fn(a...); }, args);
    reply.encode(std::monostate{});
  } else {
    reply.encode(std::apply([&](auto&... a) -> decltype(auto) { return fn(a...); }, args));
  }
}

// "<type>: <message>" of the exception being handled (in a catch block), and this
// process's pid: for pool_chunk_entry, which reports each input's failure on its own.
std::string current_exception_text();
int current_pid() noexcept;

// A chunk's reply: the worker's pid, then per input its result or its exception's text.
template <class R>
using ChunkReply = std::pair<std::int32_t, std::vector<std::variant<R, std::string>>>;

// Runs in a worker: fn on every argument tuple of a chunk (map/imap/starmap with
// chunksize > 1). An input whose call throws fails alone; the others keep their results.
template <class FnPtr>
void pool_chunk_entry(std::uintptr_t fn_address, Decoder& d, Encoder& reply) {
  FnPtr fn = reinterpret_cast<FnPtr>(fn_address);
  using Params = typename FnTraits<FnPtr>::Params;
  using R = std::decay_t<typename FnTraits<FnPtr>::Result>;
  auto chunk = d.template decode<std::vector<Params>>();
  d.finish();
  ChunkReply<R> out;
  out.first = current_pid();
  out.second.reserve(chunk.size());
  for (auto& args : chunk) {
    try {
      out.second.emplace_back(std::in_place_index<0>,
                              std::apply([&](auto&... a) -> decltype(auto) { return fn(a...); }, args));
    } catch (...) {
      out.second.emplace_back(std::in_place_index<1>, current_exception_text());
    }
  }
  chunk.clear();  // drop the arguments (and their shared memory) before replying
  reply.encode(out);
}

// Why a task failed, as data. The exception is made (by throw_task_failure) in the thread
// that asks for the result, so that exception objects never cross threads: their
// reference counts live in uninstrumented libstdc++, which ThreadSanitizer cannot see.
struct TaskFailure {
  enum class Kind : std::uint8_t { kRaised, kWorkerDied, kError };
  Kind kind = Kind::kError;
  std::string text;  // kRaised: "<type>: <message>"; otherwise the whole message
  int pid = 0;
  int index = 0;  // kWorkerDied: the worker's slot
  int exit_code = 0;
  std::string signal_name;
};
// kRaised: TaskError; kWorkerDied: ProcessExitedException; kError: Error.
[[noreturn]] void throw_task_failure(const TaskFailure& failure);

struct PoolTask {
  PoolEntry entry = nullptr;
  std::uintptr_t fn = 0;
  std::function<void(Encoder&)> encode_args;  // called once, inside Pool::submit
  std::function<void(Decoder&)> on_result;    // in the dispatcher thread; may throw
  std::function<void(TaskFailure)> on_error;  // in the dispatcher thread
};

template <class F>
using PoolFn = typename FnPointerOf<F>::type;

template <class F>
constexpr void check_pool_fn() {
  static_assert(!std::is_void_v<PoolFn<F>>,
                "Pool runs plain functions or captureless lambdas (they are named by address "
                "across processes); a capturing lambda or functor cannot be sent to a worker");
}

template <class F>
using PoolResult = std::decay_t<typename FnTraits<PoolFn<F>>::Result>;

}  // namespace detail

// The results of imap / imap_unordered, as they arrive. next() blocks for the next one
// (in input order for imap, in completion order for imap_unordered), returns nullopt after
// the last, and rethrows a task's error in its place. Also an input range:
//   for (auto& r : stream) ...
// Used by one thread at a time; valid after the Pool is gone (its remaining results then
// fail with an Error).
template <class R>
class ResultStream {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::size_t, std::variant<R, detail::TaskFailure>> ready;
    std::size_t total = 0;
    std::size_t next_index = 0;  // imap: the index handed out next
    std::size_t delivered = 0;
    bool ordered = true;
  };

 public:
  std::optional<R> next() {
    std::unique_lock lock(state_->mu);
    if (state_->delivered == state_->total) return std::nullopt;
    auto it = state_->ready.end();
    state_->cv.wait(lock, [&] {
      it = state_->ordered ? state_->ready.find(state_->next_index) : state_->ready.begin();
      return it != state_->ready.end();
    });
    auto outcome = std::move(it->second);
    state_->ready.erase(it);
    ++state_->next_index;
    ++state_->delivered;
    lock.unlock();
    if (auto* f = std::get_if<detail::TaskFailure>(&outcome)) detail::throw_task_failure(*f);
    return std::move(std::get<0>(outcome));
  }
  std::size_t size() const noexcept { return state_->total; }

  class iterator {
   public:
    using value_type = R;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(ResultStream* s) : stream_(s) { ++*this; }
    R& operator*() { return *current_; }
    iterator& operator++() {
      current_ = stream_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const { return !current_.has_value(); }

   private:
    ResultStream* stream_ = nullptr;
    std::optional<R> current_;
  };
  iterator begin() { return iterator(this); }
  std::default_sentinel_t end() const { return {}; }

 private:
  friend class Pool;
  ResultStream(std::size_t total, bool ordered) : state_(std::make_shared<State>()) {
    state_->total = total;
    state_->ordered = ordered;
  }
  // Delivery callbacks for task `index`, run in the dispatcher thread.
  std::function<void(Decoder&)> on_result(std::size_t index) const {
    return [s = state_, index](Decoder& d) {
      R value = d.template decode<R>();
      d.finish();
      std::lock_guard lock(s->mu);
      s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(index),
                       std::forward_as_tuple(std::in_place_index<0>, std::move(value)));
      s->cv.notify_all();
    };
  }
  std::function<void(detail::TaskFailure)> on_error(std::size_t index) const {
    return on_chunk_error(index, 1);
  }
  // The same for the `count` inputs from `first` on, sent as one chunk.
  std::function<void(Decoder&)> on_chunk_result(std::size_t first, std::size_t count) const {
    return [s = state_, first, count](Decoder& d) {
      auto reply = d.template decode<detail::ChunkReply<R>>();
      d.finish();
      if (reply.second.size() != count)
        throw ProtocolError("Pool: a chunk of " + std::to_string(count) + " inputs came back with " +
                            std::to_string(reply.second.size()) + " results");
      std::lock_guard lock(s->mu);
      for (std::size_t i = 0; i < count; ++i) {
        auto& item = reply.second[i];
        if (item.index() == 0) {
          s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(first + i),
                           std::forward_as_tuple(std::in_place_index<0>,
                                                 std::move(std::get<0>(item))));
        } else {
          detail::TaskFailure f;
          f.kind = detail::TaskFailure::Kind::kRaised;
          f.text = std::move(std::get<1>(item));
          f.pid = reply.first;
          s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(first + i),
                           std::forward_as_tuple(std::in_place_index<1>, std::move(f)));
        }
      }
      s->cv.notify_all();
    };
  }
  std::function<void(detail::TaskFailure)> on_chunk_error(std::size_t first,
                                                          std::size_t count) const {
    return [s = state_, first, count](detail::TaskFailure f) {
      std::lock_guard lock(s->mu);
      for (std::size_t i = 0; i < count; ++i)
        s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(first + i),
                         std::forward_as_tuple(std::in_place_index<1>, f));
      s->cv.notify_all();
    };
  }
  std::shared_ptr<State> state_;
};

// The pending result of Pool::apply_async (Python's AsyncResult; a std::future-like
// handle). get() blocks until the task finished and returns its result, or throws:
// TaskError (the task threw), ProcessExitedException (its worker died running it), Error
// (the pool was terminated or has no worker left). get() may be called once.
template <class R>
class AsyncResult {
  using Stored = std::conditional_t<std::is_void_v<R>, std::monostate, R>;
  using Outcome = std::variant<Stored, detail::TaskFailure>;

 public:
  AsyncResult() = default;
  R get() {
    Outcome outcome = future_.get();
    if (auto* f = std::get_if<detail::TaskFailure>(&outcome)) detail::throw_task_failure(*f);
    if constexpr (!std::is_void_v<R>) return std::move(std::get<0>(outcome));
  }
  void wait() const { future_.wait(); }
  // True once the task has finished (successfully or not).
  bool wait_for(Duration timeout) const {
    return future_.wait_for(timeout) == std::future_status::ready;
  }
  bool ready() const { return wait_for(Duration::zero()); }
  bool valid() const noexcept { return future_.valid(); }

 private:
  friend class Pool;
  explicit AsyncResult(std::future<Outcome> future) : future_(std::move(future)) {}
  std::future<Outcome> future_;
};

class Pool {
 public:
  // Starts `processes` workers (0: one per CPU). Throws SystemError / Error when a worker
  // cannot be started (the others are then stopped).
  explicit Pool(int processes = 0, PoolOptions options = {});
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  // terminate() unless join() already ran. Never throws.
  ~Pool();

  // Runs fn(args...) in a worker. The arguments are encoded now (errors throw here).
  template <class F, class... Args>
  AsyncResult<detail::PoolResult<F>> apply_async(F&& fn, Args&&... args) {
    detail::check_pool_fn<F>();
    using FnPtr = detail::PoolFn<F>;
    using Params = typename detail::FnTraits<FnPtr>::Params;
    using R = detail::PoolResult<F>;
    using Stored = std::conditional_t<std::is_void_v<R>, std::monostate, R>;
    using Outcome = std::variant<Stored, detail::TaskFailure>;
    auto promise = std::make_shared<std::promise<Outcome>>();
    AsyncResult<R> result(promise->get_future());
    Params params(std::forward<Args>(args)...);
    detail::PoolTask task;
    task.entry = &detail::pool_entry<FnPtr>;
    task.fn = reinterpret_cast<std::uintptr_t>(+fn);
    task.encode_args = [&params](Encoder& e) { e.encode(params); };
    task.on_result = [promise](Decoder& d) {
      Stored value = d.template decode<Stored>();
      d.finish();
      promise->set_value(Outcome(std::in_place_index<0>, std::move(value)));
    };
    task.on_error = [promise](detail::TaskFailure f) {
      promise->set_value(Outcome(std::in_place_index<1>, std::move(f)));
    };
    submit(std::move(task));
    return result;
  }
  // apply_async(...).get().
  template <class F, class... Args>
  detail::PoolResult<F> apply(F&& fn, Args&&... args) {
    return apply_async(std::forward<F>(fn), std::forward<Args>(args)...).get();
  }

  // fn(x) for every x of `inputs`; results in input order. Throws the first failed task's
  // error (in input order) once the tasks before it have finished. With chunksize > 1 the
  // inputs go to the workers in chunks of that many, one message each way per chunk (as in
  // multiprocessing.Pool: fewer, larger messages for many small tasks); an input that
  // throws still fails alone, but a worker that dies fails its whole chunk.
  template <class F, class Range>
  std::vector<detail::PoolResult<F>> map(F&& fn, const Range& inputs, std::size_t chunksize = 1) {
    return collect(imap(std::forward<F>(fn), inputs, chunksize));
  }
  template <class F, class Range>
  ResultStream<detail::PoolResult<F>> imap(F&& fn, const Range& inputs, std::size_t chunksize = 1) {
    return stream<false>(std::forward<F>(fn), inputs, /*ordered=*/true, chunksize);
  }
  template <class F, class Range>
  ResultStream<detail::PoolResult<F>> imap_unordered(F&& fn, const Range& inputs,
                                                     std::size_t chunksize = 1) {
    return stream<false>(std::forward<F>(fn), inputs, /*ordered=*/false, chunksize);
  }
  // fn(a, b, ...) for every tuple (or pair) {a, b, ...} of `inputs` (Python's starmap);
  // results in input order.
  template <class F, class Range>
  std::vector<detail::PoolResult<F>> starmap(F&& fn, const Range& inputs,
                                             std::size_t chunksize = 1) {
    return collect(stream<true>(std::forward<F>(fn), inputs, /*ordered=*/true, chunksize));
  }

  // No more tasks; workers exit once the submitted ones are done.
  void close();
  // Waits for the workers to exit. Requires close() or terminate() first (throws Error).
  void join();
  // Stops now: workers get SIGTERM (SIGKILL after 5 s); unfinished tasks fail with Error.
  void terminate();

  int processes() const noexcept;
  // The current workers' pids (a worker that died is replaced by a new pid).
  std::vector<int> pids() const;

 private:
  template <class R>
  static std::vector<R> collect(ResultStream<R> stream) {
    std::vector<R> out;
    out.reserve(stream.size());
    while (auto r = stream.next()) out.push_back(std::move(*r));
    return out;
  }

  // Unpack: each input is a tuple of fn's arguments (starmap); otherwise its one argument.
  template <bool Unpack, class F, class Range>
  ResultStream<detail::PoolResult<F>> stream(F&& fn, const Range& inputs, bool ordered,
                                             std::size_t chunksize) {
    detail::check_pool_fn<F>();
    using FnPtr = detail::PoolFn<F>;
    using R = detail::PoolResult<F>;
    using Params = typename detail::FnTraits<FnPtr>::Params;
    static_assert(!std::is_void_v<R>, "map/imap/starmap need a function that returns a value");
    static_assert(Unpack || detail::FnTraits<FnPtr>::kArity == 1,
                  "map/imap call fn with one argument (starmap unpacks tuples)");
    if (chunksize == 0) throw std::invalid_argument("Pool: chunksize must be at least 1");
    auto params_of = [](const auto& input) {
      if constexpr (Unpack)
        return std::apply([](const auto&... a) { return Params(a...); }, input);
      else
        return Params(input);
    };
    std::size_t n = static_cast<std::size_t>(std::distance(std::begin(inputs), std::end(inputs)));
    ResultStream<R> results(n, ordered);
    std::vector<Params> chunk;
    std::size_t first = 0, index = 0;
    auto send = [&] {
      detail::PoolTask task;
      task.fn = reinterpret_cast<std::uintptr_t>(+fn);
      if (chunksize == 1) {
        task.entry = &detail::pool_entry<FnPtr>;
        task.encode_args = [&chunk](Encoder& e) { e.encode(chunk.front()); };
        task.on_result = results.on_result(first);
        task.on_error = results.on_error(first);
      } else {
        task.entry = &detail::pool_chunk_entry<FnPtr>;
        task.encode_args = [&chunk](Encoder& e) { e.encode(chunk); };
        task.on_result = results.on_chunk_result(first, chunk.size());
        task.on_error = results.on_chunk_error(first, chunk.size());
      }
      submit(std::move(task));
      chunk.clear();
    };
    for (const auto& input : inputs) {
      if (chunk.empty()) first = index;
      chunk.push_back(params_of(input));
      ++index;
      if (chunk.size() == chunksize) send();
    }
    if (!chunk.empty()) send();
    return results;
  }

  // Encodes the task (in this thread) and queues it for the dispatcher. Throws Error after
  // close() / terminate().
  void submit(detail::PoolTask task);

  std::unique_ptr<internal::PoolCore> core_;
};

}  // namespace shmtensor
