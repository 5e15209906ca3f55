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
//    and is replaced. Workers are daemons, terminated by terminate() and by the destructor.
//    Like any child they are SIGKILLed when the thread that started them ends
//    (PR_SET_PDEATHSIG): the first ones are started by the thread that constructs the Pool
//    (construct it in a thread that outlives it, normally the main thread), replacements by
//    the pool's dispatcher thread, which ends only after every worker has exited.
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
#include "shmtensor/export.h"
#include "shmtensor/internal/pool_task.h"
#include "shmtensor/pool_results.h"
#include "shmtensor/process.h"
#include "shmtensor/spawn.h"
#include "shmtensor/start_method.h"

namespace shmtensor {

// A task threw in a worker. what() is "<type>: <message>".
class SHMTENSOR_API TaskError : public Error {
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

class SHMTENSOR_API Pool {
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
  AsyncResult<internal::PoolResult<F>> apply_async(F&& fn, Args&&... args) {
    internal::check_pool_fn<F>();
    using FnPtr = internal::PoolFn<F>;
    using Params = typename internal::FnTraits<FnPtr>::Params;
    using R = internal::PoolResult<F>;
    using Stored = std::conditional_t<std::is_void_v<R>, std::monostate, R>;
    using Outcome = std::variant<Stored, internal::TaskFailure>;
    auto promise = std::make_shared<std::promise<Outcome>>();
    AsyncResult<R> result(promise->get_future());
    Params params(std::forward<Args>(args)...);
    internal::PoolTask task;
    task.entry = &internal::pool_entry<FnPtr>;
    task.fn = reinterpret_cast<std::uintptr_t>(+fn);
    task.encode_args = [&params](Encoder& e) { e.encode(params); };
    task.on_result = [promise](Decoder& d, int /*pid*/) {
      Stored value = d.template decode<Stored>();
      d.finish();
      promise->set_value(Outcome(std::in_place_index<0>, std::move(value)));
    };
    task.on_error = [promise](internal::TaskFailure f) {
      promise->set_value(Outcome(std::in_place_index<1>, std::move(f)));
    };
    submit(std::move(task));
    return result;
  }
  // apply_async(...).get().
  template <class F, class... Args>
  internal::PoolResult<F> apply(F&& fn, Args&&... args) {
    return apply_async(std::forward<F>(fn), std::forward<Args>(args)...).get();
  }

  // fn(x) for every x of `inputs`; results in input order. Throws the first failed task's
  // error (in input order) once the tasks before it have finished. With chunksize > 1 the
  // inputs go to the workers in chunks of that many, one message each way per chunk (as in
  // multiprocessing.Pool: fewer, larger messages for many small tasks); an input that
  // throws still fails alone, but a worker that dies fails its whole chunk.
  template <class F, class Range>
  std::vector<internal::PoolResult<F>> map(F&& fn, const Range& inputs, std::size_t chunksize = 1) {
    return collect(imap(std::forward<F>(fn), inputs, chunksize));
  }
  template <class F, class Range>
  ResultStream<internal::PoolResult<F>> imap(F&& fn, const Range& inputs, std::size_t chunksize = 1) {
    return stream<false>(std::forward<F>(fn), inputs, /*ordered=*/true, chunksize);
  }
  template <class F, class Range>
  ResultStream<internal::PoolResult<F>> imap_unordered(F&& fn, const Range& inputs,
                                                     std::size_t chunksize = 1) {
    return stream<false>(std::forward<F>(fn), inputs, /*ordered=*/false, chunksize);
  }
  // fn(a, b, ...) for every tuple (or pair) {a, b, ...} of `inputs` (Python's starmap);
  // results in input order.
  template <class F, class Range>
  std::vector<internal::PoolResult<F>> starmap(F&& fn, const Range& inputs,
                                             std::size_t chunksize = 1) {
    return collect(stream<true>(std::forward<F>(fn), inputs, /*ordered=*/true, chunksize));
  }

  // No more tasks; workers exit once the submitted ones are done.
  void close();
  // Waits until the submitted tasks are done and every worker has exited. Requires close()
  // or terminate() first (throws Error).
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
  ResultStream<internal::PoolResult<F>> stream(F&& fn, const Range& inputs, bool ordered,
                                             std::size_t chunksize) {
    internal::check_pool_fn<F>();
    using FnPtr = internal::PoolFn<F>;
    using R = internal::PoolResult<F>;
    using Params = typename internal::FnTraits<FnPtr>::Params;
    static_assert(!std::is_void_v<R>, "map/imap/starmap need a function that returns a value");
    static_assert(Unpack || internal::FnTraits<FnPtr>::kArity == 1,
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
      internal::PoolTask task;
      task.fn = reinterpret_cast<std::uintptr_t>(+fn);
      if (chunksize == 1) {
        task.entry = &internal::pool_entry<FnPtr>;
        task.encode_args = [&chunk](Encoder& e) { e.encode(chunk.front()); };
        task.on_result = results.on_result(first);
        task.on_error = results.on_error(first);
      } else {
        task.entry = &internal::pool_chunk_entry<FnPtr>;
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
  void submit(internal::PoolTask task);

  std::unique_ptr<internal::PoolCore> core_;
};

}  // namespace shmtensor
