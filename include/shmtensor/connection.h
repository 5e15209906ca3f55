// Connection: a duplex, point-to-point channel between two processes that carries
// encodable values (see codec.h). pipe() makes a connected pair; give one end to a child
// (fork inherits it; it can also be sent over another connection or queue, and passed to
// a child started with the exec start method).
//
// Tensors travel by reference: send() moves an unshared storage into shared memory in
// place, then only a descriptor travels; the received tensor is a view of the same memory.
// With file_descriptor the segment fds ride on the same message (SCM_RIGHTS), so the sender
// may exit right after send().
//
// Thread safety: send() and recv() may be called concurrently from several threads; each
// message is delivered whole to one recv(). close() must not race with other calls.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <utility>

#include "shmtensor/codec.h"
#include "shmtensor/internal/duration.h"

namespace shmtensor {

namespace internal {
struct ConnectionAccess;  // internal/connection_access.h
}  // namespace internal

// recv() on a connection whose peer closed (or that was closed here).
class ConnectionClosed : public Error {
 public:
  explicit ConnectionClosed(const std::string& what) : Error(what) {}
};

class Connection {
 public:
  Connection() = default;  // not connected: valid() is false
  Connection(Connection&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Connection& operator=(Connection&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection() { close(); }

  // Blocks while the socket's buffer is full. Throws ConnectionClosed when the peer has
  // closed, SharedMemoryFullError / SystemError when shared memory for a tensor cannot be
  // made, Error for a message that needs more than 253 fds.
  template <class T>
  void send(const T& value) {
    Encoder e;
    e.encode(value);
    send_encoded(std::move(e));
  }
  // Like send() but never waits: false, and nothing sent, when the socket's buffer is full.
  // The value's tensors are moved into shared memory all the same.
  template <class T>
  [[nodiscard]] bool try_send(const T& value) {
    Encoder e;
    e.encode(value);
    return try_send_encoded(std::move(e));
  }
  // Blocks until a message arrives. Throws ConnectionClosed at EOF, ProtocolError for a
  // malformed message, SystemError when a well-formed message names shared memory that
  // cannot be opened or mapped here (e.g. ENOENT: a file_system segment whose name was
  // removed; EMFILE / ENOMEM). The message is consumed either way and the connection stays
  // usable for the next one.
  template <class T>
  T recv() {
    Decoder d = recv_encoded(std::nullopt);
    T value = d.decode<T>();
    d.finish();
    return value;
  }
  // Like recv() but gives up after `timeout` (any std::chrono duration; zero: only look),
  // returning nullopt.
  template <class T>
  [[nodiscard]] std::optional<T> try_recv(Duration timeout = Duration::zero()) {
    std::optional<Decoder> d = try_recv_encoded(internal::to_nanoseconds(timeout));
    if (!d) return std::nullopt;
    T value = d->decode<T>();
    d->finish();
    return value;
  }
  // True when a message (or EOF) is ready; waits up to timeout (nullopt = forever).
  [[nodiscard]] bool poll(Timeout timeout = Duration::zero()) const;
  void close() noexcept;
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }

  // The socket fd (owned by this object), e.g. to poll several connections at once.
  [[nodiscard]] int native_handle() const noexcept { return fd_; }
  // Takes ownership of a connected SOCK_SEQPACKET unix socket.
  [[nodiscard]] static Connection adopt(int fd) noexcept;
  // Gives up ownership of the socket: the caller closes it.
  [[nodiscard]] int release() noexcept;

 private:
  friend struct internal::ConnectionAccess;
  explicit Connection(int fd) noexcept : fd_(fd) {}
  void send_encoded(Encoder&& encoder);
  bool try_send_encoded(Encoder&& encoder);
  Decoder recv_encoded(std::optional<std::chrono::nanoseconds> timeout);
  std::optional<Decoder> try_recv_encoded(std::chrono::nanoseconds timeout);
  int fd_ = -1;
};

// A connected pair of duplex connections.
std::pair<Connection, Connection> pipe();

// A Connection travels as a duplicate of its socket.
template <>
struct Codec<Connection> {
  static void encode(Encoder& e, const Connection& c);
  static Connection decode(Decoder& d);
};

}  // namespace shmtensor
