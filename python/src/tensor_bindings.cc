#include <pybind11/pybind11.h>

#include "bindings.h"
#include "shmtensor/tensor.h"

namespace py = pybind11;

namespace shmtensor::python {

void bind_tensor(py::module_& m) {
  py::class_<Tensor>(m, "Tensor")
      .def("numel", &Tensor::numel)
      .def("is_shared", &Tensor::is_shared);
  m.def("empty_cache", &empty_cache);
}

}  // namespace shmtensor::python
