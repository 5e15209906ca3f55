// The wire layer's stages (docs/architecture.md draws the whole path):
//
//   encode  Encoder / Codec<T> (codec.h): a value becomes payload bytes, a list of the
//           storages its tensors use, and the fds of encoded Connections and Queues. Nothing
//           is moved into shared memory yet, so a transport may still refuse the message.
//   frame   finish_frame: moves those storages into shared memory (share_memory_), writes
//           the segment and storage tables, and adds the counts the receiver will adopt.
//   (send and receive are the transport's: transport/channel.h)
//   parse   parse_frame: validates a received datagram and its fds, maps the segments it
//           names (through the registry) and adopts its counts.
//   decode  Decoder / Codec<T>: reads the payload where it was received, without a copy.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "os/unique_fd.h"
#include "shmtensor/codec.h"
#include "wire/frame.h"

namespace shmtensor::internal {

class Segment;
class StorageImpl;

// One message's working memory on the sending side, from encode to send: what encode
// collected, then the frame built from it. The Encoder takes one from its thread's pool,
// the OutgoingFrame takes it over, and whichever ends the message gives it back
// (recycle): its vectors keep their capacity, so a thread that sends message after
// message allocates nothing for them (docs/benchmarks.md counts it).
struct EncoderState {
  // encode
  std::vector<std::byte> payload;  // the Encoder's bytes while it encodes; then the frame's
  std::vector<std::shared_ptr<StorageImpl>> storages;  // by storage index
  std::vector<UniqueFd> object_fds;
  // What an encoded object (a Queue) counted for this message, to undo if the message is
  // never sent: run by the frame's destructor, or by the Encoder's if no frame was made.
  std::vector<std::function<void()>> undo_if_unsent;
  // frame (finish_frame)
  // The lists below hold plain pointers: `storages` keeps each storage alive, and a
  // shared storage its segment (and so the segment's fd open until the message is sent).
  std::vector<std::byte> tables;             // segment and storage tables
  std::vector<std::uint32_t> storage_segment;  // by storage index: its segment's index
  std::vector<int> fds;                        // in wire order
  std::vector<Segment*> segments;              // distinct, in table order
  std::vector<UniqueFd> owned_fds;             // object dups and the blob
  // file_system segments whose in-flight count was added; dropped if never sent.
  std::vector<Segment*> in_flight;
  // Storages whose block got a count for this message; given back if never sent.
  std::vector<StorageImpl*> in_flight_blocks;
  // The fences the message names (its FenceEntry table, memory/fence.h), by segment.
  struct Fence {
    std::shared_ptr<Segment> segment;  // held until the message is sent (or dropped)
    std::uint64_t offset;
    std::uint64_t value;
  };
  std::vector<Fence> fences;

  EncoderState() = default;
  EncoderState(const EncoderState&) = delete;
  EncoderState& operator=(const EncoderState&) = delete;
  ~EncoderState() {
    for (auto& f : undo_if_unsent) f();
  }
};

struct DecoderState {
  // Keeps alive what `payload` points into: the buffer the datagram was received in, or
  // the blob's mapping. Null when the caller keeps the datagram alive (parse_frame).
  std::shared_ptr<const void> keep;
  std::span<const std::byte> payload;
  std::size_t cursor = 0;
  std::vector<Storage> storages;     // resolved, by storage index
  std::vector<UniqueFd> object_fds;  // taken in order by Decoder::take_fd
  std::size_t next_object_fd = 0;
  // parse_frame's scratch, kept here for its capacity
  std::vector<std::shared_ptr<Segment>> segments;
  std::vector<const Segment*> distinct;
  std::vector<char> proven;
};

// Per-thread pools of message states (a few of each; a state whose buffers grew past
// 64 KiB gives them back to the allocator first). recycle() empties the state (closing its
// fds, dropping its references) without running undo_if_unsent: the caller runs it when
// the message was not sent. A state given back on another thread than it came from joins
// that thread's pool; one given back while its thread exits is freed.
std::unique_ptr<EncoderState> acquire_encoder_state();
void recycle(std::unique_ptr<EncoderState> state) noexcept;
std::unique_ptr<DecoderState> acquire_decoder_state();
void recycle(std::unique_ptr<DecoderState> state) noexcept;

// The wire layer's access to Encoder and Decoder internals (their friend).
struct CodecAccess {
  static EncoderState& state(Encoder& e) noexcept { return *e.state_; }
  static std::unique_ptr<EncoderState> take_state(Encoder& e) noexcept {
    e.state_->payload.swap(e.payload_);
    return std::move(e.state_);
  }
  static std::vector<std::byte>& payload(Encoder& e) noexcept { return e.payload_; }
  static Decoder decoder(std::unique_ptr<DecoderState> state) { return Decoder(std::move(state)); }
  static DecoderState& state(Decoder& d) noexcept { return *d.state_; }
};

// An encoded message ready to send: its header and the encoder's state, which holds the
// datagram's other parts, the fds it borrows (kept open through `storages`) and those it
// owns, and the counts it carries, which the destructor gives back unless the transport
// marked it sent.
struct OutgoingFrame {
  FrameHeader header{};
  // The body (tables, then payload) unless it travels in a blob (kFlagBlob: both empty).
  std::unique_ptr<EncoderState> st;
  bool sent = false;

  // header, tables, payload: one datagram, gathered by sendmsg.
  std::array<std::span<const std::byte>, 3> parts() const noexcept;
  const std::vector<int>& fds() const noexcept { return st->fds; }
  const std::vector<Segment*>& segments() const noexcept { return st->segments; }

  ~OutgoingFrame();
  OutgoingFrame() = default;
  OutgoingFrame(OutgoingFrame&&) = default;
  OutgoingFrame& operator=(OutgoingFrame&&) = delete;
};

// A transport's say in which segment fds a frame leaves out (docs/transport.md, "fds once
// per segment"): asked once per segment whose fds travel (file_descriptor and device) the
// message uses; true leaves its fds out (SegmentEntry::fd_index kFdOmitted). Null: every
// fd is sent.
struct FdElision {
  bool (*omit)(void* context, const Segment& segment);
  void* context;
};

// What a transport has for a segment that a frame names without its fds (kFdOmitted).
struct FetchedSegment {
  // The segment mapped in this process: one it mapped already, or a host segment mapped
  // from the transport's depot. Null when the transport does not have it, or for `fds`.
  std::shared_ptr<Segment> segment;
  // A device segment this process does not map: the memfd and the allocation's fd from
  // the depot, which the parse imports exactly as those that travel in a message (both
  // invalid otherwise).
  UniqueFd meta, memory;
};

// A transport's way to get a segment that a frame names without its fds. `device`: the
// entry is a device segment's (two fds). `keep` (may be null) is given the device segment
// the parse imported from fetched fds, for the transport to keep mapped. A null fetcher:
// such a frame is refused.
struct SegmentFetcher {
  FetchedSegment (*fetch)(void* context, std::uint64_t uid, bool device);
  void* context;
  void (*keep)(void* context, const std::shared_ptr<Segment>& segment) noexcept = nullptr;
};

// The frame stage. Moves every storage the encoder collected into shared memory (with the
// current sharing strategy), then adds the counts the receiver adopts (block in-flight
// counts; file_system segments' refcounts), last, once nothing else can fail. Throws
// SystemError / SharedMemoryFullError (no shared memory), Error (more fds than a message
// carries, or a block carried by 65535 unreceived messages).
OutgoingFrame finish_frame(Encoder&& encoder, const FdElision* elision = nullptr);

// The parse stage. Validates one received datagram and its fds and resolves every storage
// reference (mapping segments not yet mapped, reusing those that are). The Decoder reads
// its payload in place: `keep` must own the datagram's bytes, or be null when the caller
// keeps them alive as long as the Decoder. A segment named without its fds (kFdOmitted)
// must be one `fetcher` has. Throws ProtocolError on any malformed or inconsistent input,
// SystemError when a named segment cannot be opened or mapped, CudaError when a device
// segment cannot be mapped in this process (the message's counts of its blocks are given
// back first); the fds are closed then.
Decoder parse_frame(std::span<const std::byte> datagram, std::vector<UniqueFd> fds,
                    std::shared_ptr<const void> keep = nullptr,
                    const SegmentFetcher* fetcher = nullptr);

// Decoder::read_tensor over raw bytes: one encoded tensor (frame.h) at the start of `bytes`,
// its storage index into `storages`, decoded into `out`. `last_use`: the tensor may take its
// storage handle out of `storages` (a message of one tensor). Sets *used to the bytes it
// took. Throws ProtocolError (`out` is then unspecified).
void read_encoded_tensor(std::span<const std::byte> bytes, std::span<Storage> storages,
                         bool last_use, std::size_t* used, Tensor& out);

// One tensor alone, the commonest message, without the general stages' working state (an
// EncoderState or DecoderState, their vectors, their pools): the frame finish_frame writes
// for a value that is one tensor, on one host segment whose fd it does not carry (a named
// segment, or one deposited with the receiver).
//
// frame_tensor writes that frame into `out` and adds the counts its receiver adopts (the
// TensorFrame gives them back unless mark_sent() was called). False, having counted
// nothing, when `t` is not of that shape (undefined, no elements, on a device, its frame
// larger than `out`) or its segment's fd would have to travel: `deposited` says whether a
// file_descriptor segment is in the receiver's depot. Moves the storage into shared memory
// first, as the frame stage does. Throws what finish_frame throws for it.
class TensorFrame {
 public:
  TensorFrame() = default;
  TensorFrame(const TensorFrame&) = delete;
  TensorFrame& operator=(const TensorFrame&) = delete;
  ~TensorFrame();
  [[nodiscard]] bool frame(const Tensor& t, const FdElision& deposited, std::span<std::byte> out);
  std::span<const std::byte> bytes() const noexcept { return {out_, size_}; }
  void mark_sent() noexcept { sent_ = true; }

 private:
  std::byte* out_ = nullptr;
  std::size_t size_ = 0;
  Segment* counted_segment_ = nullptr;  // whose block (and, named, refcount) was counted
  std::uint32_t counted_block_ = 0;
  bool sent_ = false;
};

// The receiving side: a frame whose header and tables have that shape (one host segment,
// one storage, no fds, no blob) parsed and decoded as a Tensor, into `out`, by parse_frame's
// and read_tensor's own steps in their order, so it takes and refuses exactly what they and
// Decoder::finish do, with the same errors (a payload that is not one tensor is refused so,
// after its storage's count was taken and given back, as there). False, having done
// nothing, for a frame whose header or tables have another shape: the caller parses it in
// full (parse_frame).
bool parse_tensor_frame(std::span<const std::byte> frame, const SegmentFetcher* fetcher,
                        Tensor& out);

}  // namespace shmtensor::internal
