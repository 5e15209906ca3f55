// Torch storages over shmtensor Storages: our DataPtr, the cache that gives one
// c10::StorageImpl per shmtensor Storage, and moving a torch storage into shared memory.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>

#include "shmtensor/internal/fork_handlers.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/device.h"
#include "shmtensor/torch.h"
#include "shmtensor/internal/torch_compat.h"

namespace shmtensor {

namespace {

// Our DataPtrs: the context is a heap copy of the shmtensor Storage handle, which keeps the
// bytes alive; this deleter is how shared_storage_of recognises them.
void delete_storage_context(void* context);

// One c10::StorageImpl per shmtensor Storage (keyed by its impl's address, stable while an
// entry exists: the entry's DataPtr holds that impl), while that StorageImpl lives. The
// value is weak: the cache keeps no torch storage alive, and the entry goes when our DataPtr
// is deleted (the StorageImpl died, or torch swapped our DataPtr out). `context` tells a
// live entry from a StorageImpl whose DataPtr is no longer the one the entry was made for.
//
// Lock order: g_share_mu, then g_cache_mu. Nothing that runs a DataPtr deleter (dropping
// an intrusive_ptr that may be the last, destroying a DataPtr) runs under g_cache_mu, since
// our deleter takes it; neither lock is held while calling out to user code.
struct CacheEntry {
  const Storage* context = nullptr;
  c10::weak_intrusive_ptr<c10::StorageImpl> impl{c10::intrusive_ptr<c10::StorageImpl>()};
};
std::mutex g_cache_mu;
// Bytes a thread copies at least when share_memory_ splits its copy.
constexpr std::size_t kParallelCopyGrain = std::size_t{8} << 20;

// `n` bytes copied by as many threads as torch's intra-op setting allows (at::get_num_threads:
// one in a DataLoader worker), each at least kParallelCopyGrain, as torch's own share_memory_
// copies with its intra-op threads: most of such a copy is the kernel allocating the new
// shared pages at first touch, which the threads do side by side (1 GiB on 2 CPUs, torch 2.13:
// 0.73-0.77 s with one memcpy, torch's own 0.47-0.49 s). A thread that cannot be started
// leaves its part to this one.
void copy_in_parallel(std::byte* to, const std::byte* from, std::size_t n) {
  const std::size_t threads = std::clamp<std::size_t>(
      n / kParallelCopyGrain, 1, static_cast<std::size_t>(std::max(1, at::get_num_threads())));
  const std::size_t part = (n / threads + 4095) & ~std::size_t{4095};
  std::vector<std::thread> helpers;
  for (std::size_t at = part; at < n; at += part) {
    const std::size_t len = std::min(part, n - at);
    try {
      helpers.emplace_back([=] { std::memcpy(to + at, from + at, len); });
    } catch (const std::system_error&) {
      std::memcpy(to + at, from + at, len);
    }
  }
  std::memcpy(to, from, std::min(part, n));
  for (std::thread& t : helpers) t.join();
}

std::mutex g_share_mu;  // share_memory_ checks and swaps under it (its copy runs without: moving())

// The storages whose bytes a share_memory_ is copying, without g_share_mu (under it when read
// or changed): another share_memory_ of the same storage waits until it is done. Cleared in
// a forked child, which has none of the copying threads.
std::unordered_set<const c10::StorageImpl*>& moving() {
  static auto* set = new std::unordered_set<const c10::StorageImpl*>();  // never destroyed
  return *set;
}

std::unordered_map<const void*, CacheEntry>& cache() {
  // Never destroyed: DataPtrs may be deleted by static destructors after this TU's.
  static auto* map = new std::unordered_map<const void*, CacheEntry>();
  return *map;
}

// A forked child must not inherit a lock held by another thread of the parent: hold both
// across fork (they are taken only briefly, and never around anything that forks), as the
// library's fork stage kTorchCache (shmtensor/internal/fork_handlers.h).
void lock_for_fork() noexcept {
  g_share_mu.lock();
  g_cache_mu.lock();
}
void unlock_after_fork() noexcept {
  g_cache_mu.unlock();
  g_share_mu.unlock();
}
void child_after_fork() noexcept {
  moving().clear();  // the threads that were copying are not in this process
  unlock_after_fork();
}
constexpr internal::ForkHandlers kForkHandlers{
    lock_for_fork, [](bool /*fork_failed*/) noexcept { unlock_after_fork(); }, child_after_fork};
[[maybe_unused]] const bool kForkHandlersInstalled = [] {
  internal::install_fork_handlers(internal::ForkStage::kTorchCache, &kForkHandlers);
  return true;
}();

// Whether the storage's bytes are its allocator's own, as allocated (torch's caching
// allocator's, or a pluggable allocator's): not a DataPtr torch's CUDA IPC put in place (one
// it sent, whose consumers map these bytes, or one it received). Only those move into an
// arena: processes that mapped a storage through torch's IPC must keep seeing its writes.
bool bytes_of_its_allocator(const c10::StorageImpl& storage) {
  const c10::Allocator* allocator = storage.allocator();
  if (allocator == nullptr) return false;
  const c10::DeleterFnPtr deleter = allocator->raw_deleter();
  return deleter != nullptr && storage.data_ptr().get_deleter() == deleter;
}

const void* key_of(const Storage& storage) {
  return internal::StorageAccess::impl(storage).get();
}

void delete_storage_context(void* context) {
  auto* storage = static_cast<Storage*>(context);
  c10::weak_intrusive_ptr<c10::StorageImpl> dropped{c10::intrusive_ptr<c10::StorageImpl>()};
  {
    std::lock_guard lock(g_cache_mu);
    auto it = cache().find(key_of(*storage));
    if (it != cache().end() && it->second.context == storage) {
      dropped = std::move(it->second.impl);
      cache().erase(it);
    }
  }
  delete storage;  // may release the block: outside the lock
}

c10::Device torch_device(Device device) {
  if (device.is_cuda())
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index()));
  return c10::Device(c10::kCPU);
}

// Our DataPtr over the whole of `storage` (shared, so its bytes never move), holding a
// copy of the handle.
c10::DataPtr make_data_ptr(const Storage& storage) {
  auto context = std::make_unique<Storage>(storage);
  void* data = context->data();
  c10::DataPtr ptr(data, context.get(), &delete_storage_context, torch_device(storage.device()));
  context.release();  // owned by ptr now
  return ptr;
}

const Storage* context_of(const c10::StorageImpl& impl) {
  return impl.data_ptr().cast_context<Storage>(&delete_storage_context);
}

}  // namespace

c10::Storage to_torch(const Storage& storage) {
  if (!storage.defined()) throw std::invalid_argument("to_torch: an undefined Storage");
  Storage shared = storage;
  shared.share_memory_();  // a no-op when shared already
  const void* key = key_of(shared);
  // Made before looking, outside the lock, and dropped after it if one already lives (the
  // last reference to a StorageImpl runs its deleter, which takes the lock).
  c10::intrusive_ptr<c10::StorageImpl> fresh = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<std::int64_t>(shared.nbytes()),
      make_data_ptr(shared), /*allocator=*/nullptr, /*resizable=*/false);
  c10::intrusive_ptr<c10::StorageImpl> live;
  {
    std::lock_guard lock(g_cache_mu);
    CacheEntry& entry = cache()[key];
    live = entry.impl.lock();
    if (!live || context_of(*live) != entry.context) {
      // Not alive, or (not expected: our deleter erases the entry when torch swaps our
      // DataPtr out) no longer on our bytes: `fresh` takes its place.
      std::swap(live, fresh);
      entry.context = context_of(*live);
      entry.impl = c10::weak_intrusive_ptr<c10::StorageImpl>(live);
    }
  }
  return c10::Storage(std::move(live));
}

namespace {

// shared_storage_of with g_share_mu held (share_memory_ swaps DataPtrs under it).
std::optional<Storage> shared_storage_of_locked(const c10::StorageImpl& storage) {
  const Storage* ours = context_of(storage);
  if (ours == nullptr) return std::nullopt;
  return *ours;
}

}  // namespace

std::optional<Storage> shared_storage_of(const c10::StorageImpl& storage) {
  // Under the lock: another thread may be swapping the DataPtr this reads (share_memory_).
  std::lock_guard share_lock(g_share_mu);
  return shared_storage_of_locked(storage);
}

std::optional<Storage> share_memory_(c10::StorageImpl& storage) {
  return share_memory_(storage, [](std::size_t nbytes, Device device) {
    return device.is_cuda() ? Storage::allocate(nbytes, device) : Storage::allocate_shared(nbytes);
  });
}

namespace {

// The bytes of `from` (the old storage's, torch's own allocation) into `to` (a block of this
// process's device arena on the same device): one device-to-device copy on the device's
// legacy default stream, after the work queued there and on the blocking streams (torch's
// default stream is the legacy one), then a synchronize, so that the old bytes, given back
// to torch's caching allocator when the DataPtr is swapped, are read before anything reuses
// them.
void copy_device_bytes(const Storage& to, const void* from, std::size_t nbytes) {
  // Read only (from_blob takes a mutable pointer: the copy's source is never written).
  Storage source = Storage::from_blob(const_cast<void*>(from), nbytes, to.device(), [] {});
  const std::vector<std::int64_t> sizes{static_cast<std::int64_t>(nbytes)};
  const std::vector<std::int64_t> strides{1};
  Tensor dst = Tensor::from_storage(to, 0, sizes, strides, DType::kUInt8);
  dst.copy_(Tensor::from_storage(std::move(source), 0, sizes, strides, DType::kUInt8));
  cuda::synchronize(to.device());
}

}  // namespace

std::optional<Storage> share_memory_(c10::StorageImpl& storage,
                                     const std::function<Storage(std::size_t, Device)>& allocate) {
  if (auto ours = shared_storage_of(storage)) return ours;
  const bool on_cuda = storage.device_type() == c10::kCUDA;
  if (storage.device_type() != c10::kCPU && !on_cuda)
    throw std::invalid_argument("share_memory_: a storage on " + storage.device().str() +
                                "; shmtensor shares CPU and CUDA memory only");
  const Device device = on_cuda ? Device::cuda(storage.device().index()) : Device::cpu();
  if (storage.sym_nbytes().is_symbolic())
    throw std::invalid_argument("share_memory_: a storage of symbolic size");
  const std::size_t nbytes = storage.nbytes();
  if (nbytes == 0) return std::nullopt;
  if (on_cuda && !bytes_of_its_allocator(storage)) return std::nullopt;

  Storage target = allocate(nbytes, device);
  if (!target.defined() || !target.is_shared() || target.nbytes() != nbytes ||
      target.device() != device)
    throw std::invalid_argument("share_memory_: allocate(" + std::to_string(nbytes) + ", " +
                                device.to_string() +
                                ") must return a shared Storage of that many bytes there");
  // Dropped after the locks are released: the old bytes (their deleter may be anything),
  // our reference to the StorageImpl.
  c10::DataPtr replaced;
  auto self = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(&storage);
  std::unique_lock share_lock(g_share_mu);
  // Another thread may be moving it (then wait for it), or have moved it meanwhile (then
  // `target` goes back unused).
  for (;;) {
    if (auto ours = shared_storage_of_locked(storage)) return ours;
    if (!moving().contains(&storage)) break;
    share_lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    share_lock.lock();
  }
  if (storage.nbytes() != nbytes)
    throw std::invalid_argument("share_memory_: the storage was resized while being shared");
  const c10::StorageImpl& old = storage;
  const void* from = old.data();  // read under the lock: another thread may swap it
  if (from == nullptr)
    throw std::invalid_argument(
        "share_memory_: a storage of " + std::to_string(nbytes) +
        " bytes with no data (a zero tensor's, or a functional wrapper's)");
  if (on_cuda && !bytes_of_its_allocator(storage)) return std::nullopt;  // sent meanwhile
  {
    // The copy (for a CUDA storage, a device copy and a synchronize) without the lock, which
    // every thread that asks shared_storage_of takes; the storage is marked as moving, so
    // that no other share_memory_ swaps its DataPtr meanwhile (`from` stays valid).
    moving().insert(&storage);
    share_lock.unlock();
    struct Unmark {
      std::unique_lock<std::mutex>& lock;
      const c10::StorageImpl* impl;
      ~Unmark() {
        lock.lock();
        moving().erase(impl);
      }
    } unmark{share_lock, &storage};
    if (on_cuda) {
      copy_device_bytes(target, from, nbytes);
    } else {
      copy_in_parallel(static_cast<std::byte*>(target.data()),
                       static_cast<const std::byte*>(from), nbytes);
    }
  }
  c10::DataPtr ptr = make_data_ptr(target);
  {
    std::lock_guard cache_lock(g_cache_mu);
    CacheEntry& entry = cache()[key_of(target)];
    entry.context = static_cast<const Storage*>(ptr.get_context());
    entry.impl = c10::weak_intrusive_ptr<c10::StorageImpl>(self);
  }
  replaced = storage.set_data_ptr(std::move(ptr));
  // As torch's own shared storages: a resize would move the bytes out of shared memory.
  storage.set_resizable(false);
  share_lock.unlock();
  return target;
}

}  // namespace shmtensor
