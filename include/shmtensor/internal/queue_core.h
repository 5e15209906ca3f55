// The type-independent part of a Queue<T> (queue.h), shared by the queue's handles in one
// process: the sockets, the control block, admission and the holder table
// (src/transport/queue_core.cc; docs/transport.md). Internal.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "shmtensor/codec.h"

namespace shmtensor::internal {

// The queue's message ring (src/transport/ring.h): its geometry, and the tags of its slots.
// 4,096 slots (2 MiB): an unbounded queue holds that many items before put() waits for a
// get, about what its socket's buffer held before the ring (several thousand small items).
inline constexpr std::uint32_t kQueueRingSlots = 4096;
inline constexpr std::uint32_t kQueueRingSlotBytes = 512;
inline constexpr std::uint32_t kQueueRingItem = 1;    // the slot holds the item's frame
inline constexpr std::uint32_t kQueueRingMarker = 2;  // the item is the socket's next datagram

// When the last handle anywhere is gone (no live process holds the queue, none is in
// flight), the process that dropped it drains the items left so that their shared memory
// is released. Thread-safe.
class QueueCore : public std::enable_shared_from_this<QueueCore> {
 public:
  // Throws std::invalid_argument for a maxsize above 2^31 - 1.
  static std::shared_ptr<QueueCore> create(std::size_t maxsize);
  // From an encoded queue: takes its five fds (two sockets, the control block, the ring,
  // the readiness eventfd) and validates them. Throws ProtocolError.
  static std::shared_ptr<QueueCore> decode(Decoder& d);
  ~QueueCore();
  QueueCore(const QueueCore&) = delete;
  QueueCore& operator=(const QueueCore&) = delete;

  // Admits the message (throws QueueClosed; takes a place, waiting for room in a bounded
  // queue), then frames and sends it. False, with nothing moved into shared memory or sent,
  // when no room came before the timeout (nullopt: wait forever); false also, with the
  // tensors in shared memory, when the socket's buffer stayed full until then.
  [[nodiscard]] bool put(Encoder&& e, std::optional<std::chrono::nanoseconds> timeout);
  // nullopt on timeout; throws QueueClosed when closed and drained.
  [[nodiscard]] std::optional<Decoder> get(std::optional<std::chrono::nanoseconds> timeout);
  void close() noexcept;
  [[nodiscard]] bool closed() const noexcept;
  // See Queue::readiness_fd.
  [[nodiscard]] int readiness_fd() noexcept;
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] std::size_t maxsize() const noexcept;
  void encode(Encoder& e) const;
  // file_descriptor segment fds this handle put in items, and left out of them because
  // every holder maps the segment (docs/transport.md, "fds once per segment").
  struct FdCounts {
    std::uint64_t sent = 0;
    std::uint64_t omitted = 0;
  };
  [[nodiscard]] FdCounts fd_counts() const noexcept;

  struct State;
  explicit QueueCore(std::unique_ptr<State> state);  // for make_shared: use the factories

 private:
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
