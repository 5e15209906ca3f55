// Connection: a duplex, point-to-point channel between two processes that carries
// encodable values (see codec.h). pipe() makes a connected pair; give one end to a child
// (fork inherits it; it can also be sent over another connection or queue, and passed to
// a child started with the exec start method).
//
// Tensors travel by reference: send() moves an unshared storage into shared memory in
// place, then only a descriptor travels; the received tensor is a view of the same memory.
// With file_descriptor a segment's fd rides on the first message that names it (SCM_RIGHTS)
// and is deposited with the peer, so the sender may exit right after send(); later messages
// name the segment without it.
//
// A connection made by pipe() carries its messages in a ring of slots in shared memory, one
// each way: a message without fds that fits a slot costs no syscall while the receiver is
// awake. Messages with fds (or larger) go over a SOCK_SEQPACKET socket pair, in order with
// the others; the socket also says when the peer is gone (docs/transport.md). A recv()
// blocked when its peer is killed wakes at once: while an end whose receive slept is open,
// one thread of the library per process ("shmtensor-watch") watches its socket.
//
// A Tensor alone (send<Tensor>, recv<Tensor>) is framed and parsed without an Encoder or a
// Decoder; the bytes are the same, so any receiver reads them.
//
// Thread safety: send() and recv() may be called concurrently from several threads; each
// message is delivered whole to one recv(). close() must not race with other calls.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/duration.h"

namespace shmtensor {

namespace internal {
struct ConnectionAccess;  // internal/connection_access.h
struct ConnectionCore;    // src/transport/connection_core.h
}  // namespace internal

// recv() on a connection whose peer closed (or that was closed here).
class SHMTENSOR_API ConnectionClosed : public Error {
 public:
  explicit ConnectionClosed(const std::string& what) : Error(what) {}
};

class SHMTENSOR_API Connection {
 public:
  Connection() noexcept;  // not connected: valid() is false
  Connection(Connection&& other) noexcept;
  Connection& operator=(Connection&& other) noexcept;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection();

  // Blocks while the ring (or the socket's buffer) is full. Throws ConnectionClosed when the
  // peer has closed (noticed at once when it called close(), within ~10 ms when it died),
  // SharedMemoryFullError / SystemError when shared memory for a tensor cannot be made,
  // Error for a message that needs more than 253 fds.
  template <class T>
  void send(const T& value) {
    if constexpr (std::is_same_v<T, Tensor>) {
      if (send_tensor(value, true).has_value()) return;  // sent; nullopt: not its shape
    }
    Encoder e;
    e.encode(value);
    send_encoded(std::move(e));
  }
  // Like send() but never waits: false, and nothing sent, when the ring or the socket's
  // buffer is full.
  // The value's tensors are moved into shared memory all the same.
  template <class T>
  [[nodiscard]] bool try_send(const T& value) {
    if constexpr (std::is_same_v<T, Tensor>) {
      if (const std::optional<bool> sent = send_tensor(value, false)) return *sent;
    }
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
    if constexpr (std::is_same_v<T, Tensor>) {
      Tensor t;
      (void)recv_tensor(std::nullopt, t);  // no timeout: always a tensor (or an exception)
      return t;
    }
    Decoder d = recv_encoded(std::nullopt);
    T value = d.decode<T>();
    d.finish();
    return value;
  }
  // Like recv() but gives up after `timeout` (any std::chrono duration; zero: only look),
  // returning nullopt.
  template <class T>
  [[nodiscard]] std::optional<T> try_recv(Duration timeout = Duration::zero()) {
    if constexpr (std::is_same_v<T, Tensor>) {
      std::optional<Tensor> t(std::in_place);
      if (!recv_tensor(internal::to_nanoseconds(timeout), *t)) t.reset();
      return t;
    }
    std::optional<Decoder> d = try_recv_encoded(internal::to_nanoseconds(timeout));
    if (!d) return std::nullopt;
    T value = d->decode<T>();
    d->finish();
    return value;
  }
  // True when a message (or EOF) is ready; waits up to timeout (nullopt = forever).
  [[nodiscard]] bool poll(Timeout timeout = Duration::zero()) const;
  void close() noexcept;
  [[nodiscard]] bool valid() const noexcept { return core_ != nullptr; }

  // An fd (owned by this object) that polls readable while a message may be there or the
  // peer has gone, e.g. to poll several connections at once (Python's fileno()). For a
  // connection made by pipe() it is an epoll fd over the socket and an eventfd the peer
  // signals, made on the first call; from then on every message sent to this end costs
  // its sender a write() to that eventfd. For an adopted socket: the socket. Throws
  // SystemError when no fd can be made (the open-file limit).
  [[nodiscard]] int native_handle() const;
  // Takes ownership of a connected SOCK_SEQPACKET unix socket: a connection whose messages
  // all travel on it (the peer must be one too: adopt() of the other end).
  [[nodiscard]] static Connection adopt(int fd);
  // Gives up ownership of the socket of an adopted connection: the caller closes it.
  // -1, and nothing changes, for a connection made by pipe() (its socket alone does not
  // carry the messages in its rings).
  [[nodiscard]] int release() noexcept;

 private:
  friend struct internal::ConnectionAccess;
  friend struct Codec<Connection>;
  explicit Connection(std::unique_ptr<internal::ConnectionCore> core) noexcept;
  void send_encoded(Encoder&& encoder);
  bool try_send_encoded(Encoder&& encoder);
  Decoder recv_encoded(std::optional<std::chrono::nanoseconds> timeout);
  std::optional<Decoder> try_recv_encoded(std::chrono::nanoseconds timeout);
  // A Tensor alone, the commonest message, without an Encoder or a Decoder (docs/transport.md,
  // "One tensor"): sent or not (try_send found no room); nullopt when it is not of the shape
  // that path frames (the caller encodes it). Received into `out`: false at the timeout.
  std::optional<bool> send_tensor(const Tensor& t, bool wait);
  bool recv_tensor(std::optional<std::chrono::nanoseconds> timeout, Tensor& out);
  std::unique_ptr<internal::ConnectionCore> core_;
};

// A connected pair of duplex connections (a socket pair and a ring each way).
SHMTENSOR_API std::pair<Connection, Connection> pipe();

// A Connection travels as duplicates of its fds: the socket, and for one made by pipe() its
// two rings and two eventfds.
template <>
struct SHMTENSOR_API Codec<Connection> {
  static void encode(Encoder& e, const Connection& c);
  static Connection decode(Decoder& d);
};

}  // namespace shmtensor
