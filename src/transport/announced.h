// The datagram path of a message ring, shared by Queue and Connection: a message that
// carries fds (or does not fit a slot) is a datagram on a SOCK_SEQPACKET socket, and a
// marker slot in the ring keeps its place in the order (docs/transport.md, "Items with
// fds"). A datagram is the position of its marker (8 bytes), then the frame.
//
// Senders send under send_lock, in the order of their markers: reserve the marker's
// position, send, publish the marker. A receiver that took a marker (the ring keeps its
// slot claimed in the receiver's name) takes, under recv_lock, the datagram of that
// position, which is the socket's next one once every earlier marker's datagram was taken.
// Earlier ones that no marker will claim (their sender died between the send and the
// marker, or the receiver that took the marker died) are dropped, which gives back the
// counts they carry.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

#include "os/shared_lock.h"
#include "transport/channel.h"
#include "transport/ring.h"
#include "wire/wire.h"

namespace shmtensor::internal {

// Tags of ring slots: the message's frame is in the slot, or the message is a datagram.
inline constexpr std::uint32_t kRingMessageTag = 1;
inline constexpr std::uint32_t kRingMarkerTag = 2;

// A channel's names in errors ("the queue's ring", "the connection's receive lock").
struct ChannelNames {
  const char* owner;
  const char* send_lock;
  const char* recv_lock;
};
inline constexpr ChannelNames kQueueNames{"queue", "the queue's send lock",
                                          "the queue's receive lock"};
inline constexpr ChannelNames kConnectionNames{"connection", "the connection's send lock",
                                               "the connection's receive lock"};

// One direction of datagrams announced in a ring, as this process sees it. The locks and
// `taken_below` live in shared memory that every process using the path maps.
struct AnnouncedPath {
  Ring* ring = nullptr;
  int send_fd = -1;  // where this process sends datagrams (-1: it sends none here)
  int recv_fd = -1;  // where it takes them (-1: it takes none here)
  // send_lock is held while a sender waits for room (LockHold::kLong); recv_lock for a
  // few system calls (kBrief).
  SharedLock* send_lock = nullptr;
  SharedLock* recv_lock = nullptr;
  // Under recv_lock: no datagram of a marker below this position is in the socket any more
  // (a hint for the fast path of take_announced; a peer that writes a wrong value here can
  // make receivers drop messages, never crash or hang them).
  std::uint64_t* taken_below = nullptr;
  // For frames that name segments without their fds (a queue's depot); may be null.
  const SegmentFetcher* fetcher = nullptr;
  const ChannelNames* names = &kQueueNames;
  // How many consumers asleep on the ring a marker's publish wakes: a queue's one (every
  // consumer takes items); a connection's all (its sleepers include poll() callers, which
  // take nothing: woken alone, one would leave a receiver asleep).
  int wake = 1;
};

// Sends `frame` as a datagram announced by a marker: the marker's position reserved, then
// [position][frame] sent, then the marker published, all under send_lock. kTimeout when the
// deadline passed first (nothing was sent; a reserved position is given up); kClosed when
// the ring is closed. Throws SystemError (EPIPE: the receiving end is gone). While the
// socket is full, datagrams at its head that nobody will take are dropped (when this
// process also receives there: receivers stop at this sender's reserved marker, so only
// it can make that room).
enum class AnnouncedSend { kSent, kTimeout, kClosed };
AnnouncedSend send_announced(const AnnouncedPath& path, OutgoingFrame& frame,
                             const Deadline& deadline);
// The datagram of the marker at `pos`, which this thread took (its slot stays claimed in
// our name until the datagram is taken; then, or on an error, it is released). It is the
// socket's next once every earlier marker's datagram was taken: while a live consumer
// holds an earlier marker (it may be stopped), this waits, until `deadline`; then the
// marker is given back to the ring (Ring::unread: the next pop takes it again) and the
// result is empty. It is given back at once, also empty, when the earlier marker was itself
// given back (nobody holds it): the caller pops again while its deadline allows, and that
// pop takes the earlier one. A deadline that has passed gets kAnnouncedGrace all the same,
// as a non-blocking get must find an item whose datagram another consumer is taking now.
// Throws ProtocolError when the socket does not have it (a marker another process wrote,
// or a datagram another process took), and for a receive lock held by a wedged process
// (os/shared_lock.h). Datagrams before it that nobody will take are dropped.
inline constexpr auto kAnnouncedGrace = std::chrono::milliseconds(20);
// After take_announced gave its marker back: whether the receive pops again (its deadline,
// and the grace a marker gets, have not passed; always when it has no deadline).
inline bool pop_again_after_give_back(const Deadline& deadline) {
  return !deadline || std::chrono::steady_clock::now() < *deadline + kAnnouncedGrace;
}
std::optional<Datagram> take_announced(const AnnouncedPath& path, std::uint64_t pos,
                                       const Deadline& deadline);
// The frame of a datagram take_announced returned, parsed.
Decoder parse_announced(const AnnouncedPath& path, Datagram&& d);
// A datagram no marker will claim: parsed and dropped, so that the counts it carries go
// back (a malformed one has none to give back).
void drop_datagram(const AnnouncedPath& path, Datagram&& d) noexcept;

// Readiness fds (Queue, Connection): a receiver about to clear one waits first for senders
// counted in `signalling` (between their publish and their signal), or a late signal would
// leave it readable with nothing there. At most 1 ms: a sender killed while counted never
// leaves, so a count that outlasts the wait is remembered in `stuck` (this process's) and
// not waited for again; a count below it lowers it.
void wait_for_signallers(const std::atomic<std::uint32_t>& signalling,
                         std::atomic<std::uint32_t>& stuck) noexcept;

}  // namespace shmtensor::internal
