// The one wrapper every system call goes through: retries EINTR (callers never wrap
// close(), which must not be retried on Linux) and turns -1/errno into SystemError.
#pragma once

#include <cerrno>
#include <string>

#include "shmtensor/error.h"

namespace shmtensor::internal {

// Throws SystemError(errno, call, context, advice). Chooses advice for common errnos
// (EMFILE/ENFILE: raise `ulimit -n`; ENOMEM: vm.max_map_count / memory) when none given.
[[noreturn]] void throw_system_error(int err, const char* call, const std::string& context,
                                     const std::string& advice = {});

// Calls f() until it does not fail with EINTR; returns its result. f returns an integer
// that is -1 on failure with errno set.
template <class F>
auto retry_eintr(F&& f) {
  for (;;) {
    auto rc = f();
    if (rc != -1 || errno != EINTR) return rc;
  }
}

// retry_eintr, then throw on -1.
template <class F>
auto check_syscall(const char* call, const std::string& context, F&& f) {
  auto rc = retry_eintr(f);
  if (rc == -1) throw_system_error(errno, call, context);
  return rc;
}

}  // namespace shmtensor::internal
