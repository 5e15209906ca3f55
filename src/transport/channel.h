// Sending and receiving whole frames on a SOCK_SEQPACKET socket: shared by Connection and
// Queue.
#pragma once

#include <chrono>
#include <optional>

#include "shmtensor/codec.h"

namespace shmtensor::internal {

// Encodes and sends; blocks while the socket buffer is full (unless nonblocking, then
// returns false without sending).
bool send_value(int sock, Encoder&& encoder, bool nonblocking = false);

enum class RecvStatus { kOk, kEof, kTimeout };
struct Incoming {
  RecvStatus status;
  std::optional<Decoder> decoder;
};
// Waits up to `timeout` (nullopt: forever) for one message. Several receivers may wait on
// one socket: a message goes to one of them; the others keep waiting. If `consumed` is
// given, it is set once a datagram was taken off the socket, so that a caller can tell an
// exception about that message (it is gone) from one about the socket.
Incoming recv_value(int sock, std::optional<std::chrono::nanoseconds> timeout,
                      bool* consumed = nullptr);

}  // namespace shmtensor::internal
