// How many segment fds a channel handle (a Queue's, a Connection end's) put in its
// messages, and left out of them because the segment was in the channel's depot
// (docs/transport.md, "fds once per segment"): one per file_descriptor segment a message
// names, two per device segment (its memfd and its allocation's). Internal: tests and
// benchmarks.
#pragma once

#include <cstdint>

namespace shmtensor::internal {

struct FdCounts {
  std::uint64_t sent = 0;
  std::uint64_t omitted = 0;
};

}  // namespace shmtensor::internal
