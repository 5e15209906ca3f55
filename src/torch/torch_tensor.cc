// to_torch / from_torch of tensors and dtypes (the storages: torch_storage.cc).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <stdexcept>
#include <string>

#include "shmtensor/torch.h"

namespace shmtensor {

c10::ScalarType to_torch(DType dtype) {
  switch (dtype) {
    case DType::kBool: return c10::ScalarType::Bool;
    case DType::kUInt8: return c10::ScalarType::Byte;
    case DType::kInt8: return c10::ScalarType::Char;
    case DType::kInt16: return c10::ScalarType::Short;
    case DType::kInt32: return c10::ScalarType::Int;
    case DType::kInt64: return c10::ScalarType::Long;
    case DType::kFloat16: return c10::ScalarType::Half;
    case DType::kBFloat16: return c10::ScalarType::BFloat16;
    case DType::kFloat32: return c10::ScalarType::Float;
    case DType::kFloat64: return c10::ScalarType::Double;
    case DType::kComplex64: return c10::ScalarType::ComplexFloat;
    case DType::kComplex128: return c10::ScalarType::ComplexDouble;
  }
  throw std::invalid_argument("to_torch: DType value " +
                              std::to_string(static_cast<int>(dtype)) + " is not a dtype");
}

DType dtype_from_torch(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Bool: return DType::kBool;
    case c10::ScalarType::Byte: return DType::kUInt8;
    case c10::ScalarType::Char: return DType::kInt8;
    case c10::ScalarType::Short: return DType::kInt16;
    case c10::ScalarType::Int: return DType::kInt32;
    case c10::ScalarType::Long: return DType::kInt64;
    case c10::ScalarType::Half: return DType::kFloat16;
    case c10::ScalarType::BFloat16: return DType::kBFloat16;
    case c10::ScalarType::Float: return DType::kFloat32;
    case c10::ScalarType::Double: return DType::kFloat64;
    case c10::ScalarType::ComplexFloat: return DType::kComplex64;
    case c10::ScalarType::ComplexDouble: return DType::kComplex128;
    default:
      throw std::invalid_argument(std::string("from_torch: shmtensor has no dtype for torch's ") +
                                  c10::toString(dtype) +
                                  " (it has bool, uint8, int8..int64, float16, bfloat16, "
                                  "float32, float64, complex64, complex128)");
  }
}

at::Tensor to_torch(const Tensor& tensor) {
  if (!tensor.defined()) throw std::invalid_argument("to_torch: an undefined Tensor");
  c10::Storage storage = to_torch(tensor.storage());
  // An empty tensor on the storage's device (no allocation), then set_ onto the storage.
  at::Tensor out = at::empty(
      {0}, at::TensorOptions().dtype(to_torch(tensor.dtype())).device(storage.device()));
  // Within the storage by Tensor's invariant, so set_ never resizes (it cannot: the storage
  // is not resizable).
  out.set_(std::move(storage), tensor.storage_offset(), tensor.sizes(), tensor.strides());
  return out;
}

Tensor from_torch(const at::Tensor& tensor) {
  if (!tensor.defined()) return Tensor();
  const bool on_cuda = tensor.device().type() == c10::kCUDA;
  if (tensor.device().type() != c10::kCPU && !on_cuda)
    throw std::invalid_argument("from_torch: a " + tensor.device().str() +
                                " tensor; shmtensor holds CPU and CUDA tensors only");
  if (tensor.layout() != c10::kStrided)
    throw std::invalid_argument(std::string("from_torch: a tensor of layout ") +
                                c10::toString(tensor.layout()) +
                                "; shmtensor holds strided (dense) tensors only");
  const DType dtype = dtype_from_torch(tensor.scalar_type());
  // The conjugate and negative bits are lazy: such a tensor's bytes are not its values.
  if (tensor.has_storage() && !tensor.is_conj() && !tensor.is_neg()) {
    if (auto storage = shared_storage_of(*tensor.storage().unsafeGetStorageImpl()))
      return Tensor::from_storage(std::move(*storage), tensor.storage_offset(),
                                  tensor.sizes().vec(), tensor.strides().vec(), dtype);
  }
  if (on_cuda)
    throw std::invalid_argument(
        "from_torch: a " + tensor.device().str() +
        " tensor whose storage is torch's own: move it into a device arena first "
        "(shmtensor::share_memory_ of its storage), then it converts without a copy");
  Tensor out = Tensor::empty_shared(tensor.sizes().vec(), dtype);
  if (out.numel() > 0) {
    // Not recorded by autograd: the copy is plain data, as detach() would give.
    c10::AutoGradMode no_grad(false);
    at::from_blob(out.raw_data(), tensor.sizes(), at::TensorOptions().dtype(tensor.scalar_type()))
        .copy_(tensor);
  }
  return out;
}

}  // namespace shmtensor
