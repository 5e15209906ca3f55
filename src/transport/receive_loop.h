// The receive loop of a channel on a message ring (Queue, Connection; a Broadcast reader
// receives through its Queue): take the next message off the ring, receive it (its frame
// is in the slot, or it is a marker whose datagram Endpoint::receive takes from the
// socket), and take another when the marker had to be given back. How each waits for the
// ring (busy polling first: poll_then_wait, transport/busy_poll.h) is the caller's pop.
#pragma once

#include <utility>

#include "transport/announced.h"

namespace shmtensor::internal {

// pop(): the next message taken off the ring, waiting until `deadline`; false (as a
// condition) when the deadline passed first; it throws when the channel is closed and
// empty. receive(taken): what the message makes; false (as a condition) when it was a
// marker given back to the ring, its datagram being behind one that another consumer holds
// (announced.h, take_announced); then the loop pops again while pop_again_after_give_back
// allows. Returns receive's result, or its type's empty value (nullopt, false) when the
// deadline passed first. Always inlined, as poll_then_wait.
template <class Pop, class Receive>
[[gnu::always_inline]] inline auto receive_retrying(const Deadline& deadline, Pop&& pop,
                                                   Receive&& receive) {
  using Result = decltype(receive(pop()));
  for (;;) {
    auto taken = pop();
    if (!taken) return Result{};
    if (Result got = receive(std::move(taken))) return got;
    if (!pop_again_after_give_back(deadline)) return Result{};
  }
}

}  // namespace shmtensor::internal
