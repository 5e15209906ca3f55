#include "transport/channel.h"

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "os/poll.h"
#include "os/socket.h"
#include "transport/busy_poll.h"
#include "wire/wire.h"

namespace shmtensor::internal {

static_assert(kMaxDatagram == kMaxInlineFrame + 8);

namespace {

using Clock = std::chrono::steady_clock;

std::optional<std::chrono::nanoseconds> time_left(const Deadline& deadline) {
  if (!deadline) return std::nullopt;
  return std::max(*deadline - Clock::now(), Clock::duration::zero());
}

}  // namespace

// (use_count() may read high while another thread drops its Decoder: that only costs an
// allocation.)
std::shared_ptr<std::byte[]> receive_buffer() {
  thread_local std::shared_ptr<std::byte[]> buffer;
  if (!buffer || buffer.use_count() > 1) buffer.reset(new std::byte[kMaxDatagram]);
  return buffer;
}

Deadline deadline_after(std::optional<std::chrono::nanoseconds> timeout) {
  if (!timeout) return std::nullopt;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(*timeout);
}

bool send_frame(int sock, OutgoingFrame& frame, Deadline deadline,
                std::span<const std::byte> prefix, const std::function<void()>& on_full) {
  const auto frame_parts = frame.parts();
  const std::array<std::span<const std::byte>, 4> with_prefix{prefix, frame_parts[0],
                                                              frame_parts[1], frame_parts[2]};
  const std::span<const std::span<const std::byte>> parts =
      prefix.empty() ? std::span<const std::span<const std::byte>>(frame_parts)
                     : std::span<const std::span<const std::byte>>(with_prefix);
  if (!deadline && !on_full) {
    send_message(sock, parts, frame.fds(), /*nonblocking=*/false);
  } else {
    // Non-blocking attempts, and poll for room in between: a blocking sendmsg could not
    // be interrupted at the deadline, nor make room itself.
    while (!send_message(sock, parts, frame.fds(), /*nonblocking=*/true)) {
      if (on_full) on_full();
      std::optional<std::chrono::nanoseconds> wait;
      if (on_full) wait = std::chrono::milliseconds(10);
      if (deadline) {
        const auto left = *time_left(deadline);
        if (left.count() == 0) return false;
        wait = wait ? std::min(*wait, left) : left;
      }
      (void)wait_writable(sock, wait);
    }
  }
  frame.sent = true;  // the receiver now owns the in-flight counts
  return true;
}

namespace {

Datagram datagram_of(Received&& r, std::shared_ptr<std::byte[]> buffer) {
  Datagram d;
  d.status = r.eof ? RecvStatus::kEof : RecvStatus::kOk;
  d.buffer = std::move(buffer);
  d.size = r.size;
  d.fds = std::move(r.fds);
  return d;
}

// One non-blocking receive: the socket's next datagram, or none (kTimeout) when it has
// none now.
Datagram take_datagram_now(int sock) {
  auto buffer = receive_buffer();
  Received r = receive_message(sock, std::span(buffer.get(), kMaxDatagram), /*nonblocking=*/true);
  if (r.would_block) return {};
  return datagram_of(std::move(r), std::move(buffer));
}

// Waits in the kernel (poll, or a blocking recvmsg) until `deadline` for one datagram.
Datagram wait_for_datagram(int sock, const Deadline& deadline) {
  for (;;) {
    // With a deadline, wait in poll and receive without blocking: another receiver may
    // take the datagram between the two, and then we wait again. A deadline already
    // passed needs no poll: the non-blocking receive says EAGAIN itself.
    if (deadline && Clock::now() < *deadline) {
      const int fds[1] = {sock};
      if (wait_readable(fds, time_left(deadline)).empty()) return {};
    }
    auto buffer = receive_buffer();
    Received r = receive_message(sock, std::span(buffer.get(), kMaxDatagram),
                                 /*nonblocking=*/deadline.has_value());
    if (r.would_block) {
      if (Clock::now() >= *deadline) return {};
      continue;
    }
    return datagram_of(std::move(r), std::move(buffer));
  }
}

}  // namespace

Datagram receive_datagram(int sock, Deadline deadline) {
  // Opt-in busy polling (busy_poll.h, poll_then_wait): non-blocking receives, one after the
  // other (no word to spin on in between), for up to the budget; then a wait in the kernel.
  return poll_then_wait(
      deadline, std::nullopt, [&] { return take_datagram_now(sock); },
      [](Clock::time_point) { return true; }, [&] { return wait_for_datagram(sock, deadline); });
}

Decoder parse_datagram(Datagram&& datagram) {
  const std::span<const std::byte> bytes(datagram.buffer.get(), datagram.size);
  return parse_frame(bytes, std::move(datagram.fds), std::move(datagram.buffer));
}

}  // namespace shmtensor::internal
