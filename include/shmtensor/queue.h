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
// Mechanism: a ring of message slots in shared memory (an item without fds that fits a
// slot is written there: no syscall while nobody sleeps), one SOCK_SEQPACKET socket pair
// for the items that carry fds (each a datagram, announced by a slot in the ring so that
// one producer's items stay in order; a file_descriptor arena segment's fd goes once, into
// the queue's depot, and later items name the segment without it), a readiness eventfd,
// and a small shared control
// block (item count for maxsize, closed flag, the processes holding the queue) on which
// blocked producers wait with a futex (docs/transport.md).
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
#include <exception>
#include <optional>
#include <span>
#include <stdexcept>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/duration.h"
#include "shmtensor/internal/queue_core.h"

namespace shmtensor {

// get() on a closed and drained queue, or put() on a closed queue.
class SHMTENSOR_API QueueClosed : public Error {
 public:
  explicit QueueClosed(const std::string& what) : Error(what) {}
};

template <class T>
class Queue {
 public:
  // maxsize 0: unbounded (see the header comment). Throws std::invalid_argument for a
  // maxsize above 2^31 - 1, SystemError when its sockets or control block cannot be made.
  explicit Queue(std::size_t maxsize = 0) : core_(internal::QueueCore::create(maxsize)) {}

  // Named queues, for processes this library did not start (a shell, torchrun, Ray): a
  // queue created under `name` (1 to 128 of A-Z a-z 0-9 _ . -, not starting with '.') can
  // be opened by name by any process of the same user, through that user's
  // shmtensor-manager (started on demand). The name lives until this process drops its
  // last handle of the queue, exits or dies, or unlink() removes it; a process that opened
  // the queue keeps using it then. Throws NameExists when the name is taken,
  // std::invalid_argument for an invalid name, Error when the manager cannot be reached or
  // refuses this process. docs/transport.md, "Named queues".
  static Queue create(const std::string& name, std::size_t maxsize = 0) {
    return Queue(internal::QueueCore::create_named(name, maxsize));
  }
  // Throws NameNotFound when no queue has that name; ProtocolError when what the manager
  // hands over is not a queue.
  static Queue open(const std::string& name) {
    return Queue(internal::QueueCore::open_named(name));
  }
  // Removes the name (handles keep working). Throws NameNotFound when there is none.
  static void unlink(const std::string& name) { internal::QueueCore::unlink_named(name); }

  // Blocks while the queue is full. Throws QueueClosed if closed (nothing is moved into
  // shared memory then); otherwise as Connection::send.
  void put(const T& value) { (void)core_->put(encode(value), std::nullopt); }  // never false
  // Blocks while empty. Throws QueueClosed when closed and drained; ProtocolError or
  // SystemError for an item that cannot be decoded or mapped, as Connection::recv (the
  // item is consumed, its place in a bounded queue freed, and the queue stays usable).
  // First throws, without taking anything, an error a get_many kept (see get_many).
  T get() {
    auto d = core_->get(std::nullopt);
    return decode(*d);
  }
  // Waits up to timeout for room; false if none came. A refused item's tensors stay where
  // they were, unless it was the socket's buffer that stayed full (docs/transport.md).
  // (Any std::chrono duration converts to Duration; zero: only look.)
  [[nodiscard]] bool try_put(const T& value, Duration timeout = Duration::zero()) {
    return core_->put(encode(value), internal::to_nanoseconds(timeout));
  }
  // Waits up to timeout for an item.
  [[nodiscard]] std::optional<T> try_get(Duration timeout = Duration::zero()) {
    auto d = core_->get(internal::to_nanoseconds(timeout));
    if (!d) return std::nullopt;
    return decode(*d);
  }
  // Batches: put() of each value in order, waking consumers asleep once for the batch
  // rather than once per item (a wake-up on another CPU costs microseconds). Blocks while
  // the queue is full, waking the consumers (and signalling the readiness fd) first.
  // Throws as put(): every value is encoded first, so an encoding error puts none; an error
  // while putting (QueueClosed, no shared memory) leaves the values before it in the queue,
  // and does not say how many those were.
  void put_many(std::span<const T> values) { (void)put_batch(values, std::nullopt); }
  // The same, waiting up to `timeout` in all for room; returns how many were put (the
  // first ones, in order: all, or fewer when the timeout passed first).
  [[nodiscard]] std::size_t try_put_many(std::span<const T> values,
                                         Duration timeout = Duration::zero()) {
    return put_batch(values, internal::to_nanoseconds(timeout));
  }
  // Waits for one item as get() does, then takes up to max_items - 1 more that are there
  // already, in one call. An item after the first that cannot be received is consumed as
  // by get(), and its error is kept: thrown by a later get, try_get, get_many or
  // try_get_many on this queue object or its copies in this process (one error per call,
  // oldest first; a forked child does not inherit them). One that cannot be parsed
  // (malformed, a segment that cannot be mapped here, a slot the ring refuses) ends the
  // batch: the items before it are returned. One that parses but is not a T does not: the
  // items on both sides of it are returned.
  [[nodiscard]] std::vector<T> get_many(std::size_t max_items) {
    return get_batch(max_items, std::nullopt);
  }
  // The same, waiting up to `timeout` for the first item; empty if none came.
  [[nodiscard]] std::vector<T> try_get_many(std::size_t max_items,
                                            Duration timeout = Duration::zero()) {
    return get_batch(max_items, internal::to_nanoseconds(timeout));
  }
  // Busy polling for this queue's get()s in this process (its copies here share it), in
  // place of the process's setting (busy_poll.h): each get polls the queue for up to
  // `budget`, adapting, before it blocks; Duration(0) never polls; nullopt (the default)
  // follows the process's set_busy_poll. Other processes' handles, a forked child's
  // included, are not affected. Throws
  // std::invalid_argument outside 0 to 1 second.
  void set_busy_poll(std::optional<Duration> budget) {
    if (budget && !(budget->count() >= 0))  // to_nanoseconds would make it 0
      throw std::invalid_argument("Queue::set_busy_poll: a negative budget");
    core_->set_busy_poll(internal::to_nanoseconds(budget));
  }
  [[nodiscard]] std::optional<Duration> busy_poll() const noexcept {
    auto ns = core_->busy_poll();
    if (!ns) return std::nullopt;
    return Duration(static_cast<double>(ns->count()) / 1e9);
  }
  // No more put()s anywhere; get()s drain what is there, then throw QueueClosed.
  void close() noexcept { core_->close(); }
  [[nodiscard]] bool closed() const noexcept { return core_->closed(); }
  // An fd for poll/select/epoll that is readable while an item may be there or the queue
  // is closed (multiprocessing.Pool and connection.wait wait on such an fd). Owned by the
  // queue: do not close it. A get() after it became readable may still wait (another
  // consumer took the item first). Once any process asked for it, every put() of every
  // process makes one write() on it, and a get() that empties the queue one read(): a
  // queue whose readiness nobody asks for costs nothing.
  [[nodiscard]] int readiness_fd() noexcept { return core_->readiness_fd(); }
  // Estimates: other processes change them concurrently.
  [[nodiscard]] std::size_t size() const noexcept { return core_->size(); }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  [[nodiscard]] std::size_t maxsize() const noexcept { return core_->maxsize(); }

 protected:
  explicit Queue(std::shared_ptr<internal::QueueCore> core) : core_(std::move(core)) {}
  std::shared_ptr<internal::QueueCore> core_;

 private:
  friend struct Codec<Queue<T>>;
  friend struct internal::QueueAccess;
  static Encoder encode(const T& value) {
    Encoder e;
    e.encode(value);
    return e;
  }
  static T decode(Decoder& d) {
    T value = d.template decode<T>();
    d.finish();
    return value;
  }
  std::size_t put_batch(std::span<const T> values, std::optional<std::chrono::nanoseconds> timeout) {
    std::vector<Encoder> encoded;
    encoded.reserve(values.size());
    for (const T& v : values) encoded.push_back(encode(v));
    return core_->put_many(encoded, timeout);
  }
  std::vector<T> get_batch(std::size_t max_items, std::optional<std::chrono::nanoseconds> timeout) {
    std::vector<Decoder> taken = core_->get_many(max_items, timeout);
    std::vector<T> out;
    out.reserve(taken.size());
    std::vector<std::exception_ptr> errors;
    for (Decoder& d : taken) {
      try {
        out.push_back(decode(d));
      } catch (...) {
        errors.push_back(std::current_exception());
      }
    }
    // One error per item that failed, thrown one per call (this one when it has nothing
    // else to return).
    for (std::size_t i = out.empty() ? 1 : 0; i < errors.size(); ++i) core_->defer_error(errors[i]);
    if (out.empty() && !errors.empty()) std::rethrow_exception(errors.front());
    return out;
  }
};

// JoinableQueue<T>: a Queue that counts unfinished tasks, like
// multiprocessing.JoinableQueue. Each item put is a task, counted (in the queue's shared
// control block) before it can be got; a consumer calls task_done() when it has finished
// with an item; join() waits until every task put so far, by any process, is done.
// A JoinableQueue sent over a Connection or a Queue arrives as one (as a Queue<T> too: it
// still counts its items then). Thread safety as Queue.
template <class T>
class JoinableQueue : public Queue<T> {
 public:
  explicit JoinableQueue(std::size_t maxsize = 0)
      : Queue<T>(internal::QueueCore::create(maxsize, true)) {}
  // A named JoinableQueue, as Queue<T>::create and Queue<T>::open: its task count is one
  // for every process that opens it. open() throws std::invalid_argument when the queue
  // of that name is not joinable (Queue<T>::open opens either kind).
  static JoinableQueue create(const std::string& name, std::size_t maxsize = 0) {
    return JoinableQueue(internal::QueueCore::create_named(name, maxsize, true));
  }
  static JoinableQueue open(const std::string& name) {
    auto core = internal::QueueCore::open_named(name);
    if (!core->joinable())
      throw std::invalid_argument("the named queue \"" + name + "\" is not a JoinableQueue");
    return JoinableQueue(std::move(core));
  }
  // Throws std::logic_error when called more times than there were items put.
  void task_done() { this->core_->task_done(); }
  // Blocks until every task is done (at once when none is unfinished).
  void join() { (void)this->core_->join(std::nullopt); }
  // The same, waiting up to `timeout`: false if tasks are still unfinished then.
  [[nodiscard]] bool try_join(Duration timeout) {
    return this->core_->join(internal::to_nanoseconds(timeout));
  }
 private:
  friend struct Codec<JoinableQueue<T>>;
  explicit JoinableQueue(std::shared_ptr<internal::QueueCore> core) : Queue<T>(std::move(core)) {}
};

template <class T>
struct Codec<Queue<T>> {
  static void encode(Encoder& e, const Queue<T>& q) { q.core_->encode(e); }
  static Queue<T> decode(Decoder& d) { return Queue<T>(internal::QueueCore::decode(d)); }
};

// Throws ProtocolError when the queue received is not joinable.
template <class T>
struct Codec<JoinableQueue<T>> {
  static void encode(Encoder& e, const JoinableQueue<T>& q) { q.core_->encode(e); }
  static JoinableQueue<T> decode(Decoder& d) {
    auto core = internal::QueueCore::decode(d);
    if (!core->joinable()) throw ProtocolError("received queue is not a JoinableQueue");
    return JoinableQueue<T>(std::move(core));
  }
};

}  // namespace shmtensor
