// What the CUDA test files share: the fake driver's selection (unless
// SHMTENSOR_CUDA_TEST_REAL=1: tests/cuda/cuda_test.cc says how the same program runs on a
// GPU), helpers for exec'd children, and the fixture every CUDA test runs under.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "memory/segment.h"
#include "shmtensor/device.h"
#include "shmtensor/process.h"
#include "shmtensor/tensor.h"
#include "support/leak_check.h"
#include "wire/frame.h"

namespace cuda_test {

// Whether the tests run against the real driver (SHMTENSOR_CUDA_TEST_REAL set).
bool real_driver();

// n float32 values start, start + 1, ... on the CPU.
shmtensor::Tensor iota(std::int64_t n, float start = 0);

// `p` started with the exec start method (CUDA does not survive fork).
shmtensor::Process exec_process(shmtensor::Process p);

// What a ProtocolError thrown by `f` says; "(no ProtocolError)" when none is.
std::string protocol_error_text(const std::function<void()>& f);

// A frame of one device segment entry for `seg` (its uid and size; strategy 2, `fd_index`)
// and no storage, announcing `fds` fds.
std::vector<std::byte> device_entry_frame(const shmtensor::internal::Segment& seg,
                                          std::int32_t fd_index, std::uint32_t fds);

// Skips (with the reason) where the real driver is asked for and CUDA is unavailable; checks
// that no fd, mapping or /dev/shm name is left.
class CudaTest : public shmtensor::testing::LeakCheckedTest {
 protected:
  void SetUp() override {
    if (real_driver() && !shmtensor::cuda::is_available())
      GTEST_SKIP() << "no CUDA here (" << shmtensor::cuda::unavailable_reason() << ")";
    ASSERT_TRUE(shmtensor::cuda::is_available()) << shmtensor::cuda::unavailable_reason();
    // The real driver opens fds of its own (/dev/nvidia*, eventfds, a pipe) when a process
    // first uses a device, and keeps them: use the device once before the leak check
    // records what this process holds.
    if (real_driver())
      (void)shmtensor::Tensor::zeros({1}, shmtensor::DType::kFloat32, shmtensor::Device::cuda())
          .cpu();
    LeakCheckedTest::SetUp();
  }
  void TearDown() override {
    if (!IsSkipped()) LeakCheckedTest::TearDown();
  }
  // The second device, or the first when there is one.
  static int other_device() { return shmtensor::cuda::device_count() > 1 ? 1 : 0; }
  static std::size_t granularity() {
    return shmtensor::internal::cuda::Driver::get().ready(0).granularity;
  }
};

}  // namespace cuda_test
