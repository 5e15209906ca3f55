// Everything in the torch bridge that differs between torch versions, in this one file.
//
// Built and tested against torch 1.13 (Debian bookworm's libtorch-dev and python3-torch,
// which report 1.13.0 to C++ and "1.13.0a0" to Python) and torch 2.13 (PyPI's CPU wheel, in
// the torch 2.x lane of `make test`: tools/ci/torch2_lane).
//
// What changed in 2.x that matters here:
//  - THPStorage (the C struct of torch.UntypedStorage) holds a c10::MaybeOwned<c10::Storage>
//    instead of a c10::StorageImpl*; it is read with THPStorage_Unpack. A Python object is
//    made with THPStorage_New(c10::Storage) in 2.0 and THPStorage_Wrap(c10::Storage) from
//    2.1 on (which returns the storage's existing Python object, if it has one).
//  - THPStorageClass is a PyTypeObject* from 2.1 on (a PyObject* before).
//  - Copy-on-write storages (2.2+): a lazily cloned storage has a DataPtr whose context is
//    the COW bookkeeping, not ours, so shared_storage_of() calls it foreign and
//    share_memory_() copies it (right: the clone is logically a separate storage). The
//    bridge reads bytes only through `const c10::StorageImpl&` (data(), data_ptr()), which
//    never materialises a COW storage in 2.x and is the same call in 1.13.
//  - Named tensors are gone from torch 2.13's C++ API (Tensor::has_names): has_names() below
//    asks where the member exists.
//
// Include with SHMTENSOR_TORCH_COMPAT_PYTHON defined for the Python part (libtorch_python);
// without it, this is libtorch only (the C++ library shmtensor_torch links no Python).
#pragma once

#include <c10/core/StorageImpl.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR < 1 || (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR < 13)
#error "shmtensor's torch bridge needs torch >= 1.13"
#endif

#define SHMTENSOR_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||            \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#ifdef SHMTENSOR_TORCH_COMPAT_PYTHON
#include <Python.h>
#include <torch/csrc/Export.h>  // 1.13's Storage.h uses TORCH_PYTHON_API without it
#include <torch/csrc/Storage.h>
#endif

namespace shmtensor::internal::torch_compat {

// Whether a tensor has dimension names; false where torch has no named tensors. (A template,
// so that the member is looked up on the tensor type where it is used.)
template <class Tensor>
bool has_names(const Tensor& t) {
  if constexpr (requires { t.has_names(); })
    return t.has_names();
  else
    return false;
}

#ifdef SHMTENSOR_TORCH_COMPAT_PYTHON

// 1 when obj is a torch.UntypedStorage (or a subclass), 0 when not, -1 with a Python error
// set. Needs torch imported (THPStorageClass is set by torch's module init).
inline int is_untyped_storage(PyObject* obj) {
  // A PyObject* in 1.13 and 2.0, a PyTypeObject* from 2.1: the cast fits both.
  auto* cls = reinterpret_cast<PyObject*>(THPStorageClass);
  if (cls == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torch is not initialised (THPStorageClass is null)");
    return -1;
  }
  return PyObject_IsInstance(obj, cls);
}

// The storage of a torch.UntypedStorage (is_untyped_storage(obj) == 1). Borrowed: valid while
// obj lives.
inline c10::StorageImpl* storage_impl_of(PyObject* obj) {
#if SHMTENSOR_TORCH_AT_LEAST(2, 0)
  return THPStorage_Unpack(obj).unsafeGetStorageImpl();
#else
  return reinterpret_cast<THPStorage*>(obj)->cdata;
#endif
}

// A new reference to a torch.UntypedStorage over `storage`; nullptr with a Python error set.
inline PyObject* wrap_storage(c10::Storage storage) {
#if SHMTENSOR_TORCH_AT_LEAST(2, 1)
  return THPStorage_Wrap(std::move(storage));
#elif SHMTENSOR_TORCH_AT_LEAST(2, 0)
  return THPStorage_New(std::move(storage));
#else
  // 1.13's c10::Storage has no accessor for its intrusive_ptr: take over its reference.
  return THPStorage_New(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim(storage.unsafeReleaseStorageImpl()));
#endif
}

#endif  // SHMTENSOR_TORCH_COMPAT_PYTHON

}  // namespace shmtensor::internal::torch_compat
