// One end of a Connection in one process (transport/connection.cc): its socket and, for an
// end made by pipe(), an Endpoint per direction (endpoint.h) and the state of its looks at
// the peer. Shared by the send side (connection.cc), the making of ends
// (connection_link.cc) and the receive side (connection_receive.cc).
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

#include "os/unique_fd.h"
#include "transport/channel.h"
#include "transport/endpoint.h"
#include "transport/link_control.h"

namespace shmtensor {
class Tensor;
}

namespace shmtensor::internal {

// Each direction's ring: 256 slots of 1 KiB (256 KiB; a message of up to 1,008 bytes fits a
// slot). A sender waits when its peer has 256 messages it has not taken.
inline constexpr std::uint32_t kConnectionRingSlots = 256;
inline constexpr std::uint32_t kConnectionRingSlotBytes = 1024;
// How long a blocked send or receive waits before it looks at the socket again.
inline constexpr auto kConnectionWaitSlice = std::chrono::milliseconds(50);
// A publish wakes every sleeper of the ring: receivers, and poll() callers, which take
// nothing (woken alone, one would leave a receiver asleep, with no time limit). A
// FUTEX_WAKE costs the same with one sleeper.
inline constexpr int kWakeAll = INT_MAX;

struct ConnectionCore {
  UniqueFd sock;
  // An end made by pipe(): one end of a second socket pair, which carries only deposits
  // (fds once per segment) and is never read, only peeked: what the peer deposits for us
  // queues here, and what we deposit for the peer queues at its end.
  UniqueFd depot_sock;
  // An end made by pipe(): the direction it sends in (its readiness fd is the peer's) and
  // the one it receives from (bind(), once both rings are attached).
  Endpoint out;
  Endpoint in;
  // The fork generation (os/proc.h) of the process whose native_handle() counted this
  // handle as a reader of the readiness fd; 0: none. Only that process takes it back, at
  // close(): a forked child's copy counts itself when it asks.
  std::atomic<std::uint32_t> counted_by{0};
  // native_handle()'s epoll fd, made on first use (a CAS from -1: no mutex a forked child
  // could inherit locked).
  mutable std::atomic<int> epoll{-1};
  // close_epoch of each direction as a sender (out) and a receiver (in) last saw it, and
  // when a sender last looked at the socket.
  std::atomic<std::uint32_t> seen_out_epoch{0};
  std::atomic<std::uint32_t> seen_in_epoch{0};
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

  ~ConnectionCore();
  // Ends this process's watch, if it made one (before the socket closes).
  void unwatch() noexcept;
  bool ringed() const noexcept { return in.ring().fd() >= 0; }
  // Attaches the two directions' rings and readiness fds (their LinkControl checked).
  void bind(Ring out_ring, UniqueFd out_ready, Ring in_ring, UniqueFd in_ready) noexcept;
  LinkControl* out_control() const noexcept {
    return reinterpret_cast<LinkControl*>(out.ring().user_area());
  }
  LinkControl* in_control() const noexcept {
    return reinterpret_cast<LinkControl*>(in.ring().user_area());
  }
};

// Whether the peer is gone: the socket hung up (remembered in peer_gone).
bool hung_up(ConnectionCore& c) noexcept;
[[noreturn]] void throw_ring_closed();
Deadline next_slice(const Deadline& deadline);
inline bool passed(const Deadline& deadline) {
  return deadline && std::chrono::steady_clock::now() >= *deadline;
}

// The receive side (connection_receive.cc). nullopt / false: the deadline passed first.
// Throw ConnectionClosed once the peer is gone and everything it sent was taken.
std::optional<Decoder> recv_ringed(ConnectionCore& c, const Deadline& deadline);
bool recv_tensor_ringed(ConnectionCore& c, const Deadline& deadline, Tensor& out);
// An end adopted from a bare socket: every message a datagram.
std::optional<Decoder> recv_socket(int fd, const Deadline& deadline);
// What recv<Tensor> does with a message the general way: the whole of it, as a Tensor.
void decode_tensor(Decoder d, Tensor& out);

}  // namespace shmtensor::internal
