// Shared memory for batches made in a DataLoader worker: each batch tensor is allocated
// directly in shared memory (Tensor::empty_shared), so sending it copies nothing. The
// arena (src/memory/arena.h) carves small batches out of a few segments, so thousands of
// kept batches cost the consumer a few fds and mappings, and each batch's block is freed
// (and reused by the worker) as soon as the consumer drops it.
#include <stdexcept>

#include "shmtensor/collate.h"
#include "shmtensor/data_loader.h"

namespace shmtensor::internal {

Tensor empty_batch(Dims sizes, DType dtype) {
  if (!get_worker_info()) return Tensor::empty(std::move(sizes), dtype);
  return Tensor::empty_shared(std::move(sizes), dtype);
}

void throw_collate_mismatch(const std::string& what) {
  throw std::invalid_argument("default collate: " + what);
}

}  // namespace shmtensor::internal
