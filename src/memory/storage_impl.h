// StorageImpl: what a Storage handle points at. Private bytes (heap), another owner's
// memory (Storage::from_blob), or a shared block (segment + block). The data pointer moves at most once, private → shared, under mu_.
// A shared StorageImpl is this process's one hold on its block: it releases the block
// when destroyed (segment.h). The registry makes it unique per (segment, offset).
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>

#include "memory/segment.h"

namespace shmtensor::internal {

class StorageImpl : public std::enable_shared_from_this<StorageImpl> {
 public:
  // Private heap memory of nbytes (uninitialised).
  explicit StorageImpl(std::size_t nbytes);
  // An empty (0-byte) storage of CUDA device `device`: no memory, only the device.
  struct EmptyOnDevice {
    int device;
  };
  explicit StorageImpl(EmptyOnDevice e) noexcept : nbytes_(0), device_(e.device) {
    shared_.store(true, std::memory_order_relaxed);
  }
  // Memory of another owner (Storage::from_blob): not shared; `deleter` runs once, when
  // this storage stops using the memory (destroyed, or moved by share_memory_).
  struct Foreign {
    std::byte* data;
    std::size_t nbytes;
    int device;  // -1 for host memory
    std::function<void()> deleter;
  };
  explicit StorageImpl(Foreign f) noexcept;
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
  // The CUDA device whose memory holds the bytes (this process's ordinal), -1 for host
  // memory. Device storages are born shared (in a device segment) and never move.
  int device() const noexcept { return device_; }

  // Moves into a new segment of `strategy` in place (a foreign CUDA storage: into the
  // device arena of its device, whatever the strategy). No-op if shared; allocates nothing
  // when nbytes == 0. Releases foreign memory once moved.
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
  std::function<void()> foreign_deleter_;  // until the foreign memory is released
  std::shared_ptr<Segment> segment_;
  std::size_t offset_ = 0;
  std::uint32_t block_ = 0;
  bool counted_ = false;
  int device_ = -1;
};

// A shared storage of nbytes (> 0) in a new segment of the current strategy, registered.
std::shared_ptr<StorageImpl> allocate_shared_storage(std::size_t nbytes,
                                                     SharingStrategy strategy);
// A storage of nbytes (> 0) in device memory of CUDA device `device`, registered.
std::shared_ptr<StorageImpl> allocate_device_storage(std::size_t nbytes, int device);

}  // namespace shmtensor::internal
