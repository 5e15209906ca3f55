#include "os/socket.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstring>

#include "os/syscall.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

std::pair<UniqueFd, UniqueFd> seqpacket_pair() {
  int sv[2];
  check_syscall("socketpair", "AF_UNIX, SOCK_SEQPACKET",
                [&] { return ::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv); });
  UniqueFd a(sv[0]), b(sv[1]);
  // Larger send buffers: each datagram costs its truesize (~1 KiB for a small one) against
  // the sender's SO_SNDBUF. SO_SNDBUFFORCE works for root; otherwise SO_SNDBUF is capped at
  // net.core.wmem_max. Failure only means a smaller buffer, so it is ignored.
  int size = 8 << 20;
  for (int fd : {a.get(), b.get()}) {
    if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &size, sizeof size) != 0)
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  }
  return {std::move(a), std::move(b)};
}

bool send_message(int sock, std::span<const std::span<const std::byte>> parts,
                  std::span<const int> fds, bool nonblocking) {
  iovec iov[8];
  if (parts.size() > 8) throw Error("send_message: too many parts");
  for (std::size_t i = 0; i < parts.size(); ++i) {
    iov[i].iov_base = const_cast<std::byte*>(parts[i].data());
    iov[i].iov_len = parts[i].size();
  }
  if (fds.size() > kMaxFdsPerMessage)
    throw Error("a message may carry at most 253 fds, this one needs " +
                std::to_string(fds.size()));
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = parts.size();
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  int flags = MSG_NOSIGNAL | (nonblocking ? MSG_DONTWAIT : 0);
  ssize_t n = retry_eintr([&] { return ::sendmsg(sock, &msg, flags); });
  if (n == -1) {
    if (nonblocking && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    throw_system_error(errno, "sendmsg",
                       "shmtensor message with " + std::to_string(fds.size()) + " fds");
  }
  return true;
}

Received receive_message(int sock, std::span<std::byte> buffer, bool nonblocking) {
  iovec iov{buffer.data(), buffer.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  int flags = MSG_CMSG_CLOEXEC | (nonblocking ? MSG_DONTWAIT : 0);
  // ECONNRESET: the peer's last copy closed while its own receive queue held datagrams
  // (reported once, by the next receive, even with datagrams queued here): what is queued
  // here is still whole, so receive again.
  ssize_t n;
  do n = retry_eintr([&] { return ::recvmsg(sock, &msg, flags); });
  while (n == -1 && errno == ECONNRESET);
  Received r;
  if (n == -1) {
    if (nonblocking && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      r.would_block = true;
      return r;
    }
    throw_system_error(errno, "recvmsg", "shmtensor message");
  }
  // Take ownership of every fd that arrived before judging the message, so none leaks.
  take_passed_fds(msg, r.fds);
  if (msg.msg_flags & MSG_CTRUNC) {
    throw FdsCutError(
        "a received message lost some of its file descriptors (MSG_CTRUNC): this process is "
        "at its open-file limit. Raise it with `ulimit -n` (see `shmtensor doctor`), or call "
        "set_sharing_strategy(\"file_system\") in the sending process, which passes no fds");
  }
  if (msg.msg_flags & MSG_TRUNC)
    throw ProtocolError("a received message was larger than the " + std::to_string(buffer.size()) +
                        "-byte datagram limit");
  r.size = static_cast<std::size_t>(n);
  // recvmsg returns 0 both at end of stream and for an empty datagram, which any holder of
  // the socket can send: only the socket's own state says which. End of stream: the peer
  // shut down (POLLRDHUP) and no bytes are queued behind (SIOCINQ, the sum of the queued
  // datagrams' sizes for SOCK_SEQPACKET; after a shutdown nothing new can arrive). An
  // empty datagram is returned as one (size 0; the frame parser refuses it), so no peer
  // can forge an EOF, nor hide the items queued behind it after a close().
  if (n == 0) {
    pollfd p{sock, POLLRDHUP, 0};
    int queued = 0;
    r.eof = retry_eintr([&] { return ::poll(&p, 1, 0); }) == 1 &&
            (p.revents & (POLLRDHUP | POLLHUP)) != 0 && ::ioctl(sock, SIOCINQ, &queued) == 0 &&
            queued == 0;
  }
  return r;
}

void take_passed_fds(msghdr& msg, std::vector<UniqueFd>& out) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      out.reserve(out.size() + count);  // one allocation for the list, not one per fd
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        out.emplace_back(fd);
      }
    }
  }
}

std::optional<std::size_t> peek_datagram_head(int sock, std::span<std::byte> head,
                                              const char* context) {
  for (;;) {
    const ssize_t n = ::recv(sock, head.data(), head.size(), MSG_PEEK | MSG_DONTWAIT);
    if (n >= 0) return static_cast<std::size_t>(n);
    if (errno == EINTR || errno == ECONNRESET) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return std::nullopt;
    throw SystemError(errno, "recv", context);
  }
}

std::optional<Peeked> peek_message(int sock, std::span<std::byte> head, const char* context) {
  iovec iov{head.data(), head.size()};
  // Room for every fd a datagram can carry, and for credentials should the socket pass them.
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage) +
                                CMSG_SPACE(sizeof(ucred)) + CMSG_SPACE(sizeof(int))];
  for (;;) {
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n =
        ::recvmsg(sock, &msg, MSG_PEEK | MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
    if (n < 0 && (errno == EINTR || errno == ECONNRESET)) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::nullopt;
    if (n < 0) throw SystemError(errno, "recvmsg", context);
    std::optional<Peeked> p(std::in_place);
    take_passed_fds(msg, p->fds);
    p->size = static_cast<std::size_t>(n);
    p->fds_cut = (msg.msg_flags & MSG_CTRUNC) != 0;
    return p;
  }
}

void set_peek_offset(int sock, int offset, const char* context) {
  while (::setsockopt(sock, SOL_SOCKET, SO_PEEK_OFF, &offset, sizeof offset) != 0) {
    if (errno != EINTR) throw SystemError(errno, "setsockopt(SO_PEEK_OFF)", context);
  }
}

void clear_peek_offset(int sock) noexcept {
  const int none = -1;
  (void)::setsockopt(sock, SOL_SOCKET, SO_PEEK_OFF, &none, sizeof none);
}

bool peek_offset_works() noexcept {
  static const bool works = [] {
    try {
      auto [a, b] = seqpacket_pair();
      const char one[1] = {'a'}, two[2] = {'b', 'c'};
      if (::send(a.get(), one, 1, MSG_DONTWAIT) != 1 || ::send(a.get(), two, 2, MSG_DONTWAIT) != 2)
        return false;
      int offset = 1;
      if (::setsockopt(b.get(), SOL_SOCKET, SO_PEEK_OFF, &offset, sizeof offset) != 0) return false;
      char got[4] = {};
      const ssize_t n = ::recv(b.get(), got, sizeof got, MSG_PEEK | MSG_DONTWAIT | MSG_TRUNC);
      return n == 2 && got[0] == 'b' && got[1] == 'c';
    } catch (...) {
      return false;
    }
  }();
  return works;
}

void shutdown_write(int sock) noexcept { ::shutdown(sock, SHUT_WR); }

}  // namespace shmtensor::internal
