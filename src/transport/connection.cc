// Connection: a SOCK_SEQPACKET socket pair and, for a pair made by pipe(), a message ring
// each way (transport/ring.h) with an eventfd each way for readiness. A message without fds
// that fits a slot travels in the ring of its direction; any other is a datagram announced
// by a marker in that ring (transport/announced.h), so one order holds for both. The
// socket also tells that the peer is gone: it hangs up when the last copy of the other end
// is closed, in whatever process (docs/transport.md, "Connection").
#include "shmtensor/connection.h"

#include <atomic>
#include <climits>
#include <string>
#include <thread>

#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/clock.h"
#include "os/epoll.h"
#include "os/event_fd.h"
#include "os/poll.h"
#include "os/proc.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/storage_access.h"
#include "transport/announced.h"
#include "transport/busy_poll.h"
#include "transport/channel.h"
#include "transport/depot.h"
#include "transport/hangup_watch.h"
#include "transport/link_control.h"
#include "transport/ring.h"
#include "wire/wire.h"

namespace shmtensor {

namespace internal {

namespace {

using Clock = std::chrono::steady_clock;

// Each direction's ring: 256 slots of 1 KiB (256 KiB; a message of up to 1,008 bytes fits a
// slot). A sender waits when its peer has 256 messages it has not taken.
constexpr std::uint32_t kConnectionRingSlots = 256;
constexpr std::uint32_t kConnectionRingSlotBytes = 1024;
// A peer that died without close() is noticed by a sender at most this long after (read
// on CLOCK_MONOTONIC_COARSE, whose tick, 4 ms here, it may overrun by).
constexpr std::int64_t kPeerCheckIntervalNs = 10'000'000;
// How long a receive whose deadline passed still waits for a message being written.
constexpr auto kBeingWrittenGrace = std::chrono::milliseconds(20);
// How long a blocked send or receive waits before it looks at the socket again.
constexpr auto kWaitSlice = std::chrono::milliseconds(50);
// A publish wakes every sleeper of the ring: receivers, and poll() callers, which take
// nothing (woken alone, one would leave a receiver asleep, with no time limit). A
// FUTEX_WAKE costs the same with one sleeper.
constexpr int kWakeAll = INT_MAX;


UniqueFd make_readiness_fd() {
  return make_event_fd("a connection's readiness fd", "raise `ulimit -n`");
}

}  // namespace

struct ConnectionCore {
  UniqueFd sock;
  // A connection made by pipe(): one end of a second socket pair, which carries only
  // deposits (fds once per segment) and is never read, only peeked: what the peer deposits
  // for us queues here, and what we deposit for the peer queues at its end.
  UniqueFd depot_sock;
  // This end's side of both directions' depots: it deposits with the peer through the
  // outgoing link's table, and fetches what the peer deposited through the incoming one's
  // (bind_depot, once the rings are attached).
  DepotSide depot;
  // A connection made by pipe(): the rings this end sends in and receives from, and the
  // eventfds it signals (the peer's readiness) and that say it has something (its own).
  Ring out;
  Ring in;
  UniqueFd out_ready;
  UniqueFd in_ready;
  // The fork generation (os/proc.h) of the process whose native_handle() counted this
  // handle in readiness_wanted; 0: none. Only that process takes it back, at close(): a
  // forked child's copy counts itself when it asks.
  std::atomic<std::uint32_t> counted_by{0};
  // native_handle()'s epoll fd, made on first use (a CAS from -1: no mutex a forked child
  // could inherit locked).
  mutable std::atomic<int> epoll{-1};
  // What this process last saw of close_epoch, and when a sender last looked at the socket.
  // close_epoch of each direction as a sender (out) and a receiver (in) last saw it.
  std::atomic<std::uint32_t> seen_out_epoch{0};
  std::atomic<std::uint32_t> seen_in_epoch{0};
  // wait_for_signallers' memory of a count left by senders that died (announced.h).
  std::atomic<std::uint32_t> stuck_signalling{0};
  std::atomic<std::int64_t> last_peer_check_ns{0};
  // Set once the socket was seen hung up (for good: the other end cannot reopen).
  std::atomic<bool> peer_gone{false};
  // The watch of the socket's hang-up (transport/hangup_watch.h) that lets a receive
  // without a deadline sleep with no time limit, made by the first such receive of a
  // process. watch_state: that process's fork generation << 1, | 1 once the watch is made
  // (watch_id, hangup_fired are then this process's); 0: none yet. hangup_fired: the watch
  // fired (it fires once); from then on this end's receives sleep in slices again.
  std::atomic<std::uint64_t> watch_state{0};
  std::atomic<std::uint64_t> watch_id{0};
  std::atomic<bool> hangup_fired{false};

  ~ConnectionCore() {
    unwatch();
    if (const int fd = epoll.load(std::memory_order_relaxed); fd >= 0) UniqueFd closing(fd);
  }
  // Ends this process's watch, if it made one (before the socket closes).
  void unwatch() noexcept {
    const std::uint64_t made = std::uint64_t{fork_generation()} << 1 | 1;
    if (watch_state.load(std::memory_order_acquire) != made) return;
    unwatch_hangup(watch_id.exchange(0, std::memory_order_acq_rel));
  }
  bool ringed() const noexcept { return in.fd() >= 0; }
  void bind_depot() noexcept {
    depot.bind(&out_control()->depot, depot_sock.get(), &in_control()->depot, depot_sock.get());
  }
  LinkControl* out_control() const noexcept {
    return reinterpret_cast<LinkControl*>(out.user_area());
  }
  LinkControl* in_control() const noexcept {
    return reinterpret_cast<LinkControl*>(in.user_area());
  }
  AnnouncedPath out_path() {
    LinkControl* c = out_control();
    return {&out,    sock.get(),   -1,      &c->send_lock, &c->recv_lock, &c->taken_below,
            nullptr, "connection", kWakeAll};
  }
  AnnouncedPath in_path(const SegmentFetcher* depot) {
    LinkControl* c = in_control();
    return {&in,   -1,           sock.get(), &c->send_lock, &c->recv_lock, &c->taken_below,
            depot, "connection", kWakeAll};
  }
};

namespace {

bool hung_up(ConnectionCore& c) noexcept {
  if (c.peer_gone.load(std::memory_order_relaxed)) return true;
  if (!hung_up_now(c.sock.get())) return false;
  c.peer_gone.store(true, std::memory_order_relaxed);
  return true;
}

[[noreturn]] void throw_peer_closed() {
  throw ConnectionClosed("send() on a connection whose peer has closed");
}

// Before a send on the ring (where nothing fails when the peer is gone): looks at the
// socket when an end was closed since the last look, or every kPeerCheckInterval (a peer
// that died called no close()).
void check_peer(ConnectionCore& c) {
  if (c.peer_gone.load(std::memory_order_relaxed)) throw_peer_closed();
  const std::uint32_t epoch = c.out_control()->close_epoch.load(std::memory_order_acquire);
  // The coarse clock: the fine one would cost every send a serialising TSC read.
  const std::int64_t now = coarse_monotonic_ns();
  const bool closed_since = epoch != c.seen_out_epoch.load(std::memory_order_relaxed);
  if (!closed_since &&
      now - c.last_peer_check_ns.load(std::memory_order_relaxed) < kPeerCheckIntervalNs)
    return;
  c.seen_out_epoch.store(epoch, std::memory_order_relaxed);
  c.last_peer_check_ns.store(now, std::memory_order_relaxed);
  if (hung_up(c)) throw_peer_closed();
}

Deadline next_slice(const Deadline& deadline) {
  const auto slice = Clock::now() + kWaitSlice;
  return deadline ? std::min(*deadline, slice) : slice;
}

bool passed(const Deadline& deadline) { return deadline && Clock::now() >= *deadline; }

// After a message was published in the peer's ring: its readiness fd, if it asked for it.
// The publish (a seq_cst read-modify-write) comes before this load; see rearm_ready.
void notify_peer(ConnectionCore& c) noexcept {
  if (c.out_control()->readiness_wanted.load(std::memory_order_seq_cst) != 0)
    signal_event_fd(c.out_ready.get());
}

// Counts this send in `signalling` while the peer wants its readiness fd.
class Signalling {
 public:
  explicit Signalling(LinkControl* c) noexcept
      : c_(c->readiness_wanted.load(std::memory_order_seq_cst) != 0 ? c : nullptr) {
    if (c_ != nullptr) c_->signalling.fetch_add(1, std::memory_order_seq_cst);
  }
  ~Signalling() {
    if (c_ != nullptr) c_->signalling.fetch_sub(1, std::memory_order_seq_cst);
  }
  Signalling(const Signalling&) = delete;
  Signalling& operator=(const Signalling&) = delete;

 private:
  LinkControl* c_;
};

// After a receive: our readiness fd stays readable while our ring may hold a message, and
// is cleared otherwise (then the ring is looked at again: a message published in between
// signals, by its sender or here). Senders still to signal a message we took are waited
// for first (at most ~1 ms: one killed in between never signals).
void rearm_ready(ConnectionCore& c) noexcept {
  LinkControl* ic = c.in_control();
  if (ic->readiness_wanted.load(std::memory_order_seq_cst) == 0) return;
  if (c.in.has_ready()) return;
  wait_for_signallers(ic->signalling, c.stuck_signalling);
  drain_event_fd(c.in_ready.get());
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c.in.has_ready()) signal_event_fd(c.in_ready.get());
}

// The end's epoll fd (made once): the socket, for its hang-up only (a datagram's marker
// signals the eventfd once it is published: readable before that, a receive could find
// nothing yet), and the end's eventfd.
int readiness_epoll(ConnectionCore& c) {
  if (const int e = c.epoll.load(std::memory_order_acquire); e >= 0) return e;
  UniqueFd ep = make_epoll("a connection's readiness fd", "raise `ulimit -n`");
  for (const int fd : {c.sock.get(), c.in_ready.get()})
    add_to_epoll(ep.get(), fd, fd == c.sock.get() ? kEpollReadHangup : kEpollIn,
                 static_cast<std::uint64_t>(fd), "a connection's readiness fd");
  int expected = -1;
  if (!c.epoll.compare_exchange_strong(expected, ep.get(), std::memory_order_acq_rel))
    return expected;  // another thread made one first; ours closes
  return ep.release();
}

// Counts one more reader of the readiness fd, then makes it say what is there now:
// cleared of signals nobody needs any more (a sender between its publish and its signal
// is waited for first, as in rearm_ready), then signalled if the ring holds a message.
// The count before the look at the ring (both sequentially consistent) and a sender's
// publish before its look at the count: either it signals, or we see its message.
void want_readiness(ConnectionCore& c) noexcept {
  c.in_control()->readiness_wanted.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c.in.has_ready())
    signal_event_fd(c.in_ready.get());
  else
    rearm_ready(c);
}

void unwant_readiness(ConnectionCore& c) noexcept {
  auto& wanted = c.in_control()->readiness_wanted;
  std::uint32_t n = wanted.load(std::memory_order_relaxed);  // never below 0
  while (n > 0 && !wanted.compare_exchange_weak(n, n - 1, std::memory_order_seq_cst)) {
  }
}

// A frame without fds that fits a slot, pushed into the peer's ring, then its readiness fd
// signalled if it asked. False when the deadline passed first (nothing was published).
bool push_ringed(ConnectionCore& c, std::span<const std::span<const std::byte>> parts,
                 const Deadline& deadline) {
  // Counted from here (its publish may come while it waits for room) to its signal.
  const Signalling signalling(c.out_control());
  // A first try that does not wait (and reads no clock) when there is no deadline: the
  // ring almost always has room. A wait for room is sliced: between slices, is the peer
  // still there to make it?
  for (Deadline until = deadline ? deadline : Ring::kNoWait;; until = next_slice(deadline)) {
    const Ring::Status st = c.out.push_parts(parts, kRingMessageTag, until, Ring::Wake::kDeferred);
    if (st == Ring::Status::kOk) break;
    if (st == Ring::Status::kClosed)
      throw ProtocolError("a connection's ring was closed by another process");
    if (passed(deadline)) return false;
    if (hung_up(c)) throw_peer_closed();
  }
  c.out.wake_consumers(kWakeAll);
  notify_peer(c);
  return true;
}

// FdElision::omit of a one-tensor frame (TensorFrame): true when the segment is in the
// peer's depot already; a segment that is not goes the general way, which deposits it.
bool deposited_with_peer(void* context, const Segment& seg) {
  auto& c = *static_cast<ConnectionCore*>(context);
  if (!c.depot.deposited(seg)) return false;
  c.depot.count_omitted();
  return true;
}

// A tensor alone, framed straight into a buffer on the stack (wire.h, TensorFrame): sent,
// or not (the deadline passed: false), or nullopt when it is not of that shape and goes the
// general way.
std::optional<bool> send_tensor_ringed(ConnectionCore& c, const Tensor& t,
                                       const Deadline& deadline) {
  check_peer(c);
  alignas(8) std::byte buffer[kConnectionRingSlotBytes - Ring::kSlotHeaderBytes];
  TensorFrame frame;
  if (!frame.frame(t, FdElision{deposited_with_peer, &c}, buffer)) return std::nullopt;
  const std::span<const std::byte> parts[1] = {frame.bytes()};
  if (!push_ringed(c, parts, deadline)) return false;
  frame.mark_sent();  // the receiver now owns the in-flight counts
  return true;
}

bool send_ringed(ConnectionCore& c, Encoder&& encoder, const Deadline& deadline) {
  check_peer(c);
  const FdElision elision = c.depot.elision();
  OutgoingFrame frame = finish_frame(std::move(encoder), &elision);
  const auto parts = frame.parts();
  std::size_t size = 0;
  for (const auto& part : parts) size += part.size();
  if (frame.fds().empty() && size <= c.out.max_message()) {
    if (!push_ringed(c, parts, deadline)) return false;
    frame.sent = true;  // the receiver now owns the in-flight counts
    return true;
  }
  // Counted from here (its publish may come while it waits for room) to its signal.
  const Signalling signalling(c.out_control());
  const AnnouncedPath path = c.out_path();
  for (Deadline until = deadline ? deadline : next_slice(deadline);; until = next_slice(deadline)) {
    AnnouncedSend st;
    try {
      st = send_announced(path, frame, until);
    } catch (const SystemError& e) {
      if (e.error_code() == EPIPE || e.error_code() == ECONNRESET) throw_peer_closed();
      throw;
    }
    if (st == AnnouncedSend::kSent) break;
    if (st == AnnouncedSend::kClosed)
      throw ProtocolError("a connection's ring was closed by another process");
    if (passed(deadline)) return false;
    if (hung_up(c)) throw_peer_closed();
  }
  notify_peer(c);
  return true;
}

// A slot taken off our ring, parsed: the frame in the slot, or the datagram it announces.
// Empty when that datagram is behind one another receiver holds past `deadline`
// (take_announced: the marker is back in the ring).
std::optional<Decoder> receive_popped(ConnectionCore& c, std::shared_ptr<std::byte[]> buffer,
                                      const Ring::Popped& p, const Deadline& deadline) {
  const SegmentFetcher depot = c.depot.fetcher();
  if (p.tag == kRingMessageTag) {
    std::byte* data = buffer.get();
    // Aliasing: the decoder keeps the whole buffer alive, and reads its own bytes.
    return parse_frame(std::span<const std::byte>(data, p.size), {},
                       std::shared_ptr<const void>(std::move(buffer), data), &depot);
  }
  if (p.tag != kRingMarkerTag)
    throw ProtocolError("a slot of the connection's ring has tag " + std::to_string(p.tag) +
                        ", neither a message nor a marker");
  buffer.reset();  // the datagram is received into the same per-thread buffer
  const AnnouncedPath path = c.in_path(&depot);
  std::optional<Datagram> datagram = take_announced(path, p.pos, deadline);
  if (!datagram) {
    // The marker is back in our ring: a readiness fd cleared when it was popped says so
    // again.
    if (c.in_control()->readiness_wanted.load(std::memory_order_seq_cst) != 0)
      signal_event_fd(c.in_ready.get());
    return std::nullopt;
  }
  Decoder d = parse_announced(path, std::move(*datagram));
  c.depot.pin_received(d);
  return d;
}

// The hang-up watch's fire (under its lock, so `c` is alive): the receivers asleep on our
// ring wake up and look at the socket (a receive looks once it was woken for nothing).
void on_hangup(void* context) {
  auto& c = *static_cast<ConnectionCore*>(context);
  c.hangup_fired.store(true, std::memory_order_seq_cst);
  c.in.kick();
}

// Whether a receive of this process may sleep with no time limit: the socket's hang-up is
// watched and did not fire yet, and no claim is outstanding in the ring (a writer killed
// mid-write, while another process keeps the end open, would never publish: a sliced sleep
// finds its claim dead and skips it). The first call in a process makes the watch; a thread
// that calls while another makes it sleeps in slices this once.
bool sleeps_untimed(ConnectionCore& c) noexcept {
  if (c.in.maybe_nonempty()) return false;
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

// Takes the next slot off our ring into `out` (a slot's bytes of room), waiting until the
// deadline: nullopt when it passed first. Throws ConnectionClosed once the peer is gone and
// everything it sent was taken.
std::optional<Ring::Popped> pop_ringed(ConnectionCore& c, const Deadline& deadline,
                                       std::span<std::byte> out) {
  // Opt-in busy polling (busy_poll.h): spins on the ring's publish count for up to the
  // budget, popping whenever it moves. The clock is read only when polling or given a
  // deadline.
  const bool now_only = deadline && Clock::now() >= *deadline;
  const auto budget = now_only ? std::chrono::nanoseconds(0) : busy_poll_budget();
  Clock::time_point start{}, poll_until{};
  if (budget.count() > 0) {
    start = Clock::now();
    poll_until = start + std::chrono::duration_cast<Clock::duration>(budget);
    if (deadline) poll_until = std::min(poll_until, *deadline);
  }
  const Deadline no_wait = Ring::kNoWait;
  bool woke = false;
  for (bool first = true;; first = false) {
    const std::uint32_t seen = c.in.publish_count();
    // A first look that finds the hints equal (nothing published or being written: a
    // request's answer not sent yet) skips the pop; every later look pops, which also
    // says when the ring was closed.
    Ring::Popped p;
    if (!first || c.in.maybe_nonempty()) p = c.in.pop(out, no_wait, kRingMarkerTag);
    if (p.status == Ring::Status::kOk) {
      if (budget.count() > 0) busy_poll_observe(Clock::now() - start);
      rearm_ready(c);
      return p;
    }
    if (p.status == Ring::Status::kClosed)
      throw ProtocolError("a connection's ring was closed by another process");
    // The clock before each spin: a publish count that keeps moving with nothing for us (a
    // kick, another process storing to it) must not keep us polling past the budget.
    if (budget.count() > 0 && !woke && Clock::now() < poll_until &&
        c.in.spin_for_publish(seen, poll_until))
      continue;
    // Nothing there. The socket says whether the peer is gone; it is looked at when we were
    // woken for nothing (a kick from close(), a slice that ran out) or an end was closed.
    // So is a receive that is about to give up (as recv on a hung-up socket says EOF).
    const std::uint32_t epoch = c.in_control()->close_epoch.load(std::memory_order_acquire);
    if (woke || passed(deadline) || c.peer_gone.load(std::memory_order_relaxed) ||
        epoch != c.seen_in_epoch.load(std::memory_order_relaxed)) {
      c.seen_in_epoch.store(epoch, std::memory_order_relaxed);
      if (hung_up(c)) {
        // What it sent before it went comes first.
        const Ring::Popped last = c.in.pop(out, no_wait, kRingMarkerTag);
        if (last.status == Ring::Status::kOk) return last;
        throw ConnectionClosed("recv(): the peer closed the connection");
      }
    }
    if (passed(deadline)) {
      // A message being written (its slot claimed: the tail is past the head) is waited
      // for a little even so: poll() said "ready" for it, and a receive with a zero timeout
      // after poll() must not miss it. A claim whose writer died is skipped by pop.
      if (c.in.maybe_nonempty() && Clock::now() < *deadline + kBeingWrittenGrace) {
        c.in.wait_for_publish(seen, Clock::now() + std::chrono::milliseconds(1));
        continue;
      }
      if (budget.count() > 0) busy_poll_observe(std::nullopt);
      rearm_ready(c);  // a readiness fd that said "ready" for nothing says so no more
      return std::nullopt;
    }
    if (!woke) {
      // Before the first sleep, a short spin (busy_poll.h, spin_before_sleep): a peer that
      // answers within microseconds is not made to wake us.
      if (const auto until = spin_before_sleep_until(deadline);
          until && c.in.spin_for_publish(seen, *until)) {
        woke = true;  // looked at once more below, then sleeps if it was not a message
        continue;
      }
    }
    if (!deadline && sleeps_untimed(c))
      c.in.wait_for_publish_untimed(seen);  // a hang-up kicks it (hangup_fired)
    else
      c.in.wait_for_publish(seen, deadline ? std::min(*deadline, Clock::now() + kWaitSlice)
                                           : Clock::now() + kWaitSlice);
    woke = true;
  }
}

std::optional<Decoder> recv_ringed(ConnectionCore& c, const Deadline& deadline) {
  for (;;) {
    auto buffer = receive_buffer();
    const std::optional<Ring::Popped> p =
        pop_ringed(c, deadline, std::span(buffer.get(), c.in.max_message()));
    if (!p) return std::nullopt;
    if (std::optional<Decoder> d = receive_popped(c, std::move(buffer), *p, deadline)) return d;
    if (!pop_again_after_give_back(deadline)) return std::nullopt;
  }
}

// What recv<Tensor> does with a message the general way: the whole of it, as a Tensor.
void decode_tensor(Decoder d, Tensor& out) {
  out = d.decode<Tensor>();
  d.finish();
}

// A receive as a Tensor: a slot that holds a frame of one tensor (wire.h, TensorFrame) is
// decoded from a buffer on the stack, with no Decoder; any other goes the general way.
bool recv_tensor_ringed(ConnectionCore& c, const Deadline& deadline, Tensor& out) {
  alignas(8) std::byte slot[kConnectionRingSlotBytes - Ring::kSlotHeaderBytes];
  const std::optional<Ring::Popped> p = pop_ringed(c, deadline, slot);
  if (!p) return false;
  if (p->tag == kRingMessageTag) {
    const SegmentFetcher depot = c.depot.fetcher();
    if (parse_tensor_frame(std::span(slot, p->size), &depot, out)) return true;
  }
  auto buffer = receive_buffer();
  std::memcpy(buffer.get(), slot, p->size);
  std::optional<Decoder> d = receive_popped(c, std::move(buffer), *p, deadline);
  if (!d) {
    if (!pop_again_after_give_back(deadline)) return false;
    std::optional<Decoder> again = recv_ringed(c, deadline);
    if (!again) return false;
    d = std::move(again);
  }
  decode_tensor(std::move(*d), out);
  return true;
}

// The path of an adopted socket: every message a datagram.
bool send_socket(int fd, Encoder&& encoder, const Deadline& deadline) {
  try {
    OutgoingFrame frame = finish_frame(std::move(encoder));
    return send_frame(fd, frame, deadline);
  } catch (const SystemError& e) {
    if (e.error_code() == EPIPE || e.error_code() == ECONNRESET) throw_peer_closed();
    throw;
  }
}

std::optional<Decoder> recv_socket(int fd, const Deadline& deadline) {
  Datagram d = receive_datagram(fd, deadline);
  if (d.status == RecvStatus::kEof) throw ConnectionClosed("recv(): the peer closed the connection");
  if (d.status == RecvStatus::kTimeout) return std::nullopt;
  return parse_datagram(std::move(d));
}

ConnectionCore& live(const std::unique_ptr<ConnectionCore>& core, const char* call) {
  if (!core) throw ConnectionClosed(std::string(call) + " on a closed connection");
  return *core;
}

void init_link(Ring& ring) {
  auto* c = new (ring.user_area()) LinkControl{};
  c->taken_below = 0;
  c->readiness_wanted.store(0, std::memory_order_relaxed);
  c->close_epoch.store(0, std::memory_order_relaxed);
  c->signalling.store(0, std::memory_order_relaxed);
  init_depot(&c->depot);
  std::atomic_ref<std::uint64_t>(c->magic).store(kLinkMagic, std::memory_order_release);
}

Ring attach_link(UniqueFd fd) {
  Ring ring = Ring::attach(std::move(fd));
  if (ring.slot_count() != kConnectionRingSlots || ring.slot_bytes() != kConnectionRingSlotBytes)
    throw ProtocolError("received connection ring has another geometry than a connection's");
  auto* c = reinterpret_cast<LinkControl*>(ring.user_area());
  if (std::atomic_ref<std::uint64_t>(c->magic).load(std::memory_order_acquire) != kLinkMagic)
    throw ProtocolError("received connection ring is not a connection's");
  return ring;
}

void require_socket(int fd) {
  if (fd_target(fd).rfind("socket:", 0) != 0)
    throw ProtocolError("received connection fd is not a socket");
}

}  // namespace

std::vector<int> ConnectionAccess::fds(const Connection& c) {
  std::vector<int> out;
  if (!c.core_) return out;
  const ConnectionCore& k = *c.core_;
  out.push_back(k.sock.get());
  if (k.ringed()) {
    out.insert(out.end(), {k.depot_sock.get(), k.out.fd(), k.in.fd(), k.out_ready.get(),
                           k.in_ready.get()});
    if (const int e = k.epoll.load(std::memory_order_acquire); e >= 0) out.push_back(e);
  }
  return out;
}

ConnectionAccess::FdCounts ConnectionAccess::fd_counts(const Connection& c) noexcept {
  if (!c.core_) return {};
  return c.core_->depot.counts();
}

Connection ConnectionAccess::wrap(std::unique_ptr<ConnectionCore> core) noexcept {
  return Connection(std::move(core));
}

std::pair<Connection, Connection> ConnectionAccess::socket_pair() {
  auto [a, b] = seqpacket_pair();
  return {Connection::adopt(a.release()), Connection::adopt(b.release())};
}

}  // namespace internal

using internal::ConnectionCore;

Connection::Connection() noexcept = default;
Connection::Connection(std::unique_ptr<ConnectionCore> core) noexcept : core_(std::move(core)) {}
Connection::Connection(Connection&& other) noexcept = default;
Connection& Connection::operator=(Connection&& other) noexcept {
  if (this != &other) {
    close();
    core_ = std::move(other.core_);
  }
  return *this;
}
Connection::~Connection() { close(); }

void Connection::close() noexcept {
  std::unique_ptr<ConnectionCore> core = std::move(core_);
  if (!core || !core->ringed()) return;
  // The socket first: a peer woken below finds it hung up if this was the last copy of this
  // end anywhere (another process may hold one: then nothing is closed for the peer). Its
  // watch ends before it closes.
  core->unwatch();
  core->sock.reset();
  core->out_control()->close_epoch.fetch_add(1, std::memory_order_acq_rel);
  core->in_control()->close_epoch.fetch_add(1, std::memory_order_acq_rel);
  core->out.kick();
  // A peer waiting in poll() on its native_handle() sees the hang-up there itself.
  if (core->counted_by.load(std::memory_order_relaxed) == internal::fork_generation())
    internal::unwant_readiness(*core);
}

Connection Connection::adopt(int fd) {
  internal::UniqueFd owned(fd);
  auto core = std::make_unique<ConnectionCore>();
  core->sock = std::move(owned);
  return Connection(std::move(core));
}

int Connection::release() noexcept {
  if (!core_ || core_->ringed()) return -1;
  const int fd = core_->sock.release();
  core_.reset();
  return fd;
}

namespace internal {

int ConnectionAccess::begin_wait(Connection& conn) {
  if (!conn.core_) return -1;
  ConnectionCore& c = *conn.core_;
  if (!c.ringed()) return c.sock.get();
  const int fd = readiness_epoll(c);
  want_readiness(c);
  return fd;
}

void ConnectionAccess::end_wait(Connection& conn) noexcept {
  if (conn.core_ && conn.core_->ringed()) unwant_readiness(*conn.core_);
}

}  // namespace internal

int Connection::native_handle() const {
  if (!core_) return -1;
  ConnectionCore& c = *core_;
  if (!c.ringed()) return c.sock.get();
  const int fd = internal::readiness_epoll(c);
  const std::uint32_t me = internal::fork_generation();
  if (c.counted_by.exchange(me, std::memory_order_acq_rel) != me) internal::want_readiness(c);
  return fd;
}

bool Connection::poll(Timeout timeout) const {
  ConnectionCore& c = internal::live(core_, "poll()");
  const internal::Deadline deadline = internal::deadline_after(internal::to_nanoseconds(timeout));
  if (!c.ringed()) {
    const int fds[1] = {c.sock.get()};
    return !internal::wait_readable(fds, internal::to_nanoseconds(timeout)).empty();
  }
  for (;;) {
    const std::uint32_t seen = c.in.publish_count();
    if (c.in.has_ready() || internal::hung_up(c)) return true;
    if (internal::passed(deadline)) {
      internal::rearm_ready(c);
      return false;
    }
    c.in.wait_for_publish(seen, internal::next_slice(deadline));
  }
}

void Connection::send_encoded(Encoder&& encoder) {
  ConnectionCore& c = internal::live(core_, "send()");
  if (c.ringed())
    (void)internal::send_ringed(c, std::move(encoder), std::nullopt);
  else
    (void)internal::send_socket(c.sock.get(), std::move(encoder), std::nullopt);
}

bool Connection::try_send_encoded(Encoder&& encoder) {
  ConnectionCore& c = internal::live(core_, "send()");
  const internal::Deadline now = std::chrono::steady_clock::now();
  return c.ringed() ? internal::send_ringed(c, std::move(encoder), now)
                    : internal::send_socket(c.sock.get(), std::move(encoder), now);
}

std::optional<bool> Connection::send_tensor(const Tensor& t, bool wait) {
  ConnectionCore& c = internal::live(core_, "send()");
  if (!c.ringed()) return std::nullopt;
  const internal::Deadline deadline =
      wait ? internal::Deadline{} : internal::Deadline{std::chrono::steady_clock::now()};
  return internal::send_tensor_ringed(c, t, deadline);
}

bool Connection::recv_tensor(std::optional<std::chrono::nanoseconds> timeout, Tensor& out) {
  ConnectionCore& c = internal::live(core_, "recv()");
  const internal::Deadline deadline = internal::deadline_after(timeout);
  if (c.ringed()) return internal::recv_tensor_ringed(c, deadline, out);
  std::optional<Decoder> d = internal::recv_socket(c.sock.get(), deadline);
  if (!d) return false;
  internal::decode_tensor(std::move(*d), out);
  return true;
}

namespace internal {
namespace {
std::optional<Decoder> receive_on(const std::unique_ptr<ConnectionCore>& core,
                                  std::optional<std::chrono::nanoseconds> timeout) {
  ConnectionCore& c = live(core, "recv()");
  const Deadline deadline = deadline_after(timeout);
  return c.ringed() ? recv_ringed(c, deadline) : recv_socket(c.sock.get(), deadline);
}
}  // namespace
}  // namespace internal

Decoder Connection::recv_encoded(std::optional<std::chrono::nanoseconds> timeout) {
  std::optional<Decoder> d = internal::receive_on(core_, timeout);
  if (!d) throw Error("recv(): timed out");
  return std::move(*d);
}

std::optional<Decoder> Connection::try_recv_encoded(std::chrono::nanoseconds timeout) {
  return internal::receive_on(core_, timeout);
}

std::pair<Connection, Connection> pipe() {
  using internal::Ring;
  auto [a, b] = internal::seqpacket_pair();
  auto [depot_a, depot_b] = internal::seqpacket_pair();
  Ring ab = Ring::create(internal::kConnectionRingSlots, internal::kConnectionRingSlotBytes);
  Ring ba = Ring::create(internal::kConnectionRingSlots, internal::kConnectionRingSlotBytes);
  internal::init_link(ab);
  internal::init_link(ba);
  internal::UniqueFd ready_a = internal::make_readiness_fd();  // says end a has messages
  internal::UniqueFd ready_b = internal::make_readiness_fd();
  // Each end attaches its own Ring objects (a Ring's holder record is per object).
  auto end = [](internal::UniqueFd sock, internal::UniqueFd depot, const Ring& out,
                const Ring& in, int out_ready, int in_ready) {
    auto core = std::make_unique<ConnectionCore>();
    core->sock = std::move(sock);
    core->depot_sock = std::move(depot);
    core->out = Ring::attach(internal::dup_cloexec(out.fd()));
    core->in = Ring::attach(internal::dup_cloexec(in.fd()));
    core->out_ready = internal::dup_cloexec(out_ready);
    core->in_ready = internal::dup_cloexec(in_ready);
    core->bind_depot();
    return internal::ConnectionAccess::wrap(std::move(core));
  };
  Connection first = end(std::move(a), std::move(depot_a), ab, ba, ready_b.get(), ready_a.get());
  Connection second = end(std::move(b), std::move(depot_b), ba, ab, ready_a.get(), ready_b.get());
  return {std::move(first), std::move(second)};
}

void Codec<Connection>::encode(Encoder& e, const Connection& c) {
  if (!c.valid()) throw Error("cannot send a closed connection");
  const ConnectionCore& k = *c.core_;
  e.write_pod<std::uint8_t>(k.ringed() ? 1 : 0);
  e.write_fd(k.sock.get());
  if (!k.ringed()) return;
  e.write_fd(k.depot_sock.get());
  e.write_fd(k.out.fd());
  e.write_fd(k.in.fd());
  e.write_fd(k.out_ready.get());
  e.write_fd(k.in_ready.get());
}

Connection Codec<Connection>::decode(Decoder& d) {
  const auto kind = d.read_pod<std::uint8_t>();
  if (kind > 1) throw ProtocolError("a connection's kind byte is " + std::to_string(kind));
  // Each fd is owned at once, so a message missing the later ones leaks none.
  internal::UniqueFd sock(d.take_fd());
  internal::require_socket(sock.get());
  if (kind == 0) return Connection::adopt(sock.release());
  auto core = std::make_unique<ConnectionCore>();
  core->sock = std::move(sock);
  core->depot_sock.reset(d.take_fd());
  internal::require_socket(core->depot_sock.get());
  internal::UniqueFd out(d.take_fd());
  internal::UniqueFd in(d.take_fd());
  core->out_ready.reset(d.take_fd());
  core->in_ready.reset(d.take_fd());
  // What the connection will use them as (os/event_fd.h).
  internal::require_event_fd(core->out_ready.get(), "connection readiness");
  internal::require_event_fd(core->in_ready.get(), "connection readiness");
  core->out = internal::attach_link(std::move(out));
  core->in = internal::attach_link(std::move(in));
  core->bind_depot();
  return Connection(std::move(core));
}

}  // namespace shmtensor
