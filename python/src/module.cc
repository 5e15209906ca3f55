#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "shmtensor's native part; use the shmtensor package, not this module";
  shmtensor::python::bind_tensor(m);
  shmtensor::python::bind_transport(m);
  shmtensor::python::bind_messages(m);
  shmtensor::python::bind_loader_iter(m);
}
