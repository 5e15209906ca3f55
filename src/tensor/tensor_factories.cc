// Factories and stack.
#include <cstring>
#include <stdexcept>
#include <string>

#include "shmtensor/internal/tensor_access.h"
#include "shmtensor/tensor.h"
#include "tensor/dispatch.h"

namespace shmtensor {

namespace {

// A contiguous tensor over a storage made for it of checked_nbytes(sizes, dtype) bytes
// (TensorAccess::contiguous: from_storage's checks could not fail).
Tensor make_contiguous(Storage&& storage, Dims&& sizes, DType dtype) {
  Dims strides = internal::contiguous_strides(sizes);
  return internal::TensorAccess::contiguous(std::move(storage), std::move(sizes),
                                            std::move(strides), dtype);
}

std::size_t checked_nbytes(std::span<const std::int64_t> sizes, DType dtype) {
  const std::size_t elsize = element_size(dtype);
  return static_cast<std::size_t>(internal::checked_numel(sizes, elsize)) * elsize;
}

}  // namespace

Tensor Tensor::empty(Dims sizes, DType dtype) {
  Storage storage = Storage::allocate(checked_nbytes(sizes, dtype));
  return make_contiguous(std::move(storage), std::move(sizes), dtype);
}

Tensor Tensor::empty_shared(Dims sizes, DType dtype) {
  Storage storage = Storage::allocate_shared(checked_nbytes(sizes, dtype));
  return make_contiguous(std::move(storage), std::move(sizes), dtype);
}

Tensor Tensor::zeros(Dims sizes, DType dtype) {
  Tensor t = empty(std::move(sizes), dtype);
  // All-zero bytes are zero (or false, or +0.0) in every dtype.
  if (t.nbytes() > 0) std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::zeros_shared(Dims sizes, DType dtype) {
  // Fresh shared segments are usually zero already, but a reused block need not be.
  Tensor t = empty_shared(std::move(sizes), dtype);
  if (t.nbytes() > 0) std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::ones(Dims sizes, DType dtype) {
  return full(std::move(sizes), 1.0, dtype);
}

Tensor Tensor::full(Dims sizes, double value, DType dtype) {
  Tensor t = empty(std::move(sizes), dtype);
  t.fill_(value);
  return t;
}

Tensor Tensor::full(Dims sizes, std::complex<double> value, DType dtype) {
  Tensor t = empty(std::move(sizes), dtype);
  t.fill_(value);
  return t;
}

Tensor Tensor::arange(std::int64_t n, DType dtype) {
  if (n < 0) {
    throw std::invalid_argument("Tensor::arange: n must be >= 0, got " + std::to_string(n));
  }
  Tensor t = empty({n}, dtype);
  internal::dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* out = static_cast<T*>(t.raw_data());
    for (std::int64_t i = 0; i < n; ++i) out[i] = internal::convert<T>(i);
  });
  return t;
}

Tensor Tensor::empty_like(const Tensor& other) {
  other.check_defined("empty_like");
  return empty(other.sizes(), other.dtype(), other.device());
}

Tensor Tensor::zeros_like(const Tensor& other) {
  other.check_defined("zeros_like");
  return zeros(other.sizes(), other.dtype(), other.device());
}

namespace {

// Checks the list and returns the stacked sizes.
Dims stacked_sizes(const std::vector<Tensor>& tensors, std::int64_t& dim) {
  if (tensors.empty()) throw std::invalid_argument("stack: expects a non-empty list of tensors");
  const Tensor& first = tensors.front();
  if (!first.defined()) throw std::invalid_argument("stack: tensor 0 is undefined");
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined()) {
      throw std::invalid_argument("stack: tensor " + std::to_string(i) + " is undefined");
    }
    if (t.sizes() != first.sizes()) {
      throw std::invalid_argument("stack: expects each tensor to be equal size, but got " +
                                  internal::sizes_to_string(first.sizes()) + " at entry 0 and " +
                                  internal::sizes_to_string(t.sizes()) + " at entry " +
                                  std::to_string(i));
    }
    if (t.dtype() != first.dtype()) {
      throw std::invalid_argument("stack: expects one dtype, but got " +
                                  std::string(to_string(first.dtype())) + " at entry 0 and " +
                                  std::string(to_string(t.dtype())) + " at entry " +
                                  std::to_string(i));
    }
  }
  dim = internal::wrap_dim(dim, first.dim() + 1);
  Dims sizes = first.sizes();
  sizes.insert(sizes.begin() + dim, static_cast<std::int64_t>(tensors.size()));
  return sizes;
}

// Contiguous host tensors of out's dtype stacked along dim 0 into a contiguous out: each is
// one run of bytes (the common case of a collated batch: a view and a copy_ per sample would
// cost more than the bytes). memmove: out may overlap an input, as copy_ allows.
bool copy_runs(const std::vector<Tensor>& tensors, Tensor& out, std::int64_t dim) {
  if (dim != 0 || out.is_cuda() || !out.is_contiguous()) return false;
  for (const Tensor& t : tensors)
    if (t.dtype() != out.dtype() || t.is_cuda() || !t.is_contiguous()) return false;
  auto* to = static_cast<std::byte*>(out.raw_data());
  for (const Tensor& t : tensors) {
    const std::size_t n = t.nbytes();
    if (n != 0) std::memmove(to, t.raw_data(), n);
    to += n;
  }
  return true;
}

void copy_slices(const std::vector<Tensor>& tensors, Tensor& out, std::int64_t dim) {
  if (copy_runs(tensors, out, dim)) return;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    out.select(dim, static_cast<std::int64_t>(i)).copy_(tensors[i]);
  }
}

}  // namespace

Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim) {
  auto sizes = stacked_sizes(tensors, dim);
  Tensor out = Tensor::empty(std::move(sizes), tensors.front().dtype(), tensors.front().device());
  copy_slices(tensors, out, dim);
  return out;
}

Tensor& stack_into(const std::vector<Tensor>& tensors, Tensor& out, std::int64_t dim) {
  auto sizes = stacked_sizes(tensors, dim);
  if (!out.defined() || out.sizes() != sizes) {
    throw std::invalid_argument(
        "stack_into: out has sizes " +
        (out.defined() ? internal::sizes_to_string(out.sizes()) : std::string("(undefined)")) +
        " but the stacked sizes are " + internal::sizes_to_string(sizes));
  }
  copy_slices(tensors, out, dim);
  return out;
}

}  // namespace shmtensor
