// Views: new sizes/strides/offset over the same storage, never a copy (except reshape's
// fallback). Each view reaches only elements its source reaches, so no bounds check against
// the storage is needed beyond what the source passed.
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "shmtensor/tensor.h"
#include "tensor/dispatch.h"

namespace shmtensor {

namespace {

// Replaces one -1 by the size that makes numel match; checks the product otherwise.
Dims infer_size(Dims sizes, std::int64_t numel) {
  std::optional<std::size_t> inferred;
  std::int64_t known = 1;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == -1) {
      if (inferred) throw std::invalid_argument("only one dimension can be inferred");
      inferred = d;
    } else if (sizes[d] < 0) {
      throw std::invalid_argument("invalid shape dimension " + std::to_string(sizes[d]));
    } else if (__builtin_mul_overflow(known, sizes[d], &known)) {
      throw std::invalid_argument("shape " + internal::sizes_to_string(sizes) + " overflows int64");
    }
  }
  const auto invalid = [&] {
    return std::invalid_argument("shape '" + internal::sizes_to_string(sizes) +
                                 "' is invalid for input of size " + std::to_string(numel));
  };
  if (inferred) {
    if (known == 0) {
      throw std::invalid_argument("cannot reshape tensor of " + std::to_string(numel) +
                                  " elements into shape " + internal::sizes_to_string(sizes) +
                                  " because the unspecified dimension size -1 can be any value");
    }
    if (numel % known != 0) throw invalid();
    sizes[*inferred] = numel / known;
  } else if (known != numel) {
    throw invalid();
  }
  return sizes;
}

// torch's computeStride: the strides that let `new_sizes` view memory laid out as
// old_sizes/old_strides, if any. Dimensions are grouped into chunks that are contiguous
// with respect to each other; a view may split or merge dims only within a chunk.
std::optional<Dims> compute_stride(const Dims& old_sizes, const Dims& old_strides,
                                   const Dims& new_sizes, std::int64_t numel) {
  if (old_sizes.empty()) return Dims(new_sizes.size(), 1);
  if (numel == 0) {
    // Strides of an empty tensor are arbitrary: keep them when the shape is kept (as NumPy).
    if (old_sizes == new_sizes) return old_strides;
    return internal::contiguous_strides(new_sizes);
  }
  Dims new_strides(new_sizes.size());
  auto view_d = static_cast<std::int64_t>(new_sizes.size()) - 1;
  std::int64_t chunk_base_stride = old_strides.back();
  std::int64_t tensor_numel = 1;
  std::int64_t view_numel = 1;
  for (auto d = static_cast<std::int64_t>(old_sizes.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_sizes[d];
    if (d == 0 ||
        (old_sizes[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_sizes[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

}  // namespace

Tensor Tensor::make_view(std::int64_t storage_offset, Dims sizes, Dims strides) const {
  const bool empty = std::find(sizes.begin(), sizes.end(), 0) != sizes.end();
  return Tensor(Storage(storage_), empty ? storage_offset_ : storage_offset, std::move(sizes),
                std::move(strides), dtype_);
}

Tensor Tensor::view(Dims sizes) const {
  check_defined("view");
  sizes = infer_size(std::move(sizes), numel());
  auto strides = compute_stride(sizes_, strides_, sizes, numel());
  if (!strides) {
    throw std::invalid_argument(
        "view size is not compatible with input tensor's size and stride (at least one "
        "dimension spans across two contiguous subspaces). Use reshape() instead.");
  }
  return make_view(storage_offset_, std::move(sizes), std::move(*strides));
}

Tensor Tensor::reshape(Dims sizes) const {
  check_defined("reshape");
  sizes = infer_size(std::move(sizes), numel());
  if (auto strides = compute_stride(sizes_, strides_, sizes, numel())) {
    return make_view(storage_offset_, std::move(sizes), std::move(*strides));
  }
  return clone().view(std::move(sizes));
}

Tensor Tensor::select(std::int64_t dim, std::int64_t index) const {
  check_defined("select");
  if (this->dim() == 0) throw std::out_of_range("select() cannot be applied to a 0-dim tensor");
  const auto d = static_cast<std::size_t>(internal::wrap_dim(dim, this->dim()));
  const std::int64_t size = sizes_[d];
  if (index < -size || index >= size) {
    throw std::out_of_range(
        "select(): index " + std::to_string(index) + " out of range for tensor of size " +
        internal::sizes_to_string(sizes_) + " at dimension " + std::to_string(d));
  }
  if (index < 0) index += size;
  auto sizes = sizes_;
  auto strides = strides_;
  sizes.erase(sizes.begin() + static_cast<std::ptrdiff_t>(d));
  strides.erase(strides.begin() + static_cast<std::ptrdiff_t>(d));
  const std::int64_t offset =
      internal::checked_add(storage_offset_, internal::checked_mul(index, strides_[d]));
  return make_view(offset, std::move(sizes), std::move(strides));
}

Tensor Tensor::slice(std::int64_t dim, std::int64_t start, std::int64_t end,
                     std::int64_t step) const {
  check_defined("slice");
  if (this->dim() == 0) throw std::out_of_range("slice() cannot be applied to a 0-dim tensor");
  if (step <= 0) throw std::invalid_argument("slice step must be positive");
  const auto d = static_cast<std::size_t>(internal::wrap_dim(dim, this->dim()));
  const std::int64_t size = sizes_[d];
  // Python's clamping; `x += size` cannot overflow since x < 0 <= size.
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<std::int64_t>(start, 0, size);
  end = std::clamp<std::int64_t>(end, start, size);
  auto sizes = sizes_;
  auto strides = strides_;
  // (end - start) / step rounded up, written so that it cannot overflow for a huge step.
  sizes[d] = end == start ? 0 : (end - start - 1) / step + 1;
  // The stride of a dim of size <= 1 is never used; leaving it avoids overflow for huge steps.
  if (sizes[d] > 1) strides[d] = internal::checked_mul(strides_[d], step);
  const std::int64_t offset =
      internal::checked_add(storage_offset_, internal::checked_mul(start, strides_[d]));
  return make_view(offset, std::move(sizes), std::move(strides));
}

Tensor Tensor::narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const {
  check_defined("narrow");
  if (this->dim() == 0) throw std::out_of_range("narrow() cannot be applied to a 0-dim tensor");
  const auto d = static_cast<std::size_t>(internal::wrap_dim(dim, this->dim()));
  const std::int64_t size = sizes_[d];
  if (start < -size || start > size) {
    throw std::out_of_range("narrow(): start " + std::to_string(start) +
                            " out of range for dimension of size " + std::to_string(size));
  }
  if (start < 0) start += size;
  // A negative length is a bad argument (as a negative size is), not a position out of
  // range: it gets its own message, which says what lengths fit.
  if (length < 0) {
    throw std::invalid_argument("narrow(): length " + std::to_string(length) +
                                " is negative; from start " + std::to_string(start) +
                                " in dimension " + std::to_string(d) + " of size " +
                                std::to_string(size) + " a length is 0 to " +
                                std::to_string(size - start));
  }
  if (length > size - start) {
    throw std::out_of_range("narrow(): start (" + std::to_string(start) + ") + length (" +
                            std::to_string(length) + ") exceeds dimension size (" +
                            std::to_string(size) + ")");
  }
  auto sizes = sizes_;
  sizes[d] = length;
  const std::int64_t offset =
      internal::checked_add(storage_offset_, internal::checked_mul(start, strides_[d]));
  return make_view(offset, std::move(sizes), strides_);
}

Tensor Tensor::transpose(std::int64_t dim0, std::int64_t dim1) const {
  check_defined("transpose");
  if (dim() == 0) {
    internal::wrap_dim(dim0, 1);  // torch accepts 0 and -1 for a 0-d tensor
    internal::wrap_dim(dim1, 1);
    return *this;
  }
  const auto d0 = static_cast<std::size_t>(internal::wrap_dim(dim0, dim()));
  const auto d1 = static_cast<std::size_t>(internal::wrap_dim(dim1, dim()));
  auto sizes = sizes_;
  auto strides = strides_;
  std::swap(sizes[d0], sizes[d1]);
  std::swap(strides[d0], strides[d1]);
  return make_view(storage_offset_, std::move(sizes), std::move(strides));
}

Tensor Tensor::permute(Dims dims) const {
  check_defined("permute");
  if (static_cast<std::int64_t>(dims.size()) != dim()) {
    throw std::invalid_argument("permute: number of dims " + std::to_string(dims.size()) +
                                " does not match tensor dim " + std::to_string(dim()));
  }
  std::vector<bool> seen(dims.size(), false);
  Dims sizes(dims.size());
  Dims strides(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const auto d = static_cast<std::size_t>(internal::wrap_dim(dims[i], dim()));
    if (seen[d]) throw std::invalid_argument("permute: repeated dim " + std::to_string(d));
    seen[d] = true;
    sizes[i] = sizes_[d];
    strides[i] = strides_[d];
  }
  return make_view(storage_offset_, std::move(sizes), std::move(strides));
}

Tensor Tensor::unsqueeze(std::int64_t dim) const {
  check_defined("unsqueeze");
  const auto d = static_cast<std::size_t>(internal::wrap_dim(dim, this->dim() + 1));
  auto sizes = sizes_;
  auto strides = strides_;
  // torch's choice of stride, which keeps a contiguous tensor contiguous.
  const std::int64_t stride = d < sizes_.size() ? internal::checked_mul(sizes_[d], strides_[d]) : 1;
  sizes.insert(sizes.begin() + static_cast<std::ptrdiff_t>(d), 1);
  strides.insert(strides.begin() + static_cast<std::ptrdiff_t>(d), stride);
  return make_view(storage_offset_, std::move(sizes), std::move(strides));
}

Tensor Tensor::squeeze() const {
  check_defined("squeeze");
  Dims sizes;
  Dims strides;
  for (std::size_t d = 0; d < sizes_.size(); ++d) {
    if (sizes_[d] != 1) {
      sizes.push_back(sizes_[d]);
      strides.push_back(strides_[d]);
    }
  }
  return make_view(storage_offset_, std::move(sizes), std::move(strides));
}

Tensor Tensor::squeeze(std::int64_t dim) const {
  check_defined("squeeze");
  if (this->dim() == 0) {
    internal::wrap_dim(dim, 1);
    return *this;
  }
  const auto d = static_cast<std::size_t>(internal::wrap_dim(dim, this->dim()));
  if (sizes_[d] != 1) return *this;
  auto sizes = sizes_;
  auto strides = strides_;
  sizes.erase(sizes.begin() + static_cast<std::ptrdiff_t>(d));
  strides.erase(strides.begin() + static_cast<std::ptrdiff_t>(d));
  return make_view(storage_offset_, std::move(sizes), std::move(strides));
}

Tensor Tensor::expand(Dims sizes) const {
  check_defined("expand");
  if (sizes.size() < sizes_.size()) {
    throw std::invalid_argument("expand: the number of sizes provided (" +
                                std::to_string(sizes.size()) +
                                ") must be greater or equal to the number of dimensions in the "
                                "tensor (" +
                                std::to_string(sizes_.size()) + ")");
  }
  const std::size_t lead = sizes.size() - sizes_.size();
  Dims strides(sizes.size(), 0);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i < lead) {
      if (sizes[i] < 0) {
        throw std::invalid_argument("expand: size " + std::to_string(sizes[i]) +
                                    " is not allowed in a leading, non-existing dimension");
      }
      continue;  // stride 0
    }
    const std::size_t j = i - lead;
    if (sizes[i] == -1) sizes[i] = sizes_[j];
    if (sizes[i] == sizes_[j]) {
      strides[i] = strides_[j];
    } else if (sizes_[j] == 1 && sizes[i] >= 0) {
      strides[i] = 0;
    } else {
      throw std::invalid_argument("expand: the expanded size of the tensor (" +
                                  std::to_string(sizes[i]) + ") must match the existing size (" +
                                  std::to_string(sizes_[j]) + ") at non-singleton dimension " +
                                  std::to_string(i));
    }
  }
  internal::checked_numel(sizes, element_size());  // numel() must never overflow
  return make_view(storage_offset_, std::move(sizes), std::move(strides));
}

}  // namespace shmtensor
