// fds once per segment (docs/transport.md): a depot. The first sender of an arena segment
// whose fds travel (file_descriptor: its memfd; device: its memfd and its allocation's fd)
// on a channel deposits them, once: a datagram [uid] with the fds, sent on a socket whose
// receive queue nobody takes from (a queue's sending end; a connection's depot socket
// pair). Later messages name the segment without its fds (fd_index -2, wire_format.md). A
// receiver that does not map it peeks through that receive queue (MSG_PEEK with
// SO_PEEK_OFF: nothing is taken, so a process killed meanwhile loses nothing) and maps it
// from there (a device segment: the parse imports its fds). The deposited fds live as long
// as the socket: a sender may exit right after sending, and a process that joins later
// finds every segment there.
// Queue and Connection both keep a DepotTable in their shared memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "shmtensor/internal/fd_counts.h"
#include "transport/depot_table.h"
#include "wire/wire.h"

namespace shmtensor::internal {

class Segment;

void init_depot(DepotTable* t);
// Arena segments, host (file_descriptor) or device, are deposited by every sender: they
// hold many blocks and live as long as their arena. A dedicated host segment (one large
// tensor) would stay alive with the channel: only a sender given an allowance for them
// deposits one (DedicatedDeposits: a Broadcast's writer). A receiver fetches either kind.
bool depositable(const Segment& seg) noexcept;
bool is_dedicated_host(const Segment& seg) noexcept;
// How many dedicated host segments, and bytes of them, one sender may still deposit in one
// depot, and the entries it claimed for those it did: only those entries are trusted for a
// dedicated segment (one a peer wrote, naming a segment past the allowance as deposited or
// as a failed deposit to try again, would keep its memory with the channel). Used from one
// thread at a time (a Broadcast's put).
struct DedicatedDeposits {
  int segments = 0;
  std::size_t bytes = 0;
  std::uint64_t claimed[kDepotSegments] = {};  // by entry: the uid this sender claimed it for
};
// A sender's FdElision::omit: true once `seg` is deposited. The first sender of a segment
// claims its entry and deposits it on `deposit_sock`; the message that made it do so still
// carries the fd (so does every message while a deposit fails: a full socket buffer, too
// many fds in flight). A dedicated host segment is claimed only within `dedicated` (null:
// none), which a claim spends, and deposited or left out only through an entry it claimed.
bool depot_omit(DepotTable* t, int deposit_sock, const Segment& seg,
                DedicatedDeposits* dedicated = nullptr);
// Whether `uid` has an entry (deposited or being deposited).
bool depot_names(DepotTable* t, std::uint64_t uid) noexcept;
// Whether `seg` is deposited (its fd is in the depot): depot_omit's answer for a segment
// deposited before, without its side effect (a first sender deposits); arena segments only
// (a Connection's one-tensor send asks it, and deposits no dedicated segment).
bool depot_has(DepotTable* t, const Segment& seg) noexcept;
// A receiver's fetch of a segment named without its fds: only one deposited here. Mapped
// in this process already: that one; else from `peek_sock`'s receive queue, a host segment
// mapped, a device segment (`device`) as its two fds, which the parse imports and
// validates (wire.h, FetchedSegment). Empty when the depot does not have it. Throws
// ProtocolError (its fds were cut: the open-file limit; a deposit of another kind of
// segment), SystemError.
FetchedSegment depot_fetch(DepotTable* t, int peek_sock, std::uint64_t uid, bool device);

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

// A channel handle's side of the depot (a Queue handle's; a Connection end's): the table and
// socket it deposits with when it sends, the table and socket it fetches from when it
// receives, the segments it keeps pinned, and its counts. bind() once the channel's shared
// memory and sockets exist; the tables and fds must outlive this object. A null table: this
// side does not send (or receive) there. The one place the sending and receiving steps of
// the depot are written; each Endpoint (endpoint.h) holds one.
class DepotSide {
 public:
  void bind(DepotTable* send_table, int deposit_sock, DepotTable* recv_table,
            int peek_sock) noexcept {
    send_table_ = send_table;
    deposit_sock_ = deposit_sock;
    recv_table_ = recv_table;
    peek_sock_ = peek_sock;
  }
  // For the frame stage of a send: leaves out the fds of segments deposited (depot_omit).
  [[nodiscard]] FdElision elision() noexcept { return {omit_fd, this}; }
  // For parsing a receive: a segment named without its fds, from the depot, pinned (a device
  // segment once the parse imported it).
  [[nodiscard]] SegmentFetcher fetcher() noexcept { return {fetch_deposited, this, keep_imported}; }
  // After a received message with fds was parsed: pins the deposited segments it named, so
  // that later messages naming them need no look into the depot.
  void pin_received(Decoder& d) noexcept;
  // Lets this side deposit dedicated host segments too, up to `allowance` (a Broadcast's
  // writer, for its readers' queues: docs/transport.md, "Broadcast"). Before any send.
  void allow_dedicated(DedicatedDeposits allowance) noexcept {
    dedicated_ = allowance;
    dedicated_allowed_ = true;
  }
  // Whether `seg` is deposited for the peer (depot_has), without depositing it.
  [[nodiscard]] bool deposited(const Segment& seg) const noexcept {
    return send_table_ != nullptr && depot_has(send_table_, seg);
  }
  // A send that left a segment's fd out by itself (a one-tensor frame that checked
  // deposited()).
  void count_omitted() noexcept { fds_omitted_.fetch_add(1, std::memory_order_relaxed); }
  [[nodiscard]] FdCounts counts() const noexcept {
    return {fds_sent_.load(std::memory_order_relaxed),
            fds_omitted_.load(std::memory_order_relaxed)};
  }

 private:
  static bool omit_fd(void* context, const Segment& seg);
  static FetchedSegment fetch_deposited(void* context, std::uint64_t uid, bool device);
  static void keep_imported(void* context, const std::shared_ptr<Segment>& seg) noexcept;

  DepotTable* send_table_ = nullptr;
  int deposit_sock_ = -1;
  DepotTable* recv_table_ = nullptr;
  int peek_sock_ = -1;
  DepotPins pins_;
  DedicatedDeposits dedicated_;
  bool dedicated_allowed_ = false;
  std::atomic<std::uint64_t> fds_sent_{0};     // segment fds in messages (two per device one)
  std::atomic<std::uint64_t> fds_omitted_{0};  // left out of them (deposited)
};

}  // namespace shmtensor::internal
