// The parts of the extension module shmtensor._C, each filling the module it is given.
#pragma once

#include <pybind11/pybind11.h>

namespace shmtensor::python {

// Tensor, dtypes, the buffer protocol, DLPack, strategies, empty_cache and the exception
// types (tensor_bindings.cc). Runs first: the other parts use its exception types.
void bind_tensor(pybind11::module_& m);
// The native transport: Connection/Queue for shmtensor.multiprocessing (transport_bindings.cc).
void bind_transport(pybind11::module_& m);
// One __next__ of shmtensor's DataLoader iterator in C++, for shmtensor/_loader.py
// (loader_iter.cc).
void bind_loader_iter(pybind11::module_& m);

// Parts of bind_tensor, in their own files.
// The exception classes (Error, SharedMemoryFullError, SystemCallError, ...) and the
// translators from the C++ exceptions (errors.cc).
void bind_errors(pybind11::module_& m);

}  // namespace shmtensor::python
