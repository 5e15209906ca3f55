// How shared memory is named and passed between processes; switchable at run time,
// as torch.multiprocessing.set_sharing_strategy.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "shmtensor/export.h"

namespace shmtensor {

enum class SharingStrategy {
  // memfd_create segments: no name, nothing to leak, no /dev/shm size limit; fds travel
  // with the message (SCM_RIGHTS). The default on Linux.
  kFileDescriptor,
  // Named POSIX shm objects in /dev/shm; names travel, no fds. Cleaned up by refcount and
  // by the manager daemon.
  kFileSystem,
};

// "file_descriptor" / "file_system".
SHMTENSOR_API std::string to_string(SharingStrategy strategy);
SHMTENSOR_API std::vector<SharingStrategy> get_all_sharing_strategies();
// The strategy used for storages shared from now on, process-wide. Thread-safe.
SHMTENSOR_API SharingStrategy get_sharing_strategy();
// A value outside the enum (a cast integer) throws std::invalid_argument naming it and the
// valid values.
SHMTENSOR_API void set_sharing_strategy(SharingStrategy strategy);
// Accepts "file_descriptor" or "file_system"; throws std::invalid_argument naming the
// valid values for anything else.
SHMTENSOR_API void set_sharing_strategy(std::string_view name);

}  // namespace shmtensor
