#include "transport/endpoint.h"

#include <string>
#include <utility>

#include "os/event_fd.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

void Endpoint::bind(Ring ring, UniqueFd ready_fd, const EndpointWords& words,
                    const EndpointSockets& sockets, const ChannelNames& names, int wake) noexcept {
  ring_ = std::move(ring);
  ready_fd_ = std::move(ready_fd);
  words_ = words;
  sockets_ = sockets;
  names_ = &names;
  wake_ = wake;
  depot_.bind(words.send_depot, sockets.deposit, words.recv_depot, sockets.peek);
}

AnnouncedPath Endpoint::path(const SegmentFetcher* fetcher) noexcept {
  return {&ring_,           sockets_.send,    sockets_.recv,
          words_.send_lock, words_.recv_lock, words_.taken_below,
          fetcher,          names_,           wake_};
}

OutgoingFrame Endpoint::frame(Encoder&& encoder) {
  const FdElision elision = depot_.elision();
  return finish_frame(std::move(encoder), &elision);
}

bool Endpoint::fits_slot(const OutgoingFrame& frame) const noexcept {
  if (!frame.fds().empty()) return false;
  std::size_t size = 0;
  for (const auto& part : frame.parts()) size += part.size();
  return size <= ring_.max_message();
}

AnnouncedSend Endpoint::send_datagram(OutgoingFrame& frame, const Deadline& deadline) {
  const SegmentFetcher fetcher = depot_.fetcher();  // for dead datagrams it drops
  return send_announced(path(&fetcher), frame, deadline);
}

std::optional<Decoder> Endpoint::receive(std::shared_ptr<std::byte[]> buffer, std::byte* data,
                                         const Ring::Popped& p, const Deadline& deadline) {
  const SegmentFetcher fetcher = depot_.fetcher();
  if (p.tag == kRingMessageTag) {
    // Aliasing: the decoder keeps the whole buffer alive, and reads its own bytes.
    return parse_frame(std::span<const std::byte>(data, p.size), {},
                       std::shared_ptr<const void>(std::move(buffer), data), &fetcher);
  }
  if (p.tag != kRingMarkerTag)
    throw ProtocolError(std::string("a slot of the ") + names_->owner + "'s ring has tag " +
                        std::to_string(p.tag) + ", neither a message nor a marker");
  buffer.reset();  // the datagram is received into the same per-thread buffer
  const AnnouncedPath path = this->path(&fetcher);
  std::optional<Datagram> datagram = take_announced(path, p.pos, deadline);
  if (!datagram) {
    notify();  // a readiness fd cleared when the marker was popped says "ready" again
    return std::nullopt;
  }
  Decoder d = parse_announced(path, std::move(*datagram));
  depot_.pin_received(d);
  return d;
}

void Endpoint::signal_ready() noexcept { signal_event_fd(ready_fd_.get()); }

bool Endpoint::readable_now() const noexcept {
  return ring_.has_ready() ||
         (words_.closed != nullptr && words_.closed->load(std::memory_order_seq_cst) != 0);
}

void Endpoint::rearm_wanted() noexcept {
  if (readable_now()) return;
  wait_for_signallers(*words_.signalling, stuck_signalling_);
  drain_event_fd(ready_fd_.get());
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (readable_now()) signal_event_fd(ready_fd_.get());
}

void Endpoint::want() noexcept {
  words_.readiness_wanted->fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (readable_now())
    signal_event_fd(ready_fd_.get());
  else
    rearm();
}

void Endpoint::unwant() noexcept {
  auto& wanted = *words_.readiness_wanted;
  std::uint32_t n = wanted.load(std::memory_order_relaxed);  // never below 0
  while (n > 0 && !wanted.compare_exchange_weak(n, n - 1, std::memory_order_seq_cst)) {
  }
}

}  // namespace shmtensor::internal
