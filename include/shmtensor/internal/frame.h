// A message as bytes and fds, to carry inside another channel's message: the Python module
// puts block references, Queues and Connections into ordinary pickles this way
// (python/src/transport_bindings.cc; docs/python.md). Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"

namespace shmtensor::internal {

struct OutgoingFrame;  // src/wire/wire.h

// A message made into bytes (the frame header and the inline body, or the header alone
// when the body travels in a blob) and the fds it needs. Making it frames the message
// (docs/architecture.md, "frame": the storages move into shared memory and the counts the
// message carries are taken); the fds are borrowed and stay open while it lives. Until
// mark_sent(), destroying it gives the counts back. Throws what framing throws
// (SystemError, SharedMemoryFullError). Not thread-safe.
class SHMTENSOR_API MessageFrame {
 public:
  explicit MessageFrame(Encoder&& message);
  MessageFrame(MessageFrame&&) noexcept;
  MessageFrame& operator=(MessageFrame&&) noexcept;
  ~MessageFrame();

  const std::string& bytes() const noexcept { return bytes_; }
  const std::vector<int>& fds() const noexcept;
  // By fd: the uid of the segment whose memfd it is (a file_descriptor or a device
  // segment), 0 for any other fd (a device segment's allocation, a Queue's or Connection's,
  // the blob).
  const std::vector<std::uint64_t>& fd_uids() const noexcept { return fd_uids_; }
  // The receiver owns the counts from now on, whether or not it ever parses the message.
  void mark_sent() noexcept;

 private:
  std::unique_ptr<OutgoingFrame> frame_;
  std::string bytes_;
  std::vector<std::uint64_t> fd_uids_;
};

// Parses the bytes and fds of a MessageFrame made in this or another process, and
// validates them as any received message (ProtocolError, SystemError). Owns `fds` from the
// call on: they are closed, or kept by the Decoder, whatever happens.
[[nodiscard]] SHMTENSOR_API Decoder parse_message_frame(std::span<const std::byte> bytes,
                                                        std::span<const int> fds);

}  // namespace shmtensor::internal
