// CUDA tensors: factories on a device, copies between host and device memory.
// shmtensor has no device kernels: every element operation on a CUDA tensor is a copy
// through the driver (cuda/device_memory.h), staged through host memory when the elements
// are not one contiguous run.
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/device_memory.h"
#include "shmtensor/tensor.h"
#include "tensor/dispatch.h"

namespace shmtensor {

namespace {

using internal::cuda::CUdeviceptr;

CUdeviceptr device_address(const Tensor& t) { return reinterpret_cast<CUdeviceptr>(t.raw_data()); }

// The storage bytes a tensor's elements span: [offset, offset + extent) in elements
// (strides are never negative). numel() > 0.
struct Span {
  std::int64_t first;  // element index of the first byte's element in the storage
  std::int64_t count;  // elements from there to the last one reached, inclusive
};
Span span_of(const Tensor& t) {
  std::int64_t extent = 1;
  for (std::int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  return {t.storage_offset(), extent};
}

// The elements of a CUDA tensor, in a CPU tensor with the same sizes and strides over a
// private copy of the span (one device-to-host copy).
Tensor download_span(const Tensor& t, Span span) {
  const std::size_t es = t.element_size();
  Storage host = Storage::allocate(static_cast<std::size_t>(span.count) * es);
  internal::cuda::copy_to_host(t.device().index(), host.data(),
                               reinterpret_cast<CUdeviceptr>(t.storage().data()) +
                                   static_cast<std::size_t>(span.first) * es,
                               host.nbytes());
  return Tensor::from_storage(std::move(host), 0, t.sizes(), t.strides(), t.dtype());
}

}  // namespace

Tensor Tensor::empty(Dims sizes, DType dtype, Device device) {
  if (device.is_cpu()) return empty(std::move(sizes), dtype);
  const std::size_t es = shmtensor::element_size(dtype);
  const auto nbytes = static_cast<std::size_t>(internal::checked_numel(sizes, es)) * es;
  Storage storage = Storage::allocate(nbytes, device);
  auto strides = internal::contiguous_strides(sizes);
  return from_storage(std::move(storage), 0, std::move(sizes), std::move(strides), dtype);
}

Tensor Tensor::zeros(Dims sizes, DType dtype, Device device) {
  if (device.is_cpu()) return zeros(std::move(sizes), dtype);
  Tensor t = empty(std::move(sizes), dtype, device);
  if (t.nbytes() > 0) internal::cuda::fill_device(device.index(), device_address(t), 0, t.nbytes());
  return t;
}

Tensor Tensor::to(Device device) const {
  check_defined("to");
  if (device == this->device()) return *this;
  Tensor out = empty(sizes_, dtype_, device);
  out.copy_(*this);
  return out;
}

Tensor& Tensor::copy_across_devices(const Tensor& source) {
  // copy_ has broadcast the source to our sizes and copied it out if it shares our storage.
  const bool plain = dtype_ == source.dtype_ && is_contiguous() && source.is_contiguous();
  if (plain) {
    if (!is_cuda()) {
      internal::cuda::copy_to_host(source.device().index(), raw_data(), device_address(source),
                                   nbytes());
      return *this;
    }
    if (!source.is_cuda()) {
      internal::cuda::copy_to_device(device().index(), device_address(*this), source.raw_data(),
                                     nbytes());
      return *this;
    }
    if (source.device() == device()) {
      internal::cuda::copy_device_to_device(device().index(), device_address(*this),
                                            device_address(source), nbytes());
      return *this;
    }
  }
  // Staged: the source's values on the host, converted and laid out there as *this has
  // them, then one copy to the device.
  const Tensor host_source = source.is_cuda() ? download_span(source, span_of(source)) : source;
  if (!is_cuda()) return copy_(host_source);
  if (is_contiguous()) {
    Tensor staged = Tensor::empty(sizes_, dtype_);
    staged.copy_(host_source);
    internal::cuda::copy_to_device(device().index(), device_address(*this), staged.raw_data(),
                                   nbytes());
    return *this;
  }
  const Span span = span_of(*this);
  Tensor staged = download_span(*this, span);
  staged.copy_(host_source);
  internal::cuda::copy_to_device(
      device().index(),
      reinterpret_cast<CUdeviceptr>(storage_.data()) +
          static_cast<std::size_t>(span.first) * element_size(),
      staged.storage().data(), staged.storage().nbytes());
  return *this;
}

namespace cuda {

void synchronize(Device device) {
  if (!device.is_cuda())
    throw std::invalid_argument("cuda::synchronize: " + device.to_string() +
                                " is not a CUDA device");
  internal::cuda::synchronize(device.index());
}

}  // namespace cuda

}  // namespace shmtensor
