#include "os/poll.h"

#include <poll.h>

#include <algorithm>
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
  std::vector<pollfd> pfds;
  std::vector<std::size_t> index;
  pfds.reserve(fds.size());
  index.reserve(fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) continue;
    pfds.push_back(pollfd{fds[i], POLLIN, 0});
    index.push_back(i);
  }
  std::vector<std::size_t> ready;
  if (poll_until(pfds, timeout) == 0) return ready;
  for (std::size_t i = 0; i < pfds.size(); ++i)
    if (pfds[i].revents != 0) ready.push_back(index[i]);
  return ready;
}

bool wait_writable(int fd, std::optional<std::chrono::nanoseconds> timeout) {
  pollfd p{fd, POLLOUT, 0};
  return poll_until(std::span(&p, 1), timeout) > 0;
}

}  // namespace shmtensor::internal
