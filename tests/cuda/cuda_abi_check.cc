// Compiled only where the CUDA toolkit's cuda.h is installed (tests/CMakeLists.txt): the
// declarations of src/cuda/driver_api.h, which the library uses instead of cuda.h, must
// have the driver's values and layouts. A mismatch fails the build of this file.
#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "cuda/driver_api.h"

namespace ours = shmtensor::internal::cuda;

static_assert(ours::CUDA_SUCCESS == CUDA_SUCCESS);
static_assert(ours::CUDA_ERROR_INVALID_VALUE == CUDA_ERROR_INVALID_VALUE);
static_assert(ours::CUDA_ERROR_OUT_OF_MEMORY == CUDA_ERROR_OUT_OF_MEMORY);
static_assert(ours::CUDA_ERROR_NOT_INITIALIZED == CUDA_ERROR_NOT_INITIALIZED);
static_assert(ours::CUDA_ERROR_NO_DEVICE == CUDA_ERROR_NO_DEVICE);
static_assert(ours::CUDA_ERROR_INVALID_DEVICE == CUDA_ERROR_INVALID_DEVICE);
static_assert(ours::CUDA_ERROR_NOT_SUPPORTED == CUDA_ERROR_NOT_SUPPORTED);
static_assert(ours::CUDA_ERROR_UNKNOWN == CUDA_ERROR_UNKNOWN);
static_assert(ours::CU_MEM_ALLOCATION_TYPE_PINNED == CU_MEM_ALLOCATION_TYPE_PINNED);
static_assert(ours::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ==
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
static_assert(ours::CU_MEM_LOCATION_TYPE_DEVICE == CU_MEM_LOCATION_TYPE_DEVICE);
static_assert(ours::CU_MEM_ACCESS_FLAGS_PROT_READWRITE == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
static_assert(ours::CU_MEM_ALLOC_GRANULARITY_MINIMUM == CU_MEM_ALLOC_GRANULARITY_MINIMUM);
static_assert(ours::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ==
              CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
static_assert(ours::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED ==
              CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);

static_assert(sizeof(ours::CUuuid) == sizeof(CUuuid));
static_assert(sizeof(ours::CUdeviceptr) == sizeof(CUdeviceptr));
static_assert(sizeof(ours::CUmemGenericAllocationHandle) == sizeof(CUmemGenericAllocationHandle));
static_assert(sizeof(ours::CUmemLocation) == sizeof(CUmemLocation));
static_assert(offsetof(ours::CUmemLocation, id) == offsetof(CUmemLocation, id));
static_assert(sizeof(ours::CUmemAllocationProp) == sizeof(CUmemAllocationProp));
static_assert(offsetof(ours::CUmemAllocationProp, requestedHandleTypes) ==
              offsetof(CUmemAllocationProp, requestedHandleTypes));
static_assert(offsetof(ours::CUmemAllocationProp, location) ==
              offsetof(CUmemAllocationProp, location));
static_assert(offsetof(ours::CUmemAllocationProp, win32HandleMetaData) ==
              offsetof(CUmemAllocationProp, win32HandleMetaData));
static_assert(offsetof(ours::CUmemAllocationProp, allocFlags) ==
              offsetof(CUmemAllocationProp, allocFlags));
static_assert(sizeof(ours::CUmemAccessDesc) == sizeof(CUmemAccessDesc));
static_assert(offsetof(ours::CUmemAccessDesc, flags) == offsetof(CUmemAccessDesc, flags));

static_assert(sizeof(ours::CUresult) == sizeof(CUresult));
static_assert(ours::CU_STREAM_NON_BLOCKING == CU_STREAM_NON_BLOCKING);
static_assert(ours::CU_STREAM_WAIT_VALUE_GEQ == CU_STREAM_WAIT_VALUE_GEQ);
static_assert(ours::CU_STREAM_WRITE_VALUE_DEFAULT == CU_STREAM_WRITE_VALUE_DEFAULT);
static_assert(ours::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS ==
              CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS);

// The versioned symbols src/cuda/driver.cc falls back to (drivers without
// cuGetProcAddress_v2) are the ones cuda.h maps the API names to.
#define SHMTENSOR_STR2(x) #x
#define SHMTENSOR_STR(x) SHMTENSOR_STR2(x)
static_assert(std::string_view(SHMTENSOR_STR(cuMemGetInfo)) == "cuMemGetInfo_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuMemcpyHtoD)) == "cuMemcpyHtoD_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuMemcpyDtoH)) == "cuMemcpyDtoH_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuMemcpyDtoD)) == "cuMemcpyDtoD_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuMemsetD8)) == "cuMemsetD8_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuStreamDestroy)) == "cuStreamDestroy_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuDeviceGetUuid)) == "cuDeviceGetUuid_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuGetProcAddress)) == "cuGetProcAddress_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuMemsetD32Async)) == "cuMemsetD32Async");
static_assert(std::string_view(SHMTENSOR_STR(cuCtxSynchronize)) == "cuCtxSynchronize");
static_assert(std::string_view(SHMTENSOR_STR(cuMemCreate)) == "cuMemCreate");
static_assert(std::string_view(SHMTENSOR_STR(cuStreamWriteValue64)) ==
              "cuStreamWriteValue64_v2");
static_assert(std::string_view(SHMTENSOR_STR(cuStreamWaitValue64)) == "cuStreamWaitValue64_v2");

// Parameter types of entry points whose arguments are easy to get wrong: ours take the
// same sizes in the same order (CUresult and enums are int-sized in both).
template <class R1, class... A1, class R2, class... A2>
constexpr bool same_shape(R1 (*)(A1...), R2 (*)(A2...)) {
  if constexpr (sizeof...(A1) != sizeof...(A2)) {
    return false;
  } else {
    return sizeof(R1) == sizeof(R2) && ((sizeof(A1) == sizeof(A2)) && ...);
  }
}
static_assert(same_shape(ours::DriverApi{}.cuMemCreate, &::cuMemCreate));
static_assert(same_shape(ours::DriverApi{}.cuMemMap, &::cuMemMap));
static_assert(same_shape(ours::DriverApi{}.cuMemAddressReserve, &::cuMemAddressReserve));
static_assert(same_shape(ours::DriverApi{}.cuMemImportFromShareableHandle,
                         &::cuMemImportFromShareableHandle));
static_assert(same_shape(ours::DriverApi{}.cuMemExportToShareableHandle,
                         &::cuMemExportToShareableHandle));
static_assert(same_shape(ours::DriverApi{}.cuMemSetAccess, &::cuMemSetAccess));
static_assert(same_shape(ours::DriverApi{}.cuMemsetD32Async, &::cuMemsetD32Async));
static_assert(same_shape(ours::DriverApi{}.cuStreamWriteValue64, &::cuStreamWriteValue64));
static_assert(same_shape(ours::DriverApi{}.cuStreamWaitValue64, &::cuStreamWaitValue64));
static_assert(same_shape(ours::DriverApi{}.cuMemGetAllocationGranularity,
                         &::cuMemGetAllocationGranularity));

// A pointer value: not a constant expression, so checked when the test runs.
int main() {
  return reinterpret_cast<std::uintptr_t>(ours::kLegacyStream) ==
                 reinterpret_cast<std::uintptr_t>(CU_STREAM_LEGACY)
             ? 0
             : 1;
}
