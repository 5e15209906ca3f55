#include "cuda/probe.h"

#include <cstring>
#include <exception>

#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "os/unique_fd.h"

namespace shmtensor::internal::cuda {

namespace {

// Allocates one granule, exports it, imports the fd as a receiver would, writes through
// one mapping and reads through the other.
std::string trial_export(const DeviceInfo& info) {
  try {
    auto made = DeviceMemory::create(info.ordinal, info.granularity);
    auto received = DeviceMemory::import(dup_cloexec(made->fd()), info.uuid, made->size());
    const unsigned char pattern[4] = {0x5a, 0xa5, 0x0f, 0xf0};
    unsigned char back[4] = {};
    copy_to_device(info.ordinal, made->address(), pattern, sizeof pattern);
    copy_to_host(info.ordinal, back, received->address(), sizeof back);
    if (std::memcmp(pattern, back, sizeof back) != 0)
      return "the imported mapping does not show what was written through the exported one";
    return "ok";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

CudaProbe probe_cuda() noexcept {
  CudaProbe p;
  try {
    p.available = Driver::available(&p.why);
    if (!p.available) return p;
    const Driver& d = Driver::get();
    p.library = d.library();
    p.version = d.version();
    for (int i = 0; i < d.device_count(); ++i) {
      DeviceProbe dp;
      std::string ready_error;
      try {
        (void)d.ready(i);  // retains the context, reads the granularity
      } catch (const std::exception& e) {
        ready_error = e.what();
      }
      // Until ready() succeeded, only the facts read at load may be read.
      const DeviceInfo& info = d.device(i);
      dp.ordinal = i;
      dp.name = info.name;
      dp.uuid = uuid_string(info.uuid);
      dp.vmm = info.vmm;
      dp.posix_fd = info.posix_fd;
      dp.granularity = ready_error.empty() ? info.granularity : 0;
      dp.trial = !ready_error.empty()              ? ready_error
                 : info.vmm && info.posix_fd ? trial_export(info)
                                             : "not tried (unsupported)";
      p.devices.push_back(std::move(dp));
    }
  } catch (const std::exception& e) {
    p.available = false;
    p.why = e.what();
  }
  return p;
}

}  // namespace shmtensor::internal::cuda
