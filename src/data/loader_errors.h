// The texts of the errors a DataLoader raises about its workers (docs/data_loader.md lists
// them). Kept apart from the session so that every message is in one place.
#pragma once

#include <cstdint>
#include <string>

#include "shmtensor/data_loader.h"

namespace shmtensor::internal {

// A worker reported an exception: "<type>: <message>" in failure.text.
DataLoaderWorkerError worker_error(int worker_id, int pid, const WorkerFailure& failure);

// A worker ended on its own. exit_code < 0: killed by signal -exit_code. `loading`: what
// it was doing ("" when idle); `reported`: the error text its process reported, if any.
DataLoaderWorkerDied worker_died(int worker_id, int pid, int exit_code, const std::string& loading,
                                 const std::string& reported);

// No batch within the timeout.
DataLoaderTimeout loader_timeout(double seconds, const std::string& waiting_for);

}  // namespace shmtensor::internal
