// The receive side of a Connection end made by pipe() (connection_core.h): the next slot
// of the incoming ring, waited for in slices that look at the socket (did the peer hang
// up?), or with no time limit while a watch of the socket's hang-up (hangup_watch.h) will
// kick the sleep; then parsed by the incoming Endpoint. And an adopted socket's receive.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <span>
#include <utility>

#include "os/proc.h"
#include "shmtensor/connection.h"
#include "shmtensor/tensor.h"
#include "transport/busy_poll.h"
#include "transport/connection_core.h"
#include "transport/hangup_watch.h"
#include "transport/receive_loop.h"
#include "wire/wire.h"

namespace shmtensor::internal {

namespace {

using Clock = std::chrono::steady_clock;

// How long a receive whose deadline passed still waits for a message being written.
constexpr auto kBeingWrittenGrace = std::chrono::milliseconds(20);

// The hang-up watch's fire (under its lock, so `c` is alive): the receivers asleep on our
// ring wake up and look at the socket (a receive looks once it was woken for nothing).
void on_hangup(void* context) {
  auto& c = *static_cast<ConnectionCore*>(context);
  c.hangup_fired.store(true, std::memory_order_seq_cst);
  c.in.ring().kick();
}

// Whether a receive of this process may sleep with no time limit: the socket's hang-up is
// watched and did not fire yet, and no claim is outstanding in the ring (a writer killed
// mid-write, while another process keeps the end open, would never publish: a sliced sleep
// finds its claim dead and skips it). The first call in a process makes the watch; a thread
// that calls while another makes it sleeps in slices this once.
bool sleeps_untimed(ConnectionCore& c) noexcept {
  if (c.in.ring().maybe_nonempty()) return false;
  const std::uint64_t me = std::uint64_t{fork_generation()} << 1;
  std::uint64_t seen = c.watch_state.load(std::memory_order_acquire);
  if ((seen & ~std::uint64_t{1}) != me) {
    // None yet in this process (a forked child's copy is its parent's): claimed with the
    // state "being made", so that no thread trusts the fields below until it is made.
    if (!c.watch_state.compare_exchange_strong(seen, me, std::memory_order_acq_rel)) return false;
    c.hangup_fired.store(false, std::memory_order_relaxed);
    const std::uint64_t id = watch_hangup(c.sock.get(), on_hangup, &c);
    c.watch_id.store(id, std::memory_order_relaxed);
    if (id == 0) return false;  // stays "being made": slices, in every thread, from now on
    c.watch_state.store(me | 1, std::memory_order_release);
    seen = me | 1;
  }
  // The watch fires before it kicks: a receive that read the ring's publish count after a
  // kick sees hangup_fired here, and sleeps in slices (the kick was spent).
  return (seen & 1) != 0 && !c.hangup_fired.load(std::memory_order_seq_cst);
}

// One look at our ring that does not wait, and the ring's publish count read before it
// (what a spin or a sleep after it waits to see move). The first look of a receive skips
// the pop when it finds the hints equal (nothing published or being written: a request's
// answer not sent yet); every later one pops, which also says when the ring was closed.
struct LookAtRing {
  ConnectionCore& c;
  std::span<std::byte> out;
  std::uint32_t seen = 0;
  bool looked = false;

  std::optional<Ring::Popped> operator()() {
    Ring& ring = c.in.ring();
    seen = ring.publish_count();
    Ring::Popped p;
    if (std::exchange(looked, true) || ring.maybe_nonempty())
      p = ring.pop(out, Ring::kNoWait, kRingMarkerTag);
    if (p.status == Ring::Status::kClosed) throw_ring_closed();
    if (p.status != Ring::Status::kOk) return std::nullopt;
    c.in.rearm();
    return p;
  }
};

// The wait of a receive once a look found nothing: sleeps, in slices that look at the
// socket (did the peer hang up?), or with no time limit while the socket's hang-up is
// watched, and looks again after each wake-up.
std::optional<Ring::Popped> wait_ringed(ConnectionCore& c, const Deadline& deadline,
                                        LookAtRing& look) {
  Ring& ring = c.in.ring();
  bool woke = false;
  for (bool again = false;; again = true) {
    if (again)
      if (std::optional<Ring::Popped> p = look()) return p;
    // Nothing there. The socket says whether the peer is gone; it is looked at when we were
    // woken for nothing (a kick from close(), a slice that ran out) or an end was closed.
    // So is a receive that is about to give up (as recv on a hung-up socket says EOF).
    const std::uint32_t epoch = c.in_control()->close_epoch.load(std::memory_order_acquire);
    if (woke || passed(deadline) || c.peer_gone.load(std::memory_order_relaxed) ||
        epoch != c.seen_in_epoch.load(std::memory_order_relaxed)) {
      c.seen_in_epoch.store(epoch, std::memory_order_relaxed);
      if (hung_up(c)) {
        // What it sent before it went comes first.
        const Ring::Popped last = ring.pop(look.out, Ring::kNoWait, kRingMarkerTag);
        if (last.status == Ring::Status::kOk) return last;
        throw ConnectionClosed("recv(): the peer closed the connection");
      }
    }
    if (passed(deadline)) {
      // A message being written (its slot claimed: the tail is past the head) is waited
      // for a little even so: poll() said "ready" for it, and a receive with a zero timeout
      // after poll() must not miss it. A claim whose writer died is skipped by pop.
      if (ring.maybe_nonempty() && Clock::now() < *deadline + kBeingWrittenGrace) {
        ring.wait_for_publish(look.seen, Clock::now() + std::chrono::milliseconds(1));
        continue;
      }
      c.in.rearm();  // a readiness fd that said "ready" for nothing says so no more
      return std::nullopt;
    }
    if (!woke) {
      // Before the first sleep, a short spin (busy_poll.h, spin_before_sleep): a peer that
      // answers within microseconds is not made to wake us.
      if (const auto until = spin_before_sleep_until(deadline);
          until && ring.spin_for_publish(look.seen, *until)) {
        woke = true;  // looked at once more, then sleeps if it was not a message
        continue;
      }
    }
    if (!deadline && sleeps_untimed(c))
      ring.wait_for_publish_untimed(look.seen);  // a hang-up kicks it (hangup_fired)
    else
      ring.wait_for_publish(look.seen,
                            deadline ? std::min(*deadline, Clock::now() + kConnectionWaitSlice)
                                     : Clock::now() + kConnectionWaitSlice);
    woke = true;
  }
}

// Takes the next slot off our ring into `out` (a slot's bytes of room), busy polling first
// (busy_poll.h, poll_then_wait: spins on the ring's publish count for up to the budget,
// looking whenever it moves), then waiting until the deadline: nullopt when it passed
// first. Throws ConnectionClosed once the peer is gone and everything it sent was taken.
// Inlined into both receives, as poll_then_wait is: only a wait makes a call.
[[gnu::always_inline]] inline std::optional<Ring::Popped> pop_ringed(
    ConnectionCore& c, const Deadline& deadline, std::span<std::byte> out) {
  LookAtRing look{c, out};
  return poll_then_wait(
      deadline, std::nullopt, look,
      [&](Clock::time_point until) { return c.in.ring().spin_for_publish(look.seen, until); },
      [&] {
        // Without a poll before it, the wait starts with a look (a message already there
        // costs no call), after one straight from the poll's last look.
        std::optional<Ring::Popped> p;
        if (!look.looked) p = look();
        return p ? p : wait_ringed(c, deadline, look);
      });
}

}  // namespace

std::optional<Decoder> recv_ringed(ConnectionCore& c, const Deadline& deadline) {
  std::shared_ptr<std::byte[]> buffer;
  return receive_retrying(
      deadline,
      [&] {
        buffer = receive_buffer();
        return pop_ringed(c, deadline, std::span(buffer.get(), c.in.ring().max_message()));
      },
      [&](const std::optional<Ring::Popped>& p) {
        std::byte* data = buffer.get();
        return c.in.receive(std::move(buffer), data, *p, deadline);
      });
}

void decode_tensor(Decoder d, Tensor& out) {
  out = d.decode<Tensor>();
  d.finish();
}

// A slot that holds a frame of one tensor (wire.h, TensorFrame) is decoded from a buffer on
// the stack, with no Decoder; any other goes the general way.
bool recv_tensor_ringed(ConnectionCore& c, const Deadline& deadline, Tensor& out) {
  alignas(8) std::byte slot[kConnectionRingSlotBytes - Ring::kSlotHeaderBytes];
  return receive_retrying(
      deadline, [&] { return pop_ringed(c, deadline, slot); },
      [&](const std::optional<Ring::Popped>& p) {
        if (p->tag == kRingMessageTag) {
          const SegmentFetcher depot = c.in.depot().fetcher();
          if (parse_tensor_frame(std::span(slot, p->size), &depot, out)) return true;
        }
        std::shared_ptr<std::byte[]> buffer;
        try {
          buffer = receive_buffer();
        } catch (...) {
          if (p->tag == kRingMarkerTag) c.in.ring().unread(p->pos);  // taken, not received
          throw;
        }
        std::memcpy(buffer.get(), slot, p->size);
        std::byte* data = buffer.get();
        std::optional<Decoder> d = c.in.receive(std::move(buffer), data, *p, deadline);
        if (!d) return false;
        decode_tensor(std::move(*d), out);
        return true;
      });
}

std::optional<Decoder> recv_socket(int fd, const Deadline& deadline) {
  Datagram d = receive_datagram(fd, deadline);
  if (d.status == RecvStatus::kEof)
    throw ConnectionClosed("recv(): the peer closed the connection");
  if (d.status == RecvStatus::kTimeout) return std::nullopt;
  return parse_datagram(std::move(d));
}

}  // namespace shmtensor::internal
