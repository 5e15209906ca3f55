// The libtorch bridge (target shmtensor::torch, built when libtorch is found; docs/torch.md):
// shmtensor tensors as at::Tensor and back, without copying the bytes.
//
// Not included by shmtensor.h: it needs libtorch's headers, and the rest of the library
// builds and installs without them. It is the one public header with third-party types.
//
// Ownership both ways: the torch storage of a shmtensor Storage holds a copy of that Storage
// handle in its DataPtr's context, so the bytes live until the last of the shmtensor handles
// and the torch tensors goes, whichever side is dropped first. A torch storage whose bytes
// are such a DataPtr is "ours" (recognised by its deleter function; the library is one shared
// object per process so that this function has one address).
//
// Thread safety: every function may be called from any thread. share_memory_ of one
// c10::StorageImpl concurrently with reads or writes of its bytes elsewhere is a data race,
// as torch's own share_memory_() is.
//
// Errors: a torch tensor or storage that shmtensor cannot hold (not CPU, not strided, a
// dtype shmtensor lacks, a symbolic size) is std::invalid_argument; failures to get shared
// memory throw as Storage::allocate_shared (SystemError, SharedMemoryFullError).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <functional>
#include <optional>

#include "shmtensor/dtype.h"
#include "shmtensor/export.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"

namespace shmtensor {

// ---- dtypes ---------------------------------------------------------------------------------
// Every shmtensor dtype has a torch one (kUInt8 is torch.uint8, kFloat16 torch.half, ...).
SHMTENSOR_API c10::ScalarType to_torch(DType dtype);
// The inverse; std::invalid_argument naming the dtype for those shmtensor lacks
// (quantized types, complex32, ...).
SHMTENSOR_API DType dtype_from_torch(c10::ScalarType dtype);

// ---- tensors --------------------------------------------------------------------------------
// An at::Tensor over the same bytes, sizes, strides, storage offset, dtype and device (CPU,
// or CUDA with the index the shmtensor Device has; strided; requires_grad false). Its storage spans the whole shmtensor Storage, is not resizable, and
// is shared with every other to_torch of a tensor on that Storage while one of them lives
// (one c10::StorageImpl per shmtensor Storage, so torch sees them alias).
// A storage in private memory is first moved into shared memory (Storage::share_memory_):
// torch keeps the data pointer it is given, while a shmtensor Storage's pointer moves once,
// on share_memory_, so after to_torch the bytes must never move. Throws as share_memory_
// then; an undefined tensor is std::invalid_argument.
SHMTENSOR_API at::Tensor to_torch(const Tensor& tensor);

// A shmtensor Tensor of `tensor`'s values:
//  - zero-copy (same bytes, sizes, strides, offset) when its storage is ours, i.e. came from
//    to_torch, or was moved by share_memory_ below; the result's storage() is that Storage;
//  - otherwise a contiguous copy into a new shared tensor (Tensor::empty_shared), as
//    share_memory_() would give, without changing `tensor` (so also for a tensor with the
//    conjugate or negative bit set, whose bytes are not its values).
// A CUDA tensor converts only zero-copy (its storage ours); the copy is for CPU tensors.
// Only CPU and CUDA strided tensors of a dtype shmtensor has; else std::invalid_argument. An
// undefined at::Tensor gives an undefined Tensor. requires_grad is ignored (like detach()).
SHMTENSOR_API Tensor from_torch(const at::Tensor& tensor);

// ---- storages (what the Python bridge, shmtensor._torch, builds on) -------------------------
// A torch storage over the whole of `storage` (nbytes bytes; moved into shared memory first
// when private, as in to_torch). The same c10::StorageImpl while one made earlier lives.
SHMTENSOR_API c10::Storage to_torch(const Storage& storage);

// The shmtensor Storage behind a torch storage that is ours, else std::nullopt (a storage of
// torch's own allocator or shared memory, or of another device).
SHMTENSOR_API std::optional<Storage> shared_storage_of(const c10::StorageImpl& storage);

// Moves an existing CPU or CUDA torch storage into shmtensor shared memory in place, as
// torch's share_memory_() does into its own: the bytes are copied into
// Storage::allocate_shared (current sharing strategy), or for a CUDA storage into a block of
// this process's device arena on its device (Storage::allocate(nbytes, device): one
// device-to-device copy, then a synchronize of that device, so that torch's caching
// allocator gets the old bytes back only once they were read), and the StorageImpl's DataPtr
// is swapped, so every tensor and view on it sees the shared bytes; the storage becomes
// non-resizable (as torch's shared storages are). Returns the Storage it now lives in; a
// storage already ours is left as it is and its Storage returned; a 0-byte storage is left
// alone (std::nullopt), and so is a CUDA storage whose DataPtr is not its allocator's own
// (one torch's CUDA IPC shares or received: other processes map those bytes). The copy runs
// without the bridge's lock (a second share_memory_ of the same storage waits for the
// first). Work on a non-blocking stream (torch's side streams) that writes a
// CUDA storage must be complete before (as torch asks before sharing).
// A storage in torch's own shared memory is moved too: the caller decides whether it should
// be. std::invalid_argument for a storage neither CPU nor CUDA. Throws as allocate_shared
// (CudaError for the device), with the storage unchanged.
SHMTENSOR_API std::optional<Storage> share_memory_(c10::StorageImpl& storage);
// The same, with the shared bytes from `allocate(nbytes, device)` (called without any lock
// held; it must return a shared Storage of exactly nbytes on that device, else
// std::invalid_argument). What it
// throws passes through, the storage unchanged: the Python bridge allocates through
// shmtensor._C so that failures arrive as shmtensor's Python exceptions.
SHMTENSOR_API std::optional<Storage> share_memory_(
    c10::StorageImpl& storage, const std::function<Storage(std::size_t, Device)>& allocate);

}  // namespace shmtensor
