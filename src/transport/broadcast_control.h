// The control block of a Broadcast (transport/broadcast.cc): a sealed memfd that the writer
// and every reader map. Each reader's messages travel in a queue of its own (queue_control.h,
// ring_layout.h); this block says who the writer and the readers are. Every word here may be
// written by any process that holds the broadcast: what is read from it is validated, and a
// value no honest process writes sets `broken`, after which every call of every process
// throws ProtocolError (docs/transport.md, "Broadcast"). Layout: docs/shm_layout.md,
// "Broadcast control block".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace shmtensor::internal {

inline constexpr std::uint64_t kBroadcastMagic = 0x3154534342545348ULL;  // "HSTBCST1"
inline constexpr std::uint32_t kBroadcastLayoutVersion = 2;
inline constexpr int kBroadcastMaxReaders = 64;
// Reader slot values other than a slot_owner (os/proc.h): none attached yet, and its reader
// left (the writer skips it until another attaches). A slot whose reader's unread messages
// are being dropped holds kReaderDropping | the slot_owner of the process that drops them
// (a slot_owner's pid is below 2^22, so bit 63 is free): whoever finds that process dead
// takes the drop over.
inline constexpr std::uint64_t kReaderNone = 0;
inline constexpr std::uint64_t kReaderLeft = 1;
inline constexpr std::uint64_t kReaderDropping = std::uint64_t{1} << 63;
constexpr std::uint64_t reader_dropping(std::uint64_t dropper) noexcept {
  return kReaderDropping | dropper;
}
constexpr bool is_reader_dropping(std::uint64_t v) noexcept { return (v & kReaderDropping) != 0; }
constexpr std::uint64_t reader_dropper(std::uint64_t v) noexcept { return v & ~kReaderDropping; }

struct BroadcastControl {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t size_of;
  std::uint32_t readers;  // 1 to kBroadcastMaxReaders, set at creation
  std::uint32_t depth;    // messages a reader may be behind before put() waits
  std::uint64_t writer;   // slot_owner of the process that made it, the one that puts
  // 1 once any process read a value here that no honest process writes.
  alignas(64) std::atomic<std::uint32_t> broken;
  // Per reader: kReaderNone, kReaderLeft, the slot_owner of the process that attached as
  // that reader (by CAS, from kReaderNone or kReaderLeft), or reader_dropping(the slot_owner
  // of the process that drops its unread messages).
  alignas(64) std::atomic<std::uint64_t> reader[kBroadcastMaxReaders];
};
static_assert(std::is_standard_layout_v<BroadcastControl>);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
// The offsets docs/shm_layout.md gives.
static_assert(offsetof(BroadcastControl, readers) == 16 &&
              offsetof(BroadcastControl, writer) == 24 &&
              offsetof(BroadcastControl, broken) == 64 &&
              offsetof(BroadcastControl, reader) == 128 &&
              sizeof(BroadcastControl) == 128 + 8 * kBroadcastMaxReaders);

}  // namespace shmtensor::internal
