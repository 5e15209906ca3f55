// The parts of the extension module shmtensor._C, each filling the module it is given.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"

namespace shmtensor::python {

// Tensor, dtypes, the buffer protocol, DLPack, strategies, empty_cache and the exception
// types (tensor_bindings.cc). Runs first: the other parts use its exception types.
void bind_tensor(pybind11::module_& m);
// The native transport: Connection/Queue for shmtensor.multiprocessing (transport_bindings.cc).
void bind_transport(pybind11::module_& m);
// One __next__ of shmtensor's DataLoader iterator in C++, for shmtensor/_loader.py
// (loader_iter.cc).
void bind_loader_iter(pybind11::module_& m);

// A _C._Queue's native queue for loader_iter.cc, without a Python call (transport_bindings.cc).
// Each takes the GIL held and releases it while it waits; a `queue` that is not a _Queue is
// pybind11's cast_error, the queue's errors are the library's exceptions.
// An item (its pickle or tensor message, its blocks' storages) within `timeout` seconds, or
// false.
bool native_queue_get(pybind11::handle queue, double timeout, std::string& data,
                      std::vector<Storage>& storages);
// Puts an item of no blocks if there is room now; false if not.
bool native_queue_try_put(pybind11::handle queue, std::string data);
// (bytes, [block]) of an item, as _Queue.get returns it.
pybind11::tuple native_item_to_python(std::string data, std::vector<Storage> storages);

// Tensor messages: a structure of plain values, NumPy arrays and torch tensors in shared
// blocks, encoded and decoded in one call each instead of a pickle (messages.cc).
void bind_messages(pybind11::module_& m);
// The value of a tensor message whose blocks are given as their storages (loader_iter.cc):
// a new reference, or nullptr with the Python error set.
PyObject* decode_message_of_storages(const char* data, std::size_t size,
                                     const Storage* storages, std::size_t count);
// Whether `data` is a tensor message (starts with its magic) that this process can decode
// now (one holding torch tensors needs shmtensor._torch loaded).
bool message_decodable_here(const char* data, std::size_t size);

// A block as Python names a shared storage: a 1-d uint8 Tensor over the whole of it
// (tensor_bindings.cc).
Tensor whole_block(const Storage& storage);
// The storage whose bytes an ndarray views, found through its chain of .base objects
// (ndarrays, memoryviews) ending at a Tensor, and the byte offset of the array's first
// element in it; nullopt when the chain ends elsewhere or the array reaches outside the
// storage (an array built by hand over a Tensor's address, say). (tensor_bindings.cc)
struct ArrayStorage {
  Storage storage;
  std::uintptr_t offset = 0;
};
std::optional<ArrayStorage> array_storage(pybind11::handle array);

// Parts of bind_tensor, in their own files.
// The exception classes (Error, SharedMemoryFullError, SystemCallError, ...) and the
// translators from the C++ exceptions (errors.cc).
void bind_errors(pybind11::module_& m);

}  // namespace shmtensor::python
