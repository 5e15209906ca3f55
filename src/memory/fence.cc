#include "memory/fence.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "memory/registry.h"
#include "memory/segment.h"
#include "shmtensor/device.h"

namespace shmtensor::internal {

namespace {

bool ordering_by_synchronize() {
  const char* how = std::getenv("SHMTENSOR_CUDA_ORDERING");
  return how != nullptr && std::strcmp(how, "synchronize") == 0;
}

struct DeviceFence {
  std::mutex mu;
  std::shared_ptr<Segment> segment;  // null until the first signal (and after a release)
  std::uint64_t count = 0;           // the last value queued
};

// One per device this process sees. Made once and never destroyed: no static destructor
// may release device memory after the driver is gone.
std::vector<DeviceFence>& fences() {
  static auto* all =
      new std::vector<DeviceFence>(static_cast<std::size_t>(cuda::Driver::get().device_count()));
  return *all;
}

// Set once this process made a fence or kept a fence segment: before that, release_fences
// has nothing to do (and must not load the driver).
std::atomic<bool> g_used{false};

void synchronize_quietly(int device) noexcept {
  try {
    cuda::synchronize(device);
  } catch (const std::exception&) {
  }
}

void complete_at_exit() noexcept { complete_fences_before_exit(); }

}  // namespace

void complete_fences_before_exit() noexcept {
  if (!g_used.load(std::memory_order_acquire) || cuda::forked_after_load()) return;
  for (std::size_t i = 0; i < fences().size(); ++i) {
    DeviceFence& f = fences()[i];
    std::lock_guard lock(f.mu);
    if (f.segment) synchronize_quietly(static_cast<int>(i));
  }
}

namespace {

// Received fence segments kept mapped after their messages: a wait queued on one reads it
// later. At most kKeptFenceSegments.
constexpr std::size_t kKeptFenceSegments = 16;
std::mutex g_kept_mu;
std::deque<std::shared_ptr<Segment>>& kept_segments() {
  static auto* kept = new std::deque<std::shared_ptr<Segment>>;
  return *kept;
}

}  // namespace

std::optional<SignalledFence> signal_fence(int ordinal) {
  const cuda::DeviceInfo& info = cuda::Driver::get().ready(ordinal);
  if (!info.stream_mem_ops || ordering_by_synchronize()) {
    cuda::synchronize(ordinal);
    return std::nullopt;
  }
  DeviceFence& f = fences().at(static_cast<std::size_t>(ordinal));
  std::lock_guard lock(f.mu);
  if (!f.segment) {
    auto seg = Segment::create_device(ordinal, kSegmentAlignment, 1, SegmentKind::kDeviceArena);
    cuda::fill_device(ordinal, reinterpret_cast<cuda::CUdeviceptr>(seg->payload()), 0,
                      sizeof(std::uint64_t));
    // Done before any message names it: cuMemsetD8 may return before the device ran it,
    // and a receiver would otherwise compare with whatever the memory held before.
    cuda::synchronize(ordinal);
    f.segment = Registry::instance().add_segment(seg);
    f.count = 0;
    static std::atomic<bool> at_exit{false};
    if (!at_exit.exchange(true)) std::atexit(complete_at_exit);
    g_used.store(true, std::memory_order_release);
  }
  cuda::write_fence(ordinal, reinterpret_cast<cuda::CUdeviceptr>(f.segment->payload()),
                    f.count + 1);
  ++f.count;  // once the write is queued: a refused one leaves the count
  return SignalledFence{f.segment, 0, f.count};
}

void wait_for_fence(const std::shared_ptr<Segment>& segment, std::uint64_t offset,
                    std::uint64_t value) {
  cuda::wait_for_fence(segment->device(),
                       reinterpret_cast<cuda::CUdeviceptr>(segment->payload() + offset), value);
  std::shared_ptr<Segment> dropped;
  {
    std::lock_guard lock(g_kept_mu);
    auto& kept = kept_segments();
    auto it = std::find(kept.begin(), kept.end(), segment);
    if (it != kept.end()) {
      kept.erase(it);
    } else if (kept.size() == kKeptFenceSegments) {
      dropped = std::move(kept.front());
      kept.pop_front();
    }
    kept.push_back(segment);
  }
  g_used.store(true, std::memory_order_release);
  // Its waits are done once the device finished what was queued before now.
  if (dropped) synchronize_quietly(dropped->device());
}

}  // namespace shmtensor::internal

namespace shmtensor::cuda {

void complete_fences() noexcept { internal::complete_fences_before_exit(); }

}  // namespace shmtensor::cuda

namespace shmtensor::internal {

void release_fences() noexcept {
  if (!g_used.load(std::memory_order_acquire) || cuda::forked_after_load()) return;
  std::deque<std::shared_ptr<Segment>> dropped;
  {
    std::lock_guard lock(g_kept_mu);
    dropped.swap(kept_segments());
  }
  for (const auto& seg : dropped) synchronize_quietly(seg->device());
  dropped.clear();
  for (std::size_t i = 0; i < fences().size(); ++i) {
    DeviceFence& f = fences()[i];
    std::lock_guard lock(f.mu);
    if (!f.segment) continue;
    synchronize_quietly(static_cast<int>(i));  // its queued writes land first
    f.segment.reset();
  }
}

}  // namespace shmtensor::internal
