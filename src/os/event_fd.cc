#include "os/event_fd.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "os/proc.h"
#include "os/syscall.h"
#include "shmtensor/error.h"

namespace shmtensor::internal {

UniqueFd make_event_fd(const std::string& context, const std::string& advice) {
  UniqueFd fd = try_make_event_fd();
  if (!fd.valid()) throw_system_error(errno, "eventfd", context, advice);
  return fd;
}

UniqueFd try_make_event_fd() noexcept {
  return UniqueFd(retry_eintr([] { return ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); }));
}

void signal_event_fd(int fd) noexcept {
  std::uint64_t one = 1;
  [[maybe_unused]] ssize_t n = retry_eintr([&] { return ::write(fd, &one, sizeof one); });
}

void drain_event_fd(int fd) noexcept {
  std::uint64_t value;
  [[maybe_unused]] ssize_t n = retry_eintr([&] { return ::read(fd, &value, sizeof value); });
}

void require_event_fd(int fd, const std::string& what) {
  // A pipe or a file in its place would be written to and never say when a message is there.
  if (fd_target(fd) != "anon_inode:[eventfd]")
    throw ProtocolError("received " + what + " fd is not an eventfd");
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_NONBLOCK) == 0)
    throw ProtocolError("received " + what + " eventfd is not non-blocking");
}

}  // namespace shmtensor::internal
