// The library's own door into Connection (connection.h): sending a message encoded ahead
// of time, and receiving one to decode in steps (a Pool task, a DataLoader batch, whose
// type the first field tells). src/process, src/data. Internal.
#pragma once

#include <chrono>
#include <optional>
#include <utility>

#include "shmtensor/connection.h"

namespace shmtensor::internal {

struct ConnectionAccess {
  // As Connection::send / try_send / recv / try_recv, for an Encoder or a Decoder.
  static void send(Connection& c, Encoder&& message) { c.send_encoded(std::move(message)); }
  [[nodiscard]] static bool try_send(Connection& c, Encoder&& message) {
    return c.try_send_encoded(std::move(message));
  }
  // nullopt: wait without limit; a timeout that expires throws Error.
  [[nodiscard]] static Decoder recv(Connection& c,
                                    std::optional<std::chrono::nanoseconds> timeout) {
    return c.recv_encoded(timeout);
  }
  [[nodiscard]] static std::optional<Decoder> try_recv(Connection& c,
                                                       std::chrono::nanoseconds timeout) {
    return c.try_recv_encoded(timeout);
  }
};

}  // namespace shmtensor::internal
