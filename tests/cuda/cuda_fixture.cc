#include "cuda/cuda_fixture.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "shmtensor/error.h"
#include "shmtensor/start_method.h"

namespace cuda_test {

bool real_driver() { return std::getenv("SHMTENSOR_CUDA_TEST_REAL") != nullptr; }

namespace {
// Before any test loads the driver (it is loaded at its first use): two fake devices.
[[maybe_unused]] const bool kFakeDriver = [] {
  if (!real_driver()) {
    setenv("SHMTENSOR_CUDA_DRIVER", "fake", 0);
    setenv("SHMTENSOR_FAKE_CUDA_DEVICES", "2", 0);
  }
  return true;
}();
}  // namespace

shmtensor::Tensor iota(std::int64_t n, float start) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] = start + static_cast<float>(i);
  return shmtensor::Tensor::from_vector(v);
}

shmtensor::Process exec_process(shmtensor::Process p) {
  p.set_start_method(shmtensor::StartMethod::kExec);
  p.start();
  return p;
}

std::string protocol_error_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const shmtensor::ProtocolError& e) {
    return e.what();
  }
  return "(no ProtocolError)";
}

std::vector<std::byte> device_entry_frame(const shmtensor::internal::Segment& seg,
                                          std::int32_t fd_index, std::uint32_t fds) {
  using namespace shmtensor::internal;
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.segment_count = 1;
  h.fd_count = fds;
  SegmentEntry e{};
  e.uid = seg.uid();
  e.total_size = seg.mapped_size();
  e.strategy = 2;
  e.fd_index = fd_index;
  h.body_size = sizeof e;
  std::vector<std::byte> datagram(sizeof h + sizeof e);
  std::memcpy(datagram.data(), &h, sizeof h);
  std::memcpy(datagram.data() + sizeof h, &e, sizeof e);
  return datagram;
}

}  // namespace cuda_test
