#include "cuda/device_memory.h"

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "cuda/driver.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::cuda {

namespace {

std::atomic<std::uint64_t> g_imports{0};

std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }

// Exports one granule as an fd and imports it back. `refused`: the driver refused the
// export or the import of a valid allocation, which it will keep doing; otherwise a
// failure (out of memory) may pass, and the next use of the device tries again.
struct Trial {
  bool ok = false;
  bool refused = false;
  std::string what;
};

Trial trial_export(const Driver& d, const DeviceInfo& info) {
  const DriverApi& api = d.api();
  CurrentDevice current(d, info.ordinal);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, info.device};
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = api.cuMemCreate(&handle, info.granularity, &prop, 0);
  if (r != CUDA_SUCCESS) return {false, false, "cuMemCreate: " + d.error_text(r)};
  Trial t;
  int raw = -1;
  r = api.cuMemExportToShareableHandle(&raw, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    t = {false, r != CUDA_ERROR_OUT_OF_MEMORY, "cuMemExportToShareableHandle: " + d.error_text(r)};
  } else {
    UniqueFd fd(raw);
    CUmemGenericAllocationHandle imported = 0;
    r = api.cuMemImportFromShareableHandle(
        &imported, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd.get())),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      t = {false, r != CUDA_ERROR_OUT_OF_MEMORY,
           "cuMemImportFromShareableHandle: " + d.error_text(r)};
    } else {
      api.cuMemRelease(imported);
      t.ok = true;
    }
  }
  api.cuMemRelease(handle);
  return t;
}

// Devices whose trial passed, and those whose driver refused it (for good).
struct Trials {
  std::mutex mu;
  std::set<int> passed;
  std::map<int, std::string> refused;
};
Trials& trials() {
  static Trials* t = new Trials;  // leaked: used until the process ends
  return *t;
}

const DeviceInfo& usable_device(const Driver& d, int ordinal) {
  const DeviceInfo& info = d.ready(ordinal);
  if (!info.vmm || info.granularity == 0)
    throw CudaError("cuda:" + std::to_string(ordinal) + " (" + info.name +
                    ") does not support CUDA virtual memory management, which shmtensor's "
                    "device arenas need (driver 11.3 or newer, not under MPS or vGPU)");
  if (!info.posix_fd)
    throw CudaError("cuda:" + std::to_string(ordinal) + " (" + info.name +
                    ") cannot export memory as POSIX file descriptors, which sharing CUDA "
                    "tensors between processes needs");
  // The attributes can claim what a driver or container then refuses: the first use of
  // a device tries it, so that the refusal comes now, with its reason.
  Trials& t = trials();
  std::lock_guard lock(t.mu);
  if (t.passed.count(ordinal) != 0) return info;
  auto refused = t.refused.find(ordinal);
  if (refused == t.refused.end()) {
    Trial trial = trial_export(d, info);
    if (trial.ok) {
      t.passed.insert(ordinal);
      return info;
    }
    if (!trial.refused)
      throw CudaError("cuda:" + std::to_string(ordinal) + " (" + info.name +
                      "): the trial export could not run (" + trial.what + ")");
    refused = t.refused.emplace(ordinal, trial.what).first;
  }
  throw CudaError("cuda:" + std::to_string(ordinal) + " (" + info.name +
                  ") cannot share memory between processes: a trial export failed (" +
                  refused->second + ")");
}

// Reserves address space for `size` bytes, maps `handle` there read-write for the device.
// Releases the handle in every case (the mapping keeps the memory).
CUdeviceptr map_handle(const Driver& d, int ordinal, CUmemGenericAllocationHandle handle,
                       std::size_t size, bool received) {
  const DriverApi& api = d.api();
  const DeviceInfo& info = d.device(ordinal);
  CUdeviceptr va = 0;
  CUresult r = api.cuMemAddressReserve(&va, size, info.granularity, 0, 0);
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(handle);
    d.check(r, "cuMemAddressReserve");
  }
  r = api.cuMemMap(va, size, 0, handle, 0);
  api.cuMemRelease(handle);
  if (r != CUDA_SUCCESS) {
    api.cuMemAddressFree(va, size);
    // Driver 580 answers CUDA_ERROR_NOT_SUPPORTED for a range beyond the allocation.
    if (received && (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE ||
                     r == CUDA_ERROR_NOT_SUPPORTED))
      throw ProtocolError("received a CUDA allocation that cannot be mapped for " +
                          std::to_string(size) + " bytes (cuMemMap: " + d.error_text(r) +
                          "): smaller than its segment says, or not an allocation");
    d.check(r, "cuMemMap");
  }
  CUmemAccessDesc access{};
  access.location = {CU_MEM_LOCATION_TYPE_DEVICE, info.device};
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = api.cuMemSetAccess(va, size, &access, 1);
  if (r != CUDA_SUCCESS) {
    api.cuMemUnmap(va, size);
    api.cuMemAddressFree(va, size);
    d.check(r, "cuMemSetAccess");
  }
  return va;
}

}  // namespace

std::unique_ptr<DeviceMemory> DeviceMemory::create(int ordinal, std::size_t size) {
  const Driver& d = Driver::get();
  const DeviceInfo& info = usable_device(d, ordinal);
  const DriverApi& api = d.api();
  CurrentDevice current(d, ordinal);
  size = round_up(size, info.granularity);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, info.device};
  CUmemGenericAllocationHandle handle = 0;
  d.check(api.cuMemCreate(&handle, size, &prop, 0), "cuMemCreate");
  int raw = -1;
  CUresult r = api.cuMemExportToShareableHandle(&raw, handle,
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(handle);
    d.check(r, "cuMemExportToShareableHandle");
  }
  // Whatever the driver returned, the fd kept must not outlive an exec (it would keep the
  // allocation alive in every exec'd child): a close-on-exec duplicate replaces it.
  UniqueFd exported(raw);
  UniqueFd fd;
  try {
    fd = dup_cloexec(exported.get());
  } catch (...) {
    api.cuMemRelease(handle);
    throw;
  }
  CUdeviceptr va = map_handle(d, ordinal, handle, size, /*received=*/false);
  return std::make_unique<DeviceMemory>(ordinal, std::move(fd), va, size);
}

namespace {
// False for an fd the driver never exports as an allocation: a regular file (a memfd
// included), a pipe, a socket or a directory.
bool could_be_an_allocation(int fd) {
  const FileKind kind = file_kind(fd);
  return kind != FileKind::kUnknown && kind != FileKind::kRegular && kind != FileKind::kFifo &&
         kind != FileKind::kSocket && kind != FileKind::kDirectory;
}
}  // namespace

std::unique_ptr<DeviceMemory> DeviceMemory::import(UniqueFd fd, const CUuuid& uuid,
                                                   std::size_t size) {
  const Driver& d = Driver::get();
  const int ordinal = d.ordinal_of(uuid);
  if (ordinal < 0)
    throw CudaError("received a CUDA tensor of device " + uuid_string(uuid) +
                    ", which this process does not see (CUDA_VISIBLE_DEVICES?)");
  const DeviceInfo& info = usable_device(d, ordinal);
  const DriverApi& api = d.api();
  CurrentDevice current(d, ordinal);
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = api.cuMemImportFromShareableHandle(
      &handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd.get())),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  // What the fd is decides INVALID_VALUE / INVALID_HANDLE. Driver 580 answered
  // CUDA_ERROR_UNKNOWN for a memfd (seen; files, pipes and sockets are treated alike): a
  // failure on an fd of a kind the driver never exports (its own are /dev/nvidiactl, a
  // character device) is the message's fault too. Anything else (out of memory, not
  // permitted, not supported) is this process's condition, not the message's.
  if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE ||
      (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && !could_be_an_allocation(fd.get())))
    throw ProtocolError("received an fd that the CUDA driver does not take as an allocation (" +
                        d.error_text(r) + ")");
  d.check(r, "cuMemImportFromShareableHandle");
  CUmemAllocationProp prop{};
  r = api.cuMemGetAllocationPropertiesFromHandle(&prop, handle);
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(handle);
    d.check(r, "cuMemGetAllocationPropertiesFromHandle");
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != info.device) {
    api.cuMemRelease(handle);
    throw ProtocolError("received a CUDA allocation that does not live on the device its "
                        "segment names (" + uuid_string(uuid) + ")");
  }
  size = round_up(size, info.granularity);
  CUdeviceptr va = map_handle(d, ordinal, handle, size, /*received=*/true);
  g_imports.fetch_add(1, std::memory_order_relaxed);
  return std::make_unique<DeviceMemory>(ordinal, std::move(fd), va, size);
}

DeviceMemory::~DeviceMemory() {
  // A DeviceMemory exists only where the driver loaded: unavailable now means a forked
  // child, where the driver must not be called. The mapping is then left to the process's
  // end; the fd closes either way.
  std::string why;
  if (!Driver::available(&why)) return;
  try {
    const Driver& d = Driver::get();
    CurrentDevice current(d, ordinal_);
    d.api().cuMemUnmap(address_, size_);
    d.api().cuMemAddressFree(address_, size_);
  } catch (const std::exception&) {
    // A destructor cannot report it; the address space stays reserved.
  }
}

void copy_to_device(int device, CUdeviceptr dst, const void* src, std::size_t n) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuMemcpyHtoD(dst, src, n), "cuMemcpyHtoD");
}

void copy_to_host(int device, void* dst, CUdeviceptr src, std::size_t n) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuMemcpyDtoH(dst, src, n), "cuMemcpyDtoH");
}

void copy_device_to_device(int device, CUdeviceptr dst, CUdeviceptr src, std::size_t n) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuMemcpyDtoD(dst, src, n), "cuMemcpyDtoD");
}

void fill_device(int device, CUdeviceptr dst, unsigned char value, std::size_t n) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuMemsetD8(dst, value, n), "cuMemsetD8");
}

void synchronize(int device) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuCtxSynchronize(), "cuCtxSynchronize");
}

void write_fence(int device, CUdeviceptr fence, std::uint64_t value) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuStreamWriteValue64(kLegacyStream, fence, value,
                                       CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64");
}

void wait_for_fence(int device, CUdeviceptr fence, std::uint64_t value) {
  const Driver& d = Driver::get();
  CurrentDevice current(d, device);
  d.check(d.api().cuStreamWaitValue64(kLegacyStream, fence, value, CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue64");
}

std::uint64_t import_count() noexcept { return g_imports.load(std::memory_order_relaxed); }

void check_usable(int ordinal) { (void)usable_device(Driver::get(), ordinal); }

}  // namespace shmtensor::internal::cuda
