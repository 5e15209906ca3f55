// Unix-domain SOCK_SEQPACKET sockets (one send is one message, delivered whole or not at
// all, in order) bound to a path, for the manager daemon and its client.
//
// Every socket is created close-on-exec. Sends use MSG_NOSIGNAL: a peer that died is an
// EPIPE/ECONNRESET return value, never a SIGPIPE.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// Bytes a socket path may have (sun_path without its terminating NUL): 107 on Linux.
std::size_t max_unix_socket_path() noexcept;

// Binds and listens on `path` (which must not exist). The socket is non-blocking.
// Throws SystemError; a path longer than max_unix_socket_path() is an Error naming it.
UniqueFd seqpacket_listen(const std::string& path, int backlog);

// Connects a blocking socket to `path`. On failure returns an invalid fd and stores errno
// in *err (ENOENT or ECONNREFUSED mean that nobody listens there).
UniqueFd seqpacket_connect(const std::string& path, int* err);

// accept4 (close-on-exec, non-blocking). Invalid fd when no connection is pending, the
// pending one was reset before we took it, or this process (EMFILE) or the system (ENFILE)
// has no fd to give it; then *err, when given, is errno.
UniqueFd accept_connection(int listen_fd, int* err = nullptr);

struct PeerCredentials {
  pid_t pid = 0;  // 0 when the peer is in a pid namespace this process cannot see
  uid_t uid = 0;
  gid_t gid = 0;
};
// SO_PEERCRED: who connected (as of connect()). Throws SystemError.
PeerCredentials peer_credentials(int fd);

// Sends one message with MSG_NOSIGNAL (and MSG_DONTWAIT if dont_wait). Retries EINTR.
// Returns 0 or the errno. Async-signal-safe (used in a fork child handler).
int send_packet(int fd, const void* data, std::size_t size, bool dont_wait) noexcept;

struct RecvResult {
  long size = 0;           // bytes received; 0 at end of stream
  int error = 0;           // errno (EAGAIN when nothing is pending on a non-blocking read)
  bool truncated = false;  // the message was longer than the buffer (and is lost)
};
// Receives one message. Retries EINTR, and ECONNRESET once: a peer that closed with our
// messages unread makes the next receive report it before what that peer sent (a refusal),
// which is still queued.
RecvResult recv_packet(int fd, void* buf, std::size_t capacity, bool dont_wait) noexcept;

// SO_SNDTIMEO / SO_RCVTIMEO: a blocking send or recv gives up with EAGAIN after `ms`.
void set_socket_timeouts(int fd, int ms);

}  // namespace shmtensor::internal
