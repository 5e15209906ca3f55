// How Pool (pool.h) hands results back: ResultStream (imap, imap_unordered) and
// AsyncResult (apply_async).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/pool_task.h"
#include "shmtensor/process.h"
#include "shmtensor/timeout.h"

namespace shmtensor {

class Pool;

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
    std::map<std::size_t, std::variant<R, internal::TaskFailure>> ready;
    std::size_t total = 0;
    std::size_t next_index = 0;  // imap: the index handed out next
    std::size_t delivered = 0;
    bool ordered = true;
  };

 public:
  [[nodiscard]] std::optional<R> next() {
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
    if (auto* f = std::get_if<internal::TaskFailure>(&outcome)) internal::throw_task_failure(*f);
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
  std::function<void(Decoder&, int)> on_result(std::size_t index) const {
    return [s = state_, index](Decoder& d, int /*pid*/) {
      R value = d.template decode<R>();
      d.finish();
      std::lock_guard lock(s->mu);
      s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(index),
                       std::forward_as_tuple(std::in_place_index<0>, std::move(value)));
      s->cv.notify_all();
    };
  }
  std::function<void(internal::TaskFailure)> on_error(std::size_t index) const {
    return on_chunk_error(index, 1);
  }
  // The same for the `count` inputs from `first` on, sent as one chunk.
  std::function<void(Decoder&, int)> on_chunk_result(std::size_t first, std::size_t count) const {
    return [s = state_, first, count](Decoder& d, int pid) {
      auto reply = d.template decode<internal::ChunkReply<R>>();
      d.finish();
      if (reply.size() != count)
        throw ProtocolError("Pool: a chunk of " + std::to_string(count) + " inputs came back with " +
                            std::to_string(reply.size()) + " results");
      std::lock_guard lock(s->mu);
      for (std::size_t i = 0; i < count; ++i) {
        auto& item = reply[i];
        if (item.index() == 0) {
          s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(first + i),
                           std::forward_as_tuple(std::in_place_index<0>,
                                                 std::move(std::get<0>(item))));
        } else {
          internal::TaskFailure f;
          f.kind = internal::TaskFailure::Kind::kRaised;
          f.text = std::move(std::get<1>(item));
          f.pid = pid;
          s->ready.emplace(std::piecewise_construct, std::forward_as_tuple(first + i),
                           std::forward_as_tuple(std::in_place_index<1>, std::move(f)));
        }
      }
      s->cv.notify_all();
    };
  }
  std::function<void(internal::TaskFailure)> on_chunk_error(std::size_t first,
                                                          std::size_t count) const {
    return [s = state_, first, count](internal::TaskFailure f) {
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
  using Outcome = std::variant<Stored, internal::TaskFailure>;

 public:
  AsyncResult() = default;
  R get() {
    Outcome outcome = future_.get();
    if (auto* f = std::get_if<internal::TaskFailure>(&outcome)) internal::throw_task_failure(*f);
    if constexpr (!std::is_void_v<R>) return std::move(std::get<0>(outcome));
  }
  void wait() const { future_.wait(); }
  // Waits up to `timeout`; true once the task has finished (successfully or not).
  [[nodiscard]] bool wait_for(Timeout timeout) const {
    if (!timeout) {
      future_.wait();
      return true;
    }
    return future_.wait_for(*timeout) == std::future_status::ready;
  }
  [[nodiscard]] bool ready() const { return wait_for(Duration::zero()); }
  bool valid() const noexcept { return future_.valid(); }

 private:
  friend class Pool;
  explicit AsyncResult(std::future<Outcome> future) : future_(std::move(future)) {}
  std::future<Outcome> future_;
};

}  // namespace shmtensor
