// Queue<T>: a multi-producer, multi-consumer queue between processes, carrying encodable
// values (see codec.h), like torch.multiprocessing.Queue.
//
// A Queue is a cheap handle (copies refer to the same queue). It works in children forked
// after it was made, and can be sent over a Connection or another Queue or passed to an
// exec'ed child. Every item put is delivered exactly once, to one get(), whichever process
// or thread calls it. Items from one producer thread arrive in the order they were put.
//
// Tensors travel by reference as with Connection: the sender's storage moves into shared
// memory in place, the receiver's tensor views the same bytes.
//
// Mechanism: one SOCK_SEQPACKET socket pair (the kernel delivers each datagram, fds
// included, to exactly one reader) plus a small shared control block (item count for
// maxsize, closed flag, the processes holding the queue) on which blocked producers wait
// with a futex.
//
// Lifetime: when the last process holding a queue drops its last handle, the items never
// received are drained and their shared memory released (docs/transport.md says what
// remains when a holder was SIGKILLed).
//
// Thread safety: all methods may be called from any thread of any process holding the
// queue. Unbounded queues are bounded in practice by the kernel's socket buffer: put()
// blocks when that is full until a consumer gets (docs/transport.md).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "shmtensor/codec.h"

namespace shmtensor {

// get() on a closed and drained queue, or put() on a closed queue.
class QueueClosed : public Error {
 public:
  explicit QueueClosed(const std::string& what) : Error(what) {}
};

namespace internal {
// The type-independent part of a queue, shared by its handles in one process. When the
// last handle anywhere is gone (no live process holds the queue, none is in flight), the
// process that dropped it drains the items left so that their shared memory is released.
class QueueCore : public std::enable_shared_from_this<QueueCore> {
 public:
  static std::shared_ptr<QueueCore> create(std::size_t maxsize);
  // From an encoded queue: takes its three fds and validates its control block.
  static std::shared_ptr<QueueCore> decode(Decoder& d);
  ~QueueCore();
  QueueCore(const QueueCore&) = delete;
  QueueCore& operator=(const QueueCore&) = delete;

  // False on timeout (nullopt: wait forever).
  bool put(Encoder&& e, std::optional<std::chrono::nanoseconds> timeout);
  // nullopt on timeout; throws QueueClosed when closed and drained.
  std::optional<Decoder> get(std::optional<std::chrono::nanoseconds> timeout);
  void close() noexcept;
  bool closed() const noexcept;
  std::size_t size() const noexcept;
  std::size_t maxsize() const noexcept;
  void encode(Encoder& e) const;

  struct State;
  explicit QueueCore(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
};
}  // namespace internal

template <class T>
class Queue {
 public:
  // maxsize 0: unbounded (see the header comment).
  explicit Queue(std::size_t maxsize = 0) : core_(internal::QueueCore::create(maxsize)) {}

  // Blocks while the queue is full. Throws QueueClosed if closed.
  void put(const T& value) { core_->put(encode(value), std::nullopt); }
  // Blocks while empty. Throws QueueClosed when closed and drained; ProtocolError or
  // SystemError for an item that cannot be decoded or mapped, as Connection::recv (the
  // item is consumed, its place in a bounded queue freed, and the queue stays usable).
  T get() {
    auto d = core_->get(std::nullopt);
    return decode(*d);
  }
  // Waits up to timeout for room; false if none came.
  template <class Rep = std::int64_t, class Period = std::ratio<1>>
  bool try_put(const T& value, std::chrono::duration<Rep, Period> timeout = {}) {
    return core_->put(encode(value), std::chrono::duration_cast<std::chrono::nanoseconds>(timeout));
  }
  // Waits up to timeout for an item.
  template <class Rep = std::int64_t, class Period = std::ratio<1>>
  std::optional<T> try_get(std::chrono::duration<Rep, Period> timeout = {}) {
    auto d = core_->get(std::chrono::duration_cast<std::chrono::nanoseconds>(timeout));
    if (!d) return std::nullopt;
    return decode(*d);
  }
  // No more put()s anywhere; get()s drain what is there, then throw QueueClosed.
  void close() noexcept { core_->close(); }
  bool closed() const noexcept { return core_->closed(); }
  // Estimates: other processes change them concurrently.
  std::size_t size() const noexcept { return core_->size(); }
  bool empty() const noexcept { return size() == 0; }
  std::size_t maxsize() const noexcept { return core_->maxsize(); }

  const std::shared_ptr<internal::QueueCore>& core() const noexcept { return core_; }
  explicit Queue(std::shared_ptr<internal::QueueCore> core) : core_(std::move(core)) {}

 private:
  static Encoder encode(const T& value) {
    Encoder e;
    e.encode(value);
    return e;
  }
  static T decode(Decoder& d) {
    T value = d.decode<T>();
    d.finish();
    return value;
  }
  std::shared_ptr<internal::QueueCore> core_;
};

template <class T>
struct Codec<Queue<T>> {
  static void encode(Encoder& e, const Queue<T>& q) { q.core()->encode(e); }
  static Queue<T> decode(Decoder& d) { return Queue<T>(internal::QueueCore::decode(d)); }
};

}  // namespace shmtensor
