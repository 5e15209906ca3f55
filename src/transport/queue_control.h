// The control block of a queue (transport/queue_core.cc): a sealed memfd that every
// process holding the queue maps. Its words are read and written by those processes only
// through atomics and the shared locks; a peer may write anything here, and what the
// queue does then is in docs/transport.md ("What a peer that writes the shared memory can
// do"). Layout: docs/shm_layout.md, "Queue control block".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "os/shared_lock.h"
#include "transport/depot.h"

namespace shmtensor::internal {

inline constexpr std::uint64_t kQueueMagic = 0x314555455154534dULL;  // "MSTQUEU1"
inline constexpr std::uint32_t kQueueLayoutVersion = 11;
inline constexpr int kQueueHolderSlots = 128;
// Shared by every process holding the queue (a sealed memfd, so it can be passed on).
struct QueueControl {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t size_of;
  std::uint64_t maxsize;  // 0 = unbounded
  // Places taken: items being sent, or in the ring and the socket. Futex word of producers
  // waiting for room. A producer takes a place by CAS before it frames (acq_rel pairs with
  // a consumer's release of a place), so at most maxsize items are ever queued.
  alignas(64) std::atomic<std::uint32_t> count;
  // 1 once close() was called anywhere; also a futex wake-up source for producers.
  alignas(64) std::atomic<std::uint32_t> closed;
  // Encoded copies of the queue in messages sent and not yet decoded: while any is in
  // flight, a process may still join, so nobody drains.
  std::atomic<std::uint32_t> in_flight;
  // 1 once a process found no free holder slot: holders are then unknown, and nobody
  // drains (what remains is the worst case of docs/transport.md).
  std::atomic<std::uint32_t> overflow;
  // Producers asleep (or about to sleep) on `count`: a consumer that frees a place calls
  // FUTEX_WAKE only when this is non-zero, so a get() nobody waits for makes no syscall.
  std::atomic<std::uint32_t> waiters;
  // Handles that asked for the readiness fd (QueueCore::readiness_fd; each counts once, for
  // good): while it is not 0 every put signals the queue's eventfd, and every get clears it
  // when the ring is empty.
  std::atomic<std::uint32_t> readiness_wanted;
  // Producers between publishing an item and signalling the readiness fd for it (only
  // while readiness_wanted): a consumer that clears the fd waits for them first (≤ 1 ms),
  // or their late signal would leave it readable with nothing there.
  std::atomic<std::uint32_t> signalling;
  std::uint8_t pad[40];
  // Producers send datagrams under send_lock (reserve the marker, send, publish the
  // marker), so the socket holds them in the order of their markers; consumers take a
  // datagram under recv_lock (look at the next one's marker position, take it). A holder
  // that dies leaves the lock to the next (os/shared_lock.h); what it left half done is
  // repaired by the protocol (docs/transport.md, "Items with fds").
  alignas(64) SharedLock send_lock;
  alignas(64) SharedLock recv_lock;
  // Under recv_lock: no datagram of a marker below this position is in the socket any more
  // (one past the last marker whose datagram was taken; 0 at first). A hint for
  // take_announced's fast path. A peer that writes a wrong value here can make consumers
  // drop items (as one that reads the socket can), never crash or hang them.
  std::uint64_t taken_below;
  // slot_owner(pid, start time) of each holding process; 0 = free. Set by CAS from 0 by the
  // process itself (or, at fork, by the parent on the child's behalf, with the parent's
  // value, which the child then swaps for its own); cleared by CAS by its owner.
  alignas(64) std::atomic<std::uint64_t> holders[kQueueHolderSlots];
  // Per holder slot: places its process took whose items it has not sent yet. Framing an
  // item can take seconds (a new file_system segment may wait for the manager daemon to
  // start), and a producer SIGKILLed before its sendmsg returned would take its place with
  // it; a producer that finds the queue full gives back those of dead holders.
  alignas(64) std::atomic<std::uint32_t> sending[kQueueHolderSlots];
  // A JoinableQueue's (joinable 1, set at creation): items put and not yet marked done by
  // task_done(), the futex word join() waits on; counted before an item is published, so
  // a task_done() for it never finds 0. joiners: processes' threads asleep in join(), so a
  // task_done() that reaches 0 calls FUTEX_WAKE only when someone waits.
  alignas(64) std::atomic<std::uint32_t> unfinished;
  std::atomic<std::uint32_t> joiners;
  std::uint32_t joinable;
  // Segments whose fds are deposited in the sending end's receive queue (transport/depot.h).
  alignas(64) DepotTable depot;
};
static_assert(std::is_standard_layout_v<QueueControl>);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(sizeof(QueueControl) ==
              384 + 8 * kQueueHolderSlots + 4 * kQueueHolderSlots + sizeof(DepotTable));
// The offsets docs/shm_layout.md gives.
static_assert(offsetof(QueueControl, count) == 64 && offsetof(QueueControl, send_lock) == 192 &&
              offsetof(QueueControl, recv_lock) == 256 && offsetof(QueueControl, holders) == 320 &&
              offsetof(QueueControl, sending) == 1344 &&
              offsetof(QueueControl, unfinished) == 1856 && offsetof(QueueControl, depot) == 1920 &&
              sizeof(QueueControl) == 2560);

}  // namespace shmtensor::internal
