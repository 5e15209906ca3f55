// The library's own door into Tensor (tensor.h), for the wire layer's decoder: a received
// view written straight into a Tensor. Internal.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shmtensor/export.h"
#include "shmtensor/tensor.h"

namespace shmtensor::internal {

struct SHMTENSOR_API TensorAccess {
  // Tensor::from_storage for a decoder, into `out` (replaced): the view's sizes and strides
  // are `ndim` int64 each, read from raw bytes straight into it (no Dims is built and moved
  // twice on the way). Validated as from_storage validates; what it refuses, from_storage
  // names, with its exceptions (`out` is then unspecified).
  static void assign_view(Tensor& out, Storage storage, std::int64_t storage_offset,
                          const std::byte* sizes, const std::byte* strides, std::size_t ndim,
                          DType dtype);
};

}  // namespace shmtensor::internal
