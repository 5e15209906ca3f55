// StorageImpl: what a Storage handle points at. Private bytes (heap) or a shared block
// (segment + offset). The data pointer moves at most once, private → shared, under mu_.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>

#include "memory/segment.h"

namespace shmtensor::internal {

class StorageImpl : public std::enable_shared_from_this<StorageImpl> {
 public:
  // Private heap memory of nbytes (uninitialised).
  explicit StorageImpl(std::size_t nbytes);
  // A storage at `offset` of the payload of `segment`. The caller registers it.
  StorageImpl(std::shared_ptr<Segment> segment, std::size_t offset, std::size_t nbytes);
  ~StorageImpl();
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  // acquire: pairs with the release store in share_memory_, so a thread that sees the new
  // pointer also sees the copied bytes.
  std::byte* data() const noexcept { return data_.load(std::memory_order_acquire); }
  std::size_t nbytes() const noexcept { return nbytes_; }
  bool is_shared() const noexcept { return shared_.load(std::memory_order_acquire); }

  // Moves into a new segment of `strategy` in place. No-op if shared or nbytes == 0.
  void share_memory_(SharingStrategy strategy);

  // Valid once is_shared() returned true (immutable from then on).
  const std::shared_ptr<Segment>& segment() const noexcept { return segment_; }
  std::size_t offset() const noexcept { return offset_; }

 private:
  std::mutex mu_;
  std::atomic<std::byte*> data_{nullptr};
  std::atomic<bool> shared_{false};
  std::size_t nbytes_;
  std::unique_ptr<std::byte[]> private_;
  std::shared_ptr<Segment> segment_;
  std::size_t offset_ = 0;
};

// A shared storage of nbytes (> 0) in a new segment of the current strategy, registered.
std::shared_ptr<StorageImpl> allocate_shared_storage(std::size_t nbytes,
                                                     SharingStrategy strategy);

}  // namespace shmtensor::internal
