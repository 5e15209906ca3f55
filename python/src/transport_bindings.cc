#include "bindings.h"

namespace shmtensor::python {

void bind_transport(pybind11::module_&) {}

}  // namespace shmtensor::python
