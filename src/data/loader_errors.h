// The texts of the errors a DataLoader raises about its workers (docs/data_loader.md lists
// them). Kept apart from the session so that every message is in one place.
#pragma once

#include <cstdint>
#include <string>

#include "shmtensor/data_loader.h"
#include "shmtensor/internal/worker_group.h"

namespace shmtensor::internal {

// A worker reported an exception: "<type>: <message>" in failure.text.
DataLoaderWorkerError worker_error(int worker_id, int pid, const WorkerFailure& failure);

// A worker ended on its own, as `exit` says. `loading`: what it was doing ("" when idle).
DataLoaderWorkerDied worker_died(int worker_id, const WorkerExit& exit,
                                 const std::string& loading);

// No batch within the timeout.
DataLoaderTimeout loader_timeout(double seconds, const std::string& waiting_for);

}  // namespace shmtensor::internal
