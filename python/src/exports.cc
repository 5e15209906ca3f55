#include "exports.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dtypes.h"
#include "shmtensor/device.h"
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

// ---- DLPack (dlpack.h, written out: the ABI is a handful of plain structs) -----------------
// 0.6 capsules ("dltensor", DLManagedTensor) for consumers that ask for no version (NumPy
// 1.x, torch 1.x), 1.0 capsules ("dltensor_versioned", DLManagedTensorVersioned: a
// version, flags, and the boolean type) for those that pass max_version >= (1, 0).
struct DLDevice {
  std::int32_t device_type;
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
  std::int64_t* strides;  // in elements; may be null (row-major) from a producer
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;
  DLTensor dl_tensor;
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr std::int32_t kDLCUDAHost = 3;  // page-locked host memory: host addresses
constexpr std::uint64_t kFlagReadOnly = 1;
constexpr std::uint64_t kFlagIsCopied = 2;
constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kUsedName = "used_dltensor";
constexpr const char* kUsedVersionedName = "used_dltensor_versioned";

// One exported tensor: the managed struct the consumer gets (one of the two, by version),
// and what its pointers point at.
struct DLPackState {
  DLManagedTensor managed{};
  DLManagedTensorVersioned versioned{};
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
void dlpack_versioned_deleter(DLManagedTensorVersioned* self) {
  std::unique_ptr<DLPackState> state(static_cast<DLPackState*>(self->manager_ctx));
  remove_export(state->tensor.storage());
}

// A capsule nobody consumed (a consumer renames the one it takes to "used_...").
void capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}
void versioned_capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kVersionedName)) return;
  auto* managed =
      static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersionedName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

// The one place where exporting a CUDA tensor orders the device's work before the
// consumer's. `stream` is the consumer's (the array API's values: 1 the legacy default
// stream, 2 the per-thread one, others a cudaStream_t; -1 asks for no ordering). For now
// every value but -1 waits until all the work queued on the device is complete, which is
// correct for any consumer stream; recording an event here and making `stream` wait for it
// would order without blocking the host.
void order_before_consumer(Device device, std::int64_t stream) {
  if (stream == -1) return;
  py::gil_scoped_release release;
  cuda::synchronize(device);
}

// The consumer's stream for an export from a CUDA tensor, checked as the array API says.
std::int64_t cuda_stream(const py::object& stream) {
  if (stream.is_none()) return 1;  // "the legacy default stream is assumed"
  if (PyBool_Check(stream.ptr()) || !PyLong_Check(stream.ptr()))
    throw py::type_error("__dlpack__: stream is an int or None");
  const auto s = stream.cast<std::int64_t>();
  if (s == 0)
    throw py::value_error(
        "__dlpack__: stream 0 is ambiguous for CUDA (the array API forbids it): pass 1 for the "
        "legacy default stream, 2 for the per-thread default stream, or the stream's handle");
  if (s < -1) throw py::value_error("__dlpack__: stream " + std::to_string(s) + " is not a stream");
  return s;
}

// The device a dl_device argument names: (kDLCPU, 0) or (kDLCUDA, i).
Device device_of_dl(const py::object& dl_device) {
  const auto pair = dl_device.cast<std::pair<std::int64_t, std::int64_t>>();
  if (pair.first == kDLCPU) return Device::cpu();
  if (pair.first == kDLCUDA && pair.second >= 0 && pair.second <= INT32_MAX)
    return Device::cuda(static_cast<int>(pair.second));
  throw py::buffer_error("__dlpack__: cannot export to DLPack device (" +
                         std::to_string(pair.first) + ", " + std::to_string(pair.second) +
                         "): shmtensor has the CPU (1) and CUDA (2)");
}

DLDevice dl_device_of(Device d) {
  if (d.is_cpu()) return {kDLCPU, 0};
  return {kDLCUDA, d.index()};
}

// A capsule over t (whose device's work is ordered already).
py::capsule make_capsule(const Tensor& t, bool versioned, std::uint64_t flags) {
  const DLType type = dlpack_type(t.dtype(), versioned);
  auto state = std::make_unique<DLPackState>();
  state->tensor = t;
  state->shape = t.sizes();
  state->strides = t.strides();
  DLTensor& dl = versioned ? state->versioned.dl_tensor : state->managed.dl_tensor;
  // byte_offset stays 0: torch 1.13's fromDLPack ignores it, so the offset is in `data`.
  dl.data = t.is_cuda() ? const_cast<void*>(t.raw_data()) : export_address(t);
  dl.device = dl_device_of(t.device());
  dl.ndim = static_cast<std::int32_t>(t.dim());
  dl.dtype = {type.code, type.bits, 1};
  dl.shape = state->shape.data();
  dl.strides = state->strides.data();
  dl.byte_offset = 0;
  PyObject* capsule = nullptr;
  add_export(t.storage());
  if (versioned) {
    state->versioned.version = {1, 0};
    state->versioned.manager_ctx = state.get();
    state->versioned.deleter = dlpack_versioned_deleter;
    state->versioned.flags = flags;
    capsule = PyCapsule_New(&state->versioned, kVersionedName, versioned_capsule_destructor);
  } else {
    state->managed.manager_ctx = state.get();
    state->managed.deleter = dlpack_deleter;
    capsule = PyCapsule_New(&state->managed, kCapsuleName, capsule_destructor);
  }
  if (capsule == nullptr) {
    remove_export(t.storage());
    throw py::error_already_set();
  }
  state.release();  // the capsule's destructor or the consumer's deleter frees it
  return py::reinterpret_steal<py::capsule>(capsule);
}

// Alignment Tensor::from_storage requires of an element: a complex number's is its part's.
std::size_t element_alignment(DType d) {
  const std::size_t size = element_size(d);
  return d == DType::kComplex64 || d == DType::kComplex128 ? size / 2 : size;
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

py::capsule to_dlpack(const Tensor& t, const py::object& stream, const py::object& max_version,
                      const py::object& dl_device, const py::object& copy) {
  if (!t.defined()) throw py::buffer_error("an undefined shmtensor.Tensor has no DLPack");
  if (!copy.is_none() && !PyBool_Check(copy.ptr()))
    throw py::type_error("__dlpack__: copy is True, False or None");
  bool versioned = false;
  if (!max_version.is_none()) {
    const auto v = max_version.cast<std::pair<std::int64_t, std::int64_t>>();
    versioned = v.first >= 1;
  }
  std::int64_t consumer_stream = -1;
  if (t.is_cuda()) {
    consumer_stream = cuda_stream(stream);
  } else if (!stream.is_none()) {
    throw py::buffer_error("a CPU tensor takes no stream (DLPack: stream must be None)");
  }
  const Device target = dl_device.is_none() ? t.device() : device_of_dl(dl_device);
  const bool must_copy = target != t.device() || (!copy.is_none() && copy.cast<bool>());
  if (must_copy && !copy.is_none() && !copy.cast<bool>())
    throw py::buffer_error("__dlpack__(copy=False): this " + t.device().to_string() +
                           " tensor cannot be exported to " + target.to_string() +
                           " without a copy");
  if (t.is_cuda()) order_before_consumer(t.device(), consumer_stream);
  if (!must_copy) return make_capsule(t, versioned, 0);
  Tensor copied;
  {
    py::gil_scoped_release release;
    copied = target != t.device() ? t.to(target) : t.clone();
  }
  if (copied.is_cuda()) order_before_consumer(copied.device(), consumer_stream);
  return make_capsule(copied, versioned, kFlagIsCopied);
}

py::tuple from_dlpack_capsule(const py::capsule& capsule) {
  PyObject* obj = capsule.ptr();
  const char* name = PyCapsule_GetName(obj);
  if (name == nullptr) throw py::error_already_set();
  const std::string_view n(name);
  if (n == kUsedName || n == kUsedVersionedName)
    throw py::buffer_error("this DLPack capsule was consumed already (a capsule is used once)");
  const bool versioned = n == kVersionedName;
  if (!versioned && n != kCapsuleName)
    throw py::type_error("not a DLPack capsule: a capsule named '" + std::string(n) + "'");

  DLTensor* dl = nullptr;
  bool readonly = false;
  void* managed = PyCapsule_GetPointer(obj, name);
  if (managed == nullptr) throw py::error_already_set();
  DLPackState* ours = nullptr;
  if (versioned) {
    auto* m = static_cast<DLManagedTensorVersioned*>(managed);
    if (m->version.major != 1)
      throw py::buffer_error("a DLPack " + std::to_string(m->version.major) + "." +
                             std::to_string(m->version.minor) +
                             " capsule: shmtensor reads DLPack 1.x and 0.6");
    dl = &m->dl_tensor;
    readonly = (m->flags & kFlagReadOnly) != 0;
    if (m->deleter == dlpack_versioned_deleter) ours = static_cast<DLPackState*>(m->manager_ctx);
  } else {
    auto* m = static_cast<DLManagedTensor*>(managed);
    dl = &m->dl_tensor;
    if (m->deleter == dlpack_deleter) ours = static_cast<DLPackState*>(m->manager_ctx);
  }
  if (ours != nullptr) {
    // One of ours: the tensor itself, on the same storage (shared or not, identity kept).
    Tensor t = ours->tensor;
    if (PyCapsule_SetName(obj, versioned ? kUsedVersionedName : kUsedName) != 0)
      throw py::error_already_set();
    if (versioned) {
      auto* m = static_cast<DLManagedTensorVersioned*>(managed);
      m->deleter(m);
    } else {
      auto* m = static_cast<DLManagedTensor*>(managed);
      m->deleter(m);
    }
    return py::make_tuple(std::move(t), readonly);
  }

  Device device;
  if (dl->device.device_type == kDLCPU || dl->device.device_type == kDLCUDAHost) {
    device = Device::cpu();
  } else if (dl->device.device_type == kDLCUDA && dl->device.device_id >= 0) {
    device = Device::cuda(dl->device.device_id);
  } else {
    throw py::buffer_error("a DLPack tensor on device (" +
                           std::to_string(dl->device.device_type) + ", " +
                           std::to_string(dl->device.device_id) +
                           "): shmtensor has the CPU (1) and CUDA (2)");
  }
  if (dl->dtype.lanes != 1)
    throw py::buffer_error("a DLPack dtype of " + std::to_string(dl->dtype.lanes) +
                           " lanes: shmtensor has scalars only");
  const std::optional<DType> dtype = dtype_of_dlpack(dl->dtype.code, dl->dtype.bits);
  if (!dtype)
    throw py::buffer_error("DLPack type code " + std::to_string(dl->dtype.code) + " of " +
                           std::to_string(dl->dtype.bits) +
                           " bits has no shmtensor dtype (shmtensor has bool, uint8, int8-64, "
                           "float16-64, bfloat16, complex64/128)");
  if (dl->ndim < 0 || dl->ndim > 64 || (dl->ndim > 0 && dl->shape == nullptr))
    throw py::buffer_error("a DLPack tensor of " + std::to_string(dl->ndim) + " dimensions");

  // The storage: from the first element (strides are never negative here) to the last.
  std::vector<std::int64_t> sizes(dl->shape, dl->shape + dl->ndim);
  std::vector<std::int64_t> strides(sizes.size());
  bool empty = false;
  for (std::int64_t s : sizes) {
    if (s < 0) throw py::buffer_error("a DLPack tensor with a negative size");
    empty = empty || s == 0;
  }
  if (dl->strides != nullptr) {
    strides.assign(dl->strides, dl->strides + dl->ndim);
  } else {
    std::int64_t stride = 1;
    for (std::size_t d = sizes.size(); d-- > 0;) {
      strides[d] = stride;
      if (__builtin_mul_overflow(stride, std::max<std::int64_t>(sizes[d], 1), &stride))
        throw py::buffer_error("a DLPack tensor too large");
    }
  }
  const auto itemsize = static_cast<std::int64_t>(element_size(*dtype));
  std::int64_t extent = 1;  // elements from the first to the last, inclusive
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (strides[d] < 0)
      throw py::buffer_error(
          "a DLPack tensor with negative strides (a reversed view): shmtensor tensors have "
          "none; pass a copy (np.ascontiguousarray, .contiguous())");
    std::int64_t span = 0;
    if (!empty && (__builtin_mul_overflow(sizes[d] - 1, strides[d], &span) ||
                   __builtin_add_overflow(extent, span, &extent)))
      throw py::buffer_error("a DLPack tensor too large");
  }
  std::int64_t nbytes = 0;
  if (!empty && __builtin_mul_overflow(extent, itemsize, &nbytes))
    throw py::buffer_error("a DLPack tensor too large");
  auto* first = static_cast<std::byte*>(dl->data) + dl->byte_offset;
  if (reinterpret_cast<std::uintptr_t>(first) % element_alignment(*dtype) != 0)
    throw py::buffer_error("a DLPack tensor whose data is not aligned for " +
                           to_string(*dtype));

  // The producer's deleter, armed once the tensor exists: until then a failure leaves the
  // capsule unconsumed, and its own destructor frees it.
  auto armed = std::make_shared<bool>(false);
  std::function<void()> deleter;
  if (versioned) {
    auto* m = static_cast<DLManagedTensorVersioned*>(managed);
    deleter = [m, armed] {
      if (*armed && m->deleter != nullptr) m->deleter(m);
    };
  } else {
    auto* m = static_cast<DLManagedTensor*>(managed);
    deleter = [m, armed] {
      if (*armed && m->deleter != nullptr) m->deleter(m);
    };
  }
  Tensor t = Tensor::from_storage(
      Storage::from_blob(empty ? nullptr : first, static_cast<std::size_t>(nbytes), device,
                         std::move(deleter)),
      0, std::move(sizes), std::move(strides), *dtype);
  if (PyCapsule_SetName(obj, versioned ? kUsedVersionedName : kUsedName) != 0)
    throw py::error_already_set();
  *armed = true;
  return py::make_tuple(std::move(t), readonly);
}

}  // namespace shmtensor::python
