// Storage: the refcounted bytes behind one or more tensors.
//
// A Storage is a cheap handle (copies share the bytes). Its data pointer can move exactly
// once, from private memory into shared memory, by share_memory_(): every handle and every
// tensor view on it sees the new pointer afterwards. Shared storages live in a segment
// (a memfd or a named /dev/shm object) at an offset. A storage never changes its size.
//
// Thread safety: handles may be copied and destroyed from any thread. share_memory_() may
// race with other share_memory_() calls and with data() on the same storage; writing the
// bytes while another thread calls share_memory_() is a data race (as in torch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "shmtensor/device.h"
#include "shmtensor/export.h"
#include "shmtensor/sharing_strategy.h"

namespace shmtensor {

namespace internal {
class StorageImpl;
struct StorageAccess;
}  // namespace internal

class SHMTENSOR_API Storage {
 public:
  // A null storage (defined() is false).
  Storage() = default;
  // nbytes of private, uninitialised heap memory. nbytes may be 0.
  [[nodiscard]] static Storage allocate(std::size_t nbytes);
  // nbytes directly in shared memory of the current strategy; never copied later.
  [[nodiscard]] static Storage allocate_shared(std::size_t nbytes);
  // nbytes on `device`: allocate(nbytes) for the CPU; for a CUDA device, device memory
  // from this process's device arena, shared from birth (is_shared() is true; it travels
  // by fd whatever the strategy). Uninitialised. Throws std::invalid_argument for a device
  // this process does not see, CudaError when CUDA cannot be used or is out of memory.
  [[nodiscard]] static Storage allocate(std::size_t nbytes, Device device);
  // A storage over `nbytes` at `data`, memory that shmtensor did not allocate (another
  // library's: a DLPack capsule's, a NumPy array's, a torch tensor's), without a copy. It is
  // private (is_shared() is false) and sees the owner's writes and the owner sees its own,
  // until share_memory_() moves the bytes into shared memory: from then on the storage's
  // tensors use the shared copy and no longer alias `data` (as torch's share_memory_() of a
  // tensor made by torch.from_numpy leaves the array behind). A CUDA `data` is a device
  // address of this process on `device`; share_memory_() then copies it into the device
  // arena (device to device, the device's queued work complete before and after).
  //
  // `deleter` (may be empty) is called exactly once, when the storage stops using the
  // memory: when its last handle in this process goes, or once share_memory_() has moved
  // the bytes. It may be called from any thread, with no lock of shmtensor held, and must
  // not throw. A forked child's copy of the storage calls it in the child too.
  //
  // Throws std::invalid_argument for a null `data` with nbytes > 0, or a CUDA device this
  // process does not see; CudaError when CUDA cannot be used. On a throw the deleter is not
  // called: the memory is still the caller's.
  [[nodiscard]] static Storage from_blob(void* data, std::size_t nbytes, Device device,
                                         std::function<void()> deleter);

  bool defined() const noexcept { return impl_ != nullptr; }
  // The bytes' address: for a CUDA storage a device address (for kernels and the CUDA
  // API; the host must not dereference it).
  void* data() const noexcept;
  // Where the bytes live (the CPU for an undefined storage).
  Device device() const noexcept;
  std::size_t nbytes() const noexcept;
  bool is_shared() const noexcept;
  // The strategy of the segment holding a shared storage (unspecified if not shared).
  SharingStrategy sharing_strategy() const noexcept;

  // Moves the bytes into shared memory in place (see the header comment). A no-op when
  // already shared; allocates nothing for 0 bytes. Returns *this. Throws SystemError or
  // SharedMemoryFullError when no segment can be made; the storage is unchanged then.
  Storage& share_memory_();
  // The same through a const handle (it moves the bytes, not the handle), as
  // `tensor.storage().share_memory_()` does: Tensor::storage() returns a const reference.
  const Storage& share_memory_() const { return const_cast<Storage*>(this)->share_memory_(); }

  // Number of Storage handles (and tensors) on these bytes in this process.
  long use_count() const noexcept { return impl_.use_count(); }
  bool is_same(const Storage& other) const noexcept { return impl_ == other.impl_; }

 private:
  friend struct internal::StorageAccess;
  explicit Storage(std::shared_ptr<internal::StorageImpl> impl) noexcept
      : impl_(std::move(impl)) {}

  std::shared_ptr<internal::StorageImpl> impl_;
};

// Returns shared memory this process keeps for reuse to the OS: arena segments in which no
// block is held (after taking back the holds of processes that died), cached large
// segments, and the mappings kept of segments received recently. Like torch's
// cuda.empty_cache(): never needed for correctness, useful before measuring what a process
// maps. Thread-safe. Not released: segments a Queue handle keeps mapped because their fd
// is in the queue's depot (up to 32 per handle, while it holds the queue), and the depot's
// own copies, which live as long as the queue (docs/transport.md, "fds once per segment").
SHMTENSOR_API void empty_cache();

}  // namespace shmtensor
