// shmtensor._torch: torch.UntypedStorage <-> shmtensor blocks, for shmtensor.torch (the
// Python integration, docs/torch.md). Built only with libtorch (SHMTENSOR_BUILD_TORCH).
//
// A "block" is a shmtensor._C.Tensor standing for a whole shmtensor Storage (1-d uint8 over
// it, as shmtensor._C._empty((n,), "uint8", True) makes). Blocks cross from and to shmtensor._C
// only as "shmtensor.Storage" capsules (_C._storage_capsule / _C._block_of_capsule): this
// module shares no pybind11 type with _C. Allocation goes through _C._empty too, so that a
// failure arrives as shmtensor's own Python exception (SharedMemoryFullError, ...).
//
// The GIL is released while share_storage_ copies the bytes; _C._empty is called with it.
#define SHMTENSOR_TORCH_COMPAT_PYTHON
#include <pybind11/pybind11.h>

#include <memory>
#include <optional>

#include "shmtensor/torch.h"
#include "torch/torch_compat.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

namespace compat = internal::torch_compat;

constexpr const char* kStorageCapsule = "shmtensor.Storage";  // _C's name for it

py::module_ c_module() { return py::module_::import("shmtensor._C"); }

// The Storage of a block (through _C._storage_capsule, which checks the type).
Storage storage_of_block(const py::handle& block) {
  py::object capsule = c_module().attr("_storage_capsule")(block);
  auto* storage = static_cast<Storage*>(PyCapsule_GetPointer(capsule.ptr(), kStorageCapsule));
  if (storage == nullptr) throw py::error_already_set();
  return *storage;
}

// The block of a Storage (through _C._block_of_capsule).
py::object block_of(const Storage& storage) {
  auto copy = std::make_unique<Storage>(storage);
  py::capsule capsule(copy.get(), kStorageCapsule, [](PyObject* o) {
    delete static_cast<Storage*>(PyCapsule_GetPointer(o, kStorageCapsule));
  });
  copy.release();  // the capsule's now
  return c_module().attr("_block_of_capsule")(capsule);
}

// The C++ storage of a torch.UntypedStorage; TypeError for anything else.
c10::StorageImpl& storage_impl_of(const py::handle& obj, const char* op) {
  const int is = compat::is_untyped_storage(obj.ptr());
  if (is < 0) throw py::error_already_set();
  if (is == 0)
    throw py::type_error(std::string(op) + ": expected a torch.UntypedStorage, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         " (a TypedStorage's is .untyped())");
  return *compat::storage_impl_of(obj.ptr());
}

py::object storage_from_block(const py::handle& block) {
  Storage storage = storage_of_block(block);
  if (!storage.is_shared())
    throw py::value_error(
        "storage_from_block: the block is not in shared memory (make it with "
        "shmtensor._C._empty((n,), 'uint8', True))");
  c10::Storage torch_storage = to_torch(storage);
  PyObject* obj = compat::wrap_storage(std::move(torch_storage));
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(obj);
}

py::object block_of_storage(const py::handle& storage) {
  std::optional<Storage> ours = shared_storage_of(storage_impl_of(storage, "block_of_storage"));
  if (!ours) return py::none();
  return block_of(*ours);
}

py::object share_storage(const py::handle& storage) {
  c10::StorageImpl& impl = storage_impl_of(storage, "share_storage_");
  std::optional<Storage> moved;
  {
    // `storage` (the caller's reference) keeps impl alive meanwhile.
    py::gil_scoped_release release;
    moved = share_memory_(impl, [](std::size_t nbytes) {
      py::gil_scoped_acquire acquire;
      return storage_of_block(c_module().attr("_empty")(py::make_tuple(nbytes), "uint8", true));
    });
  }
  if (!moved) return py::none();
  return block_of(*moved);
}

}  // namespace

}  // namespace shmtensor::python

PYBIND11_MODULE(_torch, m) {
  namespace sp = shmtensor::python;
  m.doc() =
      "shmtensor's bridge to torch storages (for shmtensor.torch); built against torch " TORCH_VERSION;
  // torch sets up torch.UntypedStorage (THPStorageClass) when imported.
  py::module_::import("torch");
  py::module_::import("shmtensor._C");
  m.attr("torch_version") = TORCH_VERSION;
  m.def("storage_from_block", &sp::storage_from_block, py::arg("block"),
        "A torch.UntypedStorage over the whole shared storage of `block` (a shmtensor._C.Tensor), "
        "without a copy; the torch storage keeps the bytes alive. Within a process, one torch "
        "storage per shmtensor storage while it lives.");
  m.def("block_of_storage", &sp::block_of_storage, py::arg("storage"),
        "The block (whole-storage uint8 shmtensor._C.Tensor) of a torch.UntypedStorage whose bytes "
        "are shmtensor's, else None.");
  m.def("share_storage_", &sp::share_storage, py::arg("storage"),
        "Moves a CPU torch.UntypedStorage into shmtensor shared memory (current sharing strategy) "
        "in place: the bytes are copied and every tensor and view on the storage follows; the "
        "storage becomes non-resizable. Returns its block; a storage already shmtensor's is left "
        "as it is and its block returned; a 0-byte storage is left alone (None). Raises "
        "shmtensor's exceptions (SharedMemoryFullError, ...) on allocation failures, ValueError "
        "for a storage not on the CPU, TypeError for anything but an UntypedStorage.");
}
