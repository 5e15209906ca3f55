// What spawn() and start_processes() (spawn.h) call in the library. Internal.
#pragma once

#include <vector>

#include "shmtensor/export.h"
#include "shmtensor/process.h"

namespace shmtensor {

struct SpawnOptions;  // spawn.h
class ProcessContext;

namespace internal {

// Starts every process (on failure: kills and reaps those started, rethrows), then joins
// when options.join.
SHMTENSOR_API ProcessContext start_all(std::vector<Process> processes,
                                       const SpawnOptions& options);

}  // namespace internal

}  // namespace shmtensor
