#include "devices.h"

#include <cstdint>
#include <string>
#include <string_view>

#include "shmtensor/device.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  constexpr std::string_view kPrefix = "cuda:";
  if (s.size() > kPrefix.size() && s.compare(0, kPrefix.size(), kPrefix) == 0) {
    const std::string digits = s.substr(kPrefix.size());
    if (digits.size() <= 9 && digits.find_first_not_of("0123456789") == std::string::npos)
      return Device::cuda(std::stoi(digits));
  }
  throw py::value_error("not a device: '" + s +
                        "' (expected 'cpu', 'cuda' or 'cuda:<index>', as torch names them)");
}

Device cuda_index(std::int64_t index) {
  if (index < 0 || index > INT32_MAX)
    throw py::value_error("a CUDA device index is >= 0, not " + std::to_string(index));
  return Device::cuda(static_cast<int>(index));
}

std::string device_repr(Device d) {
  if (d.is_cpu()) return "device(type='cpu')";
  return "device(type='cuda', index=" + std::to_string(d.index()) + ")";
}

}  // namespace

Device device_from_object(const py::handle& obj) {
  if (py::isinstance<Device>(obj)) return obj.cast<Device>();
  if (py::isinstance<py::str>(obj)) return parse_device(obj.cast<std::string>());
  if (PyBool_Check(obj.ptr()))
    throw py::type_error("a device is a string, an int or a device, not a bool");
  if (PyIndex_Check(obj.ptr())) return cuda_index(obj.cast<std::int64_t>());
  if (py::hasattr(obj, "type") && py::hasattr(obj, "index")) {
    // A torch.device, by its attributes (shmtensor does not import torch).
    py::object type = obj.attr("type");
    py::object index = obj.attr("index");
    if (py::isinstance<py::str>(type)) {
      const auto t = type.cast<std::string>();
      if (t == "cpu") return Device::cpu();
      if (t == "cuda") return index.is_none() ? Device::cuda(0) : cuda_index(index.cast<std::int64_t>());
      throw py::value_error("shmtensor has no device of type '" + t + "' (only cpu and cuda)");
    }
  }
  throw py::type_error("a device is 'cpu', 'cuda', 'cuda:<index>', an int or a device, not " +
                       std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
}

void bind_device(py::module_& m) {
  py::class_<Device>(m, "device", R"doc(Where a tensor's bytes live: the CPU or a CUDA device,
as torch.device. device("cpu"), device("cuda:1"), device("cuda", 1), device(1) (cuda:1).
"cuda" alone is cuda:0 (shmtensor has no current device).)doc")
      .def(py::init([](const py::object& type, const py::object& index) {
             if (index.is_none()) return device_from_object(type);
             if (!py::isinstance<py::str>(type))
               throw py::type_error("device(type, index): type is a string");
             const auto t = type.cast<std::string>();
             if (t == "cuda") return cuda_index(index.cast<std::int64_t>());
             if (t == "cpu") throw py::value_error("the CPU has no device index");
             return parse_device(t);  // raises: not a device type
           }),
           py::arg("type"), py::arg("index") = py::none())
      .def_property_readonly("type",
                             [](Device d) { return d.is_cpu() ? "cpu" : "cuda"; })
      .def_property_readonly("index",
                             [](Device d) -> py::object {
                               if (d.is_cpu()) return py::none();
                               return py::int_(d.index());
                             },
                             "None for the CPU, as torch.device's.")
      .def("__str__", &Device::to_string)
      .def("__repr__", &device_repr)
      .def("__eq__", [](Device a, const py::object& b) -> py::object {
        if (!py::isinstance<Device>(b)) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        return py::bool_(a == b.cast<Device>());
      })
      .def("__hash__", [](Device d) { return py::hash(py::make_tuple(static_cast<int>(d.type()), d.index())); })
      .def("__reduce__", [](const py::object& self) {
        return py::make_tuple(py::type::of(self), py::make_tuple(py::str(self)));
      });

  m.def("_cuda_is_available", [] { return cuda::is_available(); });
  m.def("_cuda_device_count", [] { return cuda::device_count(); });
  m.def("_cuda_unavailable_reason", [] { return cuda::unavailable_reason(); });
  m.def(
      "_cuda_synchronize",
      [](const py::object& device) {
        const Device d = device.is_none() ? Device::cuda(0) : device_from_object(device);
        py::gil_scoped_release release;
        cuda::synchronize(d);
      },
      py::arg("device") = py::none());
  m.def("_cuda_complete_fences", [] {
    py::gil_scoped_release release;
    cuda::complete_fences();
  });
}

}  // namespace shmtensor::python
