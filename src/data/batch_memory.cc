// Shared memory for batches made in a DataLoader worker: small batches are carved out of
// a per-process slab so that thousands of kept batches cost a few segments (fds and
// mappings) in the consumer instead of one each; big ones get their own storage.
//
// A slab is one shared Storage. Each batch tensor is a view into it, so the consumer's
// decoder resolves every batch of a slab to the same storage and maps the segment once;
// the slab's memory is freed when the worker has moved on and no batch in it is
// referenced anywhere. The cost: one kept batch keeps its whole slab (at most kSlabBytes).
// Once the memory layer sub-allocates small storages itself (arenas), this keeps working
// and a slab is simply one more storage.
#include <mutex>
#include <stdexcept>

#include "shmtensor/collate.h"
#include "shmtensor/data_worker.h"

namespace shmtensor {

namespace {
constexpr std::size_t kSlabBytes = std::size_t{1} << 20;
constexpr std::size_t kLargeBytes = kSlabBytes / 4;
constexpr std::size_t kAlign = 64;  // cache line; also a multiple of every element size

struct Slab {
  std::mutex mu;  // collate_fns may run on several threads of a worker
  Storage storage;
  std::size_t used = 0;
};
Slab& slab() {
  static Slab* s = new Slab;  // leaked: batches may outlive static destruction
  return *s;
}
}  // namespace

Tensor empty_batch(std::vector<std::int64_t> sizes, DType dtype) {
  if (!get_worker_info()) return Tensor::empty(std::move(sizes), dtype);
  // Tensor::empty validates sizes (negative, overflow); do the same before carving.
  std::size_t nbytes = element_size(dtype);
  for (std::int64_t s : sizes) {
    if (s < 0) return Tensor::empty(std::move(sizes), dtype);  // throws the usual error
    if (s != 0 && nbytes > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(s))
      return Tensor::empty(std::move(sizes), dtype);
    nbytes *= static_cast<std::size_t>(s);
  }
  if (nbytes == 0) return Tensor::empty(std::move(sizes), dtype);
  if (nbytes > kLargeBytes) return Tensor::empty_shared(std::move(sizes), dtype);
  std::vector<std::int64_t> strides(sizes.size());
  std::int64_t stride = 1;
  for (std::size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<std::int64_t>(sizes[i], 1);
  }
  const std::size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  Slab& s = slab();
  std::lock_guard lock(s.mu);
  if (!s.storage.defined() || s.used + rounded > s.storage.nbytes()) {
    s.storage = Storage::allocate_shared(kSlabBytes);
    s.used = 0;
  }
  const auto offset = static_cast<std::int64_t>(s.used / element_size(dtype));
  s.used += rounded;
  return Tensor::from_storage(s.storage, offset, std::move(sizes), std::move(strides), dtype);
}

namespace detail {
void throw_collate_mismatch(const std::string& what) {
  throw std::invalid_argument("default collate: " + what);
}
}  // namespace detail

}  // namespace shmtensor
