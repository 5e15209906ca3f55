#include "dtypes.h"

#include <string>

namespace py = pybind11;

namespace shmtensor::python {

DType dtype_from_object(const py::handle& obj) {
  if (py::isinstance<py::str>(obj) && obj.cast<std::string>() == "bfloat16") return DType::kBFloat16;
  py::dtype dt = py::dtype::from_args(py::reinterpret_borrow<py::object>(obj));
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  const char order = dt.attr("byteorder").cast<std::string>()[0];
  // '=' native, '|' not applicable (1-byte types); '<' is native on every target we build.
  const bool native = order == '=' || order == '|' || (order == '<' && size > 1);
  if (native) {
    switch (kind) {
      case 'b':
        if (size == 1) return DType::kBool;
        break;
      case 'u':
        if (size == 1) return DType::kUInt8;
        break;
      case 'i':
        if (size == 1) return DType::kInt8;
        if (size == 2) return DType::kInt16;
        if (size == 4) return DType::kInt32;
        if (size == 8) return DType::kInt64;
        break;
      case 'f':
        if (size == 2) return DType::kFloat16;
        if (size == 4) return DType::kFloat32;
        if (size == 8) return DType::kFloat64;
        break;
      case 'c':
        if (size == 8) return DType::kComplex64;
        if (size == 16) return DType::kComplex128;
        break;
      default:
        break;
    }
  }
  throw py::type_error("shmtensor.Tensor has no dtype for NumPy's " +
                       py::str(py::object(dt)).cast<std::string>() +
                       " (it has bool, uint8, int8, int16, int32, int64, float16, bfloat16, "
                       "float32, float64, complex64, complex128, in native byte order); "
                       "shmtensor.numpy arrays take any dtype without objects");
}

py::dtype numpy_dtype(DType dtype) {
  if (dtype == DType::kBFloat16)
    throw py::type_error("NumPy has no bfloat16: this tensor has no NumPy dtype");
  return py::dtype(to_string(dtype));
}

const char* buffer_format(DType dtype) {
  switch (dtype) {
    case DType::kBool: return "?";
    case DType::kUInt8: return "B";
    case DType::kInt8: return "b";
    case DType::kInt16: return "h";
    case DType::kInt32: return "i";
    case DType::kInt64: return "q";
    case DType::kFloat16: return "e";
    case DType::kBFloat16: return nullptr;
    case DType::kFloat32: return "f";
    case DType::kFloat64: return "d";
    case DType::kComplex64: return "Zf";
    case DType::kComplex128: return "Zd";
  }
  return nullptr;
}

namespace {
constexpr std::uint8_t kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kComplex = 5, kBool = 6;
}  // namespace

DLType dlpack_type(DType dtype, bool with_bool) {
  const auto bits = static_cast<std::uint8_t>(element_size(dtype) * 8);
  switch (dtype) {
    case DType::kBool:
      if (with_bool) return {kBool, 8};
      throw py::buffer_error(
          "DLPack 0.6 has no boolean type (torch 1.13 refuses bool too): a consumer of DLPack "
          "1.0 gets one (max_version=(1, 0)); else convert to uint8 first, or use the buffer "
          "protocol (np.asarray)");
    case DType::kUInt8: return {kUInt, bits};
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64: return {kInt, bits};
    case DType::kFloat16:
    case DType::kFloat32:
    case DType::kFloat64: return {kFloat, bits};
    case DType::kBFloat16: return {kBfloat, bits};
    case DType::kComplex64:
    case DType::kComplex128: return {kComplex, bits};
  }
  throw py::buffer_error("unknown dtype");
}

std::optional<DType> dtype_of_dlpack(std::uint8_t code, std::uint8_t bits) {
  switch (code) {
    case kInt:
      if (bits == 8) return DType::kInt8;
      if (bits == 16) return DType::kInt16;
      if (bits == 32) return DType::kInt32;
      if (bits == 64) return DType::kInt64;
      break;
    case kUInt:
      if (bits == 8) return DType::kUInt8;
      break;
    case kFloat:
      if (bits == 16) return DType::kFloat16;
      if (bits == 32) return DType::kFloat32;
      if (bits == 64) return DType::kFloat64;
      break;
    case kBfloat:
      if (bits == 16) return DType::kBFloat16;
      break;
    case kComplex:
      if (bits == 64) return DType::kComplex64;
      if (bits == 128) return DType::kComplex128;
      break;
    case kBool:
      if (bits == 8) return DType::kBool;
      break;
    default:
      break;
  }
  return std::nullopt;
}

}  // namespace shmtensor::python
