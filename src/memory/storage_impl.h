// StorageImpl: what a Storage handle points at. Private bytes (heap) or a shared block
// (segment + block). The data pointer moves at most once, private → shared, under mu_.
// A shared StorageImpl is this process's one hold on its block: it releases the block
// when destroyed (segment.h). The registry makes it unique per (segment, offset).
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
  // A storage in block `block` (at `offset` of the payload) of `segment`, which this
  // process already holds (its slot's bit, or a count when `counted`). The caller
  // registers it.
  StorageImpl(std::shared_ptr<Segment> segment, std::size_t offset, std::size_t nbytes,
              std::uint32_t block, bool counted);
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
  std::uint32_t block() const noexcept { return block_; }
  // A forked child's fork handler: how the child now holds the block.
  void set_counted_after_fork(bool counted) noexcept { counted_ = counted; }

 private:
  std::mutex mu_;
  std::atomic<std::byte*> data_{nullptr};
  std::atomic<bool> shared_{false};
  std::size_t nbytes_;
  std::byte* private_ = nullptr;  // from private_allocate()
  std::size_t private_capacity_ = 0;
  std::shared_ptr<Segment> segment_;
  std::size_t offset_ = 0;
  std::uint32_t block_ = 0;
  bool counted_ = false;
};

// A shared storage of nbytes (> 0) in a new segment of the current strategy, registered.
std::shared_ptr<StorageImpl> allocate_shared_storage(std::size_t nbytes,
                                                     SharingStrategy strategy);

}  // namespace shmtensor::internal
