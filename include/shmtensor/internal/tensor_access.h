// The library's own door into Tensor (tensor.h), for the wire layer's decoder: a received
// view written straight into a Tensor. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

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
  // A tensor over the whole of `storage` at offset 0, for a factory that made the storage
  // for it: `storage` holds exactly numel(sizes) × element_size(dtype) bytes, aligned for
  // any dtype (operator new's memory, or an arena block: 64 bytes), and `strides` are the
  // contiguous strides of `sizes`. Nothing is checked: from_storage's checks could not fail.
  static Tensor contiguous(Storage&& storage, Dims&& sizes, Dims&& strides, DType dtype) noexcept {
    return Tensor(std::move(storage), 0, std::move(sizes), std::move(strides), dtype);
  }
};

}  // namespace shmtensor::internal
