#include "os/event_fd.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>

#include "os/syscall.h"

namespace shmtensor::internal {

UniqueFd make_event_fd() {
  return UniqueFd(check_syscall("eventfd", "EFD_CLOEXEC|EFD_NONBLOCK",
                                [] { return ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); }));
}

void signal_event_fd(int fd) noexcept {
  std::uint64_t one = 1;
  [[maybe_unused]] ssize_t n = retry_eintr([&] { return ::write(fd, &one, sizeof one); });
}

void drain_event_fd(int fd) noexcept {
  std::uint64_t value;
  [[maybe_unused]] ssize_t n = retry_eintr([&] { return ::read(fd, &value, sizeof value); });
}

}  // namespace shmtensor::internal
