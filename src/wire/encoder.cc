#include <algorithm>
#include <cassert>
#include <cstring>

#include "cuda/device_memory.h"
#include "memory/fence.h"
#include "memory/storage_impl.h"
#include "os/mapping.h"
#include "os/shm.h"
#include "os/socket.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/sharing_strategy.h"
#include "wire/wire.h"

namespace shmtensor {

// The payload buffer comes from the pooled state and goes back with it: a thread that
// encodes message after message reuses its capacity.
Encoder::Encoder() : state_(internal::acquire_encoder_state()) { payload_.swap(state_->payload); }
Encoder::~Encoder() {
  if (!state_) return;  // moved from, or its state went to a frame
  for (auto& undo : state_->undo_if_unsent) undo();
  state_->payload.swap(payload_);
  internal::recycle(std::move(state_));
}
Encoder::Encoder(Encoder&&) noexcept = default;
Encoder& Encoder::operator=(Encoder&& other) noexcept {
  if (this != &other) {
    Encoder old(std::move(*this));  // ends this one's message as ~Encoder does
    payload_ = std::move(other.payload_);
    state_ = std::move(other.state_);
  }
  return *this;
}

namespace internal {
namespace {

std::size_t encoded_tensor_bytes(std::size_t ndim) noexcept {
  return sizeof(EncodedTensorHead) + 2 * ndim * sizeof(std::int64_t);
}

// A defined tensor's encoding (frame.h: EncodedTensorHead, sizes, strides) at `out`
// (encoded_tensor_bytes of room). Without storage (no elements) its offset and strides are
// written as 0.
void write_encoded_tensor(std::byte* out, const Tensor& t, std::uint32_t index, bool has_storage,
                          bool cuda) noexcept {
  const auto ndim = static_cast<std::size_t>(t.dim());
  const EncodedTensorHead head{1,
                               static_cast<std::uint8_t>(t.dtype()),
                               static_cast<std::uint8_t>(ndim),
                               static_cast<std::uint8_t>(cuda ? 1 : 0),
                               index,
                               has_storage ? t.storage_offset() : 0};
  std::memcpy(out, &head, sizeof head);
  auto* dims = out + sizeof head;
  const std::size_t dim_bytes = ndim * sizeof(std::int64_t);
  if (ndim == 0) return;
  std::memcpy(dims, t.sizes().data(), dim_bytes);
  if (has_storage)
    std::memcpy(dims + dim_bytes, t.strides().data(), dim_bytes);
  else
    std::memset(dims + dim_bytes, 0, dim_bytes);
}

// A host segment's entry (file_descriptor or file_system: frame.h, SegmentEntry). A named
// one's name follows it in the table, padded to 8 bytes (padded_name_bytes).
SegmentEntry host_segment_entry(const Segment& seg, std::int32_t fd_index) noexcept {
  SegmentEntry e{};
  e.uid = seg.uid();
  e.total_size = seg.mapped_size();
  if (seg.strategy() == SharingStrategy::kFileDescriptor) {
    e.strategy = 0;
    e.fd_index = fd_index;
  } else {
    e.strategy = 1;
    e.fd_index = -1;
    e.name_length = static_cast<std::uint16_t>(seg.name().size());
  }
  return e;
}

// A frame's header, before its flags and fd counts (finish_frame sets them when it has
// fds or a blob).
FrameHeader frame_header(std::uint64_t body_size, std::size_t segments,
                         std::size_t storages) noexcept {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.body_size = body_size;
  h.segment_count = static_cast<std::uint32_t>(segments);
  h.storage_count = static_cast<std::uint32_t>(storages);
  return h;
}

// The bytes of a segment's name in the segment table: 0 for a device or file_descriptor
// segment (no name), else its name padded to 8 bytes.
std::size_t padded_name_bytes(const Segment& seg) noexcept {
  if (seg.is_device() || seg.strategy() == SharingStrategy::kFileDescriptor) return 0;
  return (seg.name().size() + 7) / 8 * 8;
}

}  // namespace
}  // namespace internal

std::uint32_t Encoder::record_storage(const std::shared_ptr<internal::StorageImpl>& impl) {
  // Only recorded here: the frame stage moves it into shared memory, once the transport has
  // admitted the message. Several references to one storage are one entry.
  auto& storages = state_->storages;
  auto it = std::find(storages.begin(), storages.end(), impl);
  if (it == storages.end()) {
    storages.push_back(impl);
    it = storages.end() - 1;
  }
  return static_cast<std::uint32_t>(it - storages.begin());
}

void Encoder::write_storage(const Storage& s) {
  // frame.h: the u32 storage index alone.
  std::uint32_t index = internal::kNoStorage;
  if (s.defined() && s.nbytes() == 0) {
    if (s.device().is_cuda()) throw Error("cannot send a CUDA storage of 0 bytes");
    index = internal::kEmptyTensor;
  } else if (s.defined()) {
    index = record_storage(internal::StorageAccess::impl(s));
  }
  write_pod(index);
}

void Encoder::write_tensor(const Tensor& t) {
  // EncodedTensorHead, sizes, strides (frame.h): built here and appended in one write (a
  // tensor's encoding is most of a small message's work).
  if (!t.defined()) {
    write_pod<std::uint8_t>(0);
    return;
  }
  const auto ndim = static_cast<std::size_t>(t.dim());
  if (ndim > internal::kMaxTensorDims)
    throw Error("cannot send a tensor with more than 64 dimensions");
  std::uint32_t index = internal::kEmptyTensor;
  const bool has_storage = t.numel() > 0;
  bool cuda = false;
  if (has_storage) {
    const std::shared_ptr<internal::StorageImpl>& impl = internal::StorageAccess::impl(t.storage());
    cuda = impl->device() >= 0;
    index = record_storage(impl);
  } else {
    cuda = t.is_cuda();
  }
  const std::size_t at = payload_.size();
  payload_.resize(at + internal::encoded_tensor_bytes(ndim));
  internal::write_encoded_tensor(payload_.data() + at, t, index, has_storage, cuda);
}

void Encoder::write_fd(int fd) { state_->object_fds.push_back(internal::dup_cloexec(fd)); }

namespace internal {

std::array<std::span<const std::byte>, 3> OutgoingFrame::parts() const noexcept {
  return {std::span<const std::byte>(reinterpret_cast<const std::byte*>(&header), sizeof header),
          std::span<const std::byte>(st->tables), std::span<const std::byte>(st->payload)};
}

OutgoingFrame::~OutgoingFrame() {
  if (!st) return;  // moved from
  if (!sent) {
    for (StorageImpl* impl : st->in_flight_blocks)
      impl->segment()->drop_block_in_flight(impl->block());
    for (Segment* seg : st->in_flight) seg->drop_in_flight_count();
    for (auto& undo : st->undo_if_unsent) undo();
  }
  recycle(std::move(st));
}

OutgoingFrame finish_frame(Encoder&& encoder, const FdElision* elision) {
  // The frame owns the message's state from here: if anything below throws, its
  // destructor gives back what was counted so far and runs the encoded objects' undo.
  OutgoingFrame frame;
  frame.st = CodecAccess::take_state(encoder);
  EncoderState& st = *frame.st;

  // Into shared memory, in place: every tensor and view on these storages follows.
  const SharingStrategy strategy = get_sharing_strategy();
  for (const auto& impl : st.storages) impl->share_memory_(strategy);
  // What this process queued on device memory before now is done before the receiver's
  // work on the message's device storages starts: a fence per device (memory/fence.h).
  int devices[kMaxFences];
  std::size_t ndevices = 0;
  for (const auto& impl : st.storages) {
    const int device = impl->device();
    if (device < 0 || std::find(devices, devices + ndevices, device) != devices + ndevices)
      continue;
    if (ndevices == std::size(devices)) {
      cuda::synchronize(device);  // more devices than a message has fences for
      continue;
    }
    devices[ndevices++] = device;
    if (auto f = signal_fence(device))
      st.fences.push_back({std::move(f->segment), f->offset, f->value});
  }

  // Segment table: one entry per distinct segment.
  for (const auto& impl : st.storages) {
    Segment* seg = impl->segment().get();
    auto it = std::find(st.segments.begin(), st.segments.end(), seg);
    if (it == st.segments.end()) {
      st.segments.push_back(seg);
      it = st.segments.end() - 1;
    }
    st.storage_segment.push_back(static_cast<std::uint32_t>(it - st.segments.begin()));
  }
  // A fence's segment is listed like a storage's (its fds travel, the receiver maps it).
  for (const auto& f : st.fences)
    if (std::find(st.segments.begin(), st.segments.end(), f.segment.get()) == st.segments.end())
      st.segments.push_back(f.segment.get());
  // The tables' size first, so that they are written into one resize (entries appended
  // one by one cost more than the rest of a small message's frame). A segment's entry is
  // followed by its name, padded to 8 bytes, when it is neither a device segment nor a
  // file_descriptor one (the last branch below).
  std::size_t table_bytes = st.storages.size() * sizeof(StorageEntry);
  if (!st.fences.empty())
    table_bytes += 2 * sizeof(std::uint32_t) + st.fences.size() * sizeof(FenceEntry);
  for (Segment* seg : st.segments) table_bytes += sizeof(SegmentEntry) + padded_name_bytes(*seg);
  std::vector<std::byte>& tables = st.tables;
  tables.resize(table_bytes);  // zeroed: a name's padding is
  std::byte* out = tables.data();
  auto append = [&out](const void* p, std::size_t n) {
    std::memcpy(out, p, n);
    out += n;
  };
  for (Segment* seg : st.segments) {
    if (seg->is_device()) {
      // Two fds: the memfd of its header, slots and words, then the device allocation's;
      // both left out when the transport's depot has them.
      SegmentEntry e{};
      e.uid = seg->uid();
      e.total_size = seg->mapped_size();
      e.strategy = 2;
      e.fd_index = kFdOmitted;
      if (elision == nullptr || !elision->omit(elision->context, *seg)) {
        e.fd_index = static_cast<std::int32_t>(st.fds.size());
        st.fds.push_back(seg->fd());
        st.fds.push_back(seg->device_fd());
      }
      append(&e, sizeof e);
    } else if (seg->strategy() == SharingStrategy::kFileDescriptor) {
      std::int32_t fd_index = kFdOmitted;
      if (elision == nullptr || !elision->omit(elision->context, *seg)) {
        fd_index = static_cast<std::int32_t>(st.fds.size());
        st.fds.push_back(seg->fd());
      }
      const SegmentEntry e = host_segment_entry(*seg, fd_index);
      append(&e, sizeof e);
    } else {
      const SegmentEntry e = host_segment_entry(*seg, -1);
      append(&e, sizeof e);
      append(seg->name().data(), seg->name().size());
      out += padded_name_bytes(*seg) - seg->name().size();
    }
  }
  for (std::size_t i = 0; i < st.storages.size(); ++i) {
    StorageEntry e{};
    e.segment_index = st.storage_segment[i];
    e.offset = st.storages[i]->offset();
    e.nbytes = st.storages[i]->nbytes();
    append(&e, sizeof e);
  }
  if (!st.fences.empty()) {
    const std::uint32_t head[2] = {static_cast<std::uint32_t>(st.fences.size()), 0};
    append(head, sizeof head);
    for (const auto& f : st.fences) {
      FenceEntry e{};
      e.segment_index = static_cast<std::uint32_t>(
          std::find(st.segments.begin(), st.segments.end(), f.segment.get()) -
          st.segments.begin());
      e.offset = f.offset;
      e.value = f.value;
      append(&e, sizeof e);
    }
  }
  assert(out == tables.data() + tables.size());

  for (auto& fd : st.object_fds) {
    st.fds.push_back(fd.get());
    st.owned_fds.push_back(std::move(fd));
  }
  FrameHeader& h = frame.header;
  h = frame_header(tables.size() + st.payload.size(), st.segments.size(), st.storages.size());
  h.object_fd_count = static_cast<std::uint32_t>(st.object_fds.size());
  if (!st.fences.empty()) h.flags |= kFlagFences;
  if (sizeof(FrameHeader) + h.body_size > kMaxInlineFrame) {
    // Too big for one datagram: the body goes into a sealed memfd sent along.
    UniqueFd blob = create_sealed_memfd(h.body_size);
    Mapping map = Mapping::map_shared(blob.get(), h.body_size, "message blob");
    if (!tables.empty()) std::memcpy(map.data(), tables.data(), tables.size());
    if (!st.payload.empty())
      std::memcpy(map.data() + tables.size(), st.payload.data(), st.payload.size());
    // Freed, not cleared: a body this large should not stay allocated while the send
    // waits, nor in the pool afterwards.
    std::vector<std::byte>().swap(tables);
    std::vector<std::byte>().swap(st.payload);
    h.flags |= kFlagBlob;
    st.fds.push_back(blob.get());
    st.owned_fds.push_back(std::move(blob));
  }
  h.fd_count = static_cast<std::uint32_t>(st.fds.size());
  if (st.fds.size() > kMaxFdsPerMessage)
    throw Error("a message can carry at most 253 fds but this one needs " +
                std::to_string(st.fds.size()) +
                " (too many distinct file_descriptor segments): send fewer tensors per "
                "message, or use set_sharing_strategy(\"file_system\") with a /dev/shm "
                "large enough to hold them (a segment it cannot hold goes by fd)");
  // In-flight counts last: nothing above can fail after them. A block count can fail
  // (65535 messages in flight); the frame's destructor then gives back those added.
  st.in_flight_blocks.reserve(st.storages.size());  // no allocation failure between a
  st.in_flight.reserve(st.segments.size());         // count and its record
  for (const auto& impl : st.storages) {
    impl->segment()->add_block_in_flight(impl->block());
    st.in_flight_blocks.push_back(impl.get());
  }
  for (Segment* seg : st.segments) {
    if (seg->strategy() == SharingStrategy::kFileSystem) {
      seg->add_in_flight_count();
      st.in_flight.push_back(seg);
    }
  }
  return frame;
}

TensorFrame::~TensorFrame() {
  if (sent_ || counted_segment_ == nullptr) return;
  counted_segment_->drop_block_in_flight(counted_block_);
  counted_segment_->drop_in_flight_count();  // a no-op for a memfd segment
}

bool TensorFrame::frame(const Tensor& t, const FdElision& deposited, std::span<std::byte> out) {
  if (!t.defined() || t.numel() == 0) return false;
  const auto ndim = static_cast<std::size_t>(t.dim());
  const std::shared_ptr<StorageImpl>& impl = StorageAccess::impl(t.storage());
  if (impl->device() >= 0 || ndim > kMaxTensorDims) return false;
  impl->share_memory_(get_sharing_strategy());  // as finish_frame does first
  Segment& seg = *impl->segment();
  const bool named = seg.strategy() == SharingStrategy::kFileSystem;
  const std::size_t name_bytes = padded_name_bytes(seg);
  const std::size_t size = sizeof(FrameHeader) + sizeof(SegmentEntry) + name_bytes +
                           sizeof(StorageEntry) + encoded_tensor_bytes(ndim);
  // The elision last: it counts the fd it leaves out.
  if (size > out.size() || (!named && !deposited.omit(deposited.context, seg))) return false;
  // finish_frame's bytes for it: the header, the segment table (its name zero-padded), the
  // storage table, then Encoder::write_tensor's payload.
  std::byte* p = out.data();
  const FrameHeader h = frame_header(size - sizeof(FrameHeader), 1, 1);
  std::memcpy(p, &h, sizeof h);
  p += sizeof h;
  const SegmentEntry se = host_segment_entry(seg, kFdOmitted);
  std::memcpy(p, &se, sizeof se);
  p += sizeof se;
  if (named) {
    std::memcpy(p, seg.name().data(), seg.name().size());
    std::memset(p + seg.name().size(), 0, name_bytes - seg.name().size());
    p += name_bytes;
  }
  const StorageEntry st{0, 0, impl->offset(), impl->nbytes()};
  std::memcpy(p, &st, sizeof st);
  p += sizeof st;
  write_encoded_tensor(p, t, 0, true, false);
  // The counts last, as finish_frame adds them: nothing above can fail after them.
  seg.add_block_in_flight(impl->block());
  counted_segment_ = &seg;
  counted_block_ = impl->block();
  seg.add_in_flight_count();  // a no-op for a memfd segment
  out_ = out.data();
  size_ = size;
  return true;
}

}  // namespace internal
}  // namespace shmtensor
