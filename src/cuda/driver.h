// The CUDA driver, loaded at run time, and this process's view of its devices.
//
// Driver::get() loads libcuda.so.1 (or the library SHMTENSOR_CUDA_LIBRARY names) with
// dlopen on first use and resolves every entry point of DriverApi at the version it was
// pinned to (driver.cc lists them), or, with SHMTENSOR_CUDA_DRIVER=fake, uses the fake
// driver (fake_driver.cc: memfd-backed devices for tests without a GPU). It then calls
// cuInit and reads each device's UUID, name, and virtual-memory-management and POSIX-fd
// export support (the granularity comes with ready()).
//
// A process forked after the driver was loaded cannot use it (CUDA does not survive
// fork): get() throws CudaError there, naming the exec start method as the fix, also when
// another library (torch) initialised CUDA in the parent (the child inherited an fd of
// /dev/nvidiactl). The fake driver enforces the same rule for its own loading, so that
// tests see what a GPU machine does.
//
// A device's primary context is retained, and its granularity read, the first time the
// device is used (ready()): a process that uses cuda:0 holds no context on its other
// devices. The library never leaves a context of its own current on a caller's thread
// (CurrentDevice restores what was current).
//
// Thread-safe: loading happens once (a function-local static); a device's context and
// granularity are set once, under its mutex, and read only after ready() returned.
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/driver_api.h"

namespace shmtensor::internal::cuda {

struct DeviceInfo {
  int ordinal = 0;  // index in this process
  CUdevice device = 0;
  CUuuid uuid{};
  std::string name;
  bool vmm = false;       // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool posix_fd = false;  // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
  // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, and the driver has the calls.
  bool stream_mem_ops = false;
  // Set by Driver::ready(): cuMemGetAllocationGranularity (minimum; 0 without VMM) and
  // the primary context, retained for the process's life.
  std::size_t granularity = 0;
  CUcontext context = nullptr;
};

class Driver {
 public:
  // The loaded driver. Throws CudaError when it cannot be loaded or initialised, or in a
  // process forked after it was loaded.
  static const Driver& get();
  // Whether get() would succeed; *why says why not. Never throws.
  static bool available(std::string* why) noexcept;

  const DriverApi& api() const noexcept { return *api_; }
  bool fake() const noexcept { return fake_; }
  int version() const noexcept { return version_; }  // cuDriverGetVersion: 13000 = 13.0
  const std::string& library() const noexcept { return library_; }
  int device_count() const noexcept { return static_cast<int>(devices_.size()); }
  // Device `ordinal` of this process; std::invalid_argument if there is none such. Its
  // granularity and context are set once ready(ordinal) returned.
  const DeviceInfo& device(int ordinal) const;
  // device(ordinal), its primary context retained and its granularity read (once).
  // Throws CudaError when the driver refuses.
  const DeviceInfo& ready(int ordinal) const;
  // The ordinal of the device with this UUID here, -1 if this process does not see it.
  int ordinal_of(const CUuuid& uuid) const noexcept;
  // Throws CudaError "<call>: <driver's error name/text> (CUresult n)" unless r is success.
  void check(CUresult r, const char* call) const;
  std::string error_text(CUresult r) const;

 private:
  Driver() = default;
  static Driver* load(std::string* why) noexcept;
  const DriverApi* api_ = nullptr;
  DriverApi real_{};
  bool fake_ = false;
  int version_ = 0;
  std::string library_;
  // Completed by ready(), once per device, under its mutex (a failed attempt is retried
  // by the next call; std::call_once is not used because libstdc++'s hangs on a retry
  // after an exception).
  mutable std::vector<DeviceInfo> devices_;
  struct ReadyState {
    std::mutex mu;
    std::atomic<bool> done{false};
  };
  std::unique_ptr<ReadyState[]> ready_;
};

// Makes device `ordinal`'s primary context current on this thread while it lives, and
// then restores the context that was current before (the caller's, torch's).
class CurrentDevice {
 public:
  CurrentDevice(const Driver& driver, int ordinal);
  // The same for a context already retained.
  CurrentDevice(const Driver& driver, CUcontext context);
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  const Driver& driver_;
  CUcontext previous_ = nullptr;
  bool changed_ = false;
};

// Whether this process was forked after the driver was loaded (in it or an ancestor).
bool forked_after_load() noexcept;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints UUIDs.
std::string uuid_string(const CUuuid& uuid);

}  // namespace shmtensor::internal::cuda
