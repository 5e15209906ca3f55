// How a shmtensor.Tensor hands its bytes to other Python objects without a copy: the buffer
// protocol (PEP 3118; what np.asarray, memoryview and np.frombuffer use), the NumPy array
// interface and DLPack 0.6 capsules (torch.utils.dlpack.from_dlpack, np.from_dlpack).
//
// Exports pin the bytes: while a buffer or a DLPack capsule made from a storage exists,
// share_memory_() of that (private) storage raises BufferError instead of moving the bytes
// under the consumer, as bytearray refuses to resize while exported. An array made from
// __array_interface__ keeps the Tensor alive (its base) but does not pin: its data pointer
// is the one read when it was made (docs/python.md).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "shmtensor/tensor.h"

namespace shmtensor::python {

// Installs the buffer protocol on the Tensor class (for py::custom_type_setup).
void install_buffer_protocol(PyHeapTypeObject* type);
// Whether any buffer or capsule made from this storage is alive. Thread-safe (a capsule's
// deleter may run in any thread, without the GIL).
bool has_exports(const Storage& storage);

// The NumPy array interface (version 3) of t.
pybind11::dict array_interface(const Tensor& t);
// A DLPack 0.6 capsule ("dltensor") over t's elements; its deleter keeps a copy of t alive.
pybind11::capsule to_dlpack(const Tensor& t);

}  // namespace shmtensor::python
