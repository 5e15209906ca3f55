// The transport's stages between the wire layer's frame and parse (wire/wire.h): sending a
// finished frame on a SOCK_SEQPACKET socket, and taking one datagram off it. Connection and
// Queue both go through these. A Queue adds its own steps between them: admission (closed?
// room?) before the frame is made, and freeing the item's place as soon as its datagram
// left the socket, before it is parsed.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "os/unique_fd.h"
#include "shmtensor/codec.h"

namespace shmtensor::internal {

struct OutgoingFrame;

// When a wait gives up; nullopt: never.
using Deadline = std::optional<std::chrono::steady_clock::time_point>;
Deadline deadline_after(std::optional<std::chrono::nanoseconds> timeout);

// The send stage. Sends `frame` as one datagram with its fds, waiting while the socket's
// buffer is full (blocked in the kernel, or in poll until the deadline). Returns false if
// the deadline passed first: nothing was sent, and the frame's destructor gives its counts
// back. On success the receiver owns the frame's counts. Throws SystemError (EPIPE: the
// receiving end is shut down or closed).
// `prefix`: bytes sent ahead of the frame in the same datagram (a queue's marker position).
// `on_full`, when set, runs each time the socket's buffer is found full (a queue drops
// datagrams nobody will take there), and the wait for room is then sliced into 10 ms polls.
bool send_frame(int sock, OutgoingFrame& frame, Deadline deadline,
                std::span<const std::byte> prefix = {}, const std::function<void()>& on_full = {});

enum class RecvStatus { kOk, kEof, kTimeout };
// One datagram taken off a socket, not parsed yet.
struct Datagram {
  RecvStatus status = RecvStatus::kTimeout;
  std::shared_ptr<std::byte[]> buffer;  // kOk: the datagram's `size` bytes
  std::size_t size = 0;
  std::vector<UniqueFd> fds;  // owned, close-on-exec
  // Whether a datagram (or the end of the stream) came before the deadline.
  explicit operator bool() const noexcept { return status != RecvStatus::kTimeout; }
};
// The receive stage: waits until `deadline` for one datagram. Several receivers may wait on
// one socket: a datagram goes to one of them; the others keep waiting. Throws ProtocolError
// when a datagram was taken but its fds (MSG_CTRUNC: names the fd limit) or bytes
// (MSG_TRUNC) were cut, so it is lost; SystemError when the socket failed and nothing was
// taken.
Datagram receive_datagram(int sock, Deadline deadline);
// What a datagram may hold: a frame of up to kMaxInlineFrame bytes (a larger body travels
// in a blob), after a queue's 8-byte marker position.
inline constexpr std::size_t kMaxDatagram = 64 * 1024 + 8;
// The buffer of kMaxDatagram bytes the next message is received in, this thread's: a
// Decoder that reads a payload in place keeps it alive, and a thread reuses it only once
// no Decoder holds it.
std::shared_ptr<std::byte[]> receive_buffer();
// The parse stage (wire/wire.h, parse_frame) over a received datagram: its Decoder reads
// the payload in the datagram's buffer, which it keeps alive.
Decoder parse_datagram(Datagram&& datagram);

}  // namespace shmtensor::internal
