// How a shmtensor.Tensor hands its bytes to other Python objects without a copy: the buffer
// protocol (PEP 3118; what np.asarray, memoryview and np.frombuffer use), the NumPy array
// interface and DLPack capsules, 0.6 and 1.0 (torch.from_dlpack, np.from_dlpack); and the
// way in: a DLPack capsule of any producer made into a Tensor over its memory.
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
// Tensor.__dlpack__ as the Python array API defines it: a DLPack 1.0 capsule
// ("dltensor_versioned") when max_version is (1, x) or later, else a 0.6 one ("dltensor"),
// over t's elements or, when dl_device names another device or copy is True, over a copy
// (copy=False and another device: BufferError). Its deleter keeps a copy of the tensor
// alive. For a CUDA tensor, the device's work is complete before it returns unless stream
// is -1 (see order_before_consumer in exports.cc); a CPU tensor takes stream None only.
pybind11::capsule to_dlpack(const Tensor& t, const pybind11::object& stream,
                            const pybind11::object& max_version,
                            const pybind11::object& dl_device, const pybind11::object& copy);
// The Tensor over a DLPack capsule's memory (0.6 or 1.x), zero copy, and whether the
// producer marked it read-only (1.x). The capsule is consumed (renamed "used_..."); the
// producer's deleter is called once the Tensor's storage lets the memory go (its last
// handle, or share_memory_(), which moves the bytes). A capsule made by shmtensor gives
// back the tensor it was made from, on the same storage. BufferError for what a Tensor
// cannot be (another device type, a dtype it lacks, negative strides, misaligned data),
// leaving the capsule unconsumed.
pybind11::tuple from_dlpack_capsule(const pybind11::capsule& capsule);

}  // namespace shmtensor::python
