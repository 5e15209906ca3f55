// shmtensor._torch: torch.UntypedStorage <-> shmtensor blocks, for shmtensor.torch (the
// Python integration, docs/torch.md). Built only with libtorch (SHMTENSOR_BUILD_TORCH).
//
// A "block" is a shmtensor._C.Tensor standing for a whole shmtensor Storage (1-d uint8 over
// it, as shmtensor._C._empty((n,), "uint8", True) makes). Blocks cross from and to shmtensor._C
// only as "shmtensor.Storage" capsules (_C._storage_capsule / _C._block_of_capsule): this
// module shares no pybind11 type with _C. Allocation goes through _C._empty too, so that a
// failure arrives as shmtensor's own Python exception (SharedMemoryFullError, ...).
//
// The GIL is released while share_storage_ copies the bytes and while new_shared allocates;
// _C._empty is called with it.
//
// Tensors: tensor_parts / tensor_from_block carry an exact torch.Tensor as (block, dtype,
// offset, sizes, strides), so that shmtensor.torch's tensor reducer and its rebuild are one
// call each into C++ instead of torch's reduce_tensor/rebuild_tensor and the storage's own.
// Tensor messages (encoded and decoded by _C, python/src/messages.cc) describe and make their
// torch tensors through message_describe / message_make, handed to _C at import.
#define SHMTENSOR_TORCH_COMPAT_PYTHON
#include <pybind11/pybind11.h>
#include <ATen/Functions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shmtensor/torch.h"
#include "shmtensor/internal/message_torch.h"
#include "shmtensor/internal/torch_compat.h"

namespace py = pybind11;

namespace shmtensor::python {

namespace {

namespace compat = internal::torch_compat;

constexpr const char* kStorageCapsule = "shmtensor.Storage";  // _C's name for it

py::module_ c_module() { return py::module_::import("shmtensor._C"); }

// shmtensor._C's _storage_capsule and _block_of_capsule, looked up once at module init (new
// references kept for the process's life: never decref'd at exit, when the interpreter may
// be gone; set before any call, so no lazy initialisation races on the GIL).
py::handle g_to_capsule;
py::handle g_of_capsule;

// The Storage of a block (through _C._storage_capsule, which checks the type).
Storage storage_of_block(const py::handle& block) {
  py::object capsule = g_to_capsule(block);
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
  return g_of_capsule(capsule);
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

// A new shared Storage of nbytes on `device` (a block of the device's arena for a CUDA one)
// made by _C._empty (so that a failure is shmtensor's own Python exception). Needs the GIL.
Storage allocate_through_c(std::size_t nbytes, Device device = Device::cpu()) {
  py::object empty = c_module().attr("_empty");
  if (device.is_cuda())
    return storage_of_block(empty(py::make_tuple(nbytes), "uint8", true, device.to_string()));
  return storage_of_block(empty(py::make_tuple(nbytes), "uint8", true));
}

// The torch.UntypedStorage over a shared Storage (the one torch storage of it here).
py::object wrap(const Storage& storage) {
  PyObject* obj = compat::wrap_storage(to_torch(storage));
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(obj);
}

py::object storage_from_block(const py::handle& block) {
  Storage storage = storage_of_block(block);
  if (!storage.is_shared())
    throw py::value_error(
        "storage_from_block: the block is not in shared memory (make it with "
        "shmtensor._C._empty((n,), 'uint8', True))");
  return wrap(storage);
}

// Whether a storage of a size has no data (a zero tensor's, a wrapper subclass's), read
// through const access: torch 2.x's Python data_ptr() materialises a copy-on-write storage.
bool has_no_data(const py::handle& storage) {
  const c10::StorageImpl& impl = storage_impl_of(storage, "has_no_data");
  return impl.nbytes() > 0 && impl.data() == nullptr;
}

py::object block_of_storage(const py::handle& storage) {
  std::optional<Storage> ours = shared_storage_of(storage_impl_of(storage, "block_of_storage"));
  if (!ours) return py::none();
  return block_of(*ours);
}

// Moves impl into shared memory (allocating through _C._empty); nullopt for 0 bytes. The
// caller's reference keeps impl alive meanwhile.
std::optional<Storage> share_impl(c10::StorageImpl& impl) {
  py::gil_scoped_release release;
  return share_memory_(impl, [](std::size_t nbytes, Device device) {
    py::gil_scoped_acquire acquire;
    return allocate_through_c(nbytes, device);
  });
}

py::object share_storage(const py::handle& storage) {
  std::optional<Storage> moved = share_impl(storage_impl_of(storage, "share_storage_"));
  if (!moved) return py::none();
  return block_of(*moved);
}

// A new shared Storage of `nbytes` (> 0) of the process's current strategy, made without
// the GIL (a new segment's syscalls, and the manager daemon's start for the first named one,
// while this process's other threads run: a queue's feeder sending an earlier batch). A
// SharedMemoryFullError (a segment larger than /dev/shm: arena.h) is raised as _C's here;
// another failure is made again through _C._empty, which raises shmtensor's Python
// exception for it, or succeeds if the condition has passed.
Storage allocate_shared(std::size_t nbytes) {
  try {
    py::gil_scoped_release release;
    return Storage::allocate_shared(nbytes);
  } catch (const SharedMemoryFullError& e) {
    py::object error = c_module().attr("SharedMemoryFullError")(e.what());
    error.attr("requested") = py::int_(e.requested());
    error.attr("available") = py::int_(e.available());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw py::error_already_set();
  } catch (const std::exception&) {
    return allocate_through_c(nbytes);
  }
}

// A torch.UntypedStorage over a new shared block of `nbytes` (> 0), of the process's current
// strategy: _new_shared's allocation (a DataLoader worker's every batch tensor) in one call.
py::object new_shared(std::size_t nbytes) {
  if (nbytes == 0) throw py::value_error("new_shared: 0 bytes (torch's own makes empty storages)");
  return wrap(allocate_shared(nbytes));
}

// The strides of a C-contiguous tensor of `sizes` (the last 1, each other the product of the
// sizes after it, a size 0 counting as 1, as torch's); nullopt if that overflows.
std::optional<std::vector<std::int64_t>> contiguous_strides(c10::IntArrayRef sizes) {
  std::vector<std::int64_t> strides(sizes.size());
  std::int64_t stride = 1;
  for (std::size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    if (__builtin_mul_overflow(stride, std::max<std::int64_t>(sizes[i], 1), &stride))
      return std::nullopt;
  }
  return strides;
}

py::tuple int_tuple(c10::IntArrayRef values) {
  py::tuple out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

// What is wrong with a view of `itemsize`-byte elements (offset, sizes, strides) on a
// storage of `nbytes`, or nullptr when it lies within: the one rule of tensor_parts and
// tensor_from_block. A view with no elements reads nothing (torch allows any offset for
// it): only its numbers must not be negative. Any other needs its last element's end
// within the storage, computed without overflow.
const char* view_error(std::int64_t offset, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                       std::uint64_t itemsize, std::uint64_t nbytes) {
  if (sizes.size() != strides.size()) return "has a different number of strides and sizes";
  if (offset < 0) return "has a negative offset";
  bool empty = false;
  std::uint64_t numel = 1;  // multiplied in order, as torch does (it refuses an overflow)
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0) return "has sizes or strides out of range";
    empty = empty || sizes[i] == 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(sizes[i]), &numel) ||
        numel > static_cast<std::uint64_t>(INT64_MAX))
      return "overflows";
  }
  if (empty) return nullptr;
  std::uint64_t last = static_cast<std::uint64_t>(offset);  // the last element's index
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::uint64_t step = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(sizes[i] - 1),
                               static_cast<std::uint64_t>(strides[i]), &step) ||
        __builtin_add_overflow(last, step, &last))
      return "overflows";
  }
  std::uint64_t end = 0;
  if (__builtin_add_overflow(last, 1, &last) || __builtin_mul_overflow(last, itemsize, &end))
    return "overflows";
  if (end > nbytes) return "reaches past its block";
  return nullptr;
}

// The exact CPU (or, with `cuda`, CPU or CUDA) torch.Tensor that obj is, when it has nothing
// that torch's own code must handle (a subclass, another device or layout, nested,
// requires_grad, names, lazy conjugate/negative/zero bits, quantized, a functional, functorch
// or Python-dispatch wrapper, no storage); else nullptr. Borrowed: valid while obj lives.
const at::Tensor* plain_cpu_tensor(const py::handle& obj, bool cuda = false) {
  if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  const c10::DeviceType type = t.defined() ? t.device().type() : c10::kCPU;
  if (!t.defined() || !(type == c10::kCPU || (cuda && type == c10::kCUDA)) ||
      t.layout() != c10::kStrided ||
      t.is_nested() || t.requires_grad() || compat::has_names(t) || t.is_conj() || t.is_neg() ||
      t._is_zerotensor() || t.is_quantized() || !t.has_storage())
    return nullptr;
  const c10::DispatchKeySet keys = t.key_set();
  for (c10::DispatchKey k : {c10::DispatchKey::Functionalize, c10::DispatchKey::Python,
                             c10::DispatchKey::FuncTorchBatched,
                             c10::DispatchKey::FuncTorchGradWrapper})
    if (keys.has(k)) return nullptr;
  return &t;
}

// (block, dtype, offset, sizes, strides) of an exact torch.Tensor whose values are the bytes
// of a CPU or CUDA storage (strides None when they are the contiguous ones for the sizes); None for
// anything torch's own reducer must take: a subclass, another device or layout, nested,
// requires_grad, names, lazy conjugate/negative/zero bits, quantized, a functional,
// functorch or Python-dispatch wrapper, no storage or an empty one. (A storage with a size
// and no data that gets past these is refused by share_memory_: a ValueError.) When the storage is not shmtensor's yet: moved into an arena
// in place if `move` (every view follows), else (None, ...) so that the caller can set the
// strategy first.
py::object tensor_parts(const py::handle& obj, bool move) {
  const at::Tensor* plain = plain_cpu_tensor(obj, /*cuda=*/true);
  if (plain == nullptr) return py::none();
  const at::Tensor& t = *plain;
  // Our own reference to the storage and copy of the view: the GIL is released while the
  // bytes are copied, and another thread may set_() or resize_() the tensor meanwhile.
  const c10::Storage keep = t.storage();
  c10::StorageImpl* impl = keep.unsafeGetStorageImpl();
  const std::int64_t offset = t.storage_offset();
  const std::vector<std::int64_t> sizes = t.sizes().vec();
  const std::vector<std::int64_t> view_strides = t.strides().vec();
  const c10::ScalarType dtype = t.scalar_type();
  if (impl->nbytes() == 0) return py::none();
  if (view_error(offset, sizes, view_strides, static_cast<std::uint64_t>(t.element_size()),
                 impl->nbytes()) != nullptr)
    return py::none();  // not expected of a torch tensor; torch's reducer decides
  std::optional<Storage> ours = shared_storage_of(*impl);
  if (!ours && !move) return py::make_tuple(py::none(), 0, 0, py::tuple(), py::tuple());
  if (!ours) {
    // (A storage that has a size and no data is refused there, under its lock.)
    ours = share_impl(*impl);
    if (!ours) return py::none();
  }
  // Strides that are the contiguous ones for the sizes travel as None (shorter messages:
  // a 4-tensor batch's then fits a queue's ring slot with either strategy).
  auto contiguous = contiguous_strides(sizes);
  py::object strides = contiguous && *contiguous == view_strides
                           ? py::object(py::none())
                           : py::object(int_tuple(view_strides));
  return py::make_tuple(block_of(*ours), static_cast<int>(dtype), offset, int_tuple(sizes),
                        strides);
}

[[noreturn]] void bad_tensor(const std::string& what) {
  throw py::value_error("shmtensor: a received tensor " + what +
                        " (a corrupt or hostile message)");
}

// An int of a message, in 64 bits and >= 0.
std::int64_t int64_of(const py::handle& v, const char* what) {
  if (!PyLong_Check(v.ptr())) bad_tensor(std::string("has ") + what + " that are not ints");
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow != 0 || x < 0) bad_tensor(std::string("has ") + what + " out of range");
  return x;
}

std::vector<std::int64_t> int64s(const py::handle& seq, const char* what) {
  if (!PyTuple_Check(seq.ptr())) bad_tensor(std::string("has ") + what + " that are not a tuple");
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(PyTuple_GET_SIZE(seq.ptr())));
  for (py::handle v : py::reinterpret_borrow<py::tuple>(seq)) out.push_back(int64_of(v, what));
  return out;
}

// The dtype of a message's dtype code (tensor_parts' int of a c10::ScalarType).
c10::ScalarType scalar_type_of(std::int64_t code) {
  if (code < 0 || code >= static_cast<std::int64_t>(c10::ScalarType::NumOptions))
    bad_tensor("has no dtype");
  const auto scalar_type = static_cast<c10::ScalarType>(code);
  if (scalar_type == c10::ScalarType::Undefined || c10::isQIntType(scalar_type))
    bad_tensor("has no dtype");
  return scalar_type;
}

// A torch.Tensor viewing `storage` (one torch storage per shmtensor storage in a process,
// so every tensor received on a block shares it); ValueError (bad_tensor) when the view does
// not fit it.
py::object tensor_on(const Storage& storage, c10::ScalarType scalar_type, std::int64_t offset,
                     c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  if (!storage.is_shared()) bad_tensor("names a block that is not in shared memory");
  if (const char* error = view_error(offset, sizes, strides,
                                     static_cast<std::uint64_t>(c10::elementSize(scalar_type)),
                                     storage.nbytes()))
    bad_tensor(error);
  // The TensorImpl made directly, as at::empty makes one (CPU or CUDA, the autograd keys its
  // constructor adds), with the view set on it: what at::empty({0}) and set_() end with,
  // without two dispatcher calls and an empty storage between them.
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      to_torch(storage),
      c10::DispatchKeySet(storage.device().is_cuda() ? c10::DispatchKey::CUDA
                                                     : c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(scalar_type));
  impl->set_sizes_and_strides(sizes, strides, offset);
  PyObject* wrapped = THPVariable_Wrap(at::Tensor(std::move(impl)));
  if (wrapped == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(wrapped);
}

// The inverse of tensor_parts, in the receiving process: a torch.Tensor on the block's
// storage (one torch storage per shmtensor storage in a process, so every tensor received on
// a block shares it). ValueError for anything in them that is not what tensor_parts makes
// or does not fit the block (view_error).
py::object tensor_from_block(const py::handle& block, const py::handle& dtype_obj,
                             const py::handle& offset_obj, const py::handle& sizes_obj,
                             const py::handle& strides_obj) {
  const c10::ScalarType scalar_type = scalar_type_of(int64_of(dtype_obj, "a dtype code"));
  const std::int64_t offset = int64_of(offset_obj, "an offset");
  const std::vector<std::int64_t> sizes = int64s(sizes_obj, "sizes");
  std::vector<std::int64_t> strides;
  if (strides_obj.is_none()) {  // contiguous
    auto contiguous = contiguous_strides(sizes);
    if (!contiguous) bad_tensor("overflows");
    strides = std::move(*contiguous);
  } else {
    strides = int64s(strides_obj, "strides");
  }
  return tensor_on(storage_of_block(block), scalar_type, offset, sizes, strides);
}

// What torch's collate_tensor_fn does in a DataLoader worker, in one call: a new
// shared-memory storage for the batch (_new_shared's), a contiguous tensor of
// (len(batch), *elem.size()) on it, and torch.stack(batch, 0, out=that). None when the batch
// is not a non-empty list or tuple of plain CPU tensors (plain_cpu_tensor) of one dtype and
// one shape, or holds no element: torch's collate_tensor_fn then does what it does (its
// errors included).
py::object stack_shared(const py::handle& batch_obj) {
  if (!(PyList_Check(batch_obj.ptr()) || PyTuple_Check(batch_obj.ptr()))) return py::none();
  // A tuple of the items (the batch itself when it is one): a list may change under another
  // thread (free-threaded Python) while its items are read.
  auto batch = py::reinterpret_steal<py::tuple>(PySequence_Tuple(batch_obj.ptr()));
  if (!batch) throw py::error_already_set();
  const Py_ssize_t n = PyTuple_GET_SIZE(batch.ptr());
  if (n == 0) return py::none();
  PyObject** items = &PyTuple_GET_ITEM(batch.ptr(), 0);
  std::vector<at::Tensor> tensors;
  tensors.reserve(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    py::handle item(items[i]);
    const at::Tensor* t = plain_cpu_tensor(item);
    if (t == nullptr) return py::none();
    if (!tensors.empty() &&
        (t->scalar_type() != tensors[0].scalar_type() || t->sizes() != tensors[0].sizes()))
      return py::none();
    tensors.push_back(*t);
  }
  const at::Tensor& elem = tensors[0];
  std::vector<std::int64_t> sizes{static_cast<std::int64_t>(tensors.size())};
  sizes.insert(sizes.end(), elem.sizes().begin(), elem.sizes().end());
  auto strides = contiguous_strides(sizes);
  std::uint64_t nbytes = 0;
  if (!strides || __builtin_mul_overflow(static_cast<std::uint64_t>(elem.numel()),
                                         static_cast<std::uint64_t>(tensors.size()), &nbytes) ||
      __builtin_mul_overflow(nbytes, static_cast<std::uint64_t>(elem.element_size()), &nbytes))
    return py::none();
  if (nbytes == 0) return py::none();
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(elem.scalar_type()));
  out.set_(to_torch(allocate_shared(nbytes)), 0, sizes, *strides);
  {
    py::gil_scoped_release release;  // the copy: the tensors are held by `tensors`
    at::stack_out(out, tensors, 0);
  }
  PyObject* wrapped = THPVariable_Wrap(std::move(out));
  if (wrapped == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(wrapped);
}


// ---- tensor messages ------------------------------------------------------------------------
//
// shmtensor._C encodes and decodes tensor messages (python/src/messages.cc); a torch.Tensor in
// one is described and made here (shmtensor/internal/message_torch.h).

// The Python error of the exception being handled; -1 or nullptr for the caller to return.
void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// 1 and *out for a plain CPU tensor (plain_cpu_tensor) whose storage is in an arena already
// and whose view fits it; 0 for any other (the message is pickled, and the reducer moves it).
int message_describe(void* obj, internal::MessageTensor* out) noexcept {
  try {
    const at::Tensor* plain = plain_cpu_tensor(py::handle(static_cast<PyObject*>(obj)));
    if (plain == nullptr) return 0;
    const at::Tensor& t = *plain;
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    const c10::IntArrayRef sizes = t.sizes();
    const c10::IntArrayRef strides = t.strides();
    if (impl->nbytes() == 0 || sizes.size() > internal::kMessageMaxDims ||
        view_error(t.storage_offset(), sizes, strides,
                   static_cast<std::uint64_t>(t.element_size()), impl->nbytes()) != nullptr)
      return 0;
    std::optional<Storage> ours = shared_storage_of(*impl);
    if (!ours) return 0;
    out->storage = std::move(*ours);
    out->dtype = static_cast<std::uint8_t>(t.scalar_type());
    out->dims = static_cast<std::uint8_t>(sizes.size());
    out->offset = t.storage_offset();
    std::copy(sizes.begin(), sizes.end(), out->sizes);
    std::copy(strides.begin(), strides.end(), out->strides);
    auto contiguous = contiguous_strides(sizes);
    out->contiguous = contiguous && c10::IntArrayRef(*contiguous) == strides;
    return 1;
  } catch (...) {
    set_python_error();
    return -1;
  }
}

void* message_make(const internal::MessageTensor* t) noexcept {
  try {
    return tensor_on(t->storage, scalar_type_of(t->dtype), t->offset,
                     c10::IntArrayRef(t->sizes, t->dims), c10::IntArrayRef(t->strides, t->dims))
        .release()
        .ptr();
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

internal::MessageTorch g_message_torch;
}  // namespace

}  // namespace shmtensor::python

PYBIND11_MODULE(_torch, m) {
  namespace sp = shmtensor::python;
  m.doc() =
      "shmtensor's bridge to torch storages (for shmtensor.torch); built against torch " TORCH_VERSION;
  // torch sets up torch.UntypedStorage (THPStorageClass) when imported.
  py::module_::import("torch");
  py::module_ c = py::module_::import("shmtensor._C");
  sp::g_to_capsule = py::object(c.attr("_storage_capsule")).release();
  sp::g_of_capsule = py::object(c.attr("_block_of_capsule")).release();
  m.attr("torch_version") = TORCH_VERSION;
  // _C's tensor messages carry torch tensors from now on (where shmtensor.torch's reducer is
  // installed; messages.cc).
  sp::g_message_torch.tensor_type = THPVariableClass;
  sp::g_message_torch.describe = &sp::message_describe;
  sp::g_message_torch.make = &sp::message_make;
  c.attr("_set_message_torch")(
      py::capsule(static_cast<void*>(&sp::g_message_torch), shmtensor::internal::kMessageTorchCapsule));
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
  m.def("new_shared", &sp::new_shared, py::arg("nbytes"),
        "A torch.UntypedStorage over a new shared block of nbytes (> 0) with the current "
        "strategy; allocation failures raise shmtensor's exceptions.");
  m.def("has_no_data", &sp::has_no_data, py::arg("storage"),
        "Whether a torch.UntypedStorage has a size and no data (a zero tensor's), without "
        "materialising a copy-on-write storage as its data_ptr() does.");
  m.def("stack_shared", &sp::stack_shared, py::arg("batch"),
        "torch.stack(batch, 0) into a new shared-memory storage of the current strategy, as "
        "torch's collate_tensor_fn does in a DataLoader worker; None for a batch that is not a "
        "non-empty list or tuple of plain CPU tensors of one dtype and shape with elements.");
  m.def("tensor_parts", &sp::tensor_parts, py::arg("tensor"), py::arg("move"),
        "(block, dtype, offset, sizes, strides; strides None when contiguous) of an exact CPU or CUDA torch.Tensor that "
        "shmtensor.torch sends itself; None for one torch's reduce_tensor must take (a "
        "subclass, another device, not strided, requires_grad, named, conjugate/negative bit, quantized, an empty storage). A "
        "storage not yet in shared memory is moved in place if `move`, else block is None.");
  m.def("tensor_from_block", &sp::tensor_from_block, py::arg("block"), py::arg("dtype"),
        py::arg("offset"), py::arg("sizes"), py::arg("strides"),
        "The torch.Tensor of tensor_parts' other values (strides None: contiguous) over `block`'s storage (shared with every "
        "other tensor received on it here). ValueError when they do not fit the block.");
}
