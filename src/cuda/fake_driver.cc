// The fake CUDA driver (SHMTENSOR_CUDA_DRIVER=fake): just enough of the driver API for
// shmtensor's CUDA paths to run, across real processes, on a machine without a GPU.
//
// A "device allocation" is a sealed memfd named after its device; exporting it dups the
// fd, importing checks the name and seals and dups it again; reserving address space is a
// PROT_NONE anonymous mapping, cuMemMap maps the memfd over it, cuMemSetAccess makes it
// read-write, copies are memcpy. So the bytes, the fds that travel and the mappings behave
// as the real driver's do, and the leak checks of the tests (fds, mappings) see them.
//
// SHMTENSOR_FAKE_CUDA_REFUSE_EXPORT makes every export fail (while the device attribute
// still claims support), as some containers do; SHMTENSOR_FAKE_CUDA_IMPORT_OUT_OF_MEMORY
// makes every import fail as a full device would. SHMTENSOR_FAKE_CUDA_NO_STREAM_MEM_OPS
// makes the device deny 64-bit stream memory operations (an old driver).
//
// Work queued on a stream runs on a thread of the fake's own, later, as on a GPU (see
// WorkQueue below), so that a reader that does not wait for it reads stale bytes.
//
// Devices: SHMTENSOR_FAKE_CUDA_DEVICES of them (default 1, at most 8), with UUIDs
// "shmtensor-fake\0<n>"; CUDA_VISIBLE_DEVICES (a comma list of indices) selects and orders
// them as CUDA does, so processes can see one device under different indices.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/driver_api.h"

namespace shmtensor::internal::cuda {

namespace {

constexpr std::size_t kFakeGranularity = std::size_t{2} << 20;
constexpr std::size_t kFakeTotal = std::size_t{16} << 30;
constexpr const char* kNamePrefix = "shmtensor-fake-cuda-";
constexpr int kMaxFakeDevices = 8;

struct FakeAllocation {
  int fd;
  std::size_t size;
  int physical;
};

std::vector<int> g_visible;  // ordinal -> physical device; set by cuInit
std::atomic<std::size_t> g_created_bytes{0};
thread_local CUcontext t_current = nullptr;

int physical_of(int ordinal) {
  if (ordinal < 0 || ordinal >= static_cast<int>(g_visible.size())) return -1;
  return g_visible[static_cast<std::size_t>(ordinal)];
}

int ordinal_of_physical(int physical) {
  for (std::size_t i = 0; i < g_visible.size(); ++i)
    if (g_visible[i] == physical) return static_cast<int>(i);
  return -1;
}

CUresult fake_init(unsigned int) {
  int count = 1;
  if (const char* n = std::getenv("SHMTENSOR_FAKE_CUDA_DEVICES")) count = std::atoi(n);
  if (count < 0 || count > kMaxFakeDevices) return CUDA_ERROR_INVALID_VALUE;
  std::vector<int> visible;
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (env == nullptr) {
    for (int i = 0; i < count; ++i) visible.push_back(i);
  } else {
    // As CUDA: indices up to the first invalid one.
    std::string s(env);
    std::size_t pos = 0;
    while (pos <= s.size() && !s.empty()) {
      std::size_t comma = s.find(',', pos);
      std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      char* end = nullptr;
      long v = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v < 0 || v >= count) break;
      visible.push_back(static_cast<int>(v));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  g_visible = std::move(visible);
  return CUDA_SUCCESS;
}

CUresult fake_driver_version(int* v) {
  *v = 12000;
  return CUDA_SUCCESS;
}

CUresult fake_error_string(CUresult r, const char** s) {
  switch (r) {
    case CUDA_SUCCESS: *s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported"; break;
    default: *s = "unknown error"; break;
  }
  return CUDA_SUCCESS;
}

CUresult fake_device_count(int* n) {
  *n = static_cast<int>(g_visible.size());
  return CUDA_SUCCESS;
}

CUresult fake_device_get(CUdevice* d, int ordinal) {
  if (physical_of(ordinal) < 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}

CUresult fake_device_name(char* name, int len, CUdevice d) {
  const int p = physical_of(d);
  if (p < 0) return CUDA_ERROR_INVALID_DEVICE;
  std::string s = "shmtensor fake CUDA device " + std::to_string(p);
  std::strncpy(name, s.c_str(), static_cast<std::size_t>(len));
  return CUDA_SUCCESS;
}

CUresult fake_device_uuid(CUuuid* uuid, CUdevice d) {
  const int p = physical_of(d);
  if (p < 0) return CUDA_ERROR_INVALID_DEVICE;
  std::memset(uuid->bytes, 0, sizeof uuid->bytes);
  std::memcpy(uuid->bytes, "shmtensor-fake", 14);
  uuid->bytes[15] = static_cast<char>(p);
  return CUDA_SUCCESS;
}

CUresult fake_device_attribute(int* v, int attr, CUdevice d) {
  if (physical_of(d) < 0) return CUDA_ERROR_INVALID_DEVICE;
  *v = (attr == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
        attr == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED ||
        (attr == CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS &&
         std::getenv("SHMTENSOR_FAKE_CUDA_NO_STREAM_MEM_OPS") == nullptr))
           ? 1
           : 0;
  return CUDA_SUCCESS;
}

std::atomic<std::uint64_t> g_retains{0};

CUresult fake_primary_ctx_retain(CUcontext* ctx, CUdevice d) {
  if (physical_of(d) < 0) return CUDA_ERROR_INVALID_DEVICE;
  g_retains.fetch_add(1, std::memory_order_relaxed);
  *ctx = reinterpret_cast<CUcontext>(static_cast<std::uintptr_t>(d) + 1);
  return CUDA_SUCCESS;
}

CUresult fake_ctx_get_current(CUcontext* ctx) {
  *ctx = t_current;
  return CUDA_SUCCESS;
}

CUresult fake_ctx_set_current(CUcontext ctx) {
  t_current = ctx;
  return CUDA_SUCCESS;
}

// The device's work queue. What a caller queues on a stream (cuMemsetD32Async, the
// stream memory operations) runs on a thread of its own, in the order it was queued: one
// order for every stream, which CUDA allows (it is stricter than CUDA's). A fill first
// waits kFillTime, as a kernel takes time, so that a reader that does not wait for the
// work reads the bytes from before it. A synchronous call (a copy, cuMemsetD8) and
// cuCtxSynchronize wait until everything queued before them has run, as calls on the
// legacy default stream do; a wait for a value holds the queue until some process (its
// own queue) writes the value. Work still queued when the process ends is lost, as a
// SIGKILLed process's is on a GPU.
//
// The queue is made once and never destroyed: its thread may outlive static destructors.
// A forked child cannot use the driver (driver.h), so it never touches the parent's queue.
constexpr auto kFillTime = std::chrono::milliseconds(1);

struct QueuedWork {
  enum Kind { kFill32, kWrite64, kWait64 } kind;
  void* addr;
  std::uint64_t value;
  std::size_t count;  // kFill32: elements
};

class WorkQueue {
 public:
  void push(const QueuedWork& w) {
    std::lock_guard lock(mu_);
    if (!started_) {
      std::thread([this] { run(); }).detach();
      started_ = true;
    }
    work_.push_back(w);
    ++queued_;
    cv_.notify_all();
  }
  // Returns once everything queued before the call has run.
  void drain() {
    std::unique_lock lock(mu_);
    const std::uint64_t target = queued_;
    cv_.wait(lock, [&] { return done_ >= target; });
  }

 private:
  void run() {
    for (;;) {
      QueuedWork w;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return !work_.empty(); });
        w = work_.front();
      }
      execute(w);
      std::lock_guard lock(mu_);
      work_.pop_front();
      ++done_;
      cv_.notify_all();
    }
  }
  static void execute(const QueuedWork& w) {
    switch (w.kind) {
      case QueuedWork::kFill32: {
        std::this_thread::sleep_for(kFillTime);
        auto* p = static_cast<unsigned int*>(w.addr);
        for (std::size_t i = 0; i < w.count; ++i) p[i] = static_cast<unsigned int>(w.value);
        break;
      }
      case QueuedWork::kWrite64:
        std::atomic_ref(*static_cast<std::uint64_t*>(w.addr))
            .store(w.value, std::memory_order_release);
        break;
      case QueuedWork::kWait64:
        // CU_STREAM_WAIT_VALUE_GEQ: a cyclic greater-or-equal.
        while (static_cast<std::int64_t>(
                   std::atomic_ref(*static_cast<std::uint64_t*>(w.addr))
                       .load(std::memory_order_acquire) -
                   w.value) < 0)
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        break;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<QueuedWork> work_;
  std::uint64_t queued_ = 0;
  std::uint64_t done_ = 0;
  bool started_ = false;
};

WorkQueue& work_queue() {
  static WorkQueue* queue = new WorkQueue;
  return *queue;
}

std::atomic<std::uint64_t> g_synchronizations{0};
std::atomic<std::uint64_t> g_fence_writes{0};
std::atomic<std::uint64_t> g_fence_waits{0};

CUresult fake_ctx_synchronize() {
  g_synchronizations.fetch_add(1, std::memory_order_relaxed);
  work_queue().drain();
  return CUDA_SUCCESS;
}

CUresult fake_mem_info(std::size_t* free, std::size_t* total) {
  *total = kFakeTotal;
  const std::size_t used = g_created_bytes.load(std::memory_order_relaxed);
  *free = used < kFakeTotal ? kFakeTotal - used : 0;
  return CUDA_SUCCESS;
}

CUresult fake_granularity(std::size_t* g, const CUmemAllocationProp* prop, int) {
  if (prop == nullptr || physical_of(prop->location.id) < 0) return CUDA_ERROR_INVALID_DEVICE;
  *g = kFakeGranularity;
  return CUDA_SUCCESS;
}

CUresult fake_mem_create(CUmemGenericAllocationHandle* h, std::size_t size,
                         const CUmemAllocationProp* prop, unsigned long long) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || size == 0 ||
      size % kFakeGranularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  const int p = physical_of(prop->location.id);
  if (p < 0) return CUDA_ERROR_INVALID_DEVICE;
  const std::string name = kNamePrefix + std::to_string(p);
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *h = reinterpret_cast<CUmemGenericAllocationHandle>(new FakeAllocation{fd, size, p});
  g_created_bytes.fetch_add(size, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}

FakeAllocation* allocation(CUmemGenericAllocationHandle h) {
  return reinterpret_cast<FakeAllocation*>(h);
}

CUresult fake_mem_release(CUmemGenericAllocationHandle h) {
  if (h == 0) return CUDA_ERROR_INVALID_VALUE;
  close(allocation(h)->fd);
  delete allocation(h);
  return CUDA_SUCCESS;
}

CUresult fake_export(void* shareable, CUmemGenericAllocationHandle h, int type,
                     unsigned long long) {
  if (h == 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  // A container or driver that claims export support and then refuses it.
  if (std::getenv("SHMTENSOR_FAKE_CUDA_REFUSE_EXPORT") != nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  // Without FD_CLOEXEC, as nothing promises the real driver sets it: the library must.
  int fd = fcntl(allocation(h)->fd, F_DUPFD, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

CUresult fake_import(CUmemGenericAllocationHandle* h, void* os_handle, int type) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  // A device out of memory, say: not the fd's fault.
  if (std::getenv("SHMTENSOR_FAKE_CUDA_IMPORT_OUT_OF_MEMORY") != nullptr)
    return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle));
  // Only what cuMemCreate made: a sealed memfd named after its device.
  char link[PATH_MAX] = {};
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(proc.c_str(), link, sizeof link - 1);
  const std::string prefix = std::string("/memfd:") + kNamePrefix;
  // Driver 580 answered CUDA_ERROR_UNKNOWN for a memfd (seen on an H200).
  if (n <= 0 || std::strncmp(link, prefix.c_str(), prefix.size()) != 0)
    return CUDA_ERROR_UNKNOWN;
  const int p = std::atoi(link + prefix.size());
  const int seals = fcntl(fd, F_GET_SEALS);
  struct stat st {};
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW) ||
      fstat(fd, &st) != 0 || st.st_size <= 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (ordinal_of_physical(p) < 0) return CUDA_ERROR_INVALID_DEVICE;
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = reinterpret_cast<CUmemGenericAllocationHandle>(
      new FakeAllocation{own, static_cast<std::size_t>(st.st_size), p});
  return CUDA_SUCCESS;
}

CUresult fake_properties(CUmemAllocationProp* prop, CUmemGenericAllocationHandle h) {
  if (h == 0) return CUDA_ERROR_INVALID_VALUE;
  std::memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop->location = {CU_MEM_LOCATION_TYPE_DEVICE, ordinal_of_physical(allocation(h)->physical)};
  return CUDA_SUCCESS;
}

CUresult fake_reserve(CUdeviceptr* ptr, std::size_t size, std::size_t, CUdeviceptr,
                      unsigned long long) {
  void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult fake_address_free(CUdeviceptr ptr, std::size_t size) {
  return munmap(reinterpret_cast<void*>(ptr), size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult fake_map(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                  CUmemGenericAllocationHandle h, unsigned long long) {
  if (h == 0) return CUDA_ERROR_INVALID_VALUE;
  // Driver 580 answers CUDA_ERROR_NOT_SUPPORTED for a range beyond the allocation.
  if (offset > allocation(h)->size || size > allocation(h)->size - offset)
    return CUDA_ERROR_NOT_SUPPORTED;
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                 allocation(h)->fd, static_cast<off_t>(offset));
  return p == MAP_FAILED ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

CUresult fake_unmap(CUdeviceptr ptr, std::size_t size) {
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult fake_set_access(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc,
                         std::size_t count) {
  if (count != 1 || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return CUDA_ERROR_NOT_SUPPORTED;
  return mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) == 0
             ? CUDA_SUCCESS
             : CUDA_ERROR_INVALID_VALUE;
}

CUresult fake_htod(CUdeviceptr dst, const void* src, std::size_t n) {
  work_queue().drain();
  if (n > 0) std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}

CUresult fake_dtoh(void* dst, CUdeviceptr src, std::size_t n) {
  work_queue().drain();
  if (n > 0) std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}

CUresult fake_dtod(CUdeviceptr dst, CUdeviceptr src, std::size_t n) {
  work_queue().drain();
  if (n > 0) std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}

CUresult fake_memset(CUdeviceptr dst, unsigned char v, std::size_t n) {
  work_queue().drain();
  if (n > 0) std::memset(reinterpret_cast<void*>(dst), v, n);
  return CUDA_SUCCESS;
}

CUresult fake_stream_create(CUstream* stream, unsigned int) {
  *stream = reinterpret_cast<CUstream>(new char);
  return CUDA_SUCCESS;
}

CUresult fake_stream_destroy(CUstream stream) {
  work_queue().drain();  // a destroyed stream's work still completes
  delete reinterpret_cast<char*>(stream);
  return CUDA_SUCCESS;
}

CUresult fake_memset32_async(CUdeviceptr dst, unsigned int v, std::size_t n, CUstream) {
  work_queue().push({QueuedWork::kFill32, reinterpret_cast<void*>(dst), v, n});
  return CUDA_SUCCESS;
}

bool stream_mem_ops_denied() {
  return std::getenv("SHMTENSOR_FAKE_CUDA_NO_STREAM_MEM_OPS") != nullptr;
}

CUresult fake_write_value64(CUstream, CUdeviceptr addr, std::uint64_t value, unsigned int flags) {
  if (stream_mem_ops_denied()) return CUDA_ERROR_NOT_SUPPORTED;
  if (flags != CU_STREAM_WRITE_VALUE_DEFAULT || addr % 8 != 0) return CUDA_ERROR_INVALID_VALUE;
  g_fence_writes.fetch_add(1, std::memory_order_relaxed);
  work_queue().push({QueuedWork::kWrite64, reinterpret_cast<void*>(addr), value, 0});
  return CUDA_SUCCESS;
}

CUresult fake_wait_value64(CUstream, CUdeviceptr addr, std::uint64_t value, unsigned int flags) {
  if (stream_mem_ops_denied()) return CUDA_ERROR_NOT_SUPPORTED;
  if (flags != CU_STREAM_WAIT_VALUE_GEQ || addr % 8 != 0) return CUDA_ERROR_INVALID_VALUE;
  g_fence_waits.fetch_add(1, std::memory_order_relaxed);
  work_queue().push({QueuedWork::kWait64, reinterpret_cast<void*>(addr), value, 0});
  return CUDA_SUCCESS;
}

const DriverApi kFake = {
    fake_init,          fake_driver_version,     fake_error_string, fake_device_count,
    fake_device_get,    fake_device_name,        fake_device_uuid,  fake_device_attribute,
    fake_primary_ctx_retain, fake_ctx_get_current, fake_ctx_set_current, fake_ctx_synchronize,
    fake_mem_info,
    fake_granularity,   fake_mem_create,         fake_mem_release,  fake_export,
    fake_import,        fake_properties,         fake_reserve,      fake_address_free,
    fake_map,           fake_unmap,              fake_set_access,   fake_htod,
    fake_dtoh,          fake_dtod,               fake_memset,       fake_stream_create,
    fake_stream_destroy, fake_memset32_async, fake_write_value64, fake_wait_value64,
};

}  // namespace

const DriverApi& fake_driver_api() { return kFake; }

std::uint64_t fake_context_retains() noexcept { return g_retains.load(std::memory_order_relaxed); }

std::uint64_t fake_fence_writes() noexcept {
  return g_fence_writes.load(std::memory_order_relaxed);
}

std::uint64_t fake_fence_waits() noexcept { return g_fence_waits.load(std::memory_order_relaxed); }

std::uint64_t fake_synchronize_count() noexcept {
  return g_synchronizations.load(std::memory_order_relaxed);
}

}  // namespace shmtensor::internal::cuda
