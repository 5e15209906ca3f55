#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <new>

#include "memory/fence.h"
#include "memory/registry.h"
#include "memory/storage_impl.h"
#include "os/mapping.h"
#include "os/shm.h"
#include "os/socket.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/internal/tensor_access.h"
#include "wire/wire.h"

namespace shmtensor {

Decoder::Decoder(std::unique_ptr<internal::DecoderState> state) : state_(std::move(state)) {}
Decoder::~Decoder() {
  if (state_) internal::recycle(std::move(state_));  // not a moved-from one (most of them)
}
Decoder::Decoder(Decoder&&) noexcept = default;
Decoder& Decoder::operator=(Decoder&& other) noexcept {
  if (this != &other) {
    internal::recycle(std::move(state_));
    state_ = std::move(other.state_);
  }
  return *this;
}

namespace {
[[noreturn]] void bad(const std::string& what) {
  throw ProtocolError("malformed shmtensor message: " + what);
}
// How many elements that take neither bytes nor fds (std::monostate) a length may claim.
constexpr std::uint64_t kMaxEmptyElements = 65536;
}  // namespace

void Decoder::read_bytes(void* out, std::size_t n) {
  auto& st = *state_;
  if (n > st.payload.size() - st.cursor) bad("value runs past the end of the payload");
  if (n > 0) std::memcpy(out, st.payload.data() + st.cursor, n);
  st.cursor += n;
}

std::size_t Decoder::remaining() const noexcept { return state_->payload.size() - state_->cursor; }

std::size_t Decoder::read_size(std::size_t min_element_bytes) {
  auto n = read_pod<std::uint64_t>();
  std::uint64_t most = remaining() / (min_element_bytes == 0 ? 1 : min_element_bytes);
  if (min_element_bytes == 0) {
    // Elements that may be all fds (Connection, Queue) or nothing (std::monostate).
    most += (state_->object_fds.size() - state_->next_object_fd) + kMaxEmptyElements;
  }
  if (n > most) bad("length " + std::to_string(n) + " exceeds the message");
  return static_cast<std::size_t>(n);
}

Tensor Decoder::read_tensor() {
  auto& st = *state_;
  std::size_t used = 0;
  Tensor t;
  internal::read_encoded_tensor(st.payload.subspan(st.cursor), st.storages, false, &used, t);
  st.cursor += used;
  return t;
}

Storage Decoder::read_storage() {
  const auto index = read_pod<std::uint32_t>();
  if (index == internal::kNoStorage) return Storage();
  if (index == internal::kEmptyTensor) return Storage::allocate(0);
  auto& storages = state_->storages;
  if (index >= storages.size()) bad("storage index out of range");
  return storages[index];
}

int Decoder::take_fd() {
  auto& st = *state_;
  if (st.next_object_fd >= st.object_fds.size()) bad("value refers to a missing fd");
  return st.object_fds[st.next_object_fd++].release();
}

void Decoder::finish() {
  if (remaining() != 0) bad(std::to_string(remaining()) + " trailing bytes after the value");
}

namespace internal {

void read_encoded_tensor(std::span<const std::byte> bytes, std::span<Storage> storages,
                         bool last_use, std::size_t* used, Tensor& out) {
  // The head (frame.h's EncodedTensorHead), sizes and strides are read in place, with one
  // bounds check for each part, and the sizes and strides go straight into `out`: a
  // tensor's decode is most of a small message's.
  const std::byte* p = bytes.data();
  const std::size_t left = bytes.size();
  if (left == 0) bad("value runs past the end of the payload");
  const auto defined = static_cast<std::uint8_t>(p[0]);  // 0 or 1, like every flag byte
  if (defined > 1) throw ProtocolError("invalid bool byte in message");
  if (defined == 0) {
    *used = 1;
    out = Tensor();
    return;
  }
  EncodedTensorHead head;
  if (left < sizeof head) bad("value runs past the end of the payload");
  std::memcpy(&head, p, sizeof head);
  if (head.dtype >= kNumDTypes) bad("unknown dtype " + std::to_string(head.dtype));
  const auto dtype = static_cast<DType>(head.dtype);
  const std::uint8_t ndim = head.ndim;
  if (ndim > kMaxTensorDims) bad("tensor with " + std::to_string(ndim) + " dimensions");
  const std::uint32_t index = head.storage_index;
  const std::int64_t offset = head.storage_offset;
  const std::size_t dim_bytes = std::size_t{ndim} * sizeof(std::int64_t);
  if (left - sizeof head < 2 * dim_bytes) bad("value runs past the end of the payload");
  const std::byte* sizes = p + sizeof head;
  const std::byte* strides = sizes + dim_bytes;
  *used = sizeof head + 2 * dim_bytes;
  bool has_zero = false;
  for (std::size_t i = 0; i < ndim; ++i) {
    std::int64_t size;
    std::memcpy(&size, sizes + i * sizeof size, sizeof size);
    if (size < 0) bad("negative tensor size");
    has_zero = has_zero || size == 0;
  }
  if (head.device > 1) bad("unknown device " + std::to_string(head.device));
  const Device device = head.device == 1 ? Device::cuda(0) : Device::cpu();
  if (index == kEmptyTensor) {
    if (!has_zero) bad("tensor without storage has elements");
    Dims empty_sizes;
    empty_sizes.assign_bytes(sizes, ndim);
    try {
      out = Tensor::empty(std::move(empty_sizes), dtype, device);
      return;
    } catch (const CudaError&) {
      throw;  // this process cannot hold CUDA tensors: not the message's fault
    } catch (const std::exception& e) {
      bad(std::string("empty tensor: ") + e.what());  // sizes whose strides overflow
    }
  }
  if (index >= storages.size()) bad("storage index out of range");
  if ((StorageAccess::impl(storages[index])->device() >= 0) != device.is_cuda())
    bad("tensor's device disagrees with its storage's");
  try {
    // from_storage's checks: every reachable element lies inside the storage. Dims keep up
    // to 6 values inline: a tensor of up to 6 dimensions is decoded without an allocation.
    Storage& storage = storages[index];
    TensorAccess::assign_view(out, last_use ? Storage(std::move(storage)) : Storage(storage),
                              offset, sizes, strides, ndim, dtype);
  } catch (const std::bad_alloc&) {
    throw;  // a tensor of more than 6 dims keeps them on the heap: not the message's fault
  } catch (const std::exception& e) {
    bad(std::string("tensor outside its storage: ") + e.what());
  }
}

bool is_valid_segment_name(std::string_view name) noexcept {
  // "/shmtensor_<digits>_<16 hex>_<digits>"
  constexpr std::string_view prefix = "/shmtensor_";
  if (name.size() > kMaxNameLength || name.substr(0, prefix.size()) != prefix) return false;
  std::string_view rest = name.substr(prefix.size());
  auto digits = [](std::string_view s) {
    if (s.empty() || s.size() > 20) return false;
    for (char c : s)
      if (c < '0' || c > '9') return false;
    return true;
  };
  auto p1 = rest.find('_');
  if (p1 == std::string_view::npos || !digits(rest.substr(0, p1))) return false;
  rest = rest.substr(p1 + 1);
  if (rest.size() < 18 || rest[16] != '_') return false;
  for (char c : rest.substr(0, 16))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return digits(rest.substr(17));
}

namespace {

// Reads fixed-size records from the body, bounds-checked.
struct BodyReader {
  std::span<const std::byte> body;
  std::size_t pos = 0;
  template <class T>
  T take() {
    if (sizeof(T) > body.size() - pos) bad("tables run past the end of the body");
    T v;
    std::memcpy(&v, body.data() + pos, sizeof v);
    pos += sizeof v;
    return v;
  }
  std::string_view take_name(std::size_t n) {
    std::size_t padded = (n + 7) / 8 * 8;
    if (padded > body.size() - pos) bad("segment name runs past the end of the body");
    std::string_view s(reinterpret_cast<const char*>(body.data() + pos), n);
    pos += padded;
    return s;
  }
};

// A device segment this process cannot map (CudaError): resolve_segment returns its
// metadata alone and records the error here, and parse_frame gives back the message's
// counts of its blocks before throwing it.
struct UnusableSegments {
  std::vector<char> marked;  // by segment index; allocated only when one fails
  std::exception_ptr error;
};

// A device segment's two fds (from the message, or from a depot) imported: the memfd mapped
// and validated (header, uid, size), then the allocation imported on the device whose UUID
// the header names, checked to live there and to hold the segment's blocks (ProtocolError
// otherwise). When this process cannot use that device (CudaError), the error is recorded
// in `unusable` and the metadata alone returned, with `*imported` false. `arena_only`: a
// depot holds arena segments only (transport/depot.h).
std::shared_ptr<Segment> import_device_segment(UniqueFd meta, UniqueFd memory,
                                               const SegmentEntry& e, std::size_t index,
                                               UnusableSegments& unusable, bool arena_only,
                                               bool* imported) {
  *imported = false;
  auto metadata = Segment::attach_device_metadata(std::move(meta), e.uid);
  if (metadata->mapped_size() != e.total_size) bad("device segment size disagrees with its fd");
  if (arena_only && metadata->kind() != SegmentKind::kDeviceArena)
    bad("a depot holds a device segment that is not an arena's");
  std::shared_ptr<Segment> seg;
  try {
    seg = Segment::map_device_memory(metadata, std::move(memory));
  } catch (const CudaError&) {
    if (!unusable.error) unusable.error = std::current_exception();
    unusable.marked.resize(index + 1, 0);
    unusable.marked[index] = 1;
    return metadata;
  }
  *imported = true;
  return seg;
}

// A device segment entry (strategy 2): its memfd and its allocation's fd, or kFdOmitted
// when they are in the transport's depot. Kept out of line: host messages, the common
// case, keep resolve_segment small enough to inline.
[[gnu::noinline]] std::shared_ptr<Segment> resolve_device_segment(const SegmentEntry& e,
                                                                 std::vector<UniqueFd>& fds,
                                                                 std::size_t index,
                                                                 UnusableSegments& unusable,
                                                                 const SegmentFetcher* fetcher) {
  bool imported = false;
  if (e.fd_index == kFdOmitted) {
    if (fetcher == nullptr)
      bad("a device segment sent without its fds, on a transport that has no depot");
    FetchedSegment f = fetcher->fetch(fetcher->context, e.uid, /*device=*/true);
    if (f.segment) {
      // Mapped here already (pinned, or in the registry): nothing is imported.
      if (f.segment->mapped_size() != e.total_size || !f.segment->is_device())
        bad("device segment sent without its fds disagrees with its mapping");
      return f.segment;
    }
    if (!f.meta.valid() || !f.memory.valid())
      bad("a device segment sent without its fds is not in its queue's or connection's depot "
          "(uid " + std::to_string(e.uid) + ")");
    auto seg = import_device_segment(std::move(f.meta), std::move(f.memory), e, index, unusable,
                                     /*arena_only=*/true, &imported);
    if (imported && fetcher->keep != nullptr) fetcher->keep(fetcher->context, seg);
    return seg;
  }
  if (e.fd_index < 0 || static_cast<std::size_t>(e.fd_index) + 1 >= fds.size() ||
      !fds[e.fd_index].valid() || !fds[e.fd_index + 1].valid())
    bad("device segment fd index out of range");
  UniqueFd meta = std::move(fds[e.fd_index]);
  UniqueFd memory = std::move(fds[e.fd_index + 1]);
  if (auto seg = Registry::instance().find_segment(e.uid)) {
    // Mapped here already: nothing is imported, both fds close now.
    if (seg->mapped_size() != e.total_size || !seg->is_device())
      bad("device segment disagrees with its mapping");
    return seg;
  }
  auto seg = import_device_segment(std::move(meta), std::move(memory), e, index, unusable,
                                   /*arena_only=*/false, &imported);
  if (imported) Registry::instance().remember_received_segment(seg);
  return seg;
}

std::shared_ptr<Segment> resolve_segment(const SegmentEntry& e, std::string_view name,
                                         std::vector<UniqueFd>& fds, std::size_t index,
                                         UnusableSegments& unusable,
                                         const SegmentFetcher* fetcher) {
  if (e.strategy == 2) return resolve_device_segment(e, fds, index, unusable, fetcher);
  if (e.strategy == 0 && e.fd_index == kFdOmitted) {
    // Sent without its fd: only a segment deposited with the transport (a queue's depot,
    // docs/transport.md) may be named so; a transport without a depot refuses it.
    if (fetcher == nullptr)
      bad("a file_descriptor segment sent without its fd, on a transport that has no depot");
    auto seg = fetcher->fetch(fetcher->context, e.uid, /*device=*/false).segment;
    if (!seg)
      bad("a file_descriptor segment sent without its fd is not in its queue's or connection's depot (uid " +
          std::to_string(e.uid) + ")");
    if (seg->mapped_size() != e.total_size || seg->is_device() ||
        seg->strategy() != SharingStrategy::kFileDescriptor)
      bad("segment sent without its fd disagrees with its mapping");
    return seg;
  }
  if (e.strategy == 0) {
    if (e.fd_index < 0 || static_cast<std::size_t>(e.fd_index) >= fds.size() ||
        !fds[e.fd_index].valid())
      bad("segment fd index out of range");
    UniqueFd fd = std::move(fds[e.fd_index]);
    if (auto seg = Registry::instance().find_segment(e.uid)) {
      // Already mapped here (possibly our own segment): reuse it; the fd closes now.
      if (seg->mapped_size() != e.total_size || seg->is_device())
        bad("segment size disagrees with its mapping");
      return seg;
    }
    auto seg = Segment::attach_fd(std::move(fd), e.uid);
    if (seg->mapped_size() != e.total_size) bad("segment size disagrees with its fd");
    Registry::instance().remember_received_segment(seg);
    return seg;
  }
  if (e.strategy != 1) bad("unknown segment strategy");
  // The count the sender added for this message is given back by parse_frame, and only
  // once a storage of this segment proved the message carries counts (NamedCounts).
  if (auto seg = Registry::instance().find_segment(e.uid)) {
    // Mapped here: its name was checked when it was made or first received, and the
    // message's must equal it (so the character-by-character check, ~250 instructions,
    // is made once per segment, not once per message).
    if (seg->mapped_size() != e.total_size || seg->name() != name)
      bad("named segment disagrees with its mapping");
    return seg;
  }
  if (!is_valid_segment_name(name)) bad("invalid segment name");
  auto seg = Segment::attach_name(std::string(name), e.uid);  // with this process's own count
  if (seg->mapped_size() != e.total_size || seg->name() != name)
    bad("named segment size disagrees with the message");
  Registry::instance().remember_received_segment(seg);
  return seg;
}

// The block a storage entry names, checked to be one of its segment's.
std::uint32_t storage_block(const Segment& seg, const StorageEntry& e) {
  const std::int64_t block = seg.block_at(e.offset);
  if (block < 0 || e.nbytes == 0 || e.nbytes > seg.block_size())
    bad("storage is not a block of its segment");
  return static_cast<std::uint32_t>(block);
}

// This process's storage of block `b` of `seg`, taking over the count the message carries
// for it: a new storage adopts it, one held here already gives it back. A block whose count
// is not there (a replayed or forged frame) is refused.
Storage adopt_storage(const std::shared_ptr<Segment>& seg, const StorageEntry& e, std::uint32_t b) {
  bool made = false, adopted = true;
  auto impl = Registry::instance().find_or_add_storage(*seg, b, [&] {
    made = true;
    bool counted = false;
    adopted = seg->adopt_block_in_flight(b, &counted);
    return adopted ? std::make_shared<StorageImpl>(seg, e.offset, e.nbytes, b, counted) : nullptr;
  });
  if (made && !adopted) bad("storage's block carries no message count (stale or forged)");
  if (!made) {
    // We hold it already: give back the count the sender added for this message.
    bool freed = false;
    if (!seg->drop_duplicate_in_flight(b, &freed))
      bad("storage's block carries no message count (stale or forged)");
    if (impl->nbytes() != e.nbytes) bad("storage size disagrees with the one already here");
  }
  return StorageAccess::make(std::move(impl));
}

// The message's count of each named segment, given back as soon as one of the segment's
// storages proved that the message carries counts (its block had the message's count): a
// replayed or forged frame, refused at its first storage, takes no count off a live name.
// Given back at once rather than at the end of the parse, so that a receiver SIGKILLed
// mid-parse leaves as few counts as it can (the process holds a count of its own by then:
// it mapped the segment before, or attach_name added one).
class NamedCounts {
 public:
  // `proven` is scratch memory (the decoder state's), filled here.
  NamedCounts(const std::vector<std::shared_ptr<Segment>>& segments, std::vector<char>& proven)
      : segments_(segments), proven_(proven) {
    proven_.assign(segments.size(), 0);
  }
  void prove(std::size_t segment) noexcept {
    if (proven_[segment]) return;
    proven_[segment] = 1;
    segments_[segment]->drop_in_flight_count();  // no-op for memfd segments
  }
  // Every named segment had a storage. (A memfd segment without one is harmless: it
  // carries no count.)
  bool all_named_proven() const noexcept {
    for (std::size_t i = 0; i < segments_.size(); ++i)
      if (!proven_[i] && segments_[i]->strategy() == SharingStrategy::kFileSystem) return false;
    return true;
  }

 private:
  const std::vector<std::shared_ptr<Segment>>& segments_;
  std::vector<char>& proven_;
};

// The fence table (kFlagFences), checked: each fence 8 aligned bytes inside the blocks of
// a device segment of the message. Returns the count.
std::uint32_t take_fences(BodyReader& r, const std::vector<std::shared_ptr<Segment>>& segments,
                          std::array<FenceEntry, kMaxFences>& out) {
  const auto count = r.take<std::uint32_t>();
  if (r.take<std::uint32_t>() != 0 || count == 0 || count > kMaxFences) bad("bad fence count");
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto e = r.take<FenceEntry>();
    if (e.segment_index >= segments.size()) bad("fence refers to a missing segment");
    const Segment& seg = *segments[e.segment_index];
    // By kind: a device segment this process cannot map is its metadata alone.
    if (!is_device_kind(seg.kind())) bad("fence lies in a host segment");
    if (e.reserved != 0 || e.offset % 8 != 0 || seg.payload_size() < 8 ||
        e.offset > seg.payload_size() - 8)
      bad("fence lies outside its segment's blocks");
    out[i] = e;
  }
  return count;
}

}  // namespace

Decoder parse_frame(std::span<const std::byte> datagram, std::vector<UniqueFd> fds,
                    std::shared_ptr<const void> keep, const SegmentFetcher* fetcher) {
  if (datagram.size() < sizeof(FrameHeader)) bad("shorter than a frame header");
  FrameHeader h;
  std::memcpy(&h, datagram.data(), sizeof h);
  if (h.magic != kFrameMagic) bad("bad magic");
  if (h.version != kWireVersion)
    bad("wire version " + std::to_string(h.version) + ", this library speaks " +
        std::to_string(kWireVersion));
  if ((h.flags & ~(kFlagBlob | kFlagFences)) != 0) bad("unknown flags");
  if (h.fd_count != fds.size())
    bad("header announces " + std::to_string(h.fd_count) + " fds but " +
        std::to_string(fds.size()) + " arrived");
  // Its destructor gives it back to the pool if anything below throws (Decoder's does
  // once it is made).
  struct StateHolder {
    std::unique_ptr<DecoderState> st = acquire_decoder_state();
    ~StateHolder() { recycle(std::move(st)); }
  } holder;
  DecoderState* st = holder.st.get();
  std::span<const std::byte> body;
  // size_t arithmetic: a hostile object_fd_count of 0xffffffff must not wrap to 0.
  std::size_t fixed_fds =
      static_cast<std::size_t>(h.object_fd_count) + ((h.flags & kFlagBlob) ? 1u : 0u);
  if (fixed_fds > fds.size()) bad("object fd count exceeds the fds attached");
  if (h.flags & kFlagBlob) {
    if (datagram.size() != sizeof(FrameHeader)) bad("blob frame with an inline body");
    UniqueFd blob = std::move(fds.back());
    fds.pop_back();
    FdFacts facts = inspect_fd(blob.get());
    if (!facts.sealed_against_resize) bad("message blob is not sealed");
    if (h.body_size > kMaxBlob || facts.size != h.body_size || h.body_size == 0)
      bad("message blob size disagrees with the header");
    auto map = std::make_shared<Mapping>(
        Mapping::map_shared(blob.get(), static_cast<std::size_t>(h.body_size), "message blob"));
    body = {map->data(), map->size()};
    keep = std::move(map);
  } else {
    if (h.body_size != datagram.size() - sizeof(FrameHeader))
      bad("body size disagrees with the datagram");
    body = datagram.subspan(sizeof(FrameHeader));
  }
  // Object fds are the last ones (before the blob).
  std::size_t first_object = fds.size() - h.object_fd_count;
  for (std::size_t i = first_object; i < fds.size(); ++i)
    st->object_fds.push_back(std::move(fds[i]));
  fds.resize(first_object);

  BodyReader r{body};
  if (h.segment_count > kMaxFdsPerMessage * 64 ||
      h.segment_count > body.size() / sizeof(SegmentEntry))
    bad("segment count exceeds the body");
  std::vector<std::shared_ptr<Segment>>& segments = st->segments;
  segments.reserve(h.segment_count);
  UnusableSegments unusable;
  for (std::uint32_t i = 0; i < h.segment_count; ++i) {
    auto e = r.take<SegmentEntry>();
    std::string_view name;
    if (e.strategy == 1) {
      if (e.name_length == 0 || e.name_length > kMaxNameLength) bad("bad segment name length");
      name = r.take_name(e.name_length);
    }
    segments.push_back(resolve_segment(e, name, fds, i, unusable, fetcher));
  }
  // A sender lists each segment once. Listed twice, a segment would have its message count
  // given back twice (NamedCounts) by a frame that carries one: a peer could rewrite a
  // genuine two-storage message so, and unlink a name under its live holders.
  if (segments.size() > 1) {
    std::vector<const Segment*>& distinct = st->distinct;
    distinct.reserve(segments.size());
    for (const auto& seg : segments) distinct.push_back(seg.get());
    std::sort(distinct.begin(), distinct.end());
    if (std::adjacent_find(distinct.begin(), distinct.end()) != distinct.end())
      bad("segment listed twice");
  }
  for (auto& fd : fds)
    if (fd.valid()) bad("fd attached to the message that no segment uses");
  if (h.storage_count > (body.size() - r.pos) / sizeof(StorageEntry))
    bad("storage count exceeds the body");
  st->storages.reserve(h.storage_count);
  NamedCounts named_counts(segments, st->proven);
  for (std::uint32_t i = 0; i < h.storage_count; ++i) {
    auto e = r.take<StorageEntry>();
    if (e.segment_index >= segments.size()) bad("storage refers to a missing segment");
    const auto& seg = segments[e.segment_index];
    const std::uint32_t b = storage_block(*seg, e);
    if (e.segment_index < unusable.marked.size() && unusable.marked[e.segment_index]) {
      // Not received: the message's count goes back, as if it had never been sent.
      (void)seg->drop_block_in_flight(b);
      continue;
    }
    st->storages.push_back(adopt_storage(seg, e, b));
    named_counts.prove(e.segment_index);
  }
  // Senders list a segment only for its storages: a named one without would keep the
  // message's count on the name for good.
  if (!named_counts.all_named_proven()) bad("named segment that no storage uses");
  std::array<FenceEntry, kMaxFences> fences;
  const std::uint32_t fence_count = (h.flags & kFlagFences) ? take_fences(r, segments, fences) : 0;
  if (unusable.error) std::rethrow_exception(unusable.error);
  // Every check passed: the waits are queued last, so that a refused message queues none.
  for (std::uint32_t i = 0; i < fence_count; ++i)
    wait_for_fence(segments[fences[i].segment_index], fences[i].offset, fences[i].value);
  st->payload = body.subspan(r.pos);
  st->keep = std::move(keep);
  // The segments stay mapped through the storages; the scratch lists are not needed now.
  segments.clear();
  st->distinct.clear();
  return CodecAccess::decoder(std::move(holder.st));
}

bool parse_tensor_frame(std::span<const std::byte> frame, const SegmentFetcher* fetcher,
                        Tensor& out) {
  // The shape, checked before anything is done: parse_frame's checks of the header, the
  // tables' bounds and the name's length, where a frame of this shape passes them all.
  FrameHeader h;
  if (frame.size() < sizeof h) return false;
  std::memcpy(&h, frame.data(), sizeof h);
  if (h.magic != kFrameMagic || h.version != kWireVersion || h.flags != 0 || h.fd_count != 0 ||
      h.object_fd_count != 0 || h.segment_count != 1 || h.storage_count != 1 ||
      h.body_size != frame.size() - sizeof h)
    return false;
  BodyReader r{frame.subspan(sizeof h)};
  if (r.body.size() < sizeof(SegmentEntry) + sizeof(StorageEntry)) return false;
  const auto seg_entry = r.take<SegmentEntry>();
  // A device segment: the general parse, which gives back the message's counts when this
  // process cannot import it (UnusableSegments).
  if (seg_entry.strategy == 2) return false;
  std::string_view name;
  if (seg_entry.strategy == 1) {
    const std::size_t padded = (std::size_t{seg_entry.name_length} + 7) / 8 * 8;
    if (seg_entry.name_length == 0 || seg_entry.name_length > kMaxNameLength ||
        padded + sizeof(StorageEntry) > r.body.size() - r.pos)
      return false;
    name = r.take_name(seg_entry.name_length);
  }
  // From here parse_frame's own steps, in its order (and so its errors).
  std::vector<UniqueFd> no_fds;
  UnusableSegments host_only;  // stays empty: no device segment
  const std::shared_ptr<Segment> seg =
      resolve_segment(seg_entry, name, no_fds, 0, host_only, fetcher);
  const auto e = r.take<StorageEntry>();
  if (e.segment_index != 0) bad("storage refers to a missing segment");
  Storage storage = adopt_storage(seg, e, storage_block(*seg, e));
  seg->drop_in_flight_count();  // proven (NamedCounts); a no-op for a memfd segment
  // Decoder::read_tensor, then Decoder::finish.
  const std::span<const std::byte> payload = r.body.subspan(r.pos);
  std::size_t used = 0;
  read_encoded_tensor(payload, std::span(&storage, 1), true, &used, out);
  if (used != payload.size())
    bad(std::to_string(payload.size() - used) + " trailing bytes after the value");
  return true;
}

}  // namespace internal
}  // namespace shmtensor
