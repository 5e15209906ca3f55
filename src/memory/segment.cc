#include "memory/segment.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "memory/registry.h"
#include "memory/segment_observer.h"
#include "os/proc.h"
#include "os/shm.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

namespace {

// Set once by the layer above (the manager client, client.cc says when); read on every
// named-segment event. acquire/release: the struct it points to is constant.
std::atomic<const SegmentObserver*> g_observer{nullptr};

const SegmentObserver& observer() {
  const SegmentObserver* o = g_observer.load(std::memory_order_acquire);
  if (o == nullptr)
    throw Error(
        "file_system segments need the shmtensor-manager client, which this program did not "
        "install (src/manager/client.cc installs it when the library is loaded; a static link "
        "must keep that object: link the shmtensor CMake target or pkg-config's flags)");
  return *o;
}

void observe_release(const std::string& name, bool unlinked) noexcept {
  // Nothing was registered without an observer, so there is nothing to tell without one.
  if (const SegmentObserver* o = g_observer.load(std::memory_order_acquire))
    o->released(name, unlinked);
}

void give_back_counts_at_exit() noexcept { release_named_segments_before_exit(); }

// The first named segment of this process registers the exit handler. Registered then,
// it runs before the destructors of statics built earlier (global tensors, say), which
// then find their count given back already.
void register_exit_handler() noexcept {
  static std::atomic<bool> registered{false};
  if (!registered.exchange(true, std::memory_order_acq_rel)) std::atexit(give_back_counts_at_exit);
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// "/shmtensor_<pid>_<64 random bits hex>_<counter>": the random part is drawn once per
// process (and again in a forked child, whose pid differs anyway), the counter per segment.
std::string next_segment_name() {
  static std::atomic<std::uint64_t> counter{0};
  static std::atomic<pid_t> seeded_pid{0};
  static std::atomic<std::uint64_t> random_part{0};
  pid_t pid = own_pid();
  if (seeded_pid.load(std::memory_order_acquire) != pid) {
    random_part.store(random_u64(), std::memory_order_relaxed);
    seeded_pid.store(pid, std::memory_order_release);
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, "/shmtensor_%d_%016llx_%llu", static_cast<int>(pid),
                static_cast<unsigned long long>(random_part.load(std::memory_order_relaxed)),
                static_cast<unsigned long long>(counter.fetch_add(1, std::memory_order_relaxed)));
  return buf;
}

struct Layout {
  std::size_t slots_offset, words_offset, data_offset, total;
};

// Header, slot table, block words, then the blocks (page-aligned when blocks are pages or
// larger, so a large storage starts on a page). A device segment's object ends where its
// blocks would start: they are device memory.
Layout layout_for(std::size_t block_size, std::uint32_t block_count, bool device = false) {
  Layout l{};
  l.slots_offset = kSegmentHeaderSize;
  l.words_offset = l.slots_offset + kSlotCount * sizeof(std::uint64_t);
  const std::size_t align = device ? kSegmentAlignment : block_size >= 4096 ? 4096 : kSegmentAlignment;
  l.data_offset = round_up(l.words_offset + block_count * sizeof(std::uint64_t), align);
  l.total = l.data_offset + (device ? 0 : block_size * block_count);
  return l;
}

void write_header(SegmentHeader* h, const Layout& l, std::size_t block_size,
                  std::uint32_t block_count, SegmentKind kind, std::int64_t refs) {
  // The object is fresh (zero-filled by the kernel): slots and words start at 0 (free).
  // A device segment's UUID, written before, stays.
  std::uint8_t uuid[sizeof h->device_uuid];
  std::memcpy(uuid, h->device_uuid, sizeof uuid);
  std::memset(static_cast<void*>(h), 0, sizeof *h);
  std::memcpy(h->device_uuid, uuid, sizeof uuid);
  h->layout_version = kSegmentLayoutVersion;
  h->header_size = kSegmentHeaderSize;
  h->total_size = l.total;
  h->data_offset = l.data_offset;
  h->data_size = block_size * block_count;
  h->uid = random_u64();
  const ProcessId me = own_process_id();
  h->creator_pid = me.pid;
  h->kind = static_cast<std::uint32_t>(kind);
  h->creator_start_time = me.start_time;
  h->refcount.store(refs, std::memory_order_relaxed);
  h->creator_pgid = own_process_group();
  h->block_count = block_count;
  h->block_size = block_size;
  h->slots_offset = l.slots_offset;
  h->words_offset = l.words_offset;
  // The magic last, with release: a reader that sees it sees the rest.
  std::atomic_ref<std::uint64_t>(h->magic).store(kSegmentMagic, std::memory_order_release);
}

}  // namespace

Segment::Segment(SharingStrategy strategy, UniqueFd fd, Mapping mapping, std::string name,
                 const SegmentGeometry& g)
    : strategy_(strategy), fd_(std::move(fd)), mapping_(std::move(mapping)), name_(std::move(name)),
      geometry_(g) {
  // From the validated copy, never from the shared header: what we rely on.
  quarantined_.reset(new std::atomic<std::uint64_t>[(geometry_.block_count + 63) / 64]());
  if (!is_device_kind(geometry_.kind)) payload_ = mapping_.data() + geometry_.data_offset;
}

void Segment::adopt_as_creator(const FdFacts& facts) {
  device_ = facts.device;
  inode_ = facts.inode;
  claim_slot(/*creator=*/true);
  own_.store(true, std::memory_order_release);
  Registry::instance().add_segment(shared_from_this());
}

std::size_t Segment::backing_size() const noexcept {
  return device_memory_ ? device_memory_->size() : mapping_.size();
}

int Segment::device_fd() const noexcept { return device_memory_ ? device_memory_->fd() : -1; }

std::shared_ptr<Segment> Segment::create_device(int ordinal, std::size_t block_size,
                                                std::uint32_t block_count, SegmentKind kind) {
  if (block_size == 0 || block_size % kSegmentAlignment != 0 || block_count == 0 ||
      !is_device_kind(kind))
    throw std::invalid_argument("Segment::create_device: bad block geometry or kind");
  const cuda::Driver& driver = cuda::Driver::get();
  const cuda::CUuuid uuid = driver.device(ordinal).uuid;
  // The device memory first: it is what most often fails (out of device memory).
  auto memory = cuda::DeviceMemory::create(ordinal, block_size * block_count);
  const Layout l = layout_for(block_size, block_count, /*device=*/true);
  UniqueFd fd = create_sealed_memfd(l.total);
  FdFacts facts = inspect_fd(fd.get());
  Mapping map = Mapping::map_shared(fd.get(), l.total, "device segment");
  auto* h = reinterpret_cast<SegmentHeader*>(map.data());
  std::memcpy(h->device_uuid, uuid.bytes, sizeof h->device_uuid);  // write_header keeps it
  write_header(h, l, block_size, block_count, kind, 0);
  const SegmentGeometry g = validate_segment_header(*h, l.total, h->uid);
  auto seg = std::make_shared<Segment>(SharingStrategy::kFileDescriptor, std::move(fd),
                                       std::move(map), std::string(), g);
  seg->payload_ = reinterpret_cast<std::byte*>(memory->address());
  seg->device_ordinal_ = ordinal;
  seg->device_memory_ = std::move(memory);
  seg->adopt_as_creator(facts);
  return seg;
}

std::shared_ptr<Segment> Segment::create(SharingStrategy strategy, std::size_t block_size,
                                         std::uint32_t block_count, SegmentKind kind) {
  if (block_size == 0 || block_size % kSegmentAlignment != 0 || block_count == 0)
    throw std::invalid_argument("Segment::create: bad block geometry");
  const Layout l = layout_for(block_size, block_count);
  std::shared_ptr<Segment> seg;
  FdFacts facts;
  if (strategy == SharingStrategy::kFileDescriptor) {
    UniqueFd fd = create_sealed_memfd(l.total);
    facts = inspect_fd(fd.get());
    Mapping map = Mapping::map_shared(fd.get(), l.total, "memfd segment");
    auto* h = reinterpret_cast<SegmentHeader*>(map.data());
    write_header(h, l, block_size, block_count, kind, 0);
    const SegmentGeometry g = validate_segment_header(*h, l.total, h->uid);
    seg = std::make_shared<Segment>(strategy, std::move(fd), std::move(map), std::string(), g);
  } else {
    std::string name = next_segment_name();
    const SegmentObserver& obs = observer();
    obs.created(name);  // before the name exists: no unknown-name window
    register_exit_handler();
    Mapping map;
    try {
      UniqueFd fd = create_named_shm(name, l.total);
      facts = inspect_fd(fd.get());
      map = Mapping::map_shared(fd.get(), l.total, name.c_str());
    } catch (...) {
      unlink_named_shm(name);
      obs.released(name, true);
      throw;
    }
    // The fd is not kept: the name is what travels, and the mapping keeps the pages.
    auto* h = reinterpret_cast<SegmentHeader*>(map.data());
    write_header(h, l, block_size, block_count, kind, 1);
    const SegmentGeometry g = validate_segment_header(*h, l.total, h->uid);
    seg = std::make_shared<Segment>(strategy, UniqueFd(), std::move(map), std::move(name), g);
  }
  seg->adopt_as_creator(facts);
  return seg;
}

SegmentGeometry validate_segment_header(const SegmentHeader& mapped, std::size_t mapped_size,
                                        std::uint64_t expected_uid) {
  auto fail = [](const std::string& what) {
    throw ProtocolError("invalid shmtensor segment header: " + what);
  };
  std::uint64_t magic =
      std::atomic_ref<const std::uint64_t>(mapped.magic).load(std::memory_order_acquire);
  if (magic != kSegmentMagic) fail("bad magic (not a shmtensor segment, or not initialised)");
  // Each field is read once, into this copy, and only the copy is checked and used: a peer
  // that rewrites the shared header meanwhile cannot make a checked value differ from a
  // used one.
  struct {
    std::uint32_t layout_version, header_size, kind, block_count;
    std::uint64_t total_size, uid, block_size, data_size, data_offset, slots_offset,
        words_offset;
  } h{};
  const auto read = [](const auto& field) {
    using T = std::remove_cvref_t<decltype(field)>;
    return std::atomic_ref<const T>(field).load(std::memory_order_relaxed);
  };
  h.layout_version = read(mapped.layout_version);
  h.header_size = read(mapped.header_size);
  h.kind = read(mapped.kind);
  h.block_count = read(mapped.block_count);
  h.total_size = read(mapped.total_size);
  h.uid = read(mapped.uid);
  h.block_size = read(mapped.block_size);
  h.data_size = read(mapped.data_size);
  h.data_offset = read(mapped.data_offset);
  h.slots_offset = read(mapped.slots_offset);
  h.words_offset = read(mapped.words_offset);
  SegmentGeometry g;
  for (std::size_t i = 0; i < sizeof g.device_uuid; ++i) g.device_uuid[i] = read(mapped.device_uuid[i]);
  if (h.layout_version != kSegmentLayoutVersion)
    fail("layout version " + std::to_string(h.layout_version) + ", this library reads " +
         std::to_string(kSegmentLayoutVersion));
  if (h.header_size != kSegmentHeaderSize) fail("header size " + std::to_string(h.header_size));
  if (h.total_size != mapped_size)
    fail("total size " + std::to_string(h.total_size) + " but the object has " +
         std::to_string(mapped_size) + " bytes");
  if (h.uid != expected_uid) fail("uid does not match the message");
  if (h.kind < static_cast<std::uint32_t>(SegmentKind::kDedicated) ||
      h.kind > static_cast<std::uint32_t>(SegmentKind::kDeviceArena))
    fail("unknown kind " + std::to_string(h.kind));
  const auto kind = static_cast<SegmentKind>(h.kind);
  const bool device = is_device_kind(kind);
  if (h.block_size == 0 || h.block_size % kSegmentAlignment != 0 || h.block_count == 0)
    fail("block size " + std::to_string(h.block_size) + " / count " +
         std::to_string(h.block_count));
  if (h.block_count > kMaxSegmentBlocks || (is_dedicated_kind(kind) && h.block_count != 1))
    fail(std::to_string(h.block_count) + " blocks, more than a segment of this kind has");
  // Only the layout this library writes is accepted: a peer cannot place slots, words or
  // blocks anywhere else, nor make them overlap.
  const Layout l = layout_for(1, h.block_count);
  std::uint64_t data_size = 0;
  if (__builtin_mul_overflow(h.block_size, std::uint64_t{h.block_count}, &data_size) ||
      h.data_size != data_size)
    fail("data size disagrees with the blocks");
  // Device blocks are not in the object: bound them as no device holds more.
  if (device && data_size > kMaxDeviceSegmentBytes)
    fail("device blocks of " + std::to_string(data_size) + " bytes");
  if (h.slots_offset != l.slots_offset || h.words_offset != l.words_offset ||
      h.data_offset % kSegmentAlignment != 0 ||
      h.data_offset < h.words_offset + std::uint64_t{h.block_count} * sizeof(std::uint64_t) ||
      h.data_offset > mapped_size ||
      (device ? h.data_offset != mapped_size : data_size > mapped_size - h.data_offset))
    fail("slots, words or blocks lie outside the object");
  g.uid = h.uid;
  g.kind = kind;
  g.block_size = h.block_size;
  g.block_count = h.block_count;
  g.data_offset = h.data_offset;
  g.slots_offset = h.slots_offset;
  g.words_offset = h.words_offset;
  return g;
}

namespace {

// A received memfd, checked and mapped, its header validated into *geometry.
Mapping map_received_memfd(int fd, std::uint64_t uid, FdFacts* facts, SegmentGeometry* geometry) {
  *facts = inspect_fd(fd);
  if (!facts->sealed_against_resize)
    throw ProtocolError(
        "received a segment fd that is not sealed against shrinking: refusing to map it "
        "(a peer could truncate it and make this process SIGBUS)");
  if (facts->size < kSegmentHeaderSize)
    throw ProtocolError("received a segment fd of " + std::to_string(facts->size) +
                        " bytes, smaller than a segment header");
  Mapping map = Mapping::map_shared(fd, facts->size, "received memfd segment");
  *geometry =
      validate_segment_header(*reinterpret_cast<const SegmentHeader*>(map.data()), facts->size, uid);
  return map;
}

}  // namespace

std::shared_ptr<Segment> Segment::attach_device_metadata(UniqueFd meta, std::uint64_t uid) {
  FdFacts facts;
  SegmentGeometry g;
  Mapping map = map_received_memfd(meta.get(), uid, &facts, &g);
  if (!is_device_kind(g.kind)) throw ProtocolError("a device segment entry names a host segment");
  auto seg = std::make_shared<Segment>(SharingStrategy::kFileDescriptor, std::move(meta),
                                       std::move(map), std::string(), g);
  seg->device_ = facts.device;
  seg->inode_ = facts.inode;
  return seg;
}

std::shared_ptr<Segment> Segment::map_device_memory(const std::shared_ptr<Segment>& metadata,
                                                    UniqueFd memory) {
  cuda::CUuuid uuid{};
  std::memcpy(uuid.bytes, metadata->geometry_.device_uuid, sizeof uuid.bytes);
  // First, so that a failure leaves the metadata as it was.
  auto device_memory = cuda::DeviceMemory::import(std::move(memory), uuid, metadata->payload_size());
  metadata->payload_ = reinterpret_cast<std::byte*>(device_memory->address());
  metadata->device_ordinal_ = device_memory->ordinal();
  metadata->device_memory_ = std::move(device_memory);
  metadata->claim_slot(/*creator=*/false);
  return Registry::instance().add_segment(metadata);
}

std::shared_ptr<Segment> Segment::attach_device(UniqueFd meta, UniqueFd memory,
                                                std::uint64_t uid) {
  return map_device_memory(attach_device_metadata(std::move(meta), uid), std::move(memory));
}

std::shared_ptr<Segment> Segment::attach_fd(UniqueFd fd, std::uint64_t uid) {
  FdFacts facts;
  SegmentGeometry g;
  Mapping map = map_received_memfd(fd.get(), uid, &facts, &g);
  if (is_device_kind(g.kind)) throw ProtocolError("a host segment entry names a device segment");
  auto seg = std::make_shared<Segment>(SharingStrategy::kFileDescriptor, std::move(fd),
                                       std::move(map), std::string(), g);
  seg->device_ = facts.device;
  seg->inode_ = facts.inode;
  seg->claim_slot(/*creator=*/false);
  // Another thread may have attached it meanwhile: then this one goes (its slot with it).
  return Registry::instance().add_segment(seg);
}

std::shared_ptr<Segment> Segment::attach_name(const std::string& name, std::uint64_t uid) {
  const SegmentObserver& obs = observer();
  register_exit_handler();
  UniqueFd fd = open_named_shm(name);
  FdFacts facts = inspect_fd(fd.get());
  if (facts.size < kSegmentHeaderSize)
    throw ProtocolError("named segment " + name + " has " + std::to_string(facts.size) +
                        " bytes, smaller than a segment header");
  Mapping map = Mapping::map_shared(fd.get(), facts.size, name.c_str());
  const SegmentGeometry g =
      validate_segment_header(*reinterpret_cast<const SegmentHeader*>(map.data()), facts.size, uid);
  if (is_device_kind(g.kind))
    throw ProtocolError("named segment " + name + " claims to be a device segment");
  auto seg = std::make_shared<Segment>(SharingStrategy::kFileSystem, UniqueFd(), std::move(map),
                                       name, g);
  seg->header()->refcount.fetch_add(1, std::memory_order_relaxed);  // given back by ~Segment
  seg->device_ = facts.device;
  seg->inode_ = facts.inode;
  seg->claim_slot(/*creator=*/false);
  auto registered = Registry::instance().add_segment(seg);
  if (registered != seg) {
    // Another thread attached it meanwhile and holds this process's count: this one gives
    // back the count it added, and the daemon is told nothing.
    seg->duplicate_ = true;
    return registered;
  }
  obs.opened(name);
  return seg;
}

void release_named_segment_count(SegmentHeader* header, const std::string& name) noexcept {
  // acq_rel: whoever reaches zero must see all other holders' releases before unlinking.
  if (header->refcount.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    bool unlinked = unlink_named_shm(name);
    observe_release(name, unlinked);
  } else {
    observe_release(name, false);
  }
}

void set_segment_observer(const SegmentObserver* o) noexcept {
  g_observer.store(o, std::memory_order_release);
}

void Segment::give_back_count() noexcept {
  // Once: the destructor and release_named_segments_before_exit() may both get here.
  if (strategy_ != SharingStrategy::kFileSystem || duplicate_ ||
      count_given_back_.exchange(true, std::memory_order_acq_rel))
    return;
  release_named_segment_count(header(), name_);
}

void release_named_segments_before_exit() noexcept {
  // The arena keeps its segments and the registry its receive cache for the life of the
  // process, and neither is destroyed at exit (storages may outlive static destruction),
  // so without this their counts would stay on the names until the manager saw the
  // process die. Only the counts go: the mappings stay, so whatever still runs (another
  // thread, a later static destructor) keeps valid bytes.
  for (const auto& seg : Registry::instance().live_segments()) seg->give_back_count();
}

void Segment::add_in_flight_count() noexcept {
  if (strategy_ == SharingStrategy::kFileSystem)
    header()->refcount.fetch_add(1, std::memory_order_relaxed);
}

void Segment::drop_in_flight_count() noexcept {
  if (strategy_ == SharingStrategy::kFileSystem)
    if (header()->refcount.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Cannot happen while this process holds the segment; kept for robustness.
      unlink_named_shm(name_);
    }
}

Segment::~Segment() {
  if (!mapping_) return;
  Registry::instance().remove_segment(geometry_.uid, this);
  release_slot();
  if (strategy_ != SharingStrategy::kFileSystem) return;
  if (duplicate_)
    drop_in_flight_count();
  else
    give_back_count();
}

}  // namespace shmtensor::internal
