// How many file_descriptor segment fds a channel handle (a Queue's, a Connection end's) put
// in its messages, and left out of them because the segment was in the channel's depot
// (docs/transport.md, "fds once per segment"). Internal: tests and benchmarks.
#pragma once

#include <cstdint>

namespace shmtensor::internal {

struct FdCounts {
  std::uint64_t sent = 0;
  std::uint64_t omitted = 0;
};

}  // namespace shmtensor::internal
