// Element types between shmtensor and NumPy / PEP 3118 / DLPack.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "shmtensor/dtype.h"

namespace shmtensor::python {

// The DType named by a NumPy dtype-like (np.float32, "int64", np.dtype("<f4"), ...) or by
// the string "bfloat16". Throws py::type_error for dtypes shmtensor has no type for
// (unsigned wider than 8 bits, strings, objects, structured, non-native byte order, ...).
DType dtype_from_object(const pybind11::handle& obj);
// The NumPy dtype of a DType; bfloat16 (which NumPy lacks) throws py::type_error.
pybind11::dtype numpy_dtype(DType dtype);
// The PEP 3118 format character(s): "?", "B", "b", "h", "i", "q", "e", "f", "d", "Zf", "Zd";
// nullptr for bfloat16, which has none.
const char* buffer_format(DType dtype);

// DLPack type codes (dlpack.h's DLDataTypeCode).
struct DLType {
  std::uint8_t code;
  std::uint8_t bits;
};
// Throws py::buffer_error for bool unless `with_bool` (DLPack 0.6 has no boolean type;
// 1.0 has kDLBool).
DLType dlpack_type(DType dtype, bool with_bool);
// The DType of a DLPack type (code, bits), if shmtensor has one.
std::optional<DType> dtype_of_dlpack(std::uint8_t code, std::uint8_t bits);

}  // namespace shmtensor::python
