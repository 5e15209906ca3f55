// Collation: turning the samples of one batch into one batch value, as torch's
// default_collate does. A DataLoader calls its collate_fn with std::vector<Sample> (the
// samples in sampler order) and sends what it returns to the main process; DefaultCollate
// is used unless the options name another.
//
// DefaultCollate, by sample type (recursively):
//   Tensor                    stacked along a new dim 0 into one tensor; every sample must
//                             have the same sizes and dtype (else std::invalid_argument)
//   bool, integers, floats    a 1-d tensor of their dtype (int -> int32, int64_t -> int64,
//                             float -> float32, double -> float64; unsigned wider than 8
//                             bits -> int64)
//   std::string               std::vector<std::string> (strings are not tensors)
//   std::pair, std::tuple     a pair/tuple of the collated elements
//   std::vector<T>            std::vector of collated positions (samples must have equal
//                             lengths); std::array<T, N> likewise
//   std::map<K, V>            std::map<K, collated V> (samples must have the same keys)
//   struct with SHMTENSOR_FIELDS
//                             field by field, into: T::batch_type if the struct names one
//                             (with SHMTENSOR_FIELDS of as many fields, in order); else T
//                             itself when every field collates to its own type (e.g. all
//                             Tensor fields); else std::tuple of the collated fields
//
// Where the batch is made: in a DataLoader worker, the tensors are allocated directly in
// shared memory with empty_batch() and filled in place (stack_into), so the batch reaches
// the main process with no copy at all. In the calling process (num_workers = 0) they are
// private memory, as in torch.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "shmtensor/dtype.h"
#include "shmtensor/internal/collate.h"
#include "shmtensor/tensor.h"

namespace shmtensor {

// A contiguous uninitialised tensor for a batch. In a DataLoader worker it is allocated in
// shared memory (Tensor::empty_shared: a block of the worker's arena, so a consumer that
// keeps thousands of small batches maps a few segments, not thousands, and each block is
// freed when its batch is dropped everywhere). Elsewhere it is Tensor::empty. Thread-safe.
inline Tensor empty_batch(std::vector<std::int64_t> sizes, DType dtype) {
  return internal::empty_batch(std::move(sizes), dtype);
}

// The batch type DefaultCollate makes from samples of type T.
template <class T>
using Collated = internal::Collated<T>;

// torch's default_collate (see the file comment).
struct DefaultCollate {
  template <class T>
  Collated<T> operator()(std::vector<T> samples) const {
    return internal::collate_all(std::move(samples));
  }
};

}  // namespace shmtensor
