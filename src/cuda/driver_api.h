// The part of the CUDA driver API (cuda.h) that shmtensor calls, declared here so that the
// library builds without the CUDA toolkit and loads the driver at run time (driver.h).
// Values and layouts are the driver's ABI: tests/cuda/cuda_abi_check.cc compiles these
// against the toolkit's cuda.h, when one is installed, and static_asserts they agree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmtensor::internal::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUstream_st;
using CUstream = CUstream_st*;
// The context's legacy default stream (cuda.h's CU_STREAM_LEGACY): work on it waits for
// the work queued before on every blocking stream, and theirs for it.
inline const CUstream kLegacyStream = reinterpret_cast<CUstream>(std::uintptr_t{0x1});

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
inline constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
inline constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
inline constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
inline constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
inline constexpr CUresult CUDA_ERROR_UNKNOWN = 999;

struct CUuuid {
  char bytes[16];
};

// CUmemLocation, CUmemAllocationProp, CUmemAccessDesc (cuda.h's *_v1).
struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE
  int id;    // device ordinal
};
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED
  int requestedHandleTypes;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
};

inline constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
inline constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1;
inline constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
inline constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
inline constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0;
inline constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
inline constexpr int CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103;
inline constexpr int CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122;
inline constexpr unsigned int CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr unsigned int CU_STREAM_WAIT_VALUE_GEQ = 0x0;
inline constexpr unsigned int CU_STREAM_WRITE_VALUE_DEFAULT = 0x0;

// Every driver entry point shmtensor uses. Filled by the loader (the real driver: through
// cuGetProcAddress_v2 at the version each is pinned to, or dlsym of the versioned export on
// drivers older than 12.0) or by the test-only fake driver.
struct DriverApi {
  CUresult (*cuInit)(unsigned int flags);
  CUresult (*cuDriverGetVersion)(int* version);
  CUresult (*cuGetErrorString)(CUresult error, const char** str);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetName)(char* name, int len, CUdevice device);
  CUresult (*cuDeviceGetUuid)(CUuuid* uuid, CUdevice device);
  CUresult (*cuDeviceGetAttribute)(int* value, int attribute, CUdevice device);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext* ctx, CUdevice device);
  CUresult (*cuCtxGetCurrent)(CUcontext* ctx);
  CUresult (*cuCtxSetCurrent)(CUcontext ctx);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuMemGetInfo)(std::size_t* free, std::size_t* total);
  CUresult (*cuMemGetAllocationGranularity)(std::size_t* granularity,
                                            const CUmemAllocationProp* prop, int option);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle* handle, std::size_t size,
                          const CUmemAllocationProp* prop, unsigned long long flags);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle handle);
  CUresult (*cuMemExportToShareableHandle)(void* shareable, CUmemGenericAllocationHandle handle,
                                           int handle_type, unsigned long long flags);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle* handle, void* os_handle,
                                             int handle_type);
  CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp* prop,
                                                     CUmemGenericAllocationHandle handle);
  CUresult (*cuMemAddressReserve)(CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                                  CUdeviceptr addr, unsigned long long flags);
  CUresult (*cuMemAddressFree)(CUdeviceptr ptr, std::size_t size);
  CUresult (*cuMemMap)(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags);
  CUresult (*cuMemUnmap)(CUdeviceptr ptr, std::size_t size);
  CUresult (*cuMemSetAccess)(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc,
                             std::size_t count);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr dst, const void* src, std::size_t bytes);
  CUresult (*cuMemcpyDtoH)(void* dst, CUdeviceptr src, std::size_t bytes);
  CUresult (*cuMemcpyDtoD)(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes);
  CUresult (*cuMemsetD8)(CUdeviceptr dst, unsigned char value, std::size_t count);
  // Streams: for work a caller queues without waiting (the tests' ordering check).
  CUresult (*cuStreamCreate)(CUstream* stream, unsigned int flags);
  CUresult (*cuStreamDestroy)(CUstream stream);
  CUresult (*cuMemsetD32Async)(CUdeviceptr dst, unsigned int value, std::size_t count,
                               CUstream stream);
  // Stream memory operations (write_fence and wait_for_fence, cuda/device_memory.h): a sender's stream writes a value once
  // its earlier work is done, and a receiver's stream waits for it. Optional: null where
  // the driver lacks them (older than 11.7), and messages then wait with cuCtxSynchronize.
  CUresult (*cuStreamWriteValue64)(CUstream stream, CUdeviceptr addr, std::uint64_t value,
                                   unsigned int flags);
  CUresult (*cuStreamWaitValue64)(CUstream stream, CUdeviceptr addr, std::uint64_t value,
                                  unsigned int flags);
};

// The fake driver's table (fake_driver.cc): devices backed by memfd + mmap, for tests on
// machines without a GPU. Selected by SHMTENSOR_CUDA_DRIVER=fake (driver.h).
const DriverApi& fake_driver_api();
// The fake driver's count of cuCtxSynchronize calls in this process (tests check who
// waits for the device).
std::uint64_t fake_synchronize_count() noexcept;
// The fake driver's counts of stream memory operations queued in this process.
std::uint64_t fake_fence_writes() noexcept;
std::uint64_t fake_fence_waits() noexcept;
// The fake driver's count of cuDevicePrimaryCtxRetain calls in this process.
std::uint64_t fake_context_retains() noexcept;

}  // namespace shmtensor::internal::cuda
