#include "shmtensor/connection.h"

#include <cerrno>

#include "os/poll.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "transport/channel.h"
#include "wire/wire.h"

namespace shmtensor {

void Connection::close() noexcept { internal::UniqueFd(std::exchange(fd_, -1)); }

Connection Connection::adopt(int fd) noexcept { return Connection(fd); }

int Connection::release() noexcept { return std::exchange(fd_, -1); }

bool Connection::poll(Timeout timeout) const {
  if (fd_ < 0) throw ConnectionClosed("poll() on a closed connection");
  const int fds[1] = {fd_};
  return !internal::wait_readable(fds, internal::to_nanoseconds(timeout)).empty();
}

namespace {

// The send path of every Connection: frame, then send.
bool send_until(int fd, Encoder&& encoder, internal::Deadline deadline) {
  if (fd < 0) throw ConnectionClosed("send() on a closed connection");
  try {
    internal::OutgoingFrame frame = internal::finish_frame(std::move(encoder));
    return internal::send_frame(fd, frame, deadline);
  } catch (const SystemError& e) {
    if (e.error_code() == EPIPE || e.error_code() == ECONNRESET)
      throw ConnectionClosed("send() on a connection whose peer has closed");
    throw;
  }
}

std::optional<Decoder> receive_until(int fd, internal::Deadline deadline) {
  if (fd < 0) throw ConnectionClosed("recv() on a closed connection");
  internal::Datagram d = internal::receive_datagram(fd, deadline);
  if (d.status == internal::RecvStatus::kEof)
    throw ConnectionClosed("recv(): the peer closed the connection");
  if (d.status == internal::RecvStatus::kTimeout) return std::nullopt;
  return internal::parse_datagram(std::move(d));
}

}  // namespace

void Connection::send_encoded(Encoder&& encoder) {
  send_until(fd_, std::move(encoder), std::nullopt);
}

bool Connection::try_send_encoded(Encoder&& encoder) {
  return send_until(fd_, std::move(encoder), std::chrono::steady_clock::now());
}

Decoder Connection::recv_encoded(std::optional<std::chrono::nanoseconds> timeout) {
  std::optional<Decoder> d = receive_until(fd_, internal::deadline_after(timeout));
  if (!d) throw Error("recv(): timed out");
  return std::move(*d);
}

std::optional<Decoder> Connection::try_recv_encoded(std::chrono::nanoseconds timeout) {
  return receive_until(fd_, internal::deadline_after(timeout));
}

std::pair<Connection, Connection> pipe() {
  auto [a, b] = internal::seqpacket_pair();
  return {Connection::adopt(a.release()), Connection::adopt(b.release())};
}

void Codec<Connection>::encode(Encoder& e, const Connection& c) {
  if (!c.valid()) throw Error("cannot send a closed connection");
  e.write_fd(c.native_handle());
}

Connection Codec<Connection>::decode(Decoder& d) { return Connection::adopt(d.take_fd()); }

}  // namespace shmtensor
