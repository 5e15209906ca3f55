// Device: where a tensor's bytes live, the CPU (host memory, shared through memfds or
// /dev/shm) or a CUDA device (device memory, shared through the CUDA driver's POSIX file
// descriptors; docs/cuda.md).
//
// A CUDA device is named by its index in this process (`cuda:0`), as CUDA numbers the
// devices it can see. Processes may see different devices under the same index
// (CUDA_VISIBLE_DEVICES): a tensor sent to another process arrives on the device with the
// same UUID there, whatever its index.
//
// The driver (libcuda.so.1) is loaded the first time CUDA is used; the library builds and
// runs without it. CUDA does not survive fork(): a process forked after CUDA was used in
// its parent cannot use CUDA (CudaError); start such processes with StartMethod::kExec.
#pragma once

#include <cstdint>
#include <string>

#include "shmtensor/error.h"
#include "shmtensor/export.h"

namespace shmtensor {

enum class DeviceType : std::uint8_t { kCPU = 0, kCUDA = 1 };

class SHMTENSOR_API Device {
 public:
  // The CPU.
  constexpr Device() noexcept = default;
  static constexpr Device cpu() noexcept { return Device(); }
  // CUDA device `index` of this process (0 <= index; checked when the device is used).
  static constexpr Device cuda(int index = 0) noexcept { return Device(DeviceType::kCUDA, index); }

  constexpr DeviceType type() const noexcept { return type_; }
  // -1 for the CPU.
  constexpr int index() const noexcept { return index_; }
  constexpr bool is_cpu() const noexcept { return type_ == DeviceType::kCPU; }
  constexpr bool is_cuda() const noexcept { return type_ == DeviceType::kCUDA; }
  // "cpu", "cuda:0".
  std::string to_string() const;
  friend constexpr bool operator==(Device, Device) noexcept = default;

 private:
  constexpr Device(DeviceType type, int index) noexcept : type_(type), index_(index) {}
  DeviceType type_ = DeviceType::kCPU;
  int index_ = -1;
};

namespace cuda {

// Whether CUDA can be used in this process: the driver loads, initialises and sees at
// least one device. Never throws; the first call loads the driver.
SHMTENSOR_API bool is_available() noexcept;
// Devices this process sees (0 when CUDA is not available).
SHMTENSOR_API int device_count() noexcept;
// Why is_available() is false (empty when it is true).
SHMTENSOR_API std::string unavailable_reason();
// Waits until the work this process queued on `device` (kernels and copies, on any stream)
// is complete, as torch.cuda.synchronize. Throws std::invalid_argument for the CPU or a
// device this process does not see, CudaError when CUDA cannot be used.
SHMTENSOR_API void synchronize(Device device);
// Waits until the device work this process queued before the CUDA messages it sent is
// done, so that those messages' fences are written (docs/cuda.md, "Ordering"): a receiver
// waits for them, and a GPU drops the queued work of a process that ended. Called at exit
// (an atexit handler) and at the end of a Process or spawn child; a process that ends
// another way (its own _exit, Python's os._exit) calls it first. Never throws.
SHMTENSOR_API void complete_fences() noexcept;

}  // namespace cuda

}  // namespace shmtensor
