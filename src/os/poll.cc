#include "os/poll.h"

#include <poll.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <string>

#include "os/syscall.h"

namespace shmtensor::internal {

namespace {

// poll() until an event or the deadline; EINTR is retried with the time left. Returns the
// number of entries with events.
int poll_until(std::span<pollfd> pfds, std::optional<std::chrono::nanoseconds> timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
  for (;;) {
    int ms = -1;
    if (timeout) {
      // Rounded up: a wait of 0.4 ms must not become a busy poll(0) loop.
      auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      ms = static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1 << 30));
    }
    const int rc = ::poll(pfds.data(), pfds.size(), ms);
    if (rc >= 0) return rc;
    if (errno != EINTR) throw_system_error(errno, "poll", std::to_string(pfds.size()) + " fds");
  }
}

}  // namespace

std::vector<std::size_t> wait_readable(std::span<const int> fds,
                                       std::optional<std::chrono::nanoseconds> timeout) {
  // Nothing is allocated while the call blocks when there are few fds (the manager client's
  // watch thread waits on two for the life of a connection). A forked child inherits such a
  // thread's memory but not the thread, and LeakSanitizer reports what only that thread's
  // stack referenced.
  constexpr std::size_t kInline = 8;
  std::array<pollfd, kInline> inline_pfds{};
  std::array<std::size_t, kInline> inline_index{};
  std::vector<pollfd> heap_pfds;
  std::vector<std::size_t> heap_index;
  std::span<pollfd> pfds(inline_pfds);
  std::span<std::size_t> index(inline_index);
  if (fds.size() > kInline) {
    heap_pfds.resize(fds.size());
    heap_index.resize(fds.size());
    pfds = heap_pfds;
    index = heap_index;
  }
  std::size_t n = 0;
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) continue;
    pfds[n] = pollfd{fds[i], POLLIN, 0};
    index[n++] = i;
  }
  std::vector<std::size_t> ready;
  if (poll_until(pfds.first(n), timeout) == 0) return ready;
  for (std::size_t i = 0; i < n; ++i)
    if (pfds[i].revents != 0) ready.push_back(index[i]);
  return ready;
}

bool wait_writable(int fd, std::optional<std::chrono::nanoseconds> timeout) {
  pollfd p{fd, POLLOUT, 0};
  return poll_until(std::span(&p, 1), timeout) > 0;
}

bool hung_up_now(int fd) noexcept {
  pollfd p{fd, 0, 0};
  return retry_eintr([&] { return ::poll(&p, 1, 0); }) == 1 &&
         (p.revents & (POLLHUP | POLLERR)) != 0;
}

}  // namespace shmtensor::internal
