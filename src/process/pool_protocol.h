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
#include <memory>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/connection.h"
#include "shmtensor/process.h"
#include "shmtensor/start_method.h"

namespace shmtensor {

namespace internal {
// A worker's end of its connection, as the argument of pool_worker_main: copyable (a
// Process copies its arguments) and encodable (kExec sends it; the socket fd travels).
struct WorkerChannel {
  std::shared_ptr<Connection> connection;
};
}  // namespace internal

template <>
struct Codec<internal::WorkerChannel> {
  static void encode(Encoder& e, const internal::WorkerChannel& c) { e.encode(*c.connection); }
  static internal::WorkerChannel decode(Decoder& d) {
    return {std::make_shared<Connection>(d.decode<Connection>())};
  }
};

namespace internal {
inline constexpr std::uint64_t kStop = 0;  // the task id that tells a worker to exit
void pool_worker_main(int index, WorkerChannel channel);

// A started worker and the parent's end of its connection.
struct PoolWorker {
  Process process;
  Connection connection;
};
// Starts worker `index` (a daemon running pool_worker_main). `siblings`: the parent's ends
// of the other workers' connections. A forked worker closes those and the parent's end of
// its own first, so that it sees EOF (and exits) when the parent closes its end, and no
// worker keeps another's connection open. Throws what Process::start throws.
PoolWorker start_pool_worker(int index, StartMethod method, std::vector<int> siblings);
}  // namespace internal

}  // namespace shmtensor
