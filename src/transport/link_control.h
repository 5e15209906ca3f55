// One direction of a Connection made by pipe() (transport/connection.cc): the words its
// two ends share, in the user area of that direction's ring (Ring::user_area). A peer may
// write anything here: docs/transport.md, "What a peer that writes the shared memory can
// do". Layout: docs/shm_layout.md, "Connection link".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "os/shared_lock.h"
#include "transport/depot.h"
#include "transport/ring.h"

namespace shmtensor::internal {

inline constexpr std::uint64_t kLinkMagic = 0x324b4e494c545453ULL;  // "STTLINK2"

// One direction's shared words, in the user area of its ring (a peer can write them: the
// locks' protocol survives that as a queue's does, and the rest are hints).
struct LinkControl {
  std::uint64_t magic;
  // The datagram path's (transport/announced.h).
  alignas(64) SharedLock send_lock;
  alignas(64) SharedLock recv_lock;
  std::uint64_t taken_below;
  // How many want the receiving end's readiness fd signalled: one per handle whose
  // native_handle() was asked for (for good: nobody knows when its caller polls), and one
  // per waiter of the library's own (ConnectionAccess::begin_wait, for as long as it
  // sleeps). While it is not 0 every message
  // sent this way signals the direction's eventfd.
  std::atomic<std::uint32_t> readiness_wanted;
  // Bumped by every close() of either end: a sender or receiver that sees it change looks
  // at the socket (did the peer hang up?) before it goes on.
  std::atomic<std::uint32_t> close_epoch;
  // Senders between publishing a message and signalling the eventfd for it (only while
  // readiness_wanted): a receiver that clears the eventfd waits for them first, or their
  // late signal would leave it readable with nothing there.
  std::atomic<std::uint32_t> signalling;
  // Segments whose fds were deposited for this direction (transport/depot.h): in the
  // receive queue of the receiving end's depot socket, sent there by senders on theirs.
  alignas(64) DepotTable depot;
};
static_assert(sizeof(LinkControl) <= Ring::kUserBytes);
static_assert(offsetof(LinkControl, send_lock) == 64 && offsetof(LinkControl, recv_lock) == 128 &&
              offsetof(LinkControl, taken_below) == 144 && offsetof(LinkControl, depot) == 192 &&
              sizeof(LinkControl) == 832);  // docs/shm_layout.md
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

}  // namespace shmtensor::internal
