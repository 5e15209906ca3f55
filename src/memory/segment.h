// Segment: one shared-memory object (memfd or named /dev/shm object), mapped once in this
// process, carved into equal blocks (docs/shm_layout.md). Storages live in blocks; an
// arena segment holds many, a dedicated one (a large storage) exactly one.
//
// Lifetime: held by shared_ptr from the storages in it, from the arena that created it
// and from the receive cache (registry.h). For file_system segments each process holds
// one count in the header's refcount while it maps the segment, and gives it back at the
// latest when it ends cleanly (release_named_segments_before_exit); the process whose
// release takes it to zero unlinks the name. Every name is reported to the installed
// SegmentObserver (segment_observer.h). memfd segments are freed by the kernel when the
// last fd and mapping are gone.
//
// Blocks have their own cross-process state: one atomic word per block (segment_header.h)
// with a bit per holder slot and a count of messages in flight. The block operations below
// are the only writers of those words; docs/design.md proves the protocol safe.
//
// Thread-safe: the geometry is copied out of the header once validated and never re-read
// (a peer cannot change what this process believes); words and slots are atomics. slot_
// and own_ change only in a forked child's fork handler, where one thread runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "memory/segment_header.h"
#include "os/mapping.h"
#include "os/unique_fd.h"
#include "shmtensor/sharing_strategy.h"

namespace shmtensor::internal {

namespace cuda {
class DeviceMemory;
}
struct FdFacts;
struct StorageTable;  // the registry's (registry.cc)

// The most bytes of blocks a device segment may claim (more than any device has): its
// blocks are not in the object, so the object's size cannot bound them.
inline constexpr std::uint64_t kMaxDeviceSegmentBytes = std::uint64_t{1} << 40;

// What a Segment relies on from its header, as validated (validate_segment_header).
struct SegmentGeometry {
  std::uint64_t uid = 0;
  SegmentKind kind = SegmentKind::kArena;
  std::size_t block_size = 0;
  std::uint32_t block_count = 0;
  std::size_t data_offset = 0;
  std::size_t slots_offset = 0;
  std::size_t words_offset = 0;
  std::uint8_t device_uuid[16] = {};
};

class Segment : public std::enable_shared_from_this<Segment> {
 public:
  // A new segment of `block_count` blocks of `block_size` bytes (a multiple of 64), with
  // this process in slot 0, registered in this process's Registry. Throws
  // SharedMemoryFullError / SystemError, Error when the manager daemon cannot be started
  // (file_system), std::invalid_argument for a geometry that breaks the precondition.
  static std::shared_ptr<Segment> create(SharingStrategy strategy, std::size_t block_size,
                                         std::uint32_t block_count, SegmentKind kind);
  // Maps a segment received as an fd (file_descriptor). Checks size and seals before
  // mapping and validates the header after; throws ProtocolError on any mismatch,
  // SystemError when it cannot be mapped. `uid` is what the message claimed; it must match
  // the header.
  static std::shared_ptr<Segment> attach_fd(UniqueFd fd, std::uint64_t uid);
  // Opens and maps a named segment (file_system) and adds this process's count to its
  // refcount. The count the sender added for the message stays: the decoder gives it back
  // (drop_in_flight_count) once the message proved it carries counts, so a stale or forged
  // message that is refused takes nothing off the name. Throws SystemError (ENOENT: the
  // name is gone), ProtocolError for a header that does not validate.
  static std::shared_ptr<Segment> attach_name(const std::string& name, std::uint64_t uid);
  // A device segment (kind kDeviceArena / kDeviceDedicated): blocks of CUDA memory on
  // device `ordinal`, their header, slots and words in a memfd. Travels as two fds (the
  // memfd and the allocation's), whatever the sharing strategy. Throws CudaError (no
  // CUDA, out of device memory) and what create() throws.
  static std::shared_ptr<Segment> create_device(int ordinal, std::size_t block_size,
                                                std::uint32_t block_count, SegmentKind kind);
  // Maps a device segment received as its memfd and its allocation's fd: the memfd as
  // attach_fd does, then the allocation on the device whose UUID the header names.
  // ProtocolError for anything inconsistent, CudaError when CUDA cannot be used here.
  static std::shared_ptr<Segment> attach_device(UniqueFd meta, UniqueFd memory, std::uint64_t uid);
  // attach_device in two steps. First the memfd alone, mapped and validated: payload() is
  // null, nothing is registered, no slot is taken. Then its device memory: imported,
  // mapped, a slot taken, registered (returns the registered segment). When the second
  // step throws (CudaError: CUDA unusable here, the device not visible), the first
  // step's segment is unchanged and still serves to give back the in-flight counts of the
  // message's blocks (drop_block_in_flight), so that a message refused for that reason
  // leaks nothing.
  static std::shared_ptr<Segment> attach_device_metadata(UniqueFd meta, std::uint64_t uid);
  static std::shared_ptr<Segment> map_device_memory(const std::shared_ptr<Segment>& metadata,
                                                    UniqueFd memory);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  SharingStrategy strategy() const noexcept { return strategy_; }
  std::uint64_t uid() const noexcept { return geometry_.uid; }
  SegmentKind kind() const noexcept { return geometry_.kind; }
  const SegmentHeader* header() const noexcept {
    return reinterpret_cast<const SegmentHeader*>(mapping_.data());
  }
  SegmentHeader* header() noexcept { return reinterpret_cast<SegmentHeader*>(mapping_.data()); }
  // The data area: block i starts at payload() + i * block_size(). For a device segment
  // a device address, which the host must not dereference.
  std::byte* payload() const noexcept { return payload_; }
  // The CUDA device of a device segment's blocks (this process's ordinal), -1 for host
  // memory.
  int device() const noexcept { return device_ordinal_; }
  bool is_device() const noexcept { return device_ordinal_ >= 0; }
  // A device segment's allocation fd (sent with its memfd). -1 otherwise.
  int device_fd() const noexcept;
  std::size_t payload_size() const noexcept { return geometry_.block_size * geometry_.block_count; }
  std::size_t mapped_size() const noexcept { return mapping_.size(); }
  // The memory the segment keeps: the mapping, or for a device segment its device memory.
  std::size_t backing_size() const noexcept;
  std::size_t block_size() const noexcept { return geometry_.block_size; }
  std::uint32_t block_count() const noexcept { return geometry_.block_count; }
  // file_descriptor: the memfd (kept open to send it again). -1 for file_system.
  int fd() const noexcept { return fd_.get(); }
  // file_system: "/shmtensor_<pid>_<hex>_<n>". Empty for file_descriptor.
  const std::string& name() const noexcept { return name_; }

  // file_system: adds one count for a message about to carry the name (the receiver adopts
  // it). Release it with drop_in_flight_count() if the message is never sent.
  void add_in_flight_count() noexcept;
  void drop_in_flight_count() noexcept;
  // file_system: gives back this process's count of the name (unlinking it at zero) and
  // tells the observer; at most once, the destructor included. The mapping stays valid.
  // No-op for memfd segments.
  void give_back_count() noexcept;

  // ---- blocks (segment_blocks.cc) ----
  // The block that starts at payload offset `offset`, or -1 if none does.
  std::int64_t block_at(std::uint64_t offset) const noexcept;
  // This process's slot (-1: none was free; its holds are then counted in the word).
  int slot() const noexcept { return slot_; }
  // Whether this process's arena created the segment and may reuse its blocks.
  bool own() const noexcept { return own_.load(std::memory_order_acquire); }
  void disown() noexcept { own_.store(false, std::memory_order_release); }
  // Creator only: takes a free block (word 0) for a new storage held by this process.
  // False if the word was not 0 (a peer corrupted it; the block must not be used).
  bool claim_free_block(std::uint32_t block) noexcept;
  // The word of a block, read now (acquire).
  std::uint64_t block_word(std::uint32_t block) const noexcept;
  // Whether this process holds the block through its slot (its bit is set in the word).
  bool holds_block(std::uint32_t block) const noexcept;
  // A sender holding the block adds a count for a message that carries it. Throws Error
  // when 65535 messages carrying it are in flight already.
  void add_block_in_flight(std::uint32_t block);
  // The operations below that can take a word to 0 report it (true / *freed) and pass it
  // on: to this process's arena when it created the segment, otherwise to the creator
  // through the release epoch.
  // Gives back the count of a message that was never sent. True if the block became free.
  bool drop_block_in_flight(std::uint32_t block) noexcept;
  // Receiver: turns the message's count into this process's hold (its slot's bit, or the
  // count itself without a slot, or when the bit is still set by a holder being
  // destroyed). Sets *counted to how it holds. False if no count is in flight (a hostile
  // or corrupt message): nothing changed then.
  bool adopt_block_in_flight(std::uint32_t block, bool* counted) noexcept;
  // Receiver that holds the block already: gives the message's count back. False if no
  // count was in flight. *freed tells whether the block became free.
  bool drop_duplicate_in_flight(std::uint32_t block, bool* freed) noexcept;
  // Releases this process's hold. True if the block became free. A hold that is not in
  // the word (a peer corrupted it) is reported on stderr and changes nothing. The creator
  // of a dedicated segment that others still hold tells its arena
  // (arena_block_handed_over).
  bool release_block(std::uint32_t block, bool counted) noexcept;
  // Whether this process reported the block's word as corrupted: its creator never hands
  // it out again (the word no longer tells who holds it).
  bool quarantined(std::uint32_t block) const noexcept {
    return (quarantined_[block / 64].load(std::memory_order_relaxed) >> (block % 64)) & 1;
  }
  // Clears the bits of slots whose process is dead, or lives but does not map the segment
  // any more (it exec'd: its holds went with its address space), and frees those slots.
  // Returns the number of blocks that became free. Called by the creator when it runs out
  // of blocks, and by empty_cache().
  // `exec_check`: also take back the holds of live owners that do not map the segment (an
  // exec'd process). Only empty_cache() asks for it: /proc/<pid>/maps is read without a
  // lock against the owner's concurrent mmap/munmap and was seen to miss a mapping that
  // existed throughout (Linux 6.18), so a miss must be seen twice and is never acted on
  // in the allocation path.
  std::size_t reclaim_dead_slots(bool exec_check = false) noexcept;
  // A forked child: forgets the parent's slot and ownership, and takes a slot of its own
  // when it holds blocks here. Call before any block operation in the child.
  void reset_after_fork(bool take_slot) noexcept;
  // A forked child: turns a hold its parent counted for it at fork into its own.
  // Sets *counted as adopt does.
  void convert_fork_hold(std::uint32_t block, bool* counted) noexcept;
  // Parent at fork: one count per held block for the child (take_back_fork_count if the
  // fork failed).
  void add_fork_count(std::uint32_t block) noexcept;
  void take_back_fork_count(std::uint32_t block) noexcept;

  // Private: use the factories. `geometry` is the validated copy of the header.
  Segment(SharingStrategy strategy, UniqueFd fd, Mapping mapping, std::string name,
          const SegmentGeometry& geometry);

 private:
  friend class Registry;
  void claim_slot(bool creator) noexcept;
  // A segment this process just made: records its object's identity, takes slot 0, owns
  // it, registers it.
  void adopt_as_creator(const FdFacts& facts);
  void release_slot() noexcept;
  std::uint64_t* word_ptr(std::uint32_t block) const noexcept;
  std::uint64_t* slot_ptr(int slot) const noexcept;
  void note_freed_by_other() noexcept;
  void block_freed(std::uint32_t block) noexcept;
  // Clears slot s's bit in every word (its dead owner's holds); returns the blocks freed.
  std::size_t clear_slot_bits(int s) noexcept;
  void report_corruption(const char* what, std::uint32_t block, std::uint64_t word) noexcept;

  SharingStrategy strategy_;
  UniqueFd fd_;
  Mapping mapping_;
  std::string name_;
  // A second attach of a named segment that lost the race to register (attach_name): its
  // count is given back without telling the daemon (the registered one told it).
  bool duplicate_ = false;
  std::atomic<bool> count_given_back_{false};
  // Copied from the validated header, never re-read.
  SegmentGeometry geometry_;
  std::uint64_t device_ = 0;  // of the object, as /proc/<pid>/maps shows it
  std::uint64_t inode_ = 0;
  int slot_ = -1;
  std::uint64_t slot_owner_ = 0;  // what slot_ holds (this process)
  std::atomic<bool> own_{false};
  std::unique_ptr<std::atomic<std::uint64_t>[]> quarantined_;  // one bit per block
  std::byte* payload_ = nullptr;
  int device_ordinal_ = -1;
  std::unique_ptr<cuda::DeviceMemory> device_memory_;
  // The registry's table of this segment's storages here (registry.cc), so that a lookup
  // needs no map: read and written under the registry's lock; null until the first
  // storage of this segment is registered. The registry's bookkeeping, not the segment's
  // state: mutable, as the registry is handed const segments.
  mutable StorageTable* storage_table_ = nullptr;
};

// Checks a mapped header against what the mapping allows: magic, version, sizes, and that
// slots, words and data lie inside the object without overlapping. Each field is read
// once; the copy it checked is returned, and a Segment is built from that copy only (a
// peer rewriting the shared header meanwhile changes nothing this process relies on).
// Throws ProtocolError naming the first bad field.
SegmentGeometry validate_segment_header(const SegmentHeader& h, std::size_t mapped_size,
                                        std::uint64_t expected_uid);

// Removes one count from a named segment's refcount, unlinking it at zero. Used by
// Segment's destructor and for in-flight counts of messages that were never received.
void release_named_segment_count(SegmentHeader* header, const std::string& name) noexcept;

// Gives back this process's count of every named segment it still maps (give_back_count),
// so that a process that ends cleanly removes the names it was the last holder of itself,
// instead of leaving them to the manager. Runs from an atexit handler (registered with the
// first named segment); a process that ends with _exit (a forked worker) calls it first.
// Thread-safe; segments created or received afterwards keep their counts.
void release_named_segments_before_exit() noexcept;

}  // namespace shmtensor::internal
