// Unix SOCK_SEQPACKET sockets that carry whole messages with fds (SCM_RIGHTS).
#pragma once

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "os/unique_fd.h"

struct msghdr;

namespace shmtensor::internal {

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
// buffer (MSG_TRUNC) or its fds were cut (MSG_CTRUNC: names the fd limit and the other
// strategy); the fds that did arrive are closed.
Received receive_message(int sock, std::span<std::byte> buffer, bool nonblocking = false);

// Owns every fd that the SCM_RIGHTS messages of a received (or peeked) `msg` carry,
// appending them to `out`.
void take_passed_fds(msghdr& msg, std::vector<UniqueFd>& out);

// shutdown(SHUT_WR): readers of the peer get EOF after draining; writers get EPIPE.
void shutdown_write(int sock) noexcept;

}  // namespace shmtensor::internal
