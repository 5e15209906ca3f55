#include "os/unix_socket.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "os/syscall.h"

namespace shmtensor::internal {

namespace {

sockaddr_un make_address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() > max_unix_socket_path())
    throw Error("unix socket path is " + std::to_string(path.size()) + " bytes, longer than the " +
                std::to_string(max_unix_socket_path()) + " a socket address can hold: " + path +
                " — set SHMTENSOR_MANAGER_DIR (or XDG_RUNTIME_DIR) to a shorter directory");
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

}  // namespace

std::size_t max_unix_socket_path() noexcept { return sizeof(sockaddr_un::sun_path) - 1; }

UniqueFd seqpacket_listen(const std::string& path, int backlog) {
  sockaddr_un addr = make_address(path);
  UniqueFd fd(check_syscall("socket", "AF_UNIX, SOCK_SEQPACKET", [&] {
    return ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  }));
  check_syscall("bind", path, [&] {
    return ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  });
  check_syscall("listen", path, [&] { return ::listen(fd.get(), backlog); });
  return fd;
}

UniqueFd seqpacket_connect(const std::string& path, int* err) {
  sockaddr_un addr = make_address(path);
  UniqueFd fd(check_syscall("socket", "AF_UNIX, SOCK_SEQPACKET",
                            [&] { return ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0); }));
  // connect() on a unix socket completes at once (or fails); EINTR before that is retried.
  int rc = retry_eintr(
      [&] { return ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr); });
  if (rc == -1) {
    *err = errno;
    return UniqueFd();
  }
  *err = 0;
  return fd;
}

UniqueFd accept_connection(int listen_fd, int* err) {
  int fd = retry_eintr(
      [&] { return ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK); });
  if (fd < 0 && err) *err = errno;
  return UniqueFd(fd);  // -1 (invalid) on EAGAIN, ECONNABORTED, EMFILE...
}

PeerCredentials peer_credentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  check_syscall("getsockopt", "SO_PEERCRED",
                [&] { return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len); });
  return {cred.pid, cred.uid, cred.gid};
}

int send_packet(int fd, const void* data, std::size_t size, bool dont_wait) noexcept {
  int flags = MSG_NOSIGNAL | (dont_wait ? MSG_DONTWAIT : 0);
  ssize_t n = retry_eintr([&] { return ::send(fd, data, size, flags); });
  if (n < 0) return errno;
  // SOCK_SEQPACKET sends a message whole or fails; a short count cannot happen.
  return static_cast<std::size_t>(n) == size ? 0 : EMSGSIZE;
}

RecvResult recv_packet(int fd, void* buf, std::size_t capacity, bool dont_wait) noexcept {
  RecvResult r;
  msghdr msg{};
  iovec iov{buf, capacity};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  auto receive = [&] { return ::recvmsg(fd, &msg, dont_wait ? MSG_DONTWAIT : 0); };
  ssize_t n = retry_eintr(receive);
  if (n < 0 && errno == ECONNRESET) n = retry_eintr(receive);
  if (n < 0) {
    r.error = errno;
    r.size = -1;
    return r;
  }
  r.size = n;
  r.truncated = (msg.msg_flags & MSG_TRUNC) != 0;
  return r;
}

void set_socket_timeouts(int fd, int ms) {
  timeval tv{};
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  check_syscall("setsockopt", "SO_SNDTIMEO",
                [&] { return ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv); });
  check_syscall("setsockopt", "SO_RCVTIMEO",
                [&] { return ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); });
}

}  // namespace shmtensor::internal
