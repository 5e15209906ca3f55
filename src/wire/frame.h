// The wire format of one message (docs/wire_format.md is its prose twin).
//
//   FrameHeader                      32 bytes
//   body (inline, or in a memfd "blob" attached as the last fd when it is large):
//     SegmentEntry × segment_count   each followed by its name, padded to 8 bytes
//     StorageEntry × storage_count
//     with kFlagFences: u32 fence count, u32 0, FenceEntry × count
//     payload                        the encoded value
//   fds: one per file_descriptor segment (SegmentEntry::fd_index), two per device
//        segment (its memfd, then its CUDA allocation), then object fds
//        (Connection / Queue), then the blob fd if kFlagBlob.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shmtensor::internal {

inline constexpr std::uint32_t kFrameMagic = 0x31575453;  // "STW1"
inline constexpr std::uint16_t kWireVersion = 1;
inline constexpr std::uint16_t kFlagBlob = 1;
// The body has a fence table after the storage table (memory/fence.h).
inline constexpr std::uint16_t kFlagFences = 2;
// A datagram is at most this big; larger bodies travel in a blob.
inline constexpr std::size_t kMaxInlineFrame = 64 * 1024;
// A blob is at most this big (a hostile peer cannot make us map more).
inline constexpr std::size_t kMaxBlob = std::size_t{1} << 34;
inline constexpr std::size_t kMaxNameLength = 64;
// An encoded Tensor's storage index when it has no elements (and so needs no storage); an
// encoded Storage's when it has no bytes.
inline constexpr std::uint32_t kEmptyTensor = 0xfffffffeu;
// An encoded Storage (in the payload, by Encoder::write_storage) is its u32 storage index
// alone: an index into the frame's storage table, kEmptyTensor for one of 0 bytes, or this
// for an undefined one.
inline constexpr std::uint32_t kNoStorage = 0xffffffffu;
// The most dimensions an encoded Tensor has (its ndim is one byte; 64 bounds what a
// hostile message can make a receiver allocate).
inline constexpr std::size_t kMaxTensorDims = 64;

struct FrameHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t flags;
  std::uint64_t body_size;  // bytes of the body (inline after the header, or the blob)
  std::uint32_t segment_count;
  std::uint32_t storage_count;
  std::uint32_t fd_count;         // fds attached, blob included
  std::uint32_t object_fd_count;  // of which belong to encoded Connection/Queue objects
};
static_assert(sizeof(FrameHeader) == 32);

struct SegmentEntry {
  std::uint64_t uid;
  std::uint64_t total_size;  // the segment's size; checked against the fd / object
  std::uint8_t strategy;     // 0 file_descriptor, 1 file_system, 2 device (two fds)
  std::uint8_t reserved;
  std::uint16_t name_length;  // file_system: bytes of the name that follows
  // file_descriptor: index into the fds, or kFdOmitted; device: the memfd's index, the
  // allocation's fd following it, or kFdOmitted; -1 otherwise
  std::int32_t fd_index;
};
static_assert(sizeof(SegmentEntry) == 24);

// The fd_index of a file_descriptor or device segment whose fds were left out: a sender
// deposited the segment with the queue or connection (docs/transport.md, "fds once per
// segment"). A receiver whose transport's depot does not have it refuses the message.
inline constexpr std::int32_t kFdOmitted = -2;

struct StorageEntry {
  std::uint32_t segment_index;
  std::uint32_t reserved;
  std::uint64_t offset;  // from the segment's payload start
  std::uint64_t nbytes;
};
static_assert(sizeof(StorageEntry) == 24);

// A fence the receiver waits for before it uses the message's device memory (memory/fence.h):
// 8 bytes at `offset` in the blocks of a device segment of the segment table, which reach
// `value` once the sender's device work before the send is done. One per device the
// message carries, at most kMaxFences.
struct FenceEntry {
  std::uint32_t segment_index;
  std::uint32_t reserved;  // 0
  std::uint64_t offset;    // from the segment's payload start; a multiple of 8
  std::uint64_t value;
};
static_assert(sizeof(FenceEntry) == 24);
inline constexpr std::uint32_t kMaxFences = 64;

// An encoded Tensor (in the payload, by Encoder::write_tensor): this head, then
// i64 sizes[ndim], i64 strides[ndim]. An undefined tensor is the `defined` byte (0) alone.
struct EncodedTensorHead {
  std::uint8_t defined;  // 1
  std::uint8_t dtype;
  std::uint8_t ndim;
  std::uint8_t device;  // 0 CPU, 1 CUDA (an empty CUDA tensor arrives on cuda:0)
  std::uint32_t storage_index;  // or kEmptyTensor
  std::int64_t storage_offset;
};
static_assert(sizeof(EncodedTensorHead) == 16);

// Checks that `name` is one of ours: "/shmtensor_<digits>_<16 hex>_<digits>". A peer
// cannot make us open any other object.
bool is_valid_segment_name(std::string_view name) noexcept;

}  // namespace shmtensor::internal
