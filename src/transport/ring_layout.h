// The shared memory of a message ring (transport/ring.h): a header, a table of holder
// processes, then the slots, each starting with a SlotHead. A peer may write any of it:
// ring.h says what a ring does then. Layout: docs/shm_layout.md, "Message ring".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "transport/ring.h"

namespace shmtensor::internal {

inline constexpr std::uint64_t kRingMagic = 0x31474e4952545453ULL;  // "STTRING1"
// 6: holder records (32 bytes) name their claims held while waiting, and the header counts
// those of claimers with no record (HolderRecord::waiting, RingHeader::nobody_waiting); 5
// counted them in 16-byte records; 4: slot words stored less their slot's index
// (ring_word::index_bias); 3: `closed` has a broken bit (kRingBroken).
inline constexpr std::uint32_t kRingVersion = 6;
// Holder records; index kNoHolder marks a claim by a process that found none free (more
// than 127 live holders): such a claim is never judged abandoned (it may be judged a peer's:
// Ring::watch_claim).
inline constexpr std::uint32_t kHolderRecords = 127;
inline constexpr std::uint32_t kNoHolder = 127;

// The slot word: pos (50 bits) | state (2) | holder (7) | epoch (5).
namespace ring_word {

inline constexpr int kEpochBits = 5;
inline constexpr int kHolderBits = 7;
inline constexpr int kStateShift = kEpochBits + kHolderBits;
inline constexpr int kPosShift = kStateShift + 2;
inline constexpr std::uint64_t kPosMask = (std::uint64_t{1} << (64 - kPosShift)) - 1;
inline constexpr std::uint32_t kEpochMask = (1u << kEpochBits) - 1;

enum State : std::uint64_t { kFree = 0, kWriting = 1, kReady = 2, kReading = 3 };

inline constexpr std::uint64_t pack(std::uint64_t pos, State s, std::uint32_t holder = 0,
                                    std::uint32_t epoch = 0) {
  return ((pos & kPosMask) << kPosShift) | (static_cast<std::uint64_t>(s) << kStateShift) |
         (static_cast<std::uint64_t>(holder) << kEpochBits) | (epoch & kEpochMask);
}
inline constexpr std::uint64_t pos_of(std::uint64_t w) { return w >> kPosShift; }
inline constexpr State state_of(std::uint64_t w) {
  return static_cast<State>((w >> kStateShift) & 3);
}
inline constexpr std::uint32_t holder_of(std::uint64_t w) {
  return static_cast<std::uint32_t>(w >> kEpochBits) & ((1u << kHolderBits) - 1);
}
inline constexpr std::uint32_t epoch_of(std::uint64_t w) {
  return static_cast<std::uint32_t>(w) & kEpochMask;
}
// A slot's word is kept in shared memory less its slot's index in the position bits
// (stored = word - index_bias(index), modulo 2^64; index = position mod slot_count). A
// slot nobody wrote holds 0, which reads as "free for the position equal to its index",
// the word of a new ring's slot: so a new ring writes none of its slots, and only the pages
// of slots that messages reach are ever allocated. Any stored value reads as some word, and
// each word has one stored value: a peer can write no more than before.
inline constexpr std::uint64_t index_bias(std::uint64_t index) { return index << kPosShift; }
// Positions stay below kPosLimit: 2^50 (what a word keeps) less two laps of the largest
// ring, so that neither a position nor one a lap on wraps to alias another. An honest ring
// reaches it after 2^50 - 2^21 messages (3.5 years at 10 M/s); it is then broken.
inline constexpr std::uint64_t kPosLimit = kPosMask + 1 - 2 * std::uint64_t{Ring::kMaxSlotCount};
}  // namespace ring_word

// RingHeader::closed: bit 0 set by close(); bit 1 (with bit 0) when the ring is broken (it
// has no position left to hand out): every later push and every pop that finds nothing
// throws ProtocolError.
inline constexpr std::uint32_t kRingClosed = 1;
inline constexpr std::uint32_t kRingBroken = 2;

// How many claims held while waiting a holder record names by position (more are counted
// in `overflow`).
inline constexpr std::uint32_t kWaitingSlots = 2;

struct HolderRecord {
  std::atomic<std::uint64_t> owner;  // slot_owner(pid, start time); 0 = free
  std::atomic<std::uint32_t> epoch;  // bumped whenever the record gets a new owner
  // Claims of the owner held while it waits that `waiting` has no room for.
  std::atomic<std::uint32_t> overflow;
  // Positions + 1 (0: none) of the owner's claims held while it waits for something: a
  // reserved marker's position while its datagram waits for room, a taken marker while its
  // datagram is behind another consumer's. Ring::reserve and a held pop enter one,
  // commit/cancel and release/unread take it out. A live claim at a position its record
  // does not name (and no overflow), held for a second, was not made by the protocol
  // (Ring::watch_claim).
  std::atomic<std::uint64_t> waiting[kWaitingSlots];
};

struct RingHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t slot_count;
  std::uint32_t slot_bytes;
  std::uint32_t slots_offset;
  std::uint64_t total_bytes;
  alignas(64) std::atomic<std::uint64_t> tail;       // hint: next position to claim for writing
  alignas(64) std::atomic<std::uint64_t> head;       // hint: next position to claim for reading
  alignas(64) std::atomic<std::uint32_t> published;  // futex word of sleeping consumers
  std::atomic<std::uint32_t> consumers_asleep;
  alignas(64) std::atomic<std::uint32_t> freed;  // futex word of sleeping producers
  std::atomic<std::uint32_t> producers_asleep;
  alignas(64) std::atomic<std::uint32_t> closed;  // kRingClosed | kRingBroken
  // Claims held while waiting by the processes that found no record (their claims name
  // kNoHolder), counted: such claims cannot be told apart by position.
  std::atomic<std::uint32_t> nobody_waiting;
  std::atomic<std::uint64_t> abandoned;  // claims of dead processes freed (diagnostics)
  alignas(64) HolderRecord holders[kHolderRecords];
  // The user's (Ring::user_area): zero in a new ring.
  alignas(64) std::byte user[Ring::kUserBytes];
};
static_assert(std::is_standard_layout_v<RingHeader>);
static_assert(sizeof(HolderRecord) == 32 && offsetof(HolderRecord, overflow) == 12 &&
              offsetof(HolderRecord, waiting) == 16);
static_assert(offsetof(RingHeader, tail) == Ring::kTailOffset);
static_assert(offsetof(RingHeader, head) == Ring::kHeadOffset);
static_assert(offsetof(RingHeader, closed) == 320 && offsetof(RingHeader, nobody_waiting) == 324 &&
              offsetof(RingHeader, abandoned) == 328);
static_assert(offsetof(RingHeader, holders) == 384 && offsetof(RingHeader, user) == 4480 &&
              sizeof(RingHeader) == 5504);  // docs/shm_layout.md
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

struct SlotHead {
  std::atomic<std::uint64_t> stored;  // the slot word, less index_bias (Ring::load_word)
  std::uint32_t size;
  std::uint32_t tag;
};
static_assert(sizeof(SlotHead) == Ring::kSlotHeaderBytes);

}  // namespace shmtensor::internal
