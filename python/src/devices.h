// shmtensor.device (the C++ Device) and the one reading of a Python device argument.
#pragma once

#include <pybind11/pybind11.h>

#include "shmtensor/device.h"

namespace shmtensor::python {

// The Device a Python argument names, as torch reads one: "cpu", "cuda" (cuda:0: shmtensor
// has no current device), "cuda:1", an int i >= 0 (cuda:i), a shmtensor.device, or any
// object with `type` and `index` attributes (a torch.device). ValueError for a malformed
// string or a negative index, TypeError for anything else. Whether the device exists is
// checked where it is used.
Device device_from_object(const pybind11::handle& obj);

// shmtensor._C.device and the private functions behind shmtensor.cuda.
void bind_device(pybind11::module_& m);

}  // namespace shmtensor::python
