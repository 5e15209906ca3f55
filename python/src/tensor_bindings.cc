// shmtensor.Tensor and the module-level functions of shmtensor._C. Allocations and
// share_memory_() may wait on the manager daemon (file_system) or on the kernel, so they run
// without the GIL; nothing here holds a Python object while the GIL is released.
#include <pybind11/numpy.h>
#include <pybind11/complex.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <complex>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bindings.h"
#include "devices.h"
#include "dtypes.h"
#include "exports.h"
#include "shmtensor/busy_poll.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

// A shape argument: an int or a sequence of ints, as NumPy takes.
std::vector<std::int64_t> shape_from_object(const py::handle& obj) {
  if (!py::isinstance<py::sequence>(obj)) return {obj.cast<std::int64_t>()};
  std::vector<std::int64_t> out;
  for (auto item : obj) out.push_back(item.cast<std::int64_t>());
  return out;
}

// On a CUDA device, `shared` changes nothing: device memory is shared from birth.
Tensor make_tensor(const py::handle& shape, const py::handle& dtype, bool shared,
                   const py::handle& device) {
  std::vector<std::int64_t> sizes = shape_from_object(shape);
  DType dt = dtype_from_object(dtype);
  const Device d = device.is_none() ? Device::cpu() : device_from_object(device);
  py::gil_scoped_release release;
  if (d.is_cuda()) return Tensor::empty(std::move(sizes), dt, d);
  return shared ? Tensor::empty_shared(std::move(sizes), dt) : Tensor::empty(std::move(sizes), dt);
}

Tensor make_zeros(const py::handle& shape, const py::handle& dtype, const py::handle& device) {
  std::vector<std::int64_t> sizes = shape_from_object(shape);
  DType dt = dtype_from_object(dtype);
  const Device d = device.is_none() ? Device::cpu() : device_from_object(device);
  py::gil_scoped_release release;
  return Tensor::zeros(std::move(sizes), dt, d);
}

// Tensor.to(device=None, dtype=None): the same storage when nothing changes, as torch's.
Tensor tensor_to(const Tensor& t, const py::object& device, const py::object& dtype) {
  const Device d = device.is_none() ? t.device() : device_from_object(device);
  const DType dt = dtype.is_none() ? t.dtype() : dtype_from_object(dtype);
  py::gil_scoped_release release;
  return t.to(d).to(dt);
}

// Tensor.cuda(device=None): cuda:0 when None, as shmtensor has no current device.
Tensor tensor_cuda(const Tensor& t, const py::object& device) {
  const Device d = device.is_none() ? Device::cuda(0) : device_from_object(device);
  if (!d.is_cuda())
    throw py::value_error("Tensor.cuda(" + d.to_string() + "): not a CUDA device (use .to())");
  py::gil_scoped_release release;
  return t.to(d);
}

py::tuple to_tuple(std::span<const std::int64_t> v, std::int64_t scale = 1) {
  py::tuple t(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) t[i] = py::int_(v[i] * scale);
  return t;
}

// (block, offset) of an ndarray in a block (array_storage), else None: shmtensor._C._block_of.
py::object block_of(const py::handle& obj) {
  std::optional<ArrayStorage> found = array_storage(obj);
  if (!found) return py::none();
  return py::make_tuple(whole_block(found->storage), py::int_(found->offset));
}

// Storages between extension modules (shmtensor._torch): a PyCapsule named kStorageCapsule
// holding a heap copy of the Storage handle, freed by the capsule's destructor. Both modules
// link the one libshmtensor.so, so the C++ type is the same; no pybind11 type information
// is shared (torch may bring another pybind11).
constexpr const char* kStorageCapsule = "shmtensor.Storage";

py::capsule storage_capsule(const Tensor& t) {
  if (!t.defined()) throw py::value_error("_storage_capsule: an undefined Tensor");
  auto copy = std::make_unique<Storage>(t.storage());
  py::capsule capsule(copy.get(), kStorageCapsule, [](PyObject* o) {
    delete static_cast<Storage*>(PyCapsule_GetPointer(o, kStorageCapsule));
  });
  copy.release();  // the capsule's now
  return capsule;
}

Tensor block_of_capsule(const py::capsule& capsule) {
  auto* storage = static_cast<Storage*>(PyCapsule_GetPointer(capsule.ptr(), kStorageCapsule));
  if (storage == nullptr) throw py::error_already_set();  // wrong name: ValueError set
  return whole_block(*storage);
}

}  // namespace

// bindings.h says what these are.
Tensor whole_block(const Storage& storage) {
  return Tensor::from_storage(storage, 0, {static_cast<std::int64_t>(storage.nbytes())}, {1},
                              DType::kUInt8);
}

std::optional<ArrayStorage> array_storage(py::handle obj) {
  if (!py::isinstance<py::array>(obj)) return std::nullopt;
  auto a = py::reinterpret_borrow<py::array>(obj);
  py::handle base = obj;
  for (int depth = 0; !py::isinstance<Tensor>(base); ++depth) {
    if (depth > 10000) return std::nullopt;
    if (py::isinstance<py::array>(base)) {
      base = py::reinterpret_borrow<py::array>(base).base();
    } else if (PyMemoryView_Check(base.ptr())) {
      base = PyMemoryView_GET_BUFFER(base.ptr())->obj;
    } else {
      return std::nullopt;
    }
    if (!base || base.is_none()) return std::nullopt;
  }
  const Storage storage = base.cast<const Tensor&>().storage();
  if (!storage.defined()) return std::nullopt;
  const auto start = reinterpret_cast<std::uintptr_t>(storage.data());
  const auto end = start + storage.nbytes();
  const auto first = reinterpret_cast<std::uintptr_t>(a.data());
  std::uintptr_t lo = first, hi = first;
  bool empty = false;
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (a.shape(d) == 0) empty = true;
    const py::ssize_t span = (a.shape(d) - 1) * a.strides(d);
    if (span < 0) lo += span;  // wraps like the address arithmetic it mirrors
    else hi += span;
  }
  if (empty) {
    if (storage.nbytes() != 0 && (first < start || first > end)) return std::nullopt;
  } else {
    hi += a.itemsize();
    if (lo < start || hi > end) return std::nullopt;
  }
  const std::uintptr_t offset = empty && storage.nbytes() == 0 ? 0 : first - start;
  return ArrayStorage{storage, offset};
}

void bind_tensor(py::module_& m) {
  bind_errors(m);
  bind_device(m);

  py::class_<Tensor>(m, "Tensor", py::custom_type_setup([](PyHeapTypeObject* type) {
                       install_buffer_protocol(type);
                     }),
                     R"doc(A typed, strided n-d view over refcounted bytes (shmtensor's C++
Tensor). Made by shmtensor.from_numpy, shmtensor.empty/zeros/ones/full, or received from
another process; on the CPU or a CUDA device (device=, .cuda(), .to()). np.asarray(t) of a
CPU tensor is a writable view without a copy (buffer protocol); __array_interface__ and
__dlpack__ are there for other consumers, shmtensor.from_dlpack for the way in.)doc")
      .def_property_readonly("shape", [](const Tensor& t) { return to_tuple(t.sizes()); })
      .def_property_readonly(
          "dtype",
          [](const Tensor& t) -> py::object {
            if (t.dtype() == DType::kBFloat16) return py::str("bfloat16");
            return numpy_dtype(t.dtype());
          },
          "The NumPy dtype; the string 'bfloat16' for bfloat16, which NumPy lacks.")
      .def_property_readonly(
          "strides",
          [](const Tensor& t) {
            return to_tuple(t.strides(), static_cast<std::int64_t>(t.element_size()));
          },
          "In bytes, as NumPy's (stride() gives elements, as torch's).")
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("is_cuda", &Tensor::is_cuda)
      .def("cpu", [](const Tensor& t) {
        py::gil_scoped_release release;
        return t.cpu();
      }, "A copy in private CPU memory; no copy (the same storage) when on the CPU already.")
      .def("cuda", &tensor_cuda, py::arg("device") = py::none(),
           "A copy on a CUDA device (cuda:0 when None); no copy when there already.")
      .def("to", &tensor_to, py::arg("device") = py::none(), py::arg("dtype") = py::none(),
           "A copy on device with dtype (None: unchanged); no copy when neither changes.")
      .def(
          "fill_",
          [](Tensor& t, const py::object& value) -> Tensor& {
            if (PyComplex_Check(value.ptr())) {
              const auto v = value.cast<std::complex<double>>();
              py::gil_scoped_release release;
              return t.fill_(v);
            }
            const auto v = value.cast<double>();
            py::gil_scoped_release release;
            return t.fill_(v);
          },
          py::arg("value"), py::return_value_policy::reference_internal,
          "Every element set to value (converted as the C++ fill_: a double, or a complex); "
          "returns self. On a CUDA device through a host copy.")
      .def(
          "copy_",
          [](Tensor& t, const Tensor& src) -> Tensor& {
            py::gil_scoped_release release;
            return t.copy_(src);
          },
          py::arg("src"), py::return_value_policy::reference_internal,
          "src's values (broadcast, converted) written into self, between any two devices; "
          "returns self.")
      .def("data_ptr", [](const Tensor& t) {
        return reinterpret_cast<std::uintptr_t>(t.raw_data());
      }, "The address of element 0 (a device address for a CUDA tensor), as torch's.")
      .def_property_readonly("ndim", &Tensor::dim)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def_property_readonly("itemsize", &Tensor::element_size)
      .def("numel", &Tensor::numel)
      .def("dim", &Tensor::dim)
      .def("element_size", &Tensor::element_size)
      .def("storage_offset", &Tensor::storage_offset, "In elements.")
      .def(
          "size",
          [](const Tensor& t, py::object dim) -> py::object {
            if (dim.is_none()) return to_tuple(t.sizes());
            return py::int_(t.size(dim.cast<std::int64_t>()));
          },
          py::arg("dim") = py::none())
      .def(
          "stride",
          [](const Tensor& t, py::object dim) -> py::object {
            if (dim.is_none()) return to_tuple(t.strides());
            return py::int_(t.stride(dim.cast<std::int64_t>()));
          },
          py::arg("dim") = py::none(), "In elements, as torch's.")
      .def("is_contiguous", &Tensor::is_contiguous)
      // Views, as torch's (they share the bytes).
      .def("view", [](const Tensor& t, const py::object& shape) {
        return t.view(shape_from_object(shape));
      }, py::arg("shape"))
      .def("reshape", [](const Tensor& t, const py::object& shape) {
        return t.reshape(shape_from_object(shape));
      }, py::arg("shape"))
      .def("transpose", &Tensor::transpose, py::arg("dim0"), py::arg("dim1"))
      .def("permute", [](const Tensor& t, const py::args& dims) {
        return t.permute(dims.size() == 1 && py::isinstance<py::sequence>(dims[0])
                             ? shape_from_object(dims[0]) : shape_from_object(dims));
      })
      .def("select", &Tensor::select, py::arg("dim"), py::arg("index"))
      .def("narrow", &Tensor::narrow, py::arg("dim"), py::arg("start"), py::arg("length"))
      .def("contiguous", &Tensor::contiguous)
      .def("__getitem__", [](const Tensor& t, std::int64_t i) { return t.select(0, i); })
      .def("is_shared", &Tensor::is_shared)
      .def(
          "share_memory_",
          [](Tensor& t) -> Tensor& {
            if (!t.is_shared() && has_exports(t.storage()))
              throw py::buffer_error(
                  "share_memory_() would move the bytes of this tensor while a buffer or a "
                  "DLPack capsule made from it is in use (an array from np.asarray, a "
                  "memoryview, a torch tensor): call share_memory_() before exporting, or "
                  "drop those first");
            py::gil_scoped_release release;
            return t.share_memory_();
          },
          py::return_value_policy::reference_internal,
          "Moves the bytes into shared memory in place (a no-op when shared); returns self.")
      .def("clone", [](const Tensor& t) {
        py::gil_scoped_release release;
        return t.clone();
      }, "A contiguous copy in private memory.")
      .def("numpy", [](py::object self) {
             const Tensor& t = self.cast<const Tensor&>();
             if (t.is_cuda())
               throw py::type_error("numpy() of a " + t.device().to_string() +
                                    " tensor: its bytes are device memory; use .cpu() first");
             return py::module_::import("numpy").attr("asarray")(self);
           }, "np.asarray(self): a writable view, no copy (CPU tensors only).")
      .def("__len__", [](const Tensor& t) {
        if (t.dim() == 0) throw py::type_error("len() of a 0-d tensor");
        return t.sizes()[0];
      })
      .def("__repr__", &Tensor::to_string)
      .def_property_readonly("__array_interface__", &array_interface)
      .def("__dlpack__", &to_dlpack, py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(),
           py::arg("copy") = py::none(),
           "A DLPack capsule (1.0 for max_version >= (1, 0), else 0.6), as the Python array "
           "API defines it. A CUDA tensor's device work is complete before it returns unless "
           "stream is -1; a CPU tensor takes stream None only.")
      .def("__dlpack_device__", [](const Tensor& t) {
        return t.is_cuda() ? py::make_tuple(2, t.device().index()) : py::make_tuple(1, 0);
      }, "(kDLCPU, 0) = (1, 0), or (kDLCUDA, index) = (2, index).");

  m.def("_empty", &make_tensor, py::arg("shape"), py::arg("dtype"), py::arg("shared"),
        py::arg("device") = py::none(),
        "An uninitialised Tensor, in shared memory of the current strategy if shared, on "
        "device (None: the CPU).");
  m.def("_zeros", &make_zeros, py::arg("shape"), py::arg("dtype"), py::arg("device") = py::none(),
        "A Tensor of zeros in private memory (device memory on a CUDA device).");
  m.def("_from_dlpack", &from_dlpack_capsule, py::arg("capsule"),
        "(Tensor over a DLPack capsule's memory, read-only flag of the producer).");
  m.def("_block_of", &block_of, py::arg("array"));
  m.def("_storage_capsule", &storage_capsule, py::arg("tensor"),
        "A PyCapsule 'shmtensor.Storage' holding the tensor's Storage (for shmtensor._torch).");
  m.def("_block_of_capsule", &block_of_capsule, py::arg("capsule"),
        "The whole-storage uint8 Tensor of a 'shmtensor.Storage' capsule.");

  m.def("get_sharing_strategy", [] { return to_string(get_sharing_strategy()); });
  m.def("set_sharing_strategy", [](const std::string& name) { set_sharing_strategy(name); },
        py::arg("strategy"));
  m.def("get_all_sharing_strategies", [] {
    py::set out;
    for (auto s : get_all_sharing_strategies()) out.add(py::str(to_string(s)));
    return out;
  });
  m.def("set_busy_poll", [](double seconds) { set_busy_poll(Duration(seconds)); },
        py::arg("seconds"),
        "How long a native queue's get or connection's recv may poll before it blocks, in "
        "seconds (0: off, the default). See include/shmtensor/busy_poll.h.");
  m.def("get_busy_poll", [] { return get_busy_poll().count(); });
  m.def("empty_cache", [] {
    py::gil_scoped_release release;
    empty_cache();
  });
}

}  // namespace shmtensor::python
