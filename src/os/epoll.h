// epoll sets: a Connection's readiness fd (native_handle(): the socket's hang-up and the
// end's eventfd, under one fd a user can poll), and the hang-up watch's one set of sockets.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// The events an fd is watched for (epoll's own values). EPOLLHUP and EPOLLERR are always
// reported.
inline constexpr std::uint32_t kEpollIn = 0x001;           // EPOLLIN: readable
inline constexpr std::uint32_t kEpollReadHangup = 0x2000;  // EPOLLRDHUP: the peer shut down
inline constexpr std::uint32_t kEpollOneShot = 1u << 30;   // EPOLLONESHOT: once, then disarmed

// epoll_create1(EPOLL_CLOEXEC). Throws SystemError("epoll_create1", context, advice).
UniqueFd make_epoll(const std::string& context, const std::string& advice = {});
// The same, never throwing: invalid (errno set) when no fd could be had.
UniqueFd try_make_epoll() noexcept;

// epoll_ctl(EPOLL_CTL_ADD): `fd` is watched for `events`, and reported with `data`. Throws
// SystemError("epoll_ctl", context), with no advice.
void add_to_epoll(int epoll, int fd, std::uint32_t events, std::uint64_t data,
                  const std::string& context);
// The same, never throwing: false (errno set) when epoll refuses the fd.
bool try_add_to_epoll(int epoll, int fd, std::uint32_t events, std::uint64_t data) noexcept;
// epoll_ctl(EPOLL_CTL_DEL). An fd that is not in the set is ignored. Never throws.
void remove_from_epoll(int epoll, int fd) noexcept;

// epoll_wait with no time limit (EINTR is retried): writes the data of each ready fd to
// `ready`, at most 16 and at most ready.size() at a time. Returns how many, or -1 (errno
// set) on an error. Never throws.
int wait_epoll(int epoll, std::span<std::uint64_t> ready) noexcept;

}  // namespace shmtensor::internal
