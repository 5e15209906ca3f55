// Unix SOCK_SEQPACKET sockets that carry whole messages with fds (SCM_RIGHTS).
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "os/unique_fd.h"
#include "shmtensor/error.h"

struct msghdr;

namespace shmtensor::internal {

// A received message lost file descriptors (MSG_CTRUNC): this process is at its open-file
// limit. A ProtocolError, as any message that cannot be used, but this process's own
// condition, not its sender's doing: a receiver that blames senders for messages it cannot
// decode (a DataLoader's main process) tells the two apart by this type.
class FdsCutError : public ProtocolError {
 public:
  using ProtocolError::ProtocolError;
};

// The kernel's limit of fds in one SCM_RIGHTS message (SCM_MAX_FD).
inline constexpr std::size_t kMaxFdsPerMessage = 253;

// socketpair(AF_UNIX, SOCK_SEQPACKET|SOCK_CLOEXEC). Send buffers are enlarged so that a
// bounded queue's items fit without blocking the sender.
std::pair<UniqueFd, UniqueFd> seqpacket_pair();

// Sends one datagram made of `parts` with `fds` attached (MSG_NOSIGNAL). Blocks while the
// socket's buffer is full unless `nonblocking`. Returns false only if nonblocking and the
// buffer is full. Throws SystemError (EPIPE when the peer end is shut down or closed).
bool send_message(int sock, std::span<const std::span<const std::byte>> parts,
                  std::span<const int> fds, bool nonblocking = false);

struct Received {
  std::size_t size = 0;        // bytes received (0 with eof = false: an empty datagram)
  bool eof = false;            // the peer closed or shut down, and nothing is left
  bool would_block = false;    // nonblocking and nothing there
  std::vector<UniqueFd> fds;   // owned; received with MSG_CMSG_CLOEXEC
};
// Receives one datagram into `buffer`. Throws ProtocolError if it was larger than the
// buffer (MSG_TRUNC), FdsCutError if its fds were cut (MSG_CTRUNC: names the fd limit and
// the other strategy); the fds that did arrive are closed.
Received receive_message(int sock, std::span<std::byte> buffer, bool nonblocking = false);

// Owns every fd that the SCM_RIGHTS messages of a received (or peeked) `msg` carry,
// appending them to `out`.
void take_passed_fds(msghdr& msg, std::vector<UniqueFd>& out);

// Peeks: looking at a queued datagram without taking it.
//
// recv(MSG_PEEK | MSG_DONTWAIT): copies the start of the socket's next datagram into `head`
// without taking it, and without its fds (a peek without a control buffer installs none).
// Returns the bytes copied, at most head.size() (0: an empty datagram, or the end of the
// stream), or nullopt when nothing is queued. EINTR and ECONNRESET (the peer's last copy
// closed with datagrams unread here, reported once: they are still here) are retried.
// Throws SystemError("recv", context), with no advice.
std::optional<std::size_t> peek_datagram_head(int sock, std::span<std::byte> head,
                                              const char* context);

struct Peeked {
  std::size_t size = 0;       // the datagram's whole length, however much of it was copied
  bool fds_cut = false;       // MSG_CTRUNC: some of its fds did not arrive (the fd limit)
  std::vector<UniqueFd> fds;  // owned: the copies of its fds the peek installed here
};
// recvmsg(MSG_PEEK | MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC) at the socket's peek
// offset (set_peek_offset; the head without one): copies the start of the datagram there
// into `head` and owns the fds it carries, every one, the moment the peek installs them.
// nullopt when nothing is queued there. EINTR and ECONNRESET are retried, as above. Throws
// SystemError("recvmsg", context), with no advice.
std::optional<Peeked> peek_message(int sock, std::span<std::byte> head, const char* context);

// setsockopt(SO_PEEK_OFF): the next peek starts `offset` bytes into the receive queue (of a
// SOCK_SEQPACKET socket: at the datagram that starts there). The offset is the socket's,
// shared by every holder of it, and a peek moves it by the bytes it copied. EINTR is
// retried. Throws SystemError("setsockopt(SO_PEEK_OFF)", context), with no advice.
void set_peek_offset(int sock, int offset, const char* context);
// SO_PEEK_OFF -1: peeks at the head again. Errors are ignored; never throws.
void clear_peek_offset(int sock) noexcept;
// Whether a peek at an offset starts at that offset on this kernel: probed once per
// process, on a scratch socket pair. Never throws (false when the probe cannot run).
bool peek_offset_works() noexcept;

// shutdown(SHUT_WR): readers of the peer get EOF after draining; writers get EPIPE.
void shutdown_write(int sock) noexcept;

}  // namespace shmtensor::internal
