// The per-process registry of mapped segments and shared storages. It gives the wire
// layer identity: a storage reference (segment uid, offset, nbytes) that names a storage
// this process already has resolves to that very storage, and a segment already mapped is
// never mapped twice.
//
// Thread-safe (one lock: a futex word, registry.cc). Entries are weak: the registry never
// keeps anything alive.
// Across fork, the child inherits the entries (its mappings are inherited too), and for
// file_system segments the fork handlers give the child its own refcount (see registry.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace shmtensor::internal {

class Segment;
class StorageImpl;
struct StorageTable;  // registry.cc

class Registry {
 public:
  static Registry& instance();

  // Registers `segment` under its uid, unless a live segment is registered there already
  // (two threads attached the same new segment at once): returns the one registered, which
  // the caller must use, so that a process maps each segment once and each block is one
  // storage here.
  std::shared_ptr<Segment> add_segment(const std::shared_ptr<Segment>& segment);
  void remove_segment(std::uint64_t uid, const Segment* segment) noexcept;
  std::shared_ptr<Segment> find_segment(std::uint64_t uid);

  // Shared storages by (segment, block): one storage per block, so that a block received
  // twice, or sent back to its creator, is one storage here.
  void add_storage(const Segment& segment, std::uint32_t block,
                   const std::shared_ptr<StorageImpl>& s);
  void remove_storage(const Segment& segment, std::uint32_t block, const StorageImpl* s) noexcept;
  // The registered storage of that block, or a new one from make() registered now, under
  // one lock: two threads decoding the same reference get one storage. make() may return
  // null (nothing is registered then, and null is returned). `make` is called through a
  // plain pointer, not a std::function: a decoded storage costs no allocation for it.
  template <class Make>
  std::shared_ptr<StorageImpl> find_or_add_storage(const Segment& segment, std::uint32_t block,
                                                   Make&& make) {
    using M = std::remove_reference_t<Make>;
    return find_or_add_storage(
        segment, block, [](void* m) { return (*static_cast<M*>(m))(); },
        const_cast<void*>(static_cast<const void*>(std::addressof(make))));
  }
  std::shared_ptr<StorageImpl> find_or_add_storage(const Segment& segment, std::uint32_t block,
                                                   std::shared_ptr<StorageImpl> (*call)(void*),
                                                   void* make);

  // Keeps the last few segments received from other processes mapped after their last
  // storage here goes, so a stream of messages from one arena does not map and unmap it
  // each time (for a device segment: does not import it again). At most 8 segments and
  // 1 GiB of their memory (device memory included); the newest is always kept.
  // forget_cached_segments() drops them (empty_cache()). A dedicated file_system segment
  // is kept only while may_keep_unused_named_segments() (arena.h) says so: not remembered
  // when it does not, and forgotten when the last storage here of one goes while it does
  // not (received_storage_gone).
  void remember_received_segment(const std::shared_ptr<Segment>& segment);
  void forget_cached_segments();
  // Drops the file_system segments of the cache (an allocation that found /dev/shm full).
  // Returns how many went.
  std::size_t forget_cached_named_segments();
  // A storage of this process in `segment`, a dedicated file_system segment of another
  // process, went (StorageImpl's destructor).
  void received_storage_gone(const Segment& segment);

  // Every segment mapped now (release_named_segments_before_exit).
  std::vector<std::shared_ptr<Segment>> live_segments();
  // Segments registered now (tests).
  std::size_t segment_count();

  struct State;  // defined in registry.cc

 private:
  Registry();
  // The segment's table of storages, found through the pointer it keeps
  // (Segment::storage_table_), made on first use. Under the lock.
  static StorageTable& table_for(State& state, const Segment& segment);
  State* state_;  // leaked on purpose: storages may die during static destruction
};

}  // namespace shmtensor::internal
