// The type-independent part of a Queue<T> (queue.h), shared by the queue's handles in one
// process: the sockets, the control block, admission and the holder table
// (src/transport/queue_core.cc; docs/transport.md). Internal.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <exception>
#include <optional>
#include <string>
#include <span>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/fd_counts.h"

namespace shmtensor::internal {

// The queue's message ring (src/transport/ring.h): its geometry (its slots' tags are the
// transport's, src/transport/announced.h). 4,096 slots (2 MiB): an unbounded queue holds
// that many items before put() waits for a get.
inline constexpr std::uint32_t kQueueRingSlots = 4096;

// Wakes owed to the consumers of several queues (src/transport/endpoint.h): a put given one
// leaves its wake to the owner, who pays them all at once.
class DeferredWakes;
inline constexpr std::uint32_t kQueueRingSlotBytes = 512;

// When the last handle anywhere is gone (no live process holds the queue, none is in
// flight), the process that dropped it drains the items left so that their shared memory
// is released. Thread-safe.
class SHMTENSOR_API QueueCore : public std::enable_shared_from_this<QueueCore> {
 public:
  // Throws std::invalid_argument for a maxsize above 2^31 - 1. joinable: a JoinableQueue's,
  // which counts unfinished tasks (task_done, join).
  static std::shared_ptr<QueueCore> create(std::size_t maxsize, bool joinable = false);
  // From an encoded queue: takes its five fds (two sockets, the control block, the ring,
  // the readiness eventfd) and validates them. Throws ProtocolError. counted: the copy was
  // counted in flight by encode() (a message's), and its count is taken back; false for a
  // copy nobody counted (a named channel's publication), which must not take the count of
  // another copy still in flight.
  static std::shared_ptr<QueueCore> decode(Decoder& d, bool counted = true);
  // Named queues (docs/transport.md, "Named queues"): create() registered under `name` with
  // this user's shmtensor-manager, which hands the queue's fds to open_named() in any
  // process of the user. The name lives until this process drops its last handle of the
  // queue, exits or dies, or unlink_named() removes it; processes that opened the queue
  // keep it. Throw NameExists / NameNotFound, std::invalid_argument for an invalid name,
  // ProtocolError for fds that are not a queue's, Error when the manager cannot be reached.
  static std::shared_ptr<QueueCore> create_named(const std::string& name, std::size_t maxsize,
                                                 bool joinable = false);
  static std::shared_ptr<QueueCore> open_named(const std::string& name);
  static void unlink_named(const std::string& name);
  // What `shmtensor ls` shows of a named queue, read without holding it: its depth, its
  // bound (0: none), and the live processes that hold it (its ends). Throws as open_named.
  struct NamedFacts {
    std::size_t size = 0;
    std::size_t maxsize = 0;
    std::vector<std::int32_t> holders;
  };
  static NamedFacts inspect_named(const std::string& name);
  ~QueueCore();
  QueueCore(const QueueCore&) = delete;
  QueueCore& operator=(const QueueCore&) = delete;

  // Admits the message (throws QueueClosed; takes a place, waiting for room in a bounded
  // queue), then frames and sends it. False, with nothing moved into shared memory or sent,
  // when no room came before the timeout (nullopt: wait forever); false also, with the
  // tensors in shared memory, when the socket's buffer stayed full until then.
  // counted (a JoinableQueue's): the item's task was counted already (begin_task); a put
  // that does not put it (refused, timed out, an error) finishes that task. put_many
  // takes counted for one item only (std::invalid_argument otherwise).
  // defer: the consumers asleep are woken when `defer` pays (by its owner, or before this
  // or another put given it waits), not when the put returns.
  [[nodiscard]] bool put(Encoder&& e, std::optional<std::chrono::nanoseconds> timeout,
                         bool counted = false, DeferredWakes* defer = nullptr) {
    return put_many(std::span(&e, 1), timeout, counted, defer) == 1;
  }
  // put() of each item in order (each moved from), with consumers asleep woken once for
  // the batch rather than once per item. Returns how many were put: all, or fewer when
  // the timeout passed first (the items after moved nothing into shared memory, except
  // one whose datagram found the socket's buffer full). Throws as put(); the items before
  // the error are in the queue.
  [[nodiscard]] std::size_t put_many(std::span<Encoder> items,
                                     std::optional<std::chrono::nanoseconds> timeout,
                                     bool counted = false, DeferredWakes* defer = nullptr);
  // Waits until a bounded queue has room for one more item, without taking it: true at once
  // when it has (or is unbounded), false when the timeout passed first. A Broadcast's
  // writer, the one producer of its readers' queues, waits so before it puts to all of
  // them. Throws QueueClosed.
  [[nodiscard]] bool wait_for_room(std::optional<std::chrono::nanoseconds> timeout);
  // nullopt on timeout; throws QueueClosed when closed and drained.
  [[nodiscard]] std::optional<Decoder> get(std::optional<std::chrono::nanoseconds> timeout);
  // Waits for one item as get() does, then takes up to max_items - 1 more that are there
  // already. Empty on timeout (or max_items 0). An item after the first that cannot be
  // parsed is consumed and ends the batch: its error is thrown by the next get or get_many
  // of this handle (defer_error), the items before it are returned.
  [[nodiscard]] std::vector<Decoder> get_many(std::size_t max_items,
                                              std::optional<std::chrono::nanoseconds> timeout);
  // This process's handles' own busy-poll budget (Queue::set_busy_poll); nullopt: the
  // process's. Throws std::invalid_argument outside 0 to 1 second.
  void set_busy_poll(std::optional<std::chrono::nanoseconds> budget);
  [[nodiscard]] std::optional<std::chrono::nanoseconds> busy_poll() const noexcept;
  // Whether this process's gets spin briefly before they sleep (on by default; a
  // Broadcast's reader among more processes than CPUs turns it off: broadcast.cc).
  void set_spin_before_sleep(bool on) noexcept;
  [[nodiscard]] bool spins_before_sleep() const noexcept;
  // Keeps `error` (the first, if several) for the next get or get_many of this handle.
  void defer_error(std::exception_ptr error) noexcept;
  void close() noexcept;
  [[nodiscard]] bool closed() const noexcept;
  // A JoinableQueue's (queue.h). Throw std::logic_error on a queue made not joinable, and
  // task_done() when no task is unfinished. join: false when the timeout passed first.
  [[nodiscard]] bool joinable() const noexcept;
  // One more unfinished task, for an item put later with counted (Python's Queue counts an
  // item its feeder thread will send when put() returns), and one fewer for such an item
  // that never reaches put(). No-ops unless joinable.
  void begin_task() noexcept;
  void abandon_task() noexcept;
  void task_done();
  [[nodiscard]] bool join(std::optional<std::chrono::nanoseconds> timeout);
  // Lets this handle's puts deposit dedicated host segments (one large tensor each) in the
  // queue's depot too, up to `segments` of them and `bytes` in all: their fds then go once,
  // and the depot keeps their memory while the queue lives (src/transport/depot.h). A
  // Broadcast's writer does so for its readers' queues. Before any put.
  void allow_dedicated_deposits(int segments, std::size_t bytes) noexcept;
  // See Queue::readiness_fd.
  [[nodiscard]] int readiness_fd() noexcept;
  // After the readiness fd said "ready": whether an item (or the close) is there now; if
  // not, a stale signal on the fd is cleared (Endpoint::ready_now).
  [[nodiscard]] bool ready_now() noexcept;
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] std::size_t maxsize() const noexcept;
  void encode(Encoder& e) const;
  // Segment fds this handle put in items, and left out of them because the segment is in
  // the queue's depot (fd_counts.h).
  using FdCounts = internal::FdCounts;
  [[nodiscard]] FdCounts fd_counts() const noexcept;
  // The memfds of the queue's control block and ring (src/transport/queue_control.h,
  // ring_layout.h), for tests that write them as a peer would.
  struct SharedFds {
    int control = -1;
    int ring = -1;
  };
  [[nodiscard]] SharedFds shared_fds() const noexcept;

  struct State;
  explicit QueueCore(std::unique_ptr<State> state);  // for make_shared: use the factories

 private:
  void rethrow_deferred();
  std::unique_ptr<State> state_;
};

// Tests and benchmarks reach a Queue's core through this (Queue befriends it).
struct QueueAccess {
  template <class Q>
  static QueueCore& core(Q& q) noexcept {
    return *q.core_;
  }
};

}  // namespace shmtensor::internal
