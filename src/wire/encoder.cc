#include <algorithm>
#include <cassert>
#include <cstring>

#include "cuda/device_memory.h"
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
    // Only recorded here: the frame stage moves it into shared memory, once the transport
    // has admitted the message.
    const std::shared_ptr<internal::StorageImpl>& impl = internal::StorageAccess::impl(t.storage());
    cuda = impl->device() >= 0;
    auto& storages = state_->storages;
    auto it = std::find(storages.begin(), storages.end(), impl);
    if (it == storages.end()) {
      storages.push_back(impl);
      it = storages.end() - 1;
    }
    index = static_cast<std::uint32_t>(it - storages.begin());
  } else {
    cuda = t.is_cuda();
  }
  std::int64_t dims[2 * internal::kMaxTensorDims];
  const internal::EncodedTensorHead head{1, static_cast<std::uint8_t>(t.dtype()),
                                        static_cast<std::uint8_t>(ndim),
                                        static_cast<std::uint8_t>(cuda ? 1 : 0), index,
                                        has_storage ? t.storage_offset() : 0};
  for (std::size_t i = 0; i < ndim; ++i) {
    dims[i] = t.sizes()[i];
    dims[ndim + i] = has_storage ? t.strides()[i] : 0;
  }
  const std::size_t at = payload_.size();
  payload_.resize(at + sizeof head + 2 * ndim * sizeof(std::int64_t));
  std::memcpy(payload_.data() + at, &head, sizeof head);
  if (ndim > 0) std::memcpy(payload_.data() + at + sizeof head, dims, 2 * ndim * sizeof dims[0]);
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
  // What this process wrote to device memory, kernels included, is complete before the
  // message can be received: once per device the message carries.
  int synced[8];
  std::size_t nsynced = 0;
  for (const auto& impl : st.storages) {
    const int device = impl->device();
    if (device < 0 || std::find(synced, synced + nsynced, device) != synced + nsynced) continue;
    cuda::synchronize(device);
    if (nsynced < std::size(synced)) synced[nsynced++] = device;
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
  // The tables' size first, so that they are written into one resize (entries appended
  // one by one cost more than the rest of a small message's frame). A segment's entry is
  // followed by its name, padded to 8 bytes, when it is neither a device segment nor a
  // file_descriptor one (the last branch below).
  auto padded_name_bytes = [](const Segment& seg) -> std::size_t {
    if (seg.is_device() || seg.strategy() == SharingStrategy::kFileDescriptor) return 0;
    return (seg.name().size() + 7) / 8 * 8;
  };
  std::size_t table_bytes = st.storages.size() * sizeof(StorageEntry);
  for (Segment* seg : st.segments) table_bytes += sizeof(SegmentEntry) + padded_name_bytes(*seg);
  std::vector<std::byte>& tables = st.tables;
  tables.resize(table_bytes);  // zeroed: a name's padding is
  std::byte* out = tables.data();
  auto append = [&out](const void* p, std::size_t n) {
    std::memcpy(out, p, n);
    out += n;
  };
  for (Segment* seg : st.segments) {
    SegmentEntry e{};
    e.uid = seg->uid();
    e.total_size = seg->mapped_size();
    if (seg->is_device()) {
      // Two fds: the memfd of its header, slots and words, then the device allocation's.
      e.strategy = 2;
      e.fd_index = static_cast<std::int32_t>(st.fds.size());
      st.fds.push_back(seg->fd());
      st.fds.push_back(seg->device_fd());
      append(&e, sizeof e);
    } else if (seg->strategy() == SharingStrategy::kFileDescriptor) {
      e.strategy = 0;
      if (elision != nullptr && elision->omit(elision->context, *seg)) {
        e.fd_index = kFdOmitted;
      } else {
        e.fd_index = static_cast<std::int32_t>(st.fds.size());
        st.fds.push_back(seg->fd());
      }
      append(&e, sizeof e);
    } else {
      e.strategy = 1;
      e.fd_index = -1;
      e.name_length = static_cast<std::uint16_t>(seg->name().size());
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
  assert(out == tables.data() + tables.size());

  for (auto& fd : st.object_fds) {
    st.fds.push_back(fd.get());
    st.owned_fds.push_back(std::move(fd));
  }
  FrameHeader& h = frame.header;
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.body_size = tables.size() + st.payload.size();
  h.segment_count = static_cast<std::uint32_t>(st.segments.size());
  h.storage_count = static_cast<std::uint32_t>(st.storages.size());
  h.object_fd_count = static_cast<std::uint32_t>(st.object_fds.size());
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
                "message, or use set_sharing_strategy(\"file_system\")");
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

}  // namespace internal
}  // namespace shmtensor
