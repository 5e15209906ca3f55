// The torch half of shmtensor._C's tensor messages (python/src/messages.cc; docs/python.md,
// "Tensor messages"). shmtensor._C encodes and decodes a message; a torch.Tensor in it is
// described and made by these two functions of shmtensor._torch (python/src/torch_module.cc),
// which hands them to _C at import as a PyCapsule named kMessageTorchCapsule holding a
// MessageTorch. Both modules link the one libshmtensor.so, so Storage is the same type on
// both sides. Python objects are passed as void* (PyObject*): this header needs no Python.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shmtensor/storage.h"

namespace shmtensor::internal {

inline constexpr const char* kMessageTorchCapsule = "shmtensor._torch.message_torch";
inline constexpr std::size_t kMessageMaxDims = 64;

// A torch tensor as a message carries it: the shared storage it views and its view.
struct MessageTensor {
  Storage storage;          // shared (in an arena): the block the message carries
  std::uint8_t dtype = 0;   // the c10::ScalarType
  std::uint8_t dims = 0;    // <= kMessageMaxDims
  bool contiguous = false;  // strides are the C-contiguous ones for sizes
  std::int64_t offset = 0;  // in elements
  std::int64_t sizes[kMessageMaxDims] = {};
  std::int64_t strides[kMessageMaxDims] = {};  // in elements
};

struct MessageTorch {
  // torch.Tensor (a PyTypeObject*): describe is asked about objects of exactly this type.
  void* tensor_type = nullptr;
  // 1: `tensor` (a PyObject*, the GIL held) travels in a message and *out describes it;
  // 0: it does not (a subclass's data, another device, requires_grad, a storage not in an
  // arena, ...: the message is pickled); -1: a Python error is set.
  int (*describe)(void* tensor, MessageTensor* out) = nullptr;
  // A new reference to a torch.Tensor viewing t.storage (a PyObject*), or nullptr with a
  // Python error set: ValueError for a dtype or view that does not fit the storage.
  void* (*make)(const MessageTensor* t) = nullptr;
};

}  // namespace shmtensor::internal
