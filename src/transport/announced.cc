#include "transport/announced.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "os/socket.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

namespace {

constexpr std::size_t kMarkerIdBytes = sizeof(std::uint64_t);

std::uint64_t load_u64(const std::byte* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

void wait_for_signallers(const std::atomic<std::uint32_t>& signalling,
                         std::atomic<std::uint32_t>& stuck) noexcept {
  const std::uint32_t floor = stuck.load(std::memory_order_relaxed);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
  std::uint32_t n;
  while ((n = signalling.load(std::memory_order_seq_cst)) > floor &&
         std::chrono::steady_clock::now() < give_up)
    std::this_thread::yield();
  if (n != floor) stuck.store(n, std::memory_order_relaxed);
}

Decoder parse_announced(const AnnouncedPath& p, Datagram&& d) {
  const std::span<const std::byte> frame(d.buffer.get() + kMarkerIdBytes, d.size - kMarkerIdBytes);
  return parse_frame(frame, std::move(d.fds), std::move(d.buffer), p.fetcher);
}

void drop_datagram(const AnnouncedPath& p, Datagram&& d) noexcept {
  if (d.status != RecvStatus::kOk || d.size < kMarkerIdBytes) return;
  try {
    (void)parse_announced(p, std::move(d));
  } catch (...) {
  }
}

namespace {

// One datagram off the socket without waiting; kTimeout when there is none.
Datagram datagram_now(int sock) { return receive_datagram(sock, std::chrono::steady_clock::now()); }

// Whose is the socket's next datagram, which names marker position `id` (nullopt: it is too
// short to name one)? kMine: the marker at `pos`, which this thread holds. kEarlier: a
// marker's that is published and not yet taken, or that a live consumer holds (that
// consumer will take it). kLater: a later marker's (the one at `pos` is missing). kNobody:
// no marker will claim it (its producer died before the marker, the consumer holding the
// marker died, or no producer of this ring sent it). `pos` nullopt: this thread holds none.
// kEarlierFree: an earlier marker's that was given back to the ring (published, held by
// nobody): whoever pops it takes it, so a consumer behind it gives its own back.
enum class HeadOwner { kMine, kEarlier, kEarlierFree, kLater, kNobody };
HeadOwner owner_of(const Ring& ring, std::optional<std::uint64_t> id,
                   std::optional<std::uint64_t> pos) {
  if (!id) return HeadOwner::kNobody;
  if (pos && *id == *pos) return HeadOwner::kMine;
  // The slot word, not the tail hint, says whether a producer claimed the position: a
  // datagram whose position is not claimed (free, or another lap's) is nobody's.
  const Ring::SlotView v = ring.inspect(*id);
  if (v.where == Ring::Where::kGone) return HeadOwner::kNobody;
  if (pos && *id > *pos) return HeadOwner::kLater;
  if (v.where == Ring::Where::kReady) return HeadOwner::kEarlierFree;
  if (v.claimer_alive) return HeadOwner::kEarlier;
  return HeadOwner::kNobody;
}

// The marker position the socket's next datagram names, without taking it (no fds are
// received by a peek without a control buffer). Empty: no datagram (or the end of the
// stream); nullopt inside: a datagram too short to name one. An empty datagram is taken
// and dropped here (recv says 0 for it as at the end of the stream: only taking it tells).
// Called under recv_lock.
std::optional<std::optional<std::uint64_t>> peek_head(int sock) {
  for (;;) {
    std::uint64_t id = 0;
    const std::optional<std::size_t> n = peek_datagram_head(
        sock, std::as_writable_bytes(std::span(&id, 1)), "a message ring's socket");
    if (!n) return std::nullopt;
    if (*n == sizeof id) return std::optional<std::uint64_t>(id);
    if (*n > 0) return std::optional<std::uint64_t>();
    if (datagram_now(sock).status != RecvStatus::kOk) return std::nullopt;
  }
}

// Takes every datagram at the socket's head that no marker will claim, under recv_lock,
// and returns them: the caller drops them after unlocking (parsing one can take long, and
// one may hold a copy of this very queue, whose drop can drain and so take the lock).
// Empty when the lock was not had by `deadline`.
std::vector<Datagram> take_dead_heads(const AnnouncedPath& p, const Deadline& deadline) {
  std::vector<Datagram> dead;
  if (lock_shared(*p.recv_lock, deadline, LockHold::kBrief, p.names->recv_lock) == Locked::kTimeout)
    return dead;
  SharedLockGuard unlock{*p.recv_lock};
  const int sock = p.recv_fd;
  while (auto head = peek_head(sock)) {
    if (owner_of(*p.ring, *head, std::nullopt) != HeadOwner::kNobody) break;
    try {
      Datagram d = datagram_now(sock);
      if (d.status != RecvStatus::kOk) break;
      dead.push_back(std::move(d));
    } catch (const ProtocolError&) {
      // Taken and cut (its fds past this process's fd limit, or larger than any datagram
      // of ours): it was nobody's anyway.
    }
  }
  return dead;
}

}  // namespace

AnnouncedSend send_announced(const AnnouncedPath& p, OutgoingFrame& frame,
                             const Deadline& deadline) {
  // The lock is held for a few syscalls, or while its holder waits for room: a put whose
  // deadline is now (put_nowait) waits a little for it rather than report a full queue.
  Deadline lock_deadline = deadline;
  if (deadline)
    lock_deadline =
        std::max(*deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(20));
  if (lock_shared(*p.send_lock, lock_deadline, LockHold::kLong, p.names->send_lock) ==
      Locked::kTimeout)
    return AnnouncedSend::kTimeout;
  SharedLockGuard unlock{*p.send_lock};
  const Ring::Reservation r = p.ring->reserve(deadline);
  if (r.status == Ring::Status::kTimeout) return AnnouncedSend::kTimeout;
  if (r.status == Ring::Status::kClosed) return AnnouncedSend::kClosed;
  const std::uint64_t id = r.pos;
  bool sent = false;
  try {
    std::function<void()> drop_dead_heads;
    if (p.recv_fd >= 0)
      drop_dead_heads = [&] {
        for (Datagram& d : take_dead_heads(p, deadline)) drop_datagram(p, std::move(d));
      };
    sent =
        send_frame(p.send_fd, frame, deadline, std::as_bytes(std::span(&id, 1)), drop_dead_heads);
  } catch (...) {
    p.ring->cancel(r.pos);
    throw;
  }
  if (!sent) {
    p.ring->cancel(r.pos);
    return AnnouncedSend::kTimeout;
  }
  // The datagram is out: without its marker nobody claims it, and it is dropped.
  if (!p.ring->commit(r.pos, {}, kRingMarkerTag, Ring::Wake::kDeferred))
    throw Error(std::string("a message was lost: this sender's place in the ") + p.names->owner +
                "'s ring was taken from it while it sent the message (it was judged dead, "
                "or another process wrote over the ring)");
  p.ring->wake_consumers(p.wake);
  return AnnouncedSend::kSent;
}

std::optional<Datagram> take_announced(const AnnouncedPath& p, std::uint64_t pos,
                                       const Deadline& deadline) {
  struct Release {  // the marker's slot, released unless it is given back
    Ring& ring;
    std::uint64_t pos;
    bool give_back = false;
    ~Release() {
      if (give_back)
        ring.unread(pos);
      else
        ring.release(pos);
    }
  } release{*p.ring, pos};
  Deadline until = deadline;
  if (until) until = std::max(*until, std::chrono::steady_clock::now() + kAnnouncedGrace);
  auto pause = std::chrono::microseconds(20);
  const int sock = p.recv_fd;
  std::vector<Datagram> dead;
  struct DropDead {  // after the lock is given back, on every path
    std::vector<Datagram>& dead;
    const AnnouncedPath& p;
    ~DropDead() {
      for (Datagram& d : dead) drop_datagram(p, std::move(d));
    }
  } drop_dead{dead, p};
  auto missing = [&] {
    return ProtocolError(std::string("a marker in the ") + p.names->owner + "'s ring at position " +
                         std::to_string(pos) +
                         " announces a datagram the socket does not have (another process "
                         "wrote the marker, or took the datagram)");
  };
  for (;;) {
    // The earlier marker whose consumer this one waits for, when it is held (kEarlier).
    std::optional<std::uint64_t> behind;
    Locked locked;
    try {
      locked = lock_shared(*p.recv_lock, until, LockHold::kBrief, p.names->recv_lock);
    } catch (...) {
      release.give_back = true;  // a wedged lock: the marker stays someone's to take
      throw;
    }
    if (locked != Locked::kTimeout) {
      SharedLockGuard unlock{*p.recv_lock};
      // Fast path: when no marker between the last one whose datagram was taken and ours
      // is held by a consumer or given back to the ring (pending), the socket's next
      // datagram is ours, or one nobody will take: take it without a peek (a syscall
      // less). Otherwise, or when that is far, look first.
      const std::uint64_t below = *p.taken_below;
      bool fast = below <= pos && pos - below <= 64;
      for (std::uint64_t at = below; fast && at < pos; ++at)
        fast = !p.ring->pending(at, kRingMarkerTag);
      std::exception_ptr cut;
      while (fast) {
        Datagram d;
        try {
          d = datagram_now(sock);
        } catch (const ProtocolError&) {
          // Taken and cut (MSG_CTRUNC at the fd limit, MSG_TRUNC): ours or not, the peek
          // path says which (ours still there; or missing: then it was ours, and its error
          // is the one to report).
          cut = std::current_exception();
          break;
        }
        if (d.status != RecvStatus::kOk) throw missing();
        std::optional<std::uint64_t> id;
        if (d.size >= kMarkerIdBytes) id = load_u64(d.buffer.get());
        const HeadOwner owner = owner_of(*p.ring, id, pos);
        if (owner == HeadOwner::kMine) {
          *p.taken_below = std::max(*p.taken_below, pos + 1);
          return d;
        }
        dead.push_back(std::move(d));
        // A later marker's (only if another process took ours, or wrote one): it is lost,
        // and so is ours. Everything up to it is gone from the socket now: the consumers of
        // the markers in between go the slow way and lose nothing more.
        if (owner == HeadOwner::kLater) {
          *p.taken_below = std::max(*p.taken_below, *id + 1);
          throw ProtocolError(std::string("the datagram of the ") + p.names->owner +
                              "'s marker at position " + std::to_string(pos) +
                              " is missing: the socket's next was for " + std::to_string(*id) +
                              " (another process took it)");
        }
        // kEarlier cannot be (no earlier marker is held, unless a peer wrote taken_below):
        // nobody's, dropped.
      }
      for (;;) {
        const auto head = peek_head(sock);
        if (!head && cut) std::rethrow_exception(cut);
        if (!head) throw missing();
        const HeadOwner owner = owner_of(*p.ring, *head, pos);
        if (owner == HeadOwner::kEarlier) {  // its consumer waits for the lock
          behind = **head;
          break;
        }
        if (owner == HeadOwner::kEarlierFree) {
          // Given back by a consumer that gave up: ours goes back too, and the caller's
          // next pop takes the earlier one (the head is on it).
          p.ring->rewind_head(**head);
          release.give_back = true;
          return std::nullopt;
        }
        if (owner == HeadOwner::kLater && cut) std::rethrow_exception(cut);
        if (owner == HeadOwner::kLater)
          throw ProtocolError(std::string("the datagram of the ") + p.names->owner +
                              "'s marker at position " + std::to_string(pos) +
                              " is missing: the socket's next is for " + std::to_string(**head) +
                              " (another process took it)");
        if (owner == HeadOwner::kMine) {
          Datagram d = datagram_now(sock);  // MSG_CTRUNC at the fd limit throws: it is lost
          if (d.status == RecvStatus::kOk) {
            *p.taken_below = std::max(*p.taken_below, pos + 1);
            return d;
          }
          throw ProtocolError(std::string("the datagram of the ") + p.names->owner +
                              "'s marker at position " + std::to_string(pos) +
                              " went while it was being taken");
        }
        try {
          Datagram d = datagram_now(sock);
          if (d.status != RecvStatus::kOk) continue;  // the next peek says what is left
          dead.push_back(std::move(d));
        } catch (const ProtocolError&) {
          // A dead one, taken and cut: nothing of it to give back.
        }
      }
    }
    // An earlier marker's consumer takes its datagram first (or the lock was not had).
    if (until && std::chrono::steady_clock::now() >= *until) {
      release.give_back = true;
      return std::nullopt;
    }
    // A claim of that marker that a peer wrote is reported; ours goes back to the ring.
    if (behind) {
      try {
        p.ring->watch_claim(*behind);
      } catch (...) {
        release.give_back = true;
        throw;
      }
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(5000));
  }
}

}  // namespace shmtensor::internal
