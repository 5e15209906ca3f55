#include <cstring>

#include "memory/registry.h"
#include "memory/storage_impl.h"
#include "shmtensor/storage.h"

namespace shmtensor {

namespace internal {

StorageImpl::StorageImpl(std::size_t nbytes) : nbytes_(nbytes) {
  if (nbytes > 0) {
    private_.reset(new std::byte[nbytes]);
    data_.store(private_.get(), std::memory_order_relaxed);
  }
}

StorageImpl::StorageImpl(std::shared_ptr<Segment> segment, std::size_t offset,
                         std::size_t nbytes)
    : nbytes_(nbytes), segment_(std::move(segment)), offset_(offset) {
  data_.store(segment_->payload() + offset, std::memory_order_relaxed);
  shared_.store(true, std::memory_order_relaxed);
}

StorageImpl::~StorageImpl() {
  if (segment_) Registry::instance().remove_storage(segment_->uid(), offset_, this);
}

void StorageImpl::share_memory_(SharingStrategy strategy) {
  if (is_shared()) return;
  std::lock_guard lock(mu_);
  if (shared_.load(std::memory_order_relaxed)) return;  // another thread won
  if (nbytes_ > 0) {
    // The segment is made before anything changes, so a failure leaves us untouched.
    auto segment = Segment::create(strategy, nbytes_);
    std::memcpy(segment->payload(), private_.get(), nbytes_);
    segment_ = std::move(segment);
    offset_ = 0;
    Registry::instance().add_storage(segment_->uid(), offset_, shared_from_this());
    data_.store(segment_->payload(), std::memory_order_release);
    private_.reset();
  }
  shared_.store(true, std::memory_order_release);
}

std::shared_ptr<StorageImpl> allocate_shared_storage(std::size_t nbytes,
                                                     SharingStrategy strategy) {
  auto segment = Segment::create(strategy, nbytes);
  auto impl = std::make_shared<StorageImpl>(segment, 0, nbytes);
  Registry::instance().add_storage(segment->uid(), 0, impl);
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

void* Storage::data() const noexcept { return impl_ ? impl_->data() : nullptr; }
std::size_t Storage::nbytes() const noexcept { return impl_ ? impl_->nbytes() : 0; }
bool Storage::is_shared() const noexcept { return impl_ && impl_->is_shared(); }
bool Storage::resizable() const noexcept { return impl_ && !impl_->is_shared(); }
SharingStrategy Storage::sharing_strategy() const noexcept {
  return impl_ && impl_->is_shared() && impl_->segment() ? impl_->segment()->strategy()
                                                         : get_sharing_strategy();
}

Storage& Storage::share_memory_() {
  if (impl_) impl_->share_memory_(get_sharing_strategy());
  return *this;
}

}  // namespace shmtensor
