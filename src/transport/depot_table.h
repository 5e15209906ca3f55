// The depot's table (transport/depot.h), in a channel's shared memory (a queue's control
// block, a connection link): which segments' fds are deposited. A peer may write it: a
// wrong entry makes a receiver look for a segment the depot does not have (it is then
// mapped from the fd in the message, or the message is refused), never crash. Layout:
// docs/shm_layout.md, "Depot table".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "os/shared_lock.h"

namespace shmtensor::internal {

// Segments one depot can hold; later ones carry their fds in every message.
inline constexpr int kDepotSegments = 32;

// A segment whose fd is in the depot. `uid` is taken once, by CAS from 0, and never
// changes. `state`: depositing (taken, or being tried again), deposited (release: its fd
// is in the depot), failed (a sender may try again: CAS to depositing).
struct DepotEntry {
  std::atomic<std::uint64_t> uid;
  std::atomic<std::uint64_t> state;
};
static_assert(sizeof(DepotEntry) == 16);

// In shared memory; set up by init_depot.
struct DepotTable {
  // 1 when the creating process found that peeks at an offset work on its kernel
  // (otherwise nothing is deposited, and every message carries its fds).
  std::atomic<std::uint32_t> usable;
  std::uint32_t pad;
  // Held (briefly) while a process looks through the depot: the socket's peek offset is
  // shared by every holder of that socket.
  alignas(64) SharedLock lock;
  alignas(64) DepotEntry entries[kDepotSegments];
};
static_assert(std::is_standard_layout_v<DepotTable>);
static_assert(sizeof(DepotTable) == 128 + sizeof(DepotEntry) * kDepotSegments);
static_assert(offsetof(DepotTable, lock) == 64 && offsetof(DepotTable, entries) == 128);

}  // namespace shmtensor::internal
