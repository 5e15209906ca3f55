// fds once per segment (docs/transport.md): a depot. The first sender of a
// file_descriptor arena segment on a channel deposits its fd, once: a datagram [uid] with
// the fd, sent on a socket whose receive queue nobody takes from (a queue's sending end; a
// connection's depot socket pair). Later messages name the segment without its fd
// (fd_index -2, wire_format.md). A receiver that does not map it peeks through that receive
// queue (MSG_PEEK with SO_PEEK_OFF: nothing is taken, so a process killed meanwhile loses
// nothing) and maps it from there. The deposited fds live as long as the socket: a sender may
// exit right after sending, and a process that joins later finds every segment there.
// Queue and Connection both keep a DepotTable in their shared memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "transport/depot_table.h"

namespace shmtensor::internal {

class Segment;

void init_depot(DepotTable* t);
// Only arena segments are deposited: they hold many blocks and live as long as their
// arena. A dedicated segment (one large tensor) would stay alive with the channel.
bool depositable(const Segment& seg) noexcept;
// A sender's FdElision::omit: true once `seg` is deposited. The first sender of a segment
// claims its entry and deposits it on `deposit_sock`; the message that made it do so still
// carries the fd (so does every message while a deposit fails: a full socket buffer, too
// many fds in flight).
bool depot_omit(DepotTable* t, int deposit_sock, const Segment& seg);
// Whether `uid` has an entry (deposited or being deposited).
bool depot_names(DepotTable* t, std::uint64_t uid) noexcept;
// Whether `seg` is deposited (its fd is in the depot): depot_omit's answer for a segment
// deposited before, without its side effect (a first sender deposits).
bool depot_has(DepotTable* t, const Segment& seg) noexcept;
// A receiver's fetch of a segment named without its fd: only one deposited here. Mapped
// in this process already: that one; else mapped from `peek_sock`'s receive queue. Null
// when the depot does not have it. Throws ProtocolError (its fd was cut: the open-file
// limit; a deposit of another kind of segment), SystemError.
std::shared_ptr<Segment> depot_fetch(DepotTable* t, int peek_sock, std::uint64_t uid);

// Keeps up to kDepotSegments segments mapped in this process while a channel's handle
// lives, so that a receiver looks in the depot once per segment. Lock-free: a forked child
// can inherit it at any instant (a slot half-written by another thread is never released).
class DepotPins {
 public:
  DepotPins() = default;
  DepotPins(const DepotPins&) = delete;
  DepotPins& operator=(const DepotPins&) = delete;
  ~DepotPins();
  void pin(const std::shared_ptr<Segment>& seg) noexcept;
  // The segment pinned with this uid, or null: a lookup without locks, for a receiver
  // whose later messages name a segment it fetched before.
  std::shared_ptr<Segment> find(std::uint64_t uid) const noexcept;

 private:
  using Ptr = std::shared_ptr<Segment>;
  std::atomic<std::uint64_t> uids_[kDepotSegments] = {};
  std::atomic<bool> ready_[kDepotSegments] = {};
  // Constructed by the pin that claimed the slot; destroyed only when `ready`.
  alignas(Ptr) std::byte slots_[kDepotSegments][sizeof(Ptr)];
};

}  // namespace shmtensor::internal
