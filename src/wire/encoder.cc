#include <algorithm>
#include <cstring>

#include "memory/storage_impl.h"
#include "os/mapping.h"
#include "os/shm.h"
#include "os/socket.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/sharing_strategy.h"
#include "wire/wire.h"

namespace shmtensor {

Encoder::Encoder() : state_(std::make_unique<internal::EncoderState>()) {}
Encoder::~Encoder() = default;
Encoder::Encoder(Encoder&&) noexcept = default;
Encoder& Encoder::operator=(Encoder&&) noexcept = default;

void Encoder::write_tensor(const Tensor& t) {
  // Layout: u8 defined, u8 dtype, u8 ndim, u8 pad, u32 storage index (or kEmptyTensor),
  // i64 storage_offset, i64 sizes[ndim], i64 strides[ndim].
  write_pod<std::uint8_t>(t.defined() ? 1 : 0);
  if (!t.defined()) return;
  if (t.dim() > static_cast<std::int64_t>(internal::kMaxTensorDims))
    throw Error("cannot send a tensor with more than 64 dimensions");
  write_pod<std::uint8_t>(static_cast<std::uint8_t>(t.dtype()));
  write_pod<std::uint8_t>(static_cast<std::uint8_t>(t.dim()));
  write_pod<std::uint8_t>(0);
  std::uint32_t index = internal::kEmptyTensor;
  if (t.numel() > 0) {
    // Only recorded here: the frame stage moves it into shared memory, once the transport
    // has admitted the message.
    std::shared_ptr<internal::StorageImpl> impl = internal::StorageAccess::impl(t.storage());
    auto& storages = state_->storages;
    auto it = std::find(storages.begin(), storages.end(), impl);
    if (it == storages.end()) {
      storages.push_back(impl);
      it = storages.end() - 1;
    }
    index = static_cast<std::uint32_t>(it - storages.begin());
  }
  write_pod<std::uint32_t>(index);
  write_pod<std::int64_t>(t.numel() > 0 ? t.storage_offset() : 0);
  for (auto s : t.sizes()) write_pod<std::int64_t>(s);
  for (auto s : t.strides()) write_pod<std::int64_t>(t.numel() > 0 ? s : 0);
}

void Encoder::write_fd(int fd) { state_->object_fds.push_back(internal::dup_cloexec(fd)); }

namespace internal {

std::array<std::span<const std::byte>, 3> OutgoingFrame::parts() const noexcept {
  return {std::span<const std::byte>(reinterpret_cast<const std::byte*>(&header), sizeof header),
          std::span<const std::byte>(tables), std::span<const std::byte>(payload)};
}

OutgoingFrame::~OutgoingFrame() {
  if (sent) return;
  for (auto& impl : in_flight_blocks) impl->segment()->drop_block_in_flight(impl->block());
  for (auto& seg : in_flight) seg->drop_in_flight_count();
  for (auto& undo : undo_if_unsent) undo();
}

OutgoingFrame finish_frame(Encoder&& encoder) {
  EncoderState& st = CodecAccess::state(encoder);
  OutgoingFrame frame;

  // Into shared memory, in place: every tensor and view on these storages follows.
  const SharingStrategy strategy = get_sharing_strategy();
  for (const auto& impl : st.storages) impl->share_memory_(strategy);

  // Segment table: one entry per distinct segment.
  std::vector<std::uint32_t> storage_segment(st.storages.size());
  for (std::size_t i = 0; i < st.storages.size(); ++i) {
    const auto& seg = st.storages[i]->segment();
    auto it = std::find(frame.segments.begin(), frame.segments.end(), seg);
    if (it == frame.segments.end()) {
      frame.segments.push_back(seg);
      it = frame.segments.end() - 1;
    }
    storage_segment[i] = static_cast<std::uint32_t>(it - frame.segments.begin());
  }
  std::vector<std::byte>& tables = frame.tables;
  auto append = [&tables](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    tables.insert(tables.end(), b, b + n);
  };
  for (const auto& seg : frame.segments) {
    SegmentEntry e{};
    e.uid = seg->uid();
    e.total_size = seg->mapped_size();
    if (seg->strategy() == SharingStrategy::kFileDescriptor) {
      e.strategy = 0;
      e.fd_index = static_cast<std::int32_t>(frame.fds.size());
      frame.fds.push_back(seg->fd());
      append(&e, sizeof e);
    } else {
      e.strategy = 1;
      e.fd_index = -1;
      e.name_length = static_cast<std::uint16_t>(seg->name().size());
      append(&e, sizeof e);
      append(seg->name().data(), seg->name().size());
      tables.resize((tables.size() + 7) / 8 * 8);
    }
  }
  for (std::size_t i = 0; i < st.storages.size(); ++i) {
    StorageEntry e{};
    e.segment_index = storage_segment[i];
    e.offset = st.storages[i]->offset();
    e.nbytes = st.storages[i]->nbytes();
    append(&e, sizeof e);
  }
  frame.payload = std::move(CodecAccess::payload(encoder));

  for (auto& fd : st.object_fds) {
    frame.fds.push_back(fd.get());
    frame.owned_fds.push_back(std::move(fd));
  }
  FrameHeader& h = frame.header;
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.body_size = tables.size() + frame.payload.size();
  h.segment_count = static_cast<std::uint32_t>(frame.segments.size());
  h.storage_count = static_cast<std::uint32_t>(st.storages.size());
  h.object_fd_count = static_cast<std::uint32_t>(st.object_fds.size());
  if (sizeof(FrameHeader) + h.body_size > kMaxInlineFrame) {
    // Too big for one datagram: the body goes into a sealed memfd sent along.
    UniqueFd blob = create_sealed_memfd(h.body_size);
    Mapping map = Mapping::map_shared(blob.get(), h.body_size, "message blob");
    if (!tables.empty()) std::memcpy(map.data(), tables.data(), tables.size());
    if (!frame.payload.empty())
      std::memcpy(map.data() + tables.size(), frame.payload.data(), frame.payload.size());
    tables = {};
    frame.payload = {};
    h.flags |= kFlagBlob;
    frame.fds.push_back(blob.get());
    frame.owned_fds.push_back(std::move(blob));
  }
  h.fd_count = static_cast<std::uint32_t>(frame.fds.size());
  if (frame.fds.size() > kMaxFdsPerMessage)
    throw Error("a message can carry at most 253 fds but this one needs " +
                std::to_string(frame.fds.size()) +
                " (too many distinct file_descriptor segments): send fewer tensors per "
                "message, or use set_sharing_strategy(\"file_system\")");
  // In-flight counts last: nothing above can fail after them. A block count can fail
  // (65535 messages in flight); the frame's destructor then gives back those added.
  for (const auto& impl : st.storages) {
    impl->segment()->add_block_in_flight(impl->block());
    frame.in_flight_blocks.push_back(impl);
  }
  for (const auto& seg : frame.segments) {
    if (seg->strategy() == SharingStrategy::kFileSystem) {
      seg->add_in_flight_count();
      frame.in_flight.push_back(seg);
    }
  }
  frame.undo_if_unsent = std::move(st.undo_if_unsent);
  st.undo_if_unsent.clear();
  return frame;
}

}  // namespace internal
}  // namespace shmtensor
