// The per-process arena: where this process's shared storages get their bytes.
//
// Small and medium storages (up to kLargeThreshold) come from arena segments, one series
// per size class and strategy, each segment carved into blocks of the class's size; the
// segments of a class grow 1 MiB → 64 MiB. Larger storages get a dedicated segment of one
// block; freed ones are kept in a small cache and reused with their pages faulted in.
//
// A block is reused only by its creator, and only once its word is 0 (no process holds
// it, no message carries it): see segment.h and docs/design.md. The creator learns of a
// block freed by another process from the segment's release epoch, and rescans then.
//
// Thread-safe: one mutex per process. Lock order: arena, then registry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shmtensor/sharing_strategy.h"

namespace shmtensor::internal {

class Segment;

inline constexpr std::size_t kLargeThreshold = 256 * 1024;
// Dedicated segments are never "run out of": when this many exist, the arena takes back
// the holds of dead processes on them before making another (see arena_allocate).
inline constexpr std::size_t kLargeReclaimAt = 8;

struct Block {
  std::shared_ptr<Segment> segment;
  std::uint32_t index = 0;
  std::size_t offset = 0;  // from the segment's payload
};

// A block of at least nbytes (> 0), held by this process (its slot's bit is set). Throws
// SystemError / SharedMemoryFullError when a new segment is needed and cannot be made.
// file_system, /dev/shm full: first gives back what this process keeps there unused (its
// free segments and its receive cache's named segments, after clearing the holds of dead
// processes) and tries again; then, for a segment /dev/shm could hold once others give
// space back (the consumer's batches), the block is taken from the file_descriptor arena:
// a memfd segment, not limited by /dev/shm, that travels by fd (its storage's
// sharing_strategy() says file_descriptor). A segment larger than /dev/shm is refused
// (SharedMemoryFullError) before a name is made.
Block arena_allocate(SharingStrategy strategy, std::size_t nbytes);

// Whether this process may keep a file_system segment that no storage of it uses (a free
// dedicated segment, one handed over to receivers, a received one in the receive cache)
// for reuse: always where /dev/shm has no size limit; under a limit (Docker's 64 MB), only
// while /dev/shm is at most a quarter full. Every segment so kept existed when the last of
// those decisions was made, so together they take at most a quarter of a limited
// /dev/shm, and the rest stays for storages in use.
bool may_keep_unused_named_segments() noexcept;

// `segment`, a dedicated segment of ours, lost this process's hold while others (or
// messages) still hold its block. A file_system one that may not be kept
// (may_keep_unused_named_segments) leaves the arena: it is no longer ours to reuse, and
// its name goes with its last holder, as torch's do. Takes the arena lock.
void arena_block_handed_over(const Segment& segment) noexcept;
// The same in device memory of CUDA device `device` (this process's ordinal): blocks of
// device segments (segment.h), whatever the strategy. Throws std::invalid_argument for a
// device this process does not see, CudaError when CUDA cannot be used or the device is
// out of memory.
Block arena_allocate_device(int device, std::size_t nbytes);

// `block` of `segment`, one of ours, became free through this process (its word went to 0:
// Segment::block_freed): back into its free list. Takes the arena lock.
void arena_block_freed(const Segment& segment, std::uint32_t block) noexcept;

// Returns to the OS every segment of ours in which no block is held (after clearing the
// holds of dead processes). Returns how many segments went.
std::size_t arena_trim();

struct ArenaStats {
  std::size_t segments = 0;      // segments this process's arena owns
  std::size_t bytes = 0;         // their memory (mapped, or on the device)
  std::size_t blocks_held = 0;   // blocks handed out and not known to be free
  std::size_t blocks_free = 0;   // blocks in the free lists
};
ArenaStats arena_stats();

// Private (not yet shared) buffers for storages. Large ones (>= kLargeThreshold) that a
// storage frees are kept, a few at most, and handed to the next private storage of a
// similar size with their pages faulted in: a loop that makes a fresh large tensor and
// sends it (share_memory_ copies it into a cached shared segment) then runs at memcpy
// speed instead of page-fault speed. empty_cache() frees them.
std::byte* private_allocate(std::size_t nbytes, std::size_t* capacity);
void private_free(std::byte* data, std::size_t capacity) noexcept;

// Fork handlers (called by the registry's, in lock order).
void arena_prepare_fork() noexcept;
void arena_parent_after_fork() noexcept;
// The child owns no arena: its parent's segments stay the parent's.
void arena_child_after_fork() noexcept;

}  // namespace shmtensor::internal
