// The wire layer's internal entry points: Encoder → OutgoingFrame, datagram → Decoder.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "shmtensor/codec.h"
#include "wire/frame.h"

namespace shmtensor::internal {

// The storage index of an encoded tensor with no elements, which needs no shared memory
// (docs/wire_format.md).
inline constexpr std::uint32_t kEmptyTensor = 0xfffffffeu;

// Turns an encoder's collected bytes, storages and fds into a frame to send. Adds the
// in-flight counts of file_system segments (given back if the frame is never sent).
OutgoingFrame finish_frame(Encoder&& encoder);

// Sends a frame on a SOCK_SEQPACKET socket. Returns false if nonblocking and full.
bool send_frame(int sock, OutgoingFrame& frame, bool nonblocking = false);

// Validates one received datagram and its fds and resolves every storage reference
// (mapping segments not yet mapped, reusing those that are). Throws ProtocolError on any
// malformed or inconsistent input; the fds are closed and nothing is kept then.
Decoder parse_frame(std::span<const std::byte> datagram, std::vector<UniqueFd> fds);

struct EncoderState {
  std::vector<std::shared_ptr<StorageImpl>> storages;
  std::vector<std::shared_ptr<Segment>> segments;
  std::vector<UniqueFd> object_fds;
  // What an encoded object (a Queue) counted for this message, to undo if the message is
  // never sent: run by the frame's destructor, or here if no frame was made.
  std::vector<std::function<void()>> undo_if_unsent;
  EncoderState() = default;
  EncoderState(const EncoderState&) = delete;
  EncoderState& operator=(const EncoderState&) = delete;
  ~EncoderState() {
    for (auto& f : undo_if_unsent) f();
  }
};

struct DecoderState {
  std::vector<std::byte> body;         // owned copy (inline) ...
  std::span<const std::byte> payload;  // ... view of the payload inside body or the blob
  std::shared_ptr<void> blob;          // keeps a blob mapping alive while decoding
  std::size_t cursor = 0;
  std::vector<Storage> storages;     // resolved, by storage index
  std::vector<UniqueFd> object_fds;  // taken in order by Decoder::take_fd
  std::size_t next_object_fd = 0;
};

}  // namespace shmtensor::internal
