// The header at offset 0 of every shmtensor segment. Its prose twin is docs/shm_layout.md;
// change both together and bump kSegmentLayoutVersion when the layout changes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace shmtensor::internal {

inline constexpr std::uint64_t kSegmentMagic = 0x314745535453484dULL;  // "MHSTSEG1" LE
inline constexpr std::uint32_t kSegmentLayoutVersion = 4;
inline constexpr std::size_t kSegmentHeaderSize = 128;
// Payload alignment inside a segment (cache line; tensors need at most 16).
inline constexpr std::size_t kSegmentAlignment = 64;
// The most blocks a segment has: an arena segment is at most 64 MiB of blocks of at least
// 64 bytes (a dedicated one has one block). A receiver refuses more, so that a hostile
// header cannot make it allocate per-block bookkeeping for billions of blocks.
inline constexpr std::uint32_t kMaxSegmentBlocks = std::uint32_t{1} << 20;

// Every segment is carved into `block_count` blocks of `block_size` bytes: an arena has
// many small ones, a dedicated segment (a large storage) exactly one. A device segment's
// blocks are CUDA device memory (one allocation, cuda/device_memory.h): the shared object
// holds the header, slots and words only, and the header names the device by UUID.
enum class SegmentKind : std::uint32_t {
  kDedicated = 1,
  kArena = 2,
  kDeviceDedicated = 3,
  kDeviceArena = 4,
};
constexpr bool is_device_kind(SegmentKind k) {
  return k == SegmentKind::kDeviceDedicated || k == SegmentKind::kDeviceArena;
}
constexpr bool is_dedicated_kind(SegmentKind k) {
  return k == SegmentKind::kDedicated || k == SegmentKind::kDeviceDedicated;
}

// Holder slots per segment: a process that holds blocks of a segment owns one slot, keyed
// by pid + start time (slot_owner, os/proc.h), and marks each block it holds with its
// slot's bit.
inline constexpr std::uint32_t kSlotCount = 48;
// A block's word (one atomic uint64 per block): bits 0..47 are the slots that hold it,
// bits 48..63 count messages in flight that carry it plus holds of processes without a
// slot. The block is free (its creator may reuse it) exactly when the word is 0.
inline constexpr std::uint64_t kSlotBits = (std::uint64_t{1} << kSlotCount) - 1;
inline constexpr std::uint64_t kCountUnit = std::uint64_t{1} << kSlotCount;
inline constexpr std::uint64_t kCountMax = 0xffff;
constexpr std::uint64_t block_count_of(std::uint64_t word) { return word >> kSlotCount; }

struct SegmentHeader {
  std::uint64_t magic;               // kSegmentMagic; written last by the creator
  std::uint32_t layout_version;      // kSegmentLayoutVersion
  std::uint32_t header_size;         // kSegmentHeaderSize
  std::uint64_t total_size;          // bytes of the whole object, header included
  std::uint64_t data_offset;         // where the payload starts (multiple of 64)
  std::uint64_t data_size;           // payload bytes
  std::uint64_t uid;                 // random; identifies the segment in messages
  std::int32_t creator_pid;          // process that created it
  std::uint32_t kind;                // SegmentKind
  std::uint64_t creator_start_time;  // /proc/<pid>/stat field 22 of the creator
  // file_system only: processes that map the segment plus messages in flight that name it.
  // The process that takes it to 0 unlinks the name. acq_rel: the unlinker must see every
  // other holder's release.
  std::atomic<std::int64_t> refcount;
  // The creator's process group at creation. A daemon that never learned of the name (it was
  // killed before reading the registration) keeps a name with counts left while this group
  // lives: its receivers are the creator's relatives (docs/cleanup.md, G5).
  std::int32_t creator_pgid;
  std::uint32_t block_count;     // blocks in the data area (>= 1)
  std::uint64_t block_size;      // bytes per block (a multiple of 64)
  std::uint64_t slots_offset;    // kSlotCount atomic uint64 slot owners, from the start
  std::uint64_t words_offset;    // block_count atomic uint64 block words, from the start
  // Bumped (release) by a process other than the creator each time it frees a block (takes
  // its word to 0): the creator rescans a segment for free blocks only when it changed.
  std::atomic<std::uint64_t> release_epoch;
  // Device segments: the CUDA device's UUID (cuDeviceGetUuid). Zero for host segments.
  std::uint8_t device_uuid[16];
};

static_assert(std::is_standard_layout_v<SegmentHeader>);
static_assert(sizeof(SegmentHeader) == kSegmentHeaderSize);
static_assert(std::atomic<std::int64_t>::is_always_lock_free);
static_assert(offsetof(SegmentHeader, refcount) == 64);
static_assert(offsetof(SegmentHeader, creator_pgid) == 72);
static_assert(offsetof(SegmentHeader, block_size) == 80);
static_assert(offsetof(SegmentHeader, release_epoch) == 104);
static_assert(offsetof(SegmentHeader, device_uuid) == 112);

}  // namespace shmtensor::internal
