// The Pool protocol between the parent (pool.cc) and its workers (pool_worker.cc).
//
// One duplex Connection per worker, one message per task each way:
//   parent -> worker: u64 id, str entry module, u64 entry offset, str fn module,
//                     u64 fn offset, then the argument tuple (decoded by the entry)
//                     id 0 (kStop) alone: exit
//   worker -> parent: u64 id, u8 1, result   |   u64 id, u8 0, str "<type>: <message>"
// A worker runs one task at a time.
#pragma once

#include <cstdint>

#include "shmtensor/internal/worker_group.h"

namespace shmtensor::internal {

inline constexpr std::uint64_t kStop = 0;  // the task id that tells a worker to exit
// The worker process's function (a plain function, so that kExec workers run it too).
void pool_worker_main(int index, WorkerLink link);

}  // namespace shmtensor::internal
