#include "shmtensor/connection.h"

#include "os/poll.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "transport/channel.h"

namespace shmtensor {

void Connection::close() noexcept { internal::UniqueFd(std::exchange(fd_, -1)); }

Connection Connection::adopt(int fd) noexcept { return Connection(fd); }

int Connection::release() noexcept { return std::exchange(fd_, -1); }

bool Connection::poll(std::optional<std::chrono::nanoseconds> timeout) const {
  if (fd_ < 0) throw ConnectionClosed("poll() on a closed connection");
  const int fds[1] = {fd_};
  return !internal::wait_readable(fds, timeout).empty();
}

void Connection::send_encoded(Encoder&& encoder) {
  if (fd_ < 0) throw ConnectionClosed("send() on a closed connection");
  try {
    internal::send_value(fd_, std::move(encoder));
  } catch (const SystemError& e) {
    if (e.error_code() == EPIPE || e.error_code() == ECONNRESET)
      throw ConnectionClosed("send() on a connection whose peer has closed");
    throw;
  }
}

Decoder Connection::recv_encoded(std::optional<std::chrono::nanoseconds> timeout) {
  if (fd_ < 0) throw ConnectionClosed("recv() on a closed connection");
  auto r = internal::recv_value(fd_, timeout);
  if (r.status == internal::RecvStatus::kEof)
    throw ConnectionClosed("recv(): the peer closed the connection");
  if (r.status == internal::RecvStatus::kTimeout) throw Error("recv(): timed out");
  return std::move(*r.decoder);
}

std::optional<Decoder> Connection::try_recv_encoded(std::chrono::nanoseconds timeout) {
  if (fd_ < 0) throw ConnectionClosed("recv() on a closed connection");
  auto r = internal::recv_value(fd_, timeout);
  if (r.status == internal::RecvStatus::kEof)
    throw ConnectionClosed("recv(): the peer closed the connection");
  if (r.status == internal::RecvStatus::kTimeout) return std::nullopt;
  return std::move(*r.decoder);
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
