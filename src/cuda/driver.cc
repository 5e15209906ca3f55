#include "cuda/driver.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "os/fork_handlers.h"
#include "os/proc.h"
#include "os/shared_library.h"
#include "shmtensor/device.h"
#include "shmtensor/error.h"

namespace shmtensor {

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index_);
}

namespace internal::cuda {

namespace {

std::atomic<bool> g_loaded{false};
std::atomic<bool> g_forked{false};
std::atomic<bool> g_forked_child{false};
std::atomic<const Driver*> g_instance{nullptr};

void child_after_fork() noexcept {
  g_forked_child.store(true, std::memory_order_relaxed);
  if (g_loaded.load(std::memory_order_relaxed)) g_forked.store(true, std::memory_order_relaxed);
}

constexpr ForkHandlers kForkHandlers{nullptr, nullptr, child_after_fork};
// Installed when the library is loaded, so that every forked child knows it is one.
[[maybe_unused]] const bool kForkHandlersInstalled = [] {
  install_fork_handlers(ForkStage::kCudaDriver, &kForkHandlers);
  return true;
}();

bool fake_requested() {
  const char* which = std::getenv("SHMTENSOR_CUDA_DRIVER");
  return which != nullptr && std::strcmp(which, "fake") == 0;
}

constexpr const char* kForkedMessage =
    "CUDA cannot be used in a process forked after CUDA was used in its parent (CUDA does "
    "not survive fork): start it with the exec start method (StartMethod::kExec; in "
    "Python, the 'spawn' or 'forkserver' start method)";

// A forked child that has an fd of /dev/nvidiactl before loading the driver itself got it
// from its parent: some other library (torch) initialised CUDA there.
bool inherited_cuda() noexcept {
  if (!g_forked_child.load(std::memory_order_relaxed) || fake_requested()) return false;
  return has_fd_linking_to("/dev/nvidiactl");
}

// Each entry point by its base name, and the versioned symbol libcuda exports for the ABI
// this file was written against (what cuGetProcAddress returns for CUDA 12.0).
struct EntryPoint {
  const char* base;
  const char* versioned;
  std::size_t offset;  // in DriverApi
  bool optional;       // left null when missing (DriverApi says what does without it)
};
#define SHMTENSOR_ENTRY(base, versioned) {#base, versioned, offsetof(DriverApi, base), false}
#define SHMTENSOR_OPTIONAL_ENTRY(base, versioned) \
  {#base, versioned, offsetof(DriverApi, base), true}
const EntryPoint kEntryPoints[] = {
    SHMTENSOR_ENTRY(cuInit, "cuInit"),
    SHMTENSOR_ENTRY(cuDriverGetVersion, "cuDriverGetVersion"),
    SHMTENSOR_ENTRY(cuGetErrorString, "cuGetErrorString"),
    SHMTENSOR_ENTRY(cuDeviceGetCount, "cuDeviceGetCount"),
    SHMTENSOR_ENTRY(cuDeviceGet, "cuDeviceGet"),
    SHMTENSOR_ENTRY(cuDeviceGetName, "cuDeviceGetName"),
    SHMTENSOR_ENTRY(cuDeviceGetUuid, "cuDeviceGetUuid_v2"),
    SHMTENSOR_ENTRY(cuDeviceGetAttribute, "cuDeviceGetAttribute"),
    SHMTENSOR_ENTRY(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    SHMTENSOR_ENTRY(cuCtxGetCurrent, "cuCtxGetCurrent"),
    SHMTENSOR_ENTRY(cuCtxSetCurrent, "cuCtxSetCurrent"),
    SHMTENSOR_ENTRY(cuCtxSynchronize, "cuCtxSynchronize"),
    SHMTENSOR_ENTRY(cuMemGetInfo, "cuMemGetInfo_v2"),
    SHMTENSOR_ENTRY(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
    SHMTENSOR_ENTRY(cuMemCreate, "cuMemCreate"),
    SHMTENSOR_ENTRY(cuMemRelease, "cuMemRelease"),
    SHMTENSOR_ENTRY(cuMemExportToShareableHandle, "cuMemExportToShareableHandle"),
    SHMTENSOR_ENTRY(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle"),
    SHMTENSOR_ENTRY(cuMemGetAllocationPropertiesFromHandle,
                    "cuMemGetAllocationPropertiesFromHandle"),
    SHMTENSOR_ENTRY(cuMemAddressReserve, "cuMemAddressReserve"),
    SHMTENSOR_ENTRY(cuMemAddressFree, "cuMemAddressFree"),
    SHMTENSOR_ENTRY(cuMemMap, "cuMemMap"),
    SHMTENSOR_ENTRY(cuMemUnmap, "cuMemUnmap"),
    SHMTENSOR_ENTRY(cuMemSetAccess, "cuMemSetAccess"),
    SHMTENSOR_ENTRY(cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
    SHMTENSOR_ENTRY(cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
    SHMTENSOR_ENTRY(cuMemcpyDtoD, "cuMemcpyDtoD_v2"),
    SHMTENSOR_ENTRY(cuMemsetD8, "cuMemsetD8_v2"),
    SHMTENSOR_ENTRY(cuStreamCreate, "cuStreamCreate"),
    SHMTENSOR_ENTRY(cuStreamDestroy, "cuStreamDestroy_v2"),
    SHMTENSOR_ENTRY(cuMemsetD32Async, "cuMemsetD32Async"),
    SHMTENSOR_OPTIONAL_ENTRY(cuStreamWriteValue64, "cuStreamWriteValue64_v2"),
    SHMTENSOR_OPTIONAL_ENTRY(cuStreamWaitValue64, "cuStreamWaitValue64_v2"),
};
#undef SHMTENSOR_ENTRY
#undef SHMTENSOR_OPTIONAL_ENTRY
// The CUDA version every entry point is pinned to when resolved through cuGetProcAddress.
constexpr int kPinnedCudaVersion = 12000;

using GetProcAddressV2 = CUresult (*)(const char* symbol, void** pfn, int cuda_version,
                                      unsigned long long flags, int* symbol_status);

// Fills `api` from the library; false and *why when an entry point is missing.
bool resolve(void* lib, DriverApi* api, std::string* why) {
  auto get_proc = reinterpret_cast<GetProcAddressV2>(library_symbol(lib, "cuGetProcAddress_v2"));
  for (const EntryPoint& e : kEntryPoints) {
    void* fn = nullptr;
    if (get_proc != nullptr) {
      int status = 0;
      if (get_proc(e.base, &fn, kPinnedCudaVersion, 0, &status) != CUDA_SUCCESS) fn = nullptr;
    }
    // Drivers older than 12.0 have no cuGetProcAddress_v2: their versioned exports are the
    // same entry points.
    if (fn == nullptr) fn = library_symbol(lib, e.versioned);
    if (fn == nullptr && e.optional) continue;
    if (fn == nullptr) {
      *why = std::string("the CUDA driver lacks ") + e.versioned +
             " (virtual memory management needs driver 11.3 or newer)";
      return false;
    }
    std::memcpy(reinterpret_cast<char*>(api) + e.offset, &fn, sizeof fn);
  }
  return true;
}

}  // namespace

bool forked_after_load() noexcept { return g_forked.load(std::memory_order_relaxed); }

std::string uuid_string(const CUuuid& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  char out[64];
  std::snprintf(out, sizeof out,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

Driver* Driver::load(std::string* why) noexcept {
  try {
    std::unique_ptr<Driver> d(new Driver);
    if (fake_requested()) {
      d->api_ = &fake_driver_api();
      d->fake_ = true;
      d->library_ = "fake driver (SHMTENSOR_CUDA_DRIVER=fake)";
    } else {
      const char* path = std::getenv("SHMTENSOR_CUDA_LIBRARY");
      d->library_ = path != nullptr && *path != '\0' ? path : "libcuda.so.1";
      std::string error;
      void* lib = load_library(d->library_, &error);  // never unloaded
      if (lib == nullptr) {
        *why = "cannot load the CUDA driver " + d->library_ + ": " + error +
               " (no NVIDIA driver on this machine, or its library is not on the loader path)";
        return nullptr;
      }
      if (!resolve(lib, &d->real_, why)) {
        return nullptr;
      }
      d->api_ = &d->real_;
    }
    const DriverApi& api = *d->api_;
    CUresult r = api.cuInit(0);
    if (r != CUDA_SUCCESS) {
      *why = "cuInit failed: " + d->error_text(r);
      return nullptr;
    }
    api.cuDriverGetVersion(&d->version_);
    int count = 0;
    r = api.cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS || count <= 0) {
      *why = r != CUDA_SUCCESS ? "cuDeviceGetCount failed: " + d->error_text(r)
                               : std::string("the CUDA driver sees no device");
      return nullptr;
    }
    for (int i = 0; i < count; ++i) {
      DeviceInfo info;
      info.ordinal = i;
      d->check(api.cuDeviceGet(&info.device, i), "cuDeviceGet");
      char name[256] = {};
      d->check(api.cuDeviceGetName(name, sizeof name - 1, info.device), "cuDeviceGetName");
      info.name = name;
      d->check(api.cuDeviceGetUuid(&info.uuid, info.device), "cuDeviceGetUuid");
      int v = 0;
      if (api.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   info.device) == CUDA_SUCCESS)
        info.vmm = v != 0;
      v = 0;
      if (api.cuDeviceGetAttribute(
              &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, info.device) ==
          CUDA_SUCCESS)
        info.posix_fd = v != 0;
      v = 0;
      if (api.cuStreamWriteValue64 != nullptr && api.cuStreamWaitValue64 != nullptr &&
          api.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                   info.device) == CUDA_SUCCESS)
        info.stream_mem_ops = v != 0;
      d->devices_.push_back(std::move(info));
    }
    d->ready_.reset(new ReadyState[d->devices_.size()]);
    g_loaded.store(true, std::memory_order_relaxed);
    return d.release();
  } catch (const std::exception& e) {
    *why = e.what();
    return nullptr;
  }
}

namespace {
struct Loaded {
  const Driver* driver = nullptr;
  std::string why;
};
}  // namespace

bool Driver::available(std::string* why) noexcept {
  if (forked_after_load()) {
    *why = kForkedMessage;
    return false;
  }
  // Decided once per process (a forked child whose parent never loaded the driver through
  // us decides for itself).
  static const Loaded loaded = [] {
    Loaded l;
    if (inherited_cuda())
      l.why = kForkedMessage;
    else
      l.driver = load(&l.why);
    return l;
  }();
  if (loaded.driver == nullptr) {
    *why = loaded.why;
    return false;
  }
  if (g_instance.load(std::memory_order_relaxed) == nullptr)
    g_instance.store(loaded.driver, std::memory_order_release);
  return true;
}

const Driver& Driver::get() {
  std::string why;
  if (!available(&why)) throw CudaError("CUDA is not available: " + why);
  return *g_instance.load(std::memory_order_acquire);
}

const DeviceInfo& Driver::device(int ordinal) const {
  if (ordinal < 0 || ordinal >= device_count())
    throw std::invalid_argument("cuda:" + std::to_string(ordinal) + ": this process sees " +
                                std::to_string(device_count()) + " CUDA device(s)");
  return devices_[static_cast<std::size_t>(ordinal)];
}

int Driver::ordinal_of(const CUuuid& uuid) const noexcept {
  for (const auto& d : devices_)
    if (std::memcmp(d.uuid.bytes, uuid.bytes, sizeof uuid.bytes) == 0) return d.ordinal;
  return -1;
}

const DeviceInfo& Driver::ready(int ordinal) const {
  const DeviceInfo& info = device(ordinal);
  ReadyState& state = ready_[static_cast<std::size_t>(ordinal)];
  if (state.done.load(std::memory_order_acquire)) return info;
  std::lock_guard lock(state.mu);
  if (state.done.load(std::memory_order_relaxed)) return info;
  DeviceInfo& d = devices_[static_cast<std::size_t>(ordinal)];
  if (d.context == nullptr) {  // a retry after a failure below retains nothing twice
    CUcontext context = nullptr;
    check(api_->cuDevicePrimaryCtxRetain(&context, d.device), "cuDevicePrimaryCtxRetain");
    d.context = context;
  }
  if (d.vmm) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, d.device};
    CurrentDevice current(*this, d.context);
    if (api_->cuMemGetAllocationGranularity(&d.granularity, &prop,
                                            CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
      d.granularity = 0;
  }
  state.done.store(true, std::memory_order_release);
  return info;
}

CurrentDevice::CurrentDevice(const Driver& driver, int ordinal)
    : CurrentDevice(driver, driver.ready(ordinal).context) {}

CurrentDevice::CurrentDevice(const Driver& driver, CUcontext context) : driver_(driver) {
  const DriverApi& api = driver.api();
  driver.check(api.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
  if (previous_ == context) return;
  driver.check(api.cuCtxSetCurrent(context), "cuCtxSetCurrent");
  changed_ = true;
}

CurrentDevice::~CurrentDevice() {
  if (changed_) driver_.api().cuCtxSetCurrent(previous_);
}

std::string Driver::error_text(CUresult r) const {
  const char* text = nullptr;
  if (api_ == nullptr || api_->cuGetErrorString(r, &text) != CUDA_SUCCESS || text == nullptr)
    text = "unknown error";
  return std::string(text) + " (CUresult " + std::to_string(r) + ")";
}

void Driver::check(CUresult r, const char* call) const {
  if (r != CUDA_SUCCESS) throw CudaError(std::string(call) + ": " + error_text(r), r);
}

}  // namespace internal::cuda

namespace cuda {

bool is_available() noexcept {
  std::string why;
  return internal::cuda::Driver::available(&why);
}

int device_count() noexcept {
  std::string why;
  return internal::cuda::Driver::available(&why) ? internal::cuda::Driver::get().device_count()
                                                 : 0;
}

std::string unavailable_reason() {
  std::string why;
  return internal::cuda::Driver::available(&why) ? std::string() : why;
}

}  // namespace cuda
}  // namespace shmtensor
