// DeviceMemory: one physical CUDA allocation (cuMemCreate, exportable as a POSIX fd),
// mapped read-write into this process's device address space. A device segment's blocks
// live in one (memory/segment.h); its fd travels with messages like a memfd's.
//
// The creator exports the allocation once and keeps the fd (to send it again); a receiver
// imports the fd it received, maps the allocation and keeps that fd for the same reason
// (a tensor it forwards carries it). The allocation handle is released as soon as it is
// mapped: the mapping keeps the memory, and the memory lives while any process maps it or
// holds an fd of it, in this process or another, so a producer may exit while its
// consumers hold its tensors.
//
// In a process forked after CUDA was loaded the driver must not be called: the destructor
// then closes the fd and leaves the mapping to the process's end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cuda/driver_api.h"
#include "os/unique_fd.h"

namespace shmtensor::internal::cuda {

class DeviceMemory {
 public:
  // At least `size` bytes on device `ordinal` (rounded up to its granularity). Throws
  // CudaError (no driver, out of device memory, no VMM or POSIX-fd export).
  static std::unique_ptr<DeviceMemory> create(int ordinal, std::size_t size);
  // Maps `size` bytes of the allocation exported as `fd`, which must belong to the device
  // with `uuid`. ProtocolError when the fd is not such an allocation (the driver refuses
  // it, it lives on another device, or it is smaller than `size`); CudaError when this
  // process cannot use CUDA or does not see that device.
  static std::unique_ptr<DeviceMemory> import(UniqueFd fd, const CUuuid& uuid, std::size_t size);

  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  CUdeviceptr address() const noexcept { return address_; }
  std::size_t size() const noexcept { return size_; }  // mapped bytes
  int ordinal() const noexcept { return ordinal_; }
  int fd() const noexcept { return fd_.get(); }

  DeviceMemory(int ordinal, UniqueFd fd, CUdeviceptr address, std::size_t size) noexcept
      : ordinal_(ordinal), fd_(std::move(fd)), address_(address), size_(size) {}

 private:
  int ordinal_;
  UniqueFd fd_;
  CUdeviceptr address_;
  std::size_t size_;
};

// Copies between host and device memory (`device` is the device whose context runs them),
// on its default stream, so in order with each other. copy_to_host returns once the bytes
// are on the host; the others may return before the device has finished, which a later
// copy_to_host, synchronize() or a message (the sender synchronizes) waits for.
void copy_to_device(int device, CUdeviceptr dst, const void* src, std::size_t n);
void copy_to_host(int device, void* dst, CUdeviceptr src, std::size_t n);
void copy_device_to_device(int device, CUdeviceptr dst, CUdeviceptr src, std::size_t n);
void fill_device(int device, CUdeviceptr dst, unsigned char value, std::size_t n);
// Waits for the device's work (kernels the user launched on its tensors) to finish.
void synchronize(int device);
// Stream memory operations on the device's legacy default stream, whose work waits for
// the work queued before on every blocking stream (and theirs for it). Both return once
// the operation is queued; CudaError when the driver refuses. `fence` is 8 bytes of device
// memory, 8-aligned, mapped in this process.
// write_fence: the write of `value` to `fence`, once everything queued before is done
// (with a memory barrier: those writes are visible first).
void write_fence(int device, CUdeviceptr fence, std::uint64_t value);
// wait_for_fence: later work waits until `fence` holds `value` or more (a cyclic
// comparison), written by any process.
void wait_for_fence(int device, CUdeviceptr fence, std::uint64_t value);

// Throws CudaError unless device `ordinal` can hold shareable memory: virtual memory
// management, POSIX-fd export claimed, and a trial export and import at its first use
// (a refusal is remembered; a failure that may pass, out of memory, is tried again).
void check_usable(int ordinal);

// Allocations this process imported (one per device segment received and not already
// mapped): what tests and `shmtensor doctor` count.
std::uint64_t import_count() noexcept;

}  // namespace shmtensor::internal::cuda
