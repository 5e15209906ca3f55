// The transport's stages between the wire layer's frame and parse (wire/wire.h): sending
// a finished frame on a SOCK_SEQPACKET socket, and receiving one datagram into a Decoder.
// Connection and Queue both go through these; a Queue decides admission (closed? room?)
// before its frame is made.
#pragma once

#include <chrono>
#include <optional>

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
bool send_frame(int sock, OutgoingFrame& frame, Deadline deadline);

enum class RecvStatus { kOk, kEof, kTimeout };
struct Incoming {
  RecvStatus status;
  std::optional<Decoder> decoder;  // kOk: the message, parsed, to decode
};
// The receive stage, then parse: waits until `deadline` for one datagram and parses it
// (parse_frame). Several receivers may wait on one socket: a datagram goes to one of them;
// the others keep waiting. If `consumed` is given, it is set once a datagram was taken
// off the socket, so that a caller can tell an exception about that message (it is gone)
// from one about the socket.
Incoming receive_frame(int sock, Deadline deadline, bool* consumed = nullptr);

}  // namespace shmtensor::internal
