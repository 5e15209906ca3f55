#include <cstring>
#include <utility>

#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "memory/arena.h"
#include "memory/fence.h"
#include "memory/registry.h"
#include "memory/storage_impl.h"
#include "shmtensor/storage.h"

namespace shmtensor {

namespace internal {

StorageImpl::StorageImpl(std::size_t nbytes) : nbytes_(nbytes) {
  if (nbytes > 0) {
    private_ = private_allocate(nbytes, &private_capacity_);
    data_.store(private_, std::memory_order_relaxed);
  }
}

StorageImpl::StorageImpl(Foreign f) noexcept
    : nbytes_(f.nbytes), foreign_deleter_(std::move(f.deleter)), device_(f.device) {
  data_.store(f.data, std::memory_order_relaxed);
}

StorageImpl::StorageImpl(std::shared_ptr<Segment> segment, std::size_t offset,
                         std::size_t nbytes, std::uint32_t block, bool counted)
    : nbytes_(nbytes), segment_(std::move(segment)), offset_(offset), block_(block),
      counted_(counted), device_(segment_->device()) {
  data_.store(segment_->payload() + offset, std::memory_order_relaxed);
  shared_.store(true, std::memory_order_relaxed);
}

StorageImpl::~StorageImpl() {
  private_free(private_, private_capacity_);
  if (foreign_deleter_) {
    // The owner's code: a destructor cannot report its failure (from_blob forbids one).
    try {
      foreign_deleter_();
    } catch (...) {
    }
  }
  if (!segment_) return;
  if (device_ >= 0 && !segment_->own() && !cuda::forked_after_load()) {
    // A received block: work this process queued on it (a kernel launched on the tensor)
    // must end before its creator, another process, may reuse it. (A block of our own is
    // reused only here, after work queued in stream order.) A storage destructor cannot
    // report a driver failure: the block is released all the same.
    try {
      cuda::synchronize(device_);
    } catch (const std::exception&) {
    }
  }
  Registry::instance().remove_storage(*segment_, block_, this);
  segment_->release_block(block_, counted_);
  if (!segment_->own()) Registry::instance().received_storage_gone(*segment_);
}

void StorageImpl::share_memory_(SharingStrategy strategy) {
  if (is_shared()) return;
  // A foreign owner's deleter runs after the lock is released: it is the owner's code (it
  // may take the GIL, or drop the last reference to something that shares memory again).
  std::function<void()> release_foreign;
  {
    std::lock_guard lock(mu_);
    if (shared_.load(std::memory_order_relaxed)) return;  // another thread won
    if (nbytes_ > 0) {
      std::byte* src = data_.load(std::memory_order_relaxed);
      // The segment is made before anything changes, so a failure leaves us untouched.
      Block b = device_ >= 0 ? arena_allocate_device(device_, nbytes_)
                             : arena_allocate(strategy, nbytes_);
      std::byte* dst = b.segment->payload() + b.offset;
      if (device_ >= 0) {
        // Foreign device memory: the owner's queued work on it (on any stream) ends before
        // the copy reads it, and the copy ends before the owner may reuse the memory.
        cuda::synchronize(device_);
        cuda::copy_device_to_device(device_, reinterpret_cast<cuda::CUdeviceptr>(dst),
                                    reinterpret_cast<cuda::CUdeviceptr>(src), nbytes_);
        cuda::synchronize(device_);
      } else {
        std::memcpy(dst, src, nbytes_);
      }
      segment_ = std::move(b.segment);
      offset_ = b.offset;
      block_ = b.index;
      Registry::instance().add_storage(*segment_, block_, shared_from_this());
      data_.store(dst, std::memory_order_release);
      private_free(std::exchange(private_, nullptr), private_capacity_);
    }
    release_foreign = std::move(foreign_deleter_);
    foreign_deleter_ = nullptr;
    shared_.store(true, std::memory_order_release);
  }
  if (release_foreign) {
    try {
      release_foreign();
    } catch (...) {
    }
  }
}

std::shared_ptr<StorageImpl> allocate_shared_storage(std::size_t nbytes,
                                                     SharingStrategy strategy) {
  Block b = arena_allocate(strategy, nbytes);
  auto impl = std::make_shared<StorageImpl>(std::move(b.segment), b.offset, nbytes, b.index,
                                            /*counted=*/false);
  Registry::instance().add_storage(*impl->segment(), b.index, impl);
  return impl;
}

std::shared_ptr<StorageImpl> allocate_device_storage(std::size_t nbytes, int device) {
  Block b = arena_allocate_device(device, nbytes);
  auto impl = std::make_shared<StorageImpl>(std::move(b.segment), b.offset, nbytes, b.index,
                                            /*counted=*/false);
  Registry::instance().add_storage(*impl->segment(), b.index, impl);
  return impl;
}

}  // namespace internal

Storage Storage::allocate(std::size_t nbytes) {
  return Storage(std::make_shared<internal::StorageImpl>(nbytes));
}

Storage Storage::allocate_shared(std::size_t nbytes) {
  if (nbytes == 0) {
    Storage s = allocate(0);
    s.share_memory_();
    return s;
  }
  return Storage(internal::allocate_shared_storage(nbytes, get_sharing_strategy()));
}

Storage Storage::allocate(std::size_t nbytes, Device device) {
  if (device.is_cpu()) return allocate(nbytes);
  if (device.index() < 0)
    throw std::invalid_argument("Storage::allocate: " + device.to_string() + " is not a device");
  if (nbytes == 0) {
    (void)internal::cuda::Driver::get().device(device.index());  // exists, or throws
    return Storage(std::make_shared<internal::StorageImpl>(
        internal::StorageImpl::EmptyOnDevice{device.index()}));
  }
  return Storage(internal::allocate_device_storage(nbytes, device.index()));
}

Storage Storage::from_blob(void* data, std::size_t nbytes, Device device,
                           std::function<void()> deleter) {
  if (data == nullptr && nbytes > 0)
    throw std::invalid_argument("Storage::from_blob: null data for " + std::to_string(nbytes) +
                                " bytes");
  int ordinal = -1;
  if (device.is_cuda()) {
    if (device.index() < 0)
      throw std::invalid_argument("Storage::from_blob: " + device.to_string() +
                                  " is not a device");
    (void)internal::cuda::Driver::get().device(device.index());  // exists, or throws
    ordinal = device.index();
  }
  auto impl = std::make_shared<internal::StorageImpl>(internal::StorageImpl::Foreign{
      static_cast<std::byte*>(data), nbytes, ordinal, std::move(deleter)});
  return Storage(std::move(impl));
}

Device Storage::device() const noexcept {
  return impl_ && impl_->device() >= 0 ? Device::cuda(impl_->device()) : Device::cpu();
}

void* Storage::data() const noexcept { return impl_ ? impl_->data() : nullptr; }
std::size_t Storage::nbytes() const noexcept { return impl_ ? impl_->nbytes() : 0; }
bool Storage::is_shared() const noexcept { return impl_ && impl_->is_shared(); }
SharingStrategy Storage::sharing_strategy() const noexcept {
  return impl_ && impl_->is_shared() && impl_->segment() ? impl_->segment()->strategy()
                                                         : get_sharing_strategy();
}

void empty_cache() {
  internal::release_fences();
  internal::Registry::instance().forget_cached_segments();
  internal::arena_trim();
}

Storage& Storage::share_memory_() {
  if (impl_) impl_->share_memory_(get_sharing_strategy());
  return *this;
}

}  // namespace shmtensor
