// The header at offset 0 of every shmtensor segment. Its prose twin is docs/shm_layout.md;
// change both together and bump kSegmentLayoutVersion when the layout changes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace shmtensor::internal {

inline constexpr std::uint64_t kSegmentMagic = 0x314745535453484dULL;  // "MHSTSEG1" LE
inline constexpr std::uint32_t kSegmentLayoutVersion = 2;
inline constexpr std::size_t kSegmentHeaderSize = 128;
// Payload alignment inside a segment (cache line; tensors need at most 16).
inline constexpr std::size_t kSegmentAlignment = 64;

enum class SegmentKind : std::uint32_t { kDedicated = 1, kArena = 2 };

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
  std::uint8_t reserved[kSegmentHeaderSize - 76];
};

static_assert(std::is_standard_layout_v<SegmentHeader>);
static_assert(sizeof(SegmentHeader) == kSegmentHeaderSize);
static_assert(std::atomic<std::int64_t>::is_always_lock_free);
static_assert(offsetof(SegmentHeader, refcount) == 64);
static_assert(offsetof(SegmentHeader, creator_pgid) == 72);

}  // namespace shmtensor::internal
