// The library's own door into Process (process.h): making one from a launch spec (spawn,
// Pool and DataLoader workers) and reaching its state (src/process). Internal.
#pragma once

#include <utility>

#include "shmtensor/internal/launch.h"
#include "shmtensor/process.h"

namespace shmtensor::internal {

struct ProcessAccess {
  static Process make(LaunchSpec spec) { return Process(std::move(spec)); }
  static ProcessState* state(Process& p) noexcept { return p.state_.get(); }
};

}  // namespace shmtensor::internal
