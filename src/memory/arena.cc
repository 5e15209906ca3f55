#include "memory/arena.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <iterator>
#include <new>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "memory/registry.h"
#include "memory/segment.h"
#include "os/shm.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

namespace {

constexpr std::size_t kSmallStep = 64;
constexpr std::size_t kSmallLimit = 1024;  // classes of 64, 128, ..., 1024 bytes
// Above: four classes per doubling (waste under 25%), up to kLargeThreshold.
constexpr std::size_t kNumClasses = 16 + 4 * (std::bit_width(kLargeThreshold) - 1 - 10);
constexpr std::size_t kFirstSegmentBytes = std::size_t{1} << 20;
constexpr std::size_t kMaxSegmentBytes = std::size_t{64} << 20;
static_assert(kMaxSegmentBytes / kSegmentAlignment <= kMaxSegmentBlocks,
              "receivers would refuse our largest arena segments");
constexpr std::uint32_t kMinBlocks = 4;
// Freed large segments kept for reuse, at most this many and this many bytes.
constexpr std::size_t kLargeCacheCount = 4;
constexpr std::size_t kLargeCacheBytes = std::size_t{1} << 30;

struct SizeClass {
  std::size_t index;
  std::size_t block_size;
};

SizeClass size_class(std::size_t n) {
  if (n <= kSmallLimit) {
    std::size_t i = (n + kSmallStep - 1) / kSmallStep;
    return {i - 1, i * kSmallStep};
  }
  const std::size_t k = std::bit_width(n - 1) - 1;  // 2^k < n <= 2^(k+1)
  const std::size_t step = (std::size_t{1} << k) / 4;
  const std::size_t q = (n + step - 1) / step;  // 5..8
  return {16 + (k - 10) * 4 + (q - 5), q * step};
}

// One of our segments and what only we know about its blocks.
struct OwnSegment {
  std::shared_ptr<Segment> seg;
  std::vector<bool> handed_out;       // held by someone, as far as we know
  std::vector<std::uint32_t> free;    // word 0, ready to claim
  std::uint32_t bump = 0;             // blocks from here on were never used
  std::uint32_t held = 0;             // blocks handed out
  std::uint64_t seen_epoch = 0;
  std::size_t block_size() const { return seg->block_size(); }
};

struct ClassArena {
  std::vector<std::unique_ptr<OwnSegment>> segments;
  std::size_t next_bytes = kFirstSegmentBytes;
};

struct StrategyArena {
  std::array<ClassArena, kNumClasses> classes;
  std::vector<std::unique_ptr<OwnSegment>> large;
  std::size_t large_reclaim_at = kLargeReclaimAt;
};

struct PrivateBuffer {
  std::byte* data;
  std::size_t capacity;
};
constexpr std::size_t kPrivateCacheCount = 4;
constexpr std::size_t kPrivateCacheBytes = std::size_t{512} << 20;

// CUDA devices with an arena of their own (ordinals below this).
constexpr int kMaxDevices = 64;

struct State {
  std::mutex mu;
  std::vector<PrivateBuffer> private_cache;  // most recently freed last
  std::array<StrategyArena, 2> by_strategy;
  // Device arenas: made on first use. Their segments are device segments (their blocks
  // device memory), which travel by fd whatever the strategy.
  std::array<std::unique_ptr<StrategyArena>, kMaxDevices> by_device;
  std::unordered_map<const Segment*, OwnSegment*> index;
  // The parent's state, which a forked child abandons (arena_child_after_fork), kept
  // reachable on purpose: a child that ends with exit() is checked by LeakSanitizer.
  State* abandoned = nullptr;
};

State* g_state = new State;  // leaked: storages may be released during static destruction
// A forked child's references to its parent's segments, dropped on its first arena call
// (not in the fork handler: Segment destructors lock the registry and talk to the manager).
std::atomic<std::vector<std::shared_ptr<Segment>>*> g_inherited{nullptr};

void drop_inherited() {
  delete g_inherited.exchange(nullptr, std::memory_order_acq_rel);
}

// Where a storage's block comes from: host memory of a strategy, or a CUDA device.
struct ArenaKey {
  SharingStrategy strategy = SharingStrategy::kFileDescriptor;
  int device = -1;
};

StrategyArena& arena_of(ArenaKey key) {
  if (key.device < 0) return g_state->by_strategy[key.strategy == SharingStrategy::kFileSystem ? 1 : 0];
  auto& slot = g_state->by_device[static_cast<std::size_t>(key.device)];
  if (!slot) slot = std::make_unique<StrategyArena>();
  return *slot;
}

ArenaKey key_of(const Segment& seg) { return {seg.strategy(), seg.device()}; }

// The arena whose segments are names in /dev/shm.
bool is_named(ArenaKey key) {
  return key.device < 0 && key.strategy == SharingStrategy::kFileSystem;
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// Device segments are whole allocations of the device's granularity (2 MiB on current
// GPUs): a segment is made at least that big, with as many blocks as fit.
std::size_t device_granularity(int device) {
  return device < 0 ? 1 : cuda::Driver::get().ready(device).granularity;
}

// Takes a block from the free list or the untouched tail. Blocks whose word a peer
// corrupted are left marked as handed out: never reused.
bool take(OwnSegment& os, std::uint32_t* out) {
  while (!os.free.empty()) {
    std::uint32_t i = os.free.back();
    os.free.pop_back();
    os.handed_out[i] = true;
    ++os.held;
    if (os.seg->claim_free_block(i)) {
      *out = i;
      return true;
    }
  }
  while (os.bump < os.seg->block_count()) {
    std::uint32_t i = os.bump++;
    os.handed_out[i] = true;
    ++os.held;
    if (os.seg->claim_free_block(i)) {
      *out = i;
      return true;
    }
  }
  return false;
}

// Moves a handed-out block whose word is 0 to the free list. Every path that frees does
// it under the lock, and only here (claims happen under the lock too), so a block is
// never listed twice nor listed while held.
bool collect(OwnSegment& os, std::uint32_t i) {
  if (!os.handed_out[i] || os.seg->quarantined(i) || os.seg->block_word(i) != 0) return false;
  os.handed_out[i] = false;
  --os.held;
  os.free.push_back(i);
  return true;
}

bool rescan(OwnSegment& os, bool force) {
  const std::uint64_t epoch = os.seg->header()->release_epoch.load(std::memory_order_acquire);
  if (!force && epoch == os.seen_epoch) return false;
  os.seen_epoch = epoch;
  bool found = false;
  for (std::uint32_t i = 0; i < os.bump; ++i) found |= collect(os, i);
  return found;
}

OwnSegment& add_segment(std::vector<std::unique_ptr<OwnSegment>>& list,
                        std::shared_ptr<Segment> seg) {
  auto os = std::make_unique<OwnSegment>();
  os->seg = std::move(seg);
  os->handed_out.assign(os->seg->block_count(), false);
  os->seen_epoch = os->seg->header()->release_epoch.load(std::memory_order_acquire);
  g_state->index[os->seg.get()] = os.get();
  list.push_back(std::move(os));
  return *list.back();
}

Block block_of(OwnSegment& os, std::uint32_t i) {
  return Block{os.seg, i, static_cast<std::size_t>(i) * os.block_size()};
}

// What to create when no block fits: made outside the arena lock (creating a named
// segment talks to the manager, whose lock fork takes before ours).
struct NewSegment {
  std::size_t block_size = 0;
  std::uint32_t count = 0;
  SegmentKind kind = SegmentKind::kArena;
};

std::optional<Block> try_small(ArenaKey key, SizeClass sc, NewSegment* need) {
  ClassArena& ca = arena_of(key).classes[sc.index];
  std::uint32_t i = 0;
  // Newest (largest) first.
  for (auto it = ca.segments.rbegin(); it != ca.segments.rend(); ++it)
    if (take(**it, &i)) return block_of(**it, i);
  for (int pass = 0; pass < 2; ++pass) {
    bool found = false;
    for (auto& os : ca.segments) {
      // Pass 1: blocks other processes freed. Pass 2: holds of dead processes.
      if (pass == 1 && os->seg->reclaim_dead_slots() == 0) continue;
      found |= rescan(*os, pass == 1);
    }
    if (found)
      for (auto it = ca.segments.rbegin(); it != ca.segments.rend(); ++it)
        if (take(**it, &i)) return block_of(**it, i);
  }
  const std::size_t bytes =
      round_up(std::max(ca.next_bytes, sc.block_size * kMinBlocks), device_granularity(key.device));
  *need = {sc.block_size, static_cast<std::uint32_t>(bytes / sc.block_size),
           key.device < 0 ? SegmentKind::kArena : SegmentKind::kDeviceArena};
  return std::nullopt;
}

// Creates an arena segment, smaller when /dev/shm cannot hold it (Docker's 64 MB): only
// when not even one block fits does the caller get the SharedMemoryFullError.
std::shared_ptr<Segment> create_arena_segment(ArenaKey key, NewSegment* need) {
  if (key.device >= 0)
    return Segment::create_device(key.device, need->block_size, need->count, need->kind);
  for (;;) {
    try {
      return Segment::create(key.strategy, need->block_size, need->count, need->kind);
    } catch (const SharedMemoryFullError&) {
      if (need->count == 1) throw;
      need->count /= 2;
    }
  }
}

// Drops cached free large segments beyond the cache's limits, oldest first. In the named
// arena (`named`), when unused segments may not be kept (may_keep_unused_named_segments:
// one statfs, made only when a segment asks), also every one this process does not hold:
// the free ones and those handed over to receivers, which are disowned (their name goes
// with their last holder).
void limit_large_cache(StrategyArena& sa, bool named,
                       std::vector<std::shared_ptr<Segment>>* dropped) {
  std::size_t count = 0, bytes = 0;
  std::vector<bool> drop(sa.large.size(), false);
  std::optional<bool> keep;
  const auto may_keep = [&keep] {
    if (!keep) keep = may_keep_unused_named_segments();
    return *keep;
  };
  for (std::size_t k = sa.large.size(); k-- > 0;) {  // newest first
    OwnSegment& os = *sa.large[k];
    if (os.held != 0) {
      drop[k] = named && !os.seg->holds_block(0) && !may_keep();
      continue;
    }
    ++count;
    bytes += os.seg->backing_size();
    drop[k] = count > kLargeCacheCount || bytes > kLargeCacheBytes || (named && !may_keep());
  }
  std::size_t k = 0;
  std::erase_if(sa.large, [&](std::unique_ptr<OwnSegment>& os) {
    if (!drop[k++]) return false;
    if (os->held != 0) os->seg->disown();
    g_state->index.erase(os->seg.get());
    dropped->push_back(std::move(os->seg));
    return true;
  });
}

// Moves every segment of `list` in which no block is held (after clearing the holds of
// dead processes and rescanning) to *dropped.
void sweep_unused(std::vector<std::unique_ptr<OwnSegment>>& list,
                  std::vector<std::shared_ptr<Segment>>* dropped) {
  std::erase_if(list, [dropped](std::unique_ptr<OwnSegment>& os) {
    os->seg->reclaim_dead_slots(/*exec_check=*/true);
    rescan(*os, true);
    if (os->held != 0) return false;
    g_state->index.erase(os->seg.get());
    dropped->push_back(std::move(os->seg));
    return true;
  });
}

void sweep_arena(StrategyArena& sa, std::vector<std::shared_ptr<Segment>>* dropped) {
  for (auto& ca : sa.classes) {
    sweep_unused(ca.segments, dropped);
    if (ca.segments.empty()) ca.next_bytes = kFirstSegmentBytes;
  }
  sweep_unused(sa.large, dropped);
}

std::optional<Block> try_large(ArenaKey key, std::size_t nbytes,
                               std::vector<std::shared_ptr<Segment>>* dropped, NewSegment* need) {
  StrategyArena& sa = arena_of(key);
  const std::size_t size = round_up(round_up(nbytes, 4096), device_granularity(key.device));
  OwnSegment* best = nullptr;
  for (auto& os : sa.large) {
    collect(*os, 0);
    // Reuse one at most twice the size: its pages are faulted in already.
    if (os->held == 0 && os->block_size() >= size && os->block_size() <= 2 * size &&
        (best == nullptr || os->block_size() < best->block_size()))
      best = os.get();
  }
  std::uint32_t i = 0;
  if (best != nullptr && take(*best, &i)) return block_of(*best, i);
  if (sa.large.size() >= sa.large_reclaim_at) {
    // A dedicated segment is never run out of, so the holds of dead processes (a consumer
    // SIGKILLed holding a large tensor) are taken back here, once kLargeReclaimAt exist and
    // then each time their number doubled (reclaim reads /proc per holder: amortised).
    std::size_t still_held = 0;
    for (auto& os : sa.large) {
      if (os->held != 0 && os->seg->reclaim_dead_slots() != 0) collect(*os, 0);
      if (os->held != 0) {
        ++still_held;
      } else if (os->block_size() >= size && os->block_size() <= 2 * size &&
                 (best == nullptr || os->block_size() < best->block_size())) {
        best = os.get();
      }
    }
    sa.large_reclaim_at = std::max(kLargeReclaimAt, 2 * still_held);
    if (best != nullptr && take(*best, &i)) return block_of(*best, i);
  }
  limit_large_cache(sa, is_named(key), dropped);
  *need = {size, 1, key.device < 0 ? SegmentKind::kDedicated : SegmentKind::kDeviceDedicated};
  return std::nullopt;
}

}  // namespace

namespace {

// /dev/shm could not hold a named segment: gives back what this process keeps there unused
// (its free segments, after clearing dead processes' holds, and its receive cache's named
// segments); true when it gave back any, so that the allocation tries again.
bool give_back_unused_named() {
  std::vector<std::shared_ptr<Segment>> dropped;  // destroyed after unlocking
  {
    std::lock_guard lock(g_state->mu);
    sweep_arena(g_state->by_strategy[1], &dropped);
  }
  const bool gave_back = !dropped.empty();
  dropped.clear();  // the names of segments no receiver maps go now
  return Registry::instance().forget_cached_named_segments() > 0 || gave_back;
}

// Whether a named segment that /dev/shm cannot hold now (`full`) would fit an empty /dev/shm
// (others hold the space: the consumer's batches, made ahead), rather than being larger
// than /dev/shm itself.
bool dev_shm_could_hold(const SharedMemoryFullError& full) noexcept {
  const std::optional<ShmSpace> space = dev_shm_limit();
  return space && full.requested() <= space->total;
}

Block allocate_in(ArenaKey key, std::size_t nbytes) {
  if (g_inherited.load(std::memory_order_relaxed) != nullptr) drop_inherited();
  const bool large = nbytes > kLargeThreshold;
  const SizeClass sc = large ? SizeClass{0, 0} : size_class(nbytes);
  for (;;) {
    NewSegment need;
    {
      std::vector<std::shared_ptr<Segment>> dropped;  // destroyed after unlocking
      std::lock_guard lock(g_state->mu);
      auto b = large ? try_large(key, nbytes, &dropped, &need) : try_small(key, sc, &need);
      if (b) return std::move(*b);
    }
    // Outside the lock: another thread may add a segment of this class meanwhile; then the
    // class has two, which is harmless.
    std::shared_ptr<Segment> seg;
    try {
      seg = create_arena_segment(key, &need);
    } catch (const SharedMemoryFullError& full) {
      if (!is_named(key)) throw;
      if (give_back_unused_named()) continue;
      // Others hold the space (a loop keeping batches while workers make the next ones):
      // the block goes to a memfd segment, which /dev/shm's size does not limit and which
      // travels by fd whatever the strategy. A segment larger than /dev/shm is refused.
      if (!dev_shm_could_hold(full)) throw;
      return allocate_in({SharingStrategy::kFileDescriptor, key.device}, nbytes);
    }
    std::lock_guard lock(g_state->mu);
    StrategyArena& sa = arena_of(key);
    OwnSegment* os = nullptr;
    if (large) {
      os = &add_segment(sa.large, std::move(seg));
    } else {
      ClassArena& ca = sa.classes[sc.index];
      const std::size_t made = std::size_t{need.count} * need.block_size;
      ca.next_bytes = std::min(std::max(kFirstSegmentBytes, made) * 2, kMaxSegmentBytes);
      os = &add_segment(ca.segments, std::move(seg));
    }
    std::uint32_t i = 0;
    if (!take(*os, &i)) throw Error("a new segment has no free block");
    return block_of(*os, i);
  }
}

}  // namespace

Block arena_allocate(SharingStrategy strategy, std::size_t nbytes) {
  return allocate_in({strategy, -1}, nbytes);
}

Block arena_allocate_device(int device, std::size_t nbytes) {
  if (device < 0 || device >= kMaxDevices || device >= cuda::Driver::get().device_count())
    throw std::invalid_argument("cuda:" + std::to_string(device) + ": this process sees " +
                                std::to_string(cuda::Driver::get().device_count()) +
                                " CUDA device(s)");
  // Before the arena's lock: the device's context, granularity (non-zero from here on)
  // and trial export.
  cuda::check_usable(device);
  return allocate_in({SharingStrategy::kFileDescriptor, device}, nbytes);
}

void arena_block_freed(const Segment& segment, std::uint32_t block) noexcept {
  std::vector<std::shared_ptr<Segment>> dropped;
  std::lock_guard lock(g_state->mu);
  auto it = g_state->index.find(&segment);
  if (it == g_state->index.end()) return;  // trimmed, or not ours any more
  OwnSegment& os = *it->second;
  if (!collect(os, block)) return;
  if (is_dedicated_kind(segment.kind()))
    limit_large_cache(arena_of(key_of(segment)), is_named(key_of(segment)), &dropped);
}

void arena_block_handed_over(const Segment& segment) noexcept {
  // Where it may be kept, the arena is left as it is (its cache's limits apply when it
  // allocates or a block comes back free).
  if (!is_named(key_of(segment)) || may_keep_unused_named_segments()) return;
  std::vector<std::shared_ptr<Segment>> dropped;  // destroyed after unlocking
  std::lock_guard lock(g_state->mu);
  if (g_state->index.find(&segment) == g_state->index.end()) return;
  limit_large_cache(g_state->by_strategy[1], /*named=*/true, &dropped);
}

bool may_keep_unused_named_segments() noexcept {
  const std::optional<ShmSpace> space = dev_shm_limit();
  return !space || space->total - std::min(space->free, space->total) <= space->total / 4;
}

std::size_t arena_trim() {
  drop_inherited();
  std::vector<std::shared_ptr<Segment>> dropped;
  {
    std::lock_guard lock(g_state->mu);
    for (const auto& b : g_state->private_cache) ::operator delete(b.data);
    g_state->private_cache.clear();
    for (auto& sa : g_state->by_strategy) sweep_arena(sa, &dropped);
    for (auto& sa : g_state->by_device)
      if (sa) sweep_arena(*sa, &dropped);
  }
  return dropped.size();
}

std::byte* private_allocate(std::size_t nbytes, std::size_t* capacity) {
  if (nbytes >= kLargeThreshold) {
    std::lock_guard lock(g_state->mu);
    auto& cache = g_state->private_cache;
    for (auto it = cache.rbegin(); it != cache.rend(); ++it) {
      if (it->capacity >= nbytes && it->capacity <= 2 * nbytes) {
        PrivateBuffer b = *it;
        cache.erase(std::next(it).base());
        *capacity = b.capacity;
        return b.data;
      }
    }
  }
  *capacity = nbytes;
  return static_cast<std::byte*>(::operator new(nbytes));
}

void private_free(std::byte* data, std::size_t capacity) noexcept {
  if (data == nullptr) return;
  if (capacity >= kLargeThreshold) {
    std::lock_guard lock(g_state->mu);
    auto& cache = g_state->private_cache;
    cache.push_back({data, capacity});
    std::size_t bytes = 0;
    for (const auto& b : cache) bytes += b.capacity;
    while (!cache.empty() && (cache.size() > kPrivateCacheCount || bytes > kPrivateCacheBytes)) {
      bytes -= cache.front().capacity;
      ::operator delete(cache.front().data);
      cache.erase(cache.begin());
    }
    return;
  }
  ::operator delete(data);
}

ArenaStats arena_stats() {
  std::lock_guard lock(g_state->mu);
  ArenaStats st;
  for (const auto& [seg, os] : g_state->index) {
    ++st.segments;
    st.bytes += seg->backing_size();
    st.blocks_held += os->held;
    st.blocks_free += os->free.size() + (seg->block_count() - os->bump);
  }
  return st;
}

void arena_prepare_fork() noexcept { g_state->mu.lock(); }

void arena_parent_after_fork() noexcept { g_state->mu.unlock(); }

void arena_child_after_fork() noexcept {
  // The registry's child handler already disowned every segment. The old state is leaked;
  // its segments are released on the child's first arena call (see g_inherited).
  State* old = g_state;
  auto* inherited = g_inherited.load(std::memory_order_relaxed);
  if (inherited == nullptr) inherited = new std::vector<std::shared_ptr<Segment>>;
  for (auto& [seg, os] : old->index) inherited->push_back(std::move(os->seg));
  g_state = new State;
  g_state->abandoned = old;
  g_state->private_cache = std::move(old->private_cache);  // private memory: ours now
  g_inherited.store(inherited, std::memory_order_relaxed);
  old->mu.unlock();
}

}  // namespace shmtensor::internal
