// What `shmtensor doctor` reports about CUDA: the driver, each device's UUID and support
// for what shmtensor needs (virtual memory management, POSIX-fd export), and a trial
// export: one allocation made, exported as an fd, imported back, mapped, written and read.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace shmtensor::internal::cuda {

struct DeviceProbe {
  int ordinal = 0;
  std::string name;
  std::string uuid;  // "GPU-..."
  bool vmm = false;
  bool posix_fd = false;
  std::size_t granularity = 0;
  std::string trial;  // "ok", or what failed
};

struct CudaProbe {
  bool available = false;
  std::string why;      // when not available
  std::string library;  // "libcuda.so.1", or the fake driver
  int version = 0;      // cuDriverGetVersion
  std::vector<DeviceProbe> devices;
};

// Loads the driver if it is not loaded yet; never throws.
CudaProbe probe_cuda() noexcept;

}  // namespace shmtensor::internal::cuda
