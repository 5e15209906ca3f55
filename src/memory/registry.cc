#include "memory/registry.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "memory/arena.h"
#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/fork_handlers.h"
#include "os/futex.h"

namespace shmtensor::internal {

namespace {

// The registry's lock: a futex word, 0 free, 1 held, 2 held with sleepers (a lock and an
// unlock are one atomic operation each: every storage a process receives or drops takes
// it, and std::mutex cost ~50 instructions a pair there). Process-local (private futex
// operations, os/futex.h); held across fork by the fork handlers. Never throws, and leaves
// errno as it found it, as pthread_mutex_lock does.
class RegistryLock {
 public:
  void lock() noexcept {
    std::uint32_t seen = 0;
    if (word_.compare_exchange_strong(seen, 1, std::memory_order_acquire)) return;
    const int saved = errno;
    if (seen != 2) seen = word_.exchange(2, std::memory_order_acquire);
    while (seen != 0) {
      // Returns at once (EAGAIN) if the word is no longer 2; EINTR: look again.
      futex_wait_private(&word_, 2);
      seen = word_.exchange(2, std::memory_order_acquire);
    }
    errno = saved;
  }
  void unlock() noexcept {
    if (word_.exchange(0, std::memory_order_release) != 2) return;
    const int saved = errno;
    futex_wake_private(&word_, 1);
    errno = saved;
  }

 private:
  std::atomic<std::uint32_t> word_{0};
};

}  // namespace

struct StorageTable {
  struct Slot {
    std::weak_ptr<StorageImpl> weak;
    const StorageImpl* raw = nullptr;  // for identity in remove_storage (weak is expired then)
  };
  // Pages by page number (hashed: a hostile segment may claim billions of blocks, and a
  // slot is made only for a block that became a storage here).
  static constexpr std::uint32_t kPageSlots = 128;
  std::unordered_map<std::uint32_t, std::unique_ptr<Slot[]>> pages;
  std::uint32_t last_page = UINT32_MAX;  // the page used last (lookups come in order)
  Slot* last = nullptr;
  Slot* page(std::uint32_t p, bool make) {
    if (p == last_page) return last;
    auto it = pages.find(p);
    if (it == pages.end()) {
      if (!make) return nullptr;
      it = pages.emplace(p, std::make_unique<Slot[]>(kPageSlots)).first;
    }
    last_page = p;
    last = it->second.get();
    return last;
  }
  Slot* find(std::uint32_t block) {
    Slot* pg = page(block / kPageSlots, /*make=*/false);
    return pg != nullptr ? &pg[block % kPageSlots] : nullptr;
  }
  Slot& at(std::uint32_t block) {
    return page(block / kPageSlots, /*make=*/true)[block % kPageSlots];
  }
  template <class F>
  void for_each(F&& f) const {
    for (const auto& [p, page] : pages)
      for (std::uint32_t i = 0; i < kPageSlots; ++i)
        if (page[i].raw != nullptr) f(page[i]);
  }
};

struct Registry::State {
  RegistryLock mu;
  std::unordered_map<std::uint64_t, std::weak_ptr<Segment>> segments;
  // Raw pointers alongside, for identity checks in remove_* (weak_ptr is expired by then).
  std::unordered_map<std::uint64_t, const Segment*> segment_ptrs;
  // Storages by segment and block: a table per segment, indexed by block, in pages made
  // when first used. A receiver looks up every tensor it receives here, and blocks come
  // in allocation order, so lookups walk memory in order (a node-based map keyed by
  // (uid, offset) costs a cache miss or three per lookup: a quarter of a consumer's time
  // when it keeps millions of tensors). The key is the Segment's address: a table goes with its
  // Segment (~Segment calls remove_segment), and every registered storage holds its
  // segment, so an address is never reused while its table lives. Tables stay while their
  // segment does, so a stream of tensors through one segment allocates nothing here.
  std::unordered_map<const Segment*, StorageTable> storages;
  std::deque<std::shared_ptr<Segment>> received;  // most recent first
};

namespace {

constexpr std::size_t kReceivedCacheSize = 8;
constexpr std::size_t kReceivedCacheBytes = std::size_t{1} << 30;

Registry::State* g_state = nullptr;

// fork handlers. A forked child inherits every mapping, so it holds every named segment
// the parent holds and must own a count of each in its refcount: otherwise its Segment
// destructors would release the parent's counts. Likewise it inherits every storage, so
// it must hold every block the parent holds. The counts are added in the parent before
// fork (so no window exists where the parent alone could drop the last count while the
// child still maps it); from then on they are the child's, and the child turns its block
// counts into holds of its own slot (a SIGKILLed child's holds can then be reclaimed).
// Only if the fork failed does the parent take them back. The arena mutex and the registry
// lock are held across fork, so the child never inherits them locked by another thread.
struct Forking {
  std::vector<std::shared_ptr<Segment>> named;
  std::vector<std::shared_ptr<StorageImpl>> storages;
  std::vector<std::shared_ptr<Segment>> all;
};
Forking* g_forking = nullptr;

void prepare_fork() noexcept;
void parent_after_fork(bool fork_failed) noexcept;
void child_after_fork() noexcept;
constexpr ForkHandlers kForkHandlers{prepare_fork, parent_after_fork, child_after_fork};

}  // namespace

Registry::Registry() : state_(new State) {
  g_state = state_;
  install_fork_handlers(ForkStage::kMemory, &kForkHandlers);
}

Registry& Registry::instance() {
  static Registry* r = new Registry();  // never destroyed: see state_
  return *r;
}

namespace {

void prepare_fork() noexcept {
  arena_prepare_fork();  // lock order: arena, then registry
  g_state->mu.lock();
  // Allocation here is fine: we are in the parent, before fork.
  g_forking = new Forking();
  for (auto& [uid, weak] : g_state->segments) {
    if (auto seg = weak.lock()) {
      if (seg->strategy() == SharingStrategy::kFileSystem) {
        seg->header()->refcount.fetch_add(1, std::memory_order_relaxed);
        g_forking->named.push_back(seg);
      }
      g_forking->all.push_back(std::move(seg));
    }
  }
  for (auto& [seg, table] : g_state->storages) {
    table.for_each([](const StorageTable::Slot& slot) {
      if (auto impl = slot.weak.lock()) {
        impl->segment()->add_fork_count(impl->block());
        g_forking->storages.push_back(std::move(impl));
      }
    });
  }
}

void parent_after_fork(bool fork_failed) noexcept {
  auto* held = g_forking;
  g_forking = nullptr;
  g_state->mu.unlock();
  // On success the counts added in prepare_fork belong to the child: the parent keeps its
  // own and gives nothing back. On failure no child exists, so the parent takes them back;
  // this cannot reach zero: the parent itself still holds a count (held keeps the segments
  // alive).
  if (fork_failed) {
    for (auto& seg : held->named) seg->header()->refcount.fetch_sub(1, std::memory_order_relaxed);
    for (auto& impl : held->storages) impl->segment()->take_back_fork_count(impl->block());
  }
  arena_parent_after_fork();
  delete held;  // drops the temporary references outside the locks
}

void child_after_fork() noexcept {
  // The child keeps the counts added for it. It drops the temporary shared_ptrs only
  // after unlocking: a Segment destructor takes the registry lock.
  auto* held = g_forking;
  g_forking = nullptr;
  // Every inherited segment gets a slot, not only those we hold blocks of at fork: the
  // child keeps the inherited Segment and reuses it for blocks of it received later, and
  // a slot can be taken only here (single-threaded). Without one those later holds would
  // be counts, which nobody can take back when the child dies: a producer whose forked
  // consumers crash would never get those blocks back.
  for (auto& seg : held->all) seg->reset_after_fork(/*take_slot=*/true);
  for (auto& impl : held->storages) {
    bool counted = true;
    impl->segment()->convert_fork_hold(impl->block(), &counted);
    impl->set_counted_after_fork(counted);
  }
  g_state->mu.unlock();
  arena_child_after_fork();
  delete held;
}

}  // namespace

std::shared_ptr<Segment> Registry::add_segment(const std::shared_ptr<Segment>& segment) {
  std::lock_guard lock(state_->mu);
  auto& weak = state_->segments[segment->uid()];
  if (auto existing = weak.lock()) return existing;
  weak = segment;
  state_->segment_ptrs[segment->uid()] = segment.get();
  return segment;
}

void Registry::remove_segment(std::uint64_t uid, const Segment* segment) noexcept {
  std::lock_guard lock(state_->mu);
  state_->storages.erase(segment);  // its storages are gone: each held the segment
  segment->storage_table_ = nullptr;
  auto it = state_->segment_ptrs.find(uid);
  if (it != state_->segment_ptrs.end() && it->second == segment) {
    state_->segment_ptrs.erase(it);
    state_->segments.erase(uid);
  }
}

std::shared_ptr<Segment> Registry::find_segment(std::uint64_t uid) {
  std::lock_guard lock(state_->mu);
  auto it = state_->segments.find(uid);
  return it == state_->segments.end() ? nullptr : it->second.lock();
}

StorageTable& Registry::table_for(State& state, const Segment& segment) {
  if (segment.storage_table_ == nullptr) segment.storage_table_ = &state.storages[&segment];
  return *segment.storage_table_;
}

void Registry::add_storage(const Segment& segment, std::uint32_t block,
                           const std::shared_ptr<StorageImpl>& s) {
  std::lock_guard lock(state_->mu);
  table_for(*state_, segment).at(block) = {s, s.get()};
}

void Registry::remove_storage(const Segment& segment, std::uint32_t block,
                              const StorageImpl* s) noexcept {
  std::lock_guard lock(state_->mu);
  if (segment.storage_table_ == nullptr) return;
  StorageTable::Slot* slot = segment.storage_table_->find(block);
  if (slot != nullptr && slot->raw == s) *slot = {};
}

std::shared_ptr<StorageImpl> Registry::find_or_add_storage(
    const Segment& segment, std::uint32_t block, std::shared_ptr<StorageImpl> (*call)(void*),
    void* make) {
  std::lock_guard lock(state_->mu);
  if (segment.storage_table_ != nullptr)
    if (StorageTable::Slot* slot = segment.storage_table_->find(block))
      if (auto found = slot->weak.lock()) return found;
  // make() only constructs (no registry calls), so it may run under the lock. Nothing is
  // allocated here for a reference that make() refuses (a forged one).
  std::shared_ptr<StorageImpl> made = call(make);
  if (made) table_for(*state_, segment).at(block) = {made, made.get()};
  return made;
}

namespace {

bool is_named_dedicated(const Segment& segment) {
  return segment.strategy() == SharingStrategy::kFileSystem && is_dedicated_kind(segment.kind());
}

}  // namespace

void Registry::remember_received_segment(const std::shared_ptr<Segment>& segment) {
  // Before the lock: a statfs.
  if (is_named_dedicated(*segment) && !may_keep_unused_named_segments()) return;
  std::vector<std::shared_ptr<Segment>> evicted;  // destroyed after unlocking (~Segment locks)
  std::lock_guard lock(state_->mu);
  auto& r = state_->received;
  if (!r.empty() && r.front() == segment) return;
  auto it = std::find(r.begin(), r.end(), segment);
  if (it != r.end()) r.erase(it);
  r.push_front(segment);
  // At most kReceivedCacheSize segments and kReceivedCacheBytes of their memory (device
  // memory included), the newest always kept.
  std::size_t bytes = 0;
  for (const auto& seg : r) bytes += seg->backing_size();
  while (r.size() > 1 && (r.size() > kReceivedCacheSize || bytes > kReceivedCacheBytes)) {
    bytes -= r.back()->backing_size();
    evicted.push_back(std::move(r.back()));
    r.pop_back();
  }
}

void Registry::forget_cached_segments() {
  std::deque<std::shared_ptr<Segment>> dropped;
  std::lock_guard lock(state_->mu);
  dropped.swap(state_->received);
}

std::size_t Registry::forget_cached_named_segments() {
  std::vector<std::shared_ptr<Segment>> dropped;  // destroyed after unlocking
  std::lock_guard lock(state_->mu);
  std::erase_if(state_->received, [&dropped](std::shared_ptr<Segment>& seg) {
    if (seg->strategy() != SharingStrategy::kFileSystem) return false;
    dropped.push_back(std::move(seg));
    return true;
  });
  return dropped.size();
}

void Registry::received_storage_gone(const Segment& segment) {
  if (!is_named_dedicated(segment) || may_keep_unused_named_segments()) return;
  std::shared_ptr<Segment> dropped;  // destroyed after unlocking
  std::lock_guard lock(state_->mu);
  auto& r = state_->received;
  auto it = std::find_if(r.begin(), r.end(),
                         [&segment](const auto& s) { return s.get() == &segment; });
  if (it == r.end()) return;
  dropped = std::move(*it);
  r.erase(it);
}

std::vector<std::shared_ptr<Segment>> Registry::live_segments() {
  std::lock_guard lock(state_->mu);
  std::vector<std::shared_ptr<Segment>> live;
  for (auto& [uid, weak] : state_->segments)
    if (auto seg = weak.lock()) live.push_back(std::move(seg));
  return live;
}

std::size_t Registry::segment_count() {
  std::lock_guard lock(state_->mu);
  return state_->segments.size();
}

}  // namespace shmtensor::internal
