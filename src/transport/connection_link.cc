// Making the ends of a Connection (connection_core.h): pipe()'s two ends, each with an
// Endpoint per direction over the rings and readiness fds of both links; and an end sent in
// a message (Codec<Connection>), whose fds are checked for what the end will use them as.
#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "os/event_fd.h"
#include "os/proc.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "transport/connection_core.h"
#include "wire/wire.h"

namespace shmtensor {

namespace internal {

void ConnectionCore::bind(Ring out_ring, UniqueFd out_ready, Ring in_ring,
                          UniqueFd in_ready) noexcept {
  auto words = [](LinkControl* c) {
    EndpointWords w;
    w.send_lock = &c->send_lock;
    w.recv_lock = &c->recv_lock;
    w.taken_below = &c->taken_below;
    w.readiness_wanted = &c->readiness_wanted;
    w.signalling = &c->signalling;
    return w;
  };
  // Each direction's depot table is in its LinkControl: this end deposits with the peer
  // through the outgoing one's, and fetches what the peer deposited through the incoming
  // one's, peeking at its own depot socket.
  auto* oc = reinterpret_cast<LinkControl*>(out_ring.user_area());
  auto* ic = reinterpret_cast<LinkControl*>(in_ring.user_area());
  EndpointWords ow = words(oc);
  ow.send_depot = &oc->depot;
  EndpointWords iw = words(ic);
  iw.recv_depot = &ic->depot;
  out.bind(std::move(out_ring), std::move(out_ready), ow,
           {.send = sock.get(), .deposit = depot_sock.get()}, kConnectionNames, kWakeAll);
  in.bind(std::move(in_ring), std::move(in_ready), iw,
          {.recv = sock.get(), .peek = depot_sock.get()}, kConnectionNames, kWakeAll);
}

namespace {

UniqueFd make_readiness_fd() {
  return make_event_fd("a connection's readiness fd", "raise `ulimit -n`");
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

}  // namespace internal

using internal::ConnectionCore;

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
  auto end = [](internal::UniqueFd sock, internal::UniqueFd depot, const Ring& out, const Ring& in,
                int out_ready, int in_ready) {
    auto core = std::make_unique<ConnectionCore>();
    core->sock = std::move(sock);
    core->depot_sock = std::move(depot);
    core->bind(Ring::attach(internal::dup_cloexec(out.fd())), internal::dup_cloexec(out_ready),
               Ring::attach(internal::dup_cloexec(in.fd())), internal::dup_cloexec(in_ready));
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
  e.write_fd(k.out.ring().fd());
  e.write_fd(k.in.ring().fd());
  e.write_fd(k.out.ready_fd());
  e.write_fd(k.in.ready_fd());
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
  internal::UniqueFd out_ready(d.take_fd());
  internal::UniqueFd in_ready(d.take_fd());
  // What the connection will use them as (os/event_fd.h).
  internal::require_event_fd(out_ready.get(), "connection readiness");
  internal::require_event_fd(in_ready.get(), "connection readiness");
  core->bind(internal::attach_link(std::move(out)), std::move(out_ready),
             internal::attach_link(std::move(in)), std::move(in_ready));
  return Connection(std::move(core));
}

}  // namespace shmtensor
