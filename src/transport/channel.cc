#include "transport/channel.h"

#include <algorithm>
#include <vector>

#include "os/poll.h"
#include "os/socket.h"
#include "wire/wire.h"

namespace shmtensor::internal {

bool send_value(int sock, Encoder&& encoder, bool nonblocking) {
  OutgoingFrame frame = finish_frame(std::move(encoder));
  return send_frame(sock, frame, nonblocking);
}

Incoming recv_value(int sock, std::optional<std::chrono::nanoseconds> timeout, bool* consumed) {
  // One buffer per thread: a datagram is at most kMaxInlineFrame bytes.
  thread_local std::vector<std::byte> buffer(kMaxInlineFrame);
  using Clock = std::chrono::steady_clock;
  const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
  for (;;) {
    // A zero timeout needs no poll(): the non-blocking recvmsg below says EAGAIN itself.
    if (timeout && timeout->count() > 0) {
      auto left = deadline - Clock::now();
      const int fds[1] = {sock};
      if (wait_readable(fds, std::max(left, decltype(left)::zero())).empty())
        return {RecvStatus::kTimeout, std::nullopt};
    }
    // With a timeout, receive without blocking: another receiver may have taken the
    // message between poll and recvmsg, in which case we wait again.
    Received r;
    try {
      r = receive_message(sock, buffer, timeout.has_value());
    } catch (const ProtocolError&) {
      // MSG_CTRUNC / MSG_TRUNC: the datagram was taken (and its fds closed).
      if (consumed != nullptr) *consumed = true;
      throw;
    }
    if (r.would_block) {
      if (timeout && timeout->count() <= 0) return {RecvStatus::kTimeout, std::nullopt};
      continue;
    }
    if (r.eof) return {RecvStatus::kEof, std::nullopt};
    if (consumed != nullptr) *consumed = true;
    return {RecvStatus::kOk,
            parse_frame(std::span<const std::byte>(buffer.data(), r.size), std::move(r.fds))};
  }
}

}  // namespace shmtensor::internal
