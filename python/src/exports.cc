#include "exports.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "dtypes.h"
#include "shmtensor/internal/storage_access.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

// Export counts by storage (its impl's address: stable for the impl's life, and an impl
// with exports is alive, since every export holds a Tensor on it).
std::mutex g_exports_mu;
std::unordered_map<const void*, long>& exports() {
  static auto* map = new std::unordered_map<const void*, long>();  // outlives atexit order
  return *map;
}
void add_export(const Storage& s) {
  std::lock_guard lock(g_exports_mu);
  ++exports()[internal::StorageAccess::impl(s).get()];
}
void remove_export(const Storage& s) {
  std::lock_guard lock(g_exports_mu);
  auto it = exports().find(internal::StorageAccess::impl(s).get());
  if (it != exports().end() && --it->second == 0) exports().erase(it);
}

// An exported tensor's address for a consumer: empty tensors may have no bytes at all
// (a 0-byte storage has a null data pointer), and a null buf/data confuses consumers.
void* export_address(const Tensor& t) {
  static std::max_align_t empty_target;
  if (t.is_cuda())
    throw std::invalid_argument("a " + t.device().to_string() +
                                " tensor's bytes are device memory: call .cpu() first");
  void* p = const_cast<void*>(t.raw_data());
  return p == nullptr ? &empty_target : p;
}

bool is_f_contiguous(const Tensor& t) {
  std::int64_t expected = 1;
  for (std::int64_t d = 0; d < t.dim(); ++d) {
    if (t.sizes()[d] == 0) return true;
    if (t.sizes()[d] != 1 && t.strides()[d] != expected) return false;
    expected *= t.sizes()[d];
  }
  return true;
}

// What a Py_buffer's shape/strides/format point at, freed by releasebuffer.
struct BufferState {
  Tensor tensor;  // keeps the storage, and so its export count's key, alive
  std::vector<Py_ssize_t> shape;
  std::vector<Py_ssize_t> strides;
};

int get_buffer(PyObject* obj, Py_buffer* view, int flags) {
  view->obj = nullptr;
  try {
    const Tensor& t = py::handle(obj).cast<const Tensor&>();
    if (!t.defined()) throw py::buffer_error("an undefined shmtensor.Tensor has no buffer");
    const char* format = buffer_format(t.dtype());
    if (format == nullptr)
      throw py::buffer_error(
          "bfloat16 has no buffer format (PEP 3118) and NumPy has no bfloat16: use __dlpack__ "
          "(torch.utils.dlpack.from_dlpack), or .to('float32')");
    const bool c_contig = t.is_contiguous();
    const bool f_contig = is_f_contiguous(t);
    // Without PyBUF_STRIDES the consumer assumes C order; the *_CONTIGUOUS requests ask
    // for one order explicitly.
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !c_contig)
      throw py::buffer_error("this shmtensor.Tensor is not C-contiguous");
    if ((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS && !c_contig)
      throw py::buffer_error("this shmtensor.Tensor is not C-contiguous");
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f_contig)
      throw py::buffer_error("this shmtensor.Tensor is not Fortran-contiguous");
    if ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c_contig && !f_contig)
      throw py::buffer_error("this shmtensor.Tensor is not contiguous");

    auto state = std::make_unique<BufferState>();
    state->tensor = t;
    const auto itemsize = static_cast<Py_ssize_t>(t.element_size());
    for (std::int64_t d = 0; d < t.dim(); ++d) {
      state->shape.push_back(static_cast<Py_ssize_t>(t.sizes()[d]));
      state->strides.push_back(static_cast<Py_ssize_t>(t.strides()[d]) * itemsize);
    }
    view->buf = export_address(t);
    view->len = static_cast<Py_ssize_t>(t.nbytes());
    view->readonly = 0;
    view->itemsize = itemsize;
    view->format = (flags & PyBUF_FORMAT) == PyBUF_FORMAT ? const_cast<char*>(format) : nullptr;
    if ((flags & PyBUF_ND) == PyBUF_ND) {
      view->ndim = static_cast<int>(t.dim());
      view->shape = state->shape.data();
    } else {
      view->ndim = 1;
      view->shape = nullptr;
    }
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? state->strides.data() : nullptr;
    view->suboffsets = nullptr;
    add_export(t.storage());
    view->internal = state.release();
    view->obj = obj;
    Py_INCREF(obj);
    return 0;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
  }
  return -1;
}

void release_buffer(PyObject*, Py_buffer* view) {
  std::unique_ptr<BufferState> state(static_cast<BufferState*>(view->internal));
  view->internal = nullptr;
  if (state) remove_export(state->tensor.storage());
}

// ---- DLPack 0.6 (dlpack.h, written out: the ABI is a handful of plain structs) -------------
struct DLDevice {
  std::int32_t device_type;  // kDLCPU = 1
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr std::int32_t kDLCPU = 1;
constexpr const char* kCapsuleName = "dltensor";

struct DLPackState {
  DLManagedTensor managed{};
  Tensor tensor;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
};

// Called by the consumer when it is done (possibly in another thread, without the GIL: it
// touches no Python object).
void dlpack_deleter(DLManagedTensor* self) {
  std::unique_ptr<DLPackState> state(static_cast<DLPackState*>(self->manager_ctx));
  remove_export(state->tensor.storage());
}

// A capsule nobody consumed (the consumer renames a consumed one to "used_dltensor").
void capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr) managed->deleter(managed);
}

}  // namespace

void install_buffer_protocol(PyHeapTypeObject* heap_type) {
  heap_type->as_buffer.bf_getbuffer = get_buffer;
  heap_type->as_buffer.bf_releasebuffer = release_buffer;
  heap_type->ht_type.tp_as_buffer = &heap_type->as_buffer;
}

bool has_exports(const Storage& storage) {
  std::lock_guard lock(g_exports_mu);
  return exports().count(internal::StorageAccess::impl(storage).get()) > 0;
}

py::dict array_interface(const Tensor& t) {
  py::dtype dt = numpy_dtype(t.dtype());
  py::dict d;
  py::tuple shape(t.dim());
  for (std::int64_t i = 0; i < t.dim(); ++i) shape[i] = py::int_(t.sizes()[i]);
  d["shape"] = shape;
  d["typestr"] = dt.attr("str");
  d["data"] = py::make_tuple(py::int_(reinterpret_cast<std::uintptr_t>(export_address(t))), false);
  if (t.is_contiguous()) {
    d["strides"] = py::none();
  } else {
    py::tuple strides(t.dim());
    for (std::int64_t i = 0; i < t.dim(); ++i)
      strides[i] = py::int_(t.strides()[i] * static_cast<std::int64_t>(t.element_size()));
    d["strides"] = strides;
  }
  d["version"] = 3;
  return d;
}

py::capsule to_dlpack(const Tensor& t) {
  const DLType type = dlpack_type(t.dtype());
  auto state = std::make_unique<DLPackState>();
  state->tensor = t;
  state->shape = t.sizes();
  state->strides = t.strides();
  DLTensor& dl = state->managed.dl_tensor;
  // byte_offset stays 0: torch 1.13's fromDLPack ignores it, so the offset is in `data`.
  dl.data = export_address(t);
  dl.device = {kDLCPU, 0};
  dl.ndim = static_cast<std::int32_t>(t.dim());
  dl.dtype = {type.code, type.bits, 1};
  dl.shape = state->shape.data();
  dl.strides = state->strides.data();
  dl.byte_offset = 0;
  state->managed.manager_ctx = state.get();
  state->managed.deleter = dlpack_deleter;
  add_export(t.storage());
  PyObject* capsule = PyCapsule_New(&state->managed, kCapsuleName, capsule_destructor);
  if (capsule == nullptr) {
    remove_export(t.storage());
    throw py::error_already_set();
  }
  state.release();  // the capsule's destructor or the consumer's deleter frees it
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace shmtensor::python
