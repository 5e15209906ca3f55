// One direction of a channel, as one handle of one process sees it (docs/transport.md):
// the message ring, the datagram path of the messages that carry fds or do not fit a slot
// (announced.h), the depot that sends each segment's fd once (depot.h), and the readiness
// eventfd that poll() callers wait on. A Queue handle holds one, which it both sends and
// receives on; a Connection end holds two: `out`, which it sends on (its readiness fd is the
// peer's), and `in`, which it receives from.
//
// The words these share with the other processes (locks, hints, counts) live in the
// channel's control block (queue_control.h; link_control.h, one per direction):
// EndpointWords points at them. What a channel adds around an endpoint — a queue's places
// and holders, a connection's hang-up checks — stays with the channel.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>

#include "os/shared_lock.h"
#include "os/unique_fd.h"
#include "transport/announced.h"
#include "transport/channel.h"
#include "transport/depot.h"
#include "transport/ring.h"
#include "wire/wire.h"

namespace shmtensor::internal {

// The channel's words in shared memory that one direction uses.
struct EndpointWords {
  SharedLock* send_lock = nullptr;  // the datagram path's (announced.h)
  SharedLock* recv_lock = nullptr;
  std::uint64_t* taken_below = nullptr;
  // How many want the readiness fd signalled; while it is not 0, every publish signals it.
  std::atomic<std::uint32_t>* readiness_wanted = nullptr;
  // Senders between a publish and its signal (wait_for_signallers, announced.h).
  std::atomic<std::uint32_t>* signalling = nullptr;
  // A queue's closed flag: readable for good once set. Null for a connection.
  const std::atomic<std::uint32_t>* closed = nullptr;
  DepotTable* send_depot = nullptr;  // the table this end deposits with (null: sends none)
  DepotTable* recv_depot = nullptr;  // the table it fetches from (null: receives none)
};

// Where this end sends and takes datagrams and deposits: fds the channel owns (-1: none).
struct EndpointSockets {
  int send = -1;     // datagrams out
  int recv = -1;     // datagrams in
  int deposit = -1;  // deposits for the receivers (depot.h)
  int peek = -1;     // the receive queue deposits are peeked from
};

class Endpoint {
 public:
  Endpoint() = default;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Once, when the channel's shared memory and fds exist; `ring` and `ready_fd` become this
  // endpoint's, the words and sockets must outlive it. `wake`: how many consumers asleep on
  // the ring a marker's publish wakes (AnnouncedPath::wake).
  void bind(Ring ring, UniqueFd ready_fd, const EndpointWords& words,
            const EndpointSockets& sockets, const ChannelNames& names, int wake) noexcept;

  [[nodiscard]] Ring& ring() noexcept { return ring_; }
  [[nodiscard]] const Ring& ring() const noexcept { return ring_; }
  [[nodiscard]] int ready_fd() const noexcept { return ready_fd_.get(); }
  [[nodiscard]] DepotSide& depot() noexcept { return depot_; }
  [[nodiscard]] const DepotSide& depot() const noexcept { return depot_; }
  [[nodiscard]] const ChannelNames& names() const noexcept { return *names_; }
  // The datagram path, with this end's depot fetcher (which must outlive the path).
  [[nodiscard]] AnnouncedPath path(const SegmentFetcher* fetcher) noexcept;

  // ---- Sending ----
  // The message framed for this channel: the fds of segments in the receivers' depot left
  // out (depot.h).
  [[nodiscard]] OutgoingFrame frame(Encoder&& encoder);
  // Whether `frame` travels in a slot (no fds, and it fits) rather than as a datagram.
  [[nodiscard]] bool fits_slot(const OutgoingFrame& frame) const noexcept;
  // A frame that fits a slot, published; the consumers asleep are woken later
  // (Ring::wake_consumers). kTimeout when the deadline passed first; kClosed: the ring was.
  Ring::Status push(std::span<const std::span<const std::byte>> parts, const Deadline& deadline) {
    return ring_.push_parts(parts, kRingMessageTag, deadline, Ring::Wake::kDeferred);
  }
  // A frame as a datagram announced by a marker (send_announced); the marker wakes `wake`.
  AnnouncedSend send_datagram(OutgoingFrame& frame, const Deadline& deadline);
  // After a publish: signals the readiness fd when a reader asked for it. The publish (a
  // seq_cst read-modify-write) comes before this load; a reader's count (want(), a seq_cst
  // read-modify-write) and rearm()'s drain come before a full fence and its look at the
  // ring: either the sender sees the count, or the reader the message.
  void notify() noexcept {
    if (words_.readiness_wanted->load(std::memory_order_seq_cst) != 0) signal_ready();
  }
  // Counts a sender from before its publish (which may come while it waits for room) to
  // its signal, while a reader wants the readiness fd; rearm() waits for those counted.
  class Signalling {
   public:
    Signalling() = default;
    explicit Signalling(Endpoint& e) noexcept { begin(e); }
    ~Signalling() { end(); }
    Signalling(const Signalling&) = delete;
    Signalling& operator=(const Signalling&) = delete;
    // Counted (again) from now, if a reader wants the fd and this is not counted yet.
    void begin(Endpoint& e) noexcept {
      if (counted_ != nullptr) return;
      if (e.words_.readiness_wanted->load(std::memory_order_seq_cst) == 0) return;
      counted_ = e.words_.signalling;
      counted_->fetch_add(1, std::memory_order_seq_cst);
    }
    void end() noexcept {
      if (counted_ == nullptr) return;
      counted_->fetch_sub(1, std::memory_order_seq_cst);
      counted_ = nullptr;
    }

   private:
    std::atomic<std::uint32_t>* counted_ = nullptr;
  };

  // ---- Receiving ----
  // A slot taken off the ring (`p`, its bytes at `data` in `buffer`), parsed: the frame in
  // the slot, or the datagram its marker announces. Empty when that datagram is behind one
  // another receiver holds past `deadline` (take_announced): the marker is back in the ring,
  // and the readiness fd says so again. Throws ProtocolError for a slot of another tag.
  std::optional<Decoder> receive(std::shared_ptr<std::byte[]> buffer, std::byte* data,
                                 const Ring::Popped& p, const Deadline& deadline);
  // After a receive: the readiness fd stays readable while the ring may hold a message (or
  // a queue is closed), and is cleared otherwise — then the ring is looked at again, so a
  // message published in between signals (by its sender, or here). Senders still to signal
  // a message taken are waited for first (wait_for_signallers: at most ~1 ms).
  void rearm() noexcept {
    if (words_.readiness_wanted->load(std::memory_order_seq_cst) != 0) rearm_wanted();
  }
  // One more reader of the readiness fd (for good, or until unwant()); the fd is then made
  // to say what is there now. The count comes before the look at the ring (both seq_cst),
  // and a sender's publish before its look at the count: it signals, or we see its message.
  void want() noexcept;
  void unwant() noexcept;
  // Whether the ring holds a message or the queue is closed, now. When not, a readiness fd
  // left readable by a sender that signalled after rearm() stopped waiting for it (over
  // ~1 ms late: a sender descheduled between its publish and its signal) is cleared, so
  // that a poll() that believed it does not hand a get() an empty queue.
  bool ready_now() noexcept {
    if (readable_now()) return true;
    rearm();
    return readable_now();
  }

 private:
  [[nodiscard]] bool readable_now() const noexcept;
  void rearm_wanted() noexcept;
  void signal_ready() noexcept;

  Ring ring_;
  UniqueFd ready_fd_;
  EndpointWords words_;
  EndpointSockets sockets_;
  const ChannelNames* names_ = nullptr;
  int wake_ = 1;
  DepotSide depot_;
  // wait_for_signallers' memory of a count left by senders that died (announced.h).
  std::atomic<std::uint32_t> stuck_signalling_{0};
};

// What a sender owes one endpoint's receivers for the items it published there and has not
// signalled yet: a wake of the consumers asleep on the ring for those in slots, and the
// readiness fd (a consumer may wait in poll() on it rather than in the ring).
struct OwedWake {
  Endpoint* endpoint = nullptr;
  int unwoken = 0;           // items published in ring slots since the last pay()
  bool unsignalled = false;  // items published since the last pay()
  Endpoint::Signalling signalling;
  // Before each publish: counted from before the first one not signalled yet.
  void before_publish() noexcept { signalling.begin(*endpoint); }
  void pay() noexcept {
    if (endpoint == nullptr) return;
    endpoint->ring().wake_consumers(unwoken);
    unwoken = 0;
    if (unsignalled) endpoint->notify();
    unsignalled = false;
    signalling.end();
  }
};

// Wakes owed to the receivers of several endpoints (QueueCore::put_many's `defer`): a
// sender that publishes to each of them first and wakes them all after (a Broadcast's
// put), so that a receiver polling gets its item without waiting for the others' wakes.
// A put that must wait (for room, a slot, a lock) pays every wake owed first: no receiver
// is left asleep while its sender waits. The destructor pays what is left.
class DeferredWakes {
 public:
  explicit DeferredWakes(std::size_t endpoints)
      : owed_(new OwedWake[endpoints]), capacity_(endpoints) {}
  ~DeferredWakes() { pay(); }
  DeferredWakes(const DeferredWakes&) = delete;
  DeferredWakes& operator=(const DeferredWakes&) = delete;
  // The wake owed to `e`'s receivers, kept until pay(). Throws std::length_error past the
  // number of endpoints given at construction.
  OwedWake& owe(Endpoint& e) {
    for (std::size_t i = 0; i < used_; ++i)
      if (owed_[i].endpoint == &e) return owed_[i];
    if (used_ == capacity_) throw std::length_error("DeferredWakes: more endpoints than made for");
    owed_[used_].endpoint = &e;
    return owed_[used_++];
  }
  void pay() noexcept {
    for (std::size_t i = 0; i < used_; ++i) owed_[i].pay();
  }

 private:
  std::unique_ptr<OwedWake[]> owed_;
  std::size_t capacity_;
  std::size_t used_ = 0;
};

}  // namespace shmtensor::internal
