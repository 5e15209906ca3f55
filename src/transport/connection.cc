// Connection: a SOCK_SEQPACKET socket pair and, for a pair made by pipe(), an Endpoint
// (endpoint.h) each way: a message ring with an eventfd for readiness. A message without fds
// that fits a slot travels in the ring of its direction; any other is a datagram announced
// by a marker in that ring (transport/announced.h), so one order holds for both. The
// socket also tells that the peer is gone: it hangs up when the last copy of the other end
// is closed, in whatever process (docs/transport.md, "Connection"). This file: an end's
// sending, closing and public calls; connection_link.cc: making the ends (pipe(), a
// received end); connection_receive.cc: receiving.
#include "shmtensor/connection.h"

#include <atomic>
#include <string>

#include "os/clock.h"
#include "os/epoll.h"
#include "os/event_fd.h"
#include "os/poll.h"
#include "os/proc.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "shmtensor/internal/connection_access.h"
#include "transport/connection_core.h"
#include "transport/hangup_watch.h"
#include "wire/wire.h"

namespace shmtensor {

namespace internal {

namespace {

// A peer that died without close() is noticed by a sender at most this long after (read
// on CLOCK_MONOTONIC_COARSE, whose tick, 4 ms here, it may overrun by).
constexpr std::int64_t kPeerCheckIntervalNs = 10'000'000;

[[noreturn]] void throw_peer_closed() {
  throw ConnectionClosed("send() on a connection whose peer has closed");
}

}  // namespace

ConnectionCore::~ConnectionCore() {
  unwatch();
  if (const int fd = epoll.load(std::memory_order_relaxed); fd >= 0) UniqueFd closing(fd);
}

void ConnectionCore::unwatch() noexcept {
  const std::uint64_t made = std::uint64_t{fork_generation()} << 1 | 1;
  if (watch_state.load(std::memory_order_acquire) != made) return;
  unwatch_hangup(watch_id.exchange(0, std::memory_order_acq_rel));
}

bool hung_up(ConnectionCore& c) noexcept {
  if (c.peer_gone.load(std::memory_order_relaxed)) return true;
  if (!hung_up_now(c.sock.get())) return false;
  c.peer_gone.store(true, std::memory_order_relaxed);
  return true;
}

void throw_ring_closed() {
  throw ProtocolError("a connection's ring was closed by another process");
}

Deadline next_slice(const Deadline& deadline) {
  const auto slice = std::chrono::steady_clock::now() + kConnectionWaitSlice;
  return deadline ? std::min(*deadline, slice) : slice;
}

namespace {

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

// The end's epoll fd (made once): the socket, for its hang-up only (a datagram's marker
// signals the eventfd once it is published: readable before that, a receive could find
// nothing yet), and the end's eventfd.
int readiness_epoll(ConnectionCore& c) {
  if (const int e = c.epoll.load(std::memory_order_acquire); e >= 0) return e;
  UniqueFd ep = make_epoll("a connection's readiness fd", "raise `ulimit -n`");
  for (const int fd : {c.sock.get(), c.in.ready_fd()})
    add_to_epoll(ep.get(), fd, fd == c.sock.get() ? kEpollReadHangup : kEpollIn,
                 static_cast<std::uint64_t>(fd), "a connection's readiness fd");
  int expected = -1;
  if (!c.epoll.compare_exchange_strong(expected, ep.get(), std::memory_order_acq_rel))
    return expected;  // another thread made one first; ours closes
  return ep.release();
}

// A frame without fds that fits a slot, pushed into the peer's ring, then its readiness fd
// signalled if it asked. False when the deadline passed first (nothing was published).
// A first try that does not wait (and reads no clock) when there is no deadline: the ring
// almost always has room. A wait for room is sliced: between slices, is the peer still
// there to make it?
bool push_ringed(ConnectionCore& c, std::span<const std::span<const std::byte>> parts,
                 const Deadline& deadline) {
  const Endpoint::Signalling signalling(c.out);
  for (Deadline until = deadline ? deadline : Ring::kNoWait;; until = next_slice(deadline)) {
    const Ring::Status st = c.out.push(parts, until);
    if (st == Ring::Status::kOk) break;
    if (st == Ring::Status::kClosed) throw_ring_closed();
    if (passed(deadline)) return false;
    if (hung_up(c)) throw_peer_closed();
  }
  c.out.ring().wake_consumers(kWakeAll);
  c.out.notify();
  return true;
}

// FdElision::omit of a one-tensor frame (TensorFrame): true when the segment is in the
// peer's depot already; a segment that is not goes the general way, which deposits it.
bool deposited_with_peer(void* context, const Segment& seg) {
  auto& depot = *static_cast<DepotSide*>(context);
  if (!depot.deposited(seg)) return false;
  depot.count_omitted();
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
  if (!frame.frame(t, FdElision{deposited_with_peer, &c.out.depot()}, buffer)) return std::nullopt;
  const std::span<const std::byte> parts[1] = {frame.bytes()};
  if (!push_ringed(c, parts, deadline)) return false;
  frame.mark_sent();  // the receiver now owns the in-flight counts
  return true;
}

bool send_ringed(ConnectionCore& c, Encoder&& encoder, const Deadline& deadline) {
  check_peer(c);
  OutgoingFrame frame = c.out.frame(std::move(encoder));
  if (c.out.fits_slot(frame)) {
    if (!push_ringed(c, frame.parts(), deadline)) return false;
    frame.sent = true;  // the receiver now owns the in-flight counts
    return true;
  }
  const Endpoint::Signalling signalling(c.out);
  for (Deadline until = deadline ? deadline : next_slice(deadline);; until = next_slice(deadline)) {
    AnnouncedSend st;
    try {
      st = c.out.send_datagram(frame, until);
    } catch (const SystemError& e) {
      if (e.error_code() == EPIPE || e.error_code() == ECONNRESET) throw_peer_closed();
      throw;
    }
    if (st == AnnouncedSend::kSent) break;
    if (st == AnnouncedSend::kClosed) throw_ring_closed();
    if (passed(deadline)) return false;
    if (hung_up(c)) throw_peer_closed();
  }
  c.out.notify();
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

ConnectionCore& live(const std::unique_ptr<ConnectionCore>& core, const char* call) {
  if (!core) throw ConnectionClosed(std::string(call) + " on a closed connection");
  return *core;
}

}  // namespace

std::vector<int> ConnectionAccess::fds(const Connection& c) {
  std::vector<int> out;
  if (!c.core_) return out;
  const ConnectionCore& k = *c.core_;
  out.push_back(k.sock.get());
  if (k.ringed()) {
    out.insert(out.end(), {k.depot_sock.get(), k.out.ring().fd(), k.in.ring().fd(),
                           k.out.ready_fd(), k.in.ready_fd()});
    if (const int e = k.epoll.load(std::memory_order_acquire); e >= 0) out.push_back(e);
  }
  return out;
}

ConnectionAccess::FdCounts ConnectionAccess::fd_counts(const Connection& c) noexcept {
  if (!c.core_) return {};
  return c.core_->out.depot().counts();
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
  core->out.ring().kick();
  // A peer waiting in poll() on its native_handle() sees the hang-up there itself.
  if (core->counted_by.load(std::memory_order_relaxed) == internal::fork_generation())
    core->in.unwant();
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
  c.in.want();
  return fd;
}

void ConnectionAccess::end_wait(Connection& conn) noexcept {
  if (conn.core_ && conn.core_->ringed()) conn.core_->in.unwant();
}

}  // namespace internal

int Connection::native_handle() const {
  if (!core_) return -1;
  ConnectionCore& c = *core_;
  if (!c.ringed()) return c.sock.get();
  const int fd = internal::readiness_epoll(c);
  const std::uint32_t me = internal::fork_generation();
  if (c.counted_by.exchange(me, std::memory_order_acq_rel) != me) c.in.want();
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
    const std::uint32_t seen = c.in.ring().publish_count();
    if (c.in.ring().has_ready() || internal::hung_up(c)) return true;
    if (internal::passed(deadline)) {
      c.in.rearm();
      return false;
    }
    c.in.ring().wait_for_publish(seen, internal::next_slice(deadline));
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

}  // namespace shmtensor
