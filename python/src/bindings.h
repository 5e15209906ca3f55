// The parts of the extension module shmtensor._C, each filling the module it is given.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "shmtensor/storage.h"

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

// Parts of bind_tensor, in their own files.
// The exception classes (Error, SharedMemoryFullError, SystemCallError, ...) and the
// translators from the C++ exceptions (errors.cc).
void bind_errors(pybind11::module_& m);

}  // namespace shmtensor::python
