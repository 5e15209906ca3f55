#include "os/syscall.h"

#include <cstring>

namespace shmtensor {

namespace {
std::string format_system_error(int err, const std::string& call, const std::string& context,
                                const std::string& advice) {
  std::string msg = call + "(" + context + "): " + std::strerror(err);
  if (!advice.empty()) msg += " — " + advice;
  return msg;
}
}  // namespace

SystemError::SystemError(int err, std::string syscall, const std::string& context,
                         const std::string& advice)
    : Error(format_system_error(err, syscall, context, advice)),
      errno_(err),
      syscall_(std::move(syscall)) {}

namespace internal {

[[noreturn]] void throw_system_error(int err, const char* call, const std::string& context,
                                     const std::string& advice) {
  std::string why = advice;
  if (why.empty()) {
    switch (err) {
      case EMFILE:
        why =
            "this process is at its open-file limit; raise it with `ulimit -n` (see `shmtensor "
            "doctor`) or use set_sharing_strategy(\"file_system\"), which passes no fds";
        break;
      case ENFILE:
        why = "the system-wide open-file limit (fs.file-max) is reached";
        break;
      case ENOMEM:
        why =
            "out of memory or out of mappings: check free memory and vm.max_map_count (see "
            "`shmtensor doctor`)";
        break;
      case ENOSPC:
        why = "no space left: check the size of /dev/shm (`df -h /dev/shm`, `shmtensor doctor`)";
        break;
      default:
        break;
    }
  }
  throw SystemError(err, call, context, why);
}

}  // namespace internal
}  // namespace shmtensor
