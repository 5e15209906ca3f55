// The library's own door into Connection (connection.h): sending a message encoded ahead
// of time, and receiving one to decode in steps (a Pool task, a DataLoader batch, whose
// type the first field tells). src/process, src/data. Internal.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "shmtensor/connection.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/fd_counts.h"

namespace shmtensor::internal {

struct SHMTENSOR_API ConnectionAccess {
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
  // Every fd the connection owns in this process (to close them in a forked child that
  // must not hold it).
  [[nodiscard]] static std::vector<int> fds(const Connection& c);
  // A connected pair whose messages all travel on the socket (adopt() of both ends): for a
  // peer that receives its end as a bare inherited fd (an exec'd child's arguments).
  [[nodiscard]] static std::pair<Connection, Connection> socket_pair();
  // For a waiter that sleeps in poll() on several connections (a worker group): the fd to
  // poll for this one (for an end made by pipe(), its epoll fd), which is signalled for
  // messages sent from now until end_wait() (and readable at once if one is there), without
  // every later send to this end paying for a signal as after native_handle(). Throws
  // SystemError when no fd can be made.
  [[nodiscard]] static int begin_wait(Connection& c);
  static void end_wait(Connection& c) noexcept;
  // Whether a message waits on this end, without a syscall (src/transport/connection_peek.cc):
  // a published slot in its incoming ring. Always true for a socket-only end (only a receive
  // sees a datagram) and false for a closed one. A peer that hung up is not a message: a
  // caller that must see the end of the stream receives (or polls) too.
  [[nodiscard]] static bool has_message(const Connection& c) noexcept;
  // Spins (loads and pauses, no syscall, no store to shared memory) until the ring of one of
  // `ends` holds a published message, or `until` passes: the index of the first found, or
  // nullopt. Null, closed and socket-only ends are never found (poll() sees a datagram).
  [[nodiscard]] static std::optional<std::size_t> spin_for_message(
      std::span<Connection* const> ends, std::chrono::steady_clock::time_point until) noexcept;
  [[nodiscard]] static Connection wrap(std::unique_ptr<ConnectionCore> core) noexcept;
  // Segment fds this end put in messages, and left out of them (the segment was deposited
  // with the peer: fds once per segment), since it was made here (fd_counts.h).
  using FdCounts = internal::FdCounts;
  [[nodiscard]] static FdCounts fd_counts(const Connection& c) noexcept;
};

}  // namespace shmtensor::internal
