#include "os/epoll.h"

#include <sys/epoll.h>

#include <algorithm>
#include <cerrno>

#include "os/syscall.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

static_assert(kEpollIn == EPOLLIN);
static_assert(kEpollReadHangup == EPOLLRDHUP);
static_assert(kEpollOneShot == EPOLLONESHOT);

UniqueFd make_epoll(const std::string& context, const std::string& advice) {
  UniqueFd fd = try_make_epoll();
  if (!fd.valid()) throw_system_error(errno, "epoll_create1", context, advice);
  return fd;
}

UniqueFd try_make_epoll() noexcept { return UniqueFd(::epoll_create1(EPOLL_CLOEXEC)); }

void add_to_epoll(int epoll, int fd, std::uint32_t events, std::uint64_t data,
                  const std::string& context) {
  // No advice: ENOMEM and ENOSPC (fs.epoll.max_user_watches) here are not about memory or
  // /dev/shm.
  if (!try_add_to_epoll(epoll, fd, events, data)) throw SystemError(errno, "epoll_ctl", context);
}

bool try_add_to_epoll(int epoll, int fd, std::uint32_t events, std::uint64_t data) noexcept {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = data;
  return ::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &ev) == 0;
}

void remove_from_epoll(int epoll, int fd) noexcept {
  (void)::epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nullptr);
}

int wait_epoll(int epoll, std::span<std::uint64_t> ready) noexcept {
  epoll_event events[16];
  const int most = static_cast<int>(std::min<std::size_t>(ready.size(), 16));
  const int n = retry_eintr([&] { return ::epoll_wait(epoll, events, most, -1); });
  for (int i = 0; i < n; ++i) ready[i] = events[i].data.u64;
  return n;
}

}  // namespace shmtensor::internal
