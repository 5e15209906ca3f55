// What `shmtensor doctor | ls | gc` print, as functions of what they found, so that the
// commands stay thin and their output is testable in-process.
#pragma once

#include <string>
#include <vector>

#include "cuda/probe.h"
#include "manager/segments.h"
#include "os/limits.h"

namespace shmtensor::internal::manager {

struct Check {
  std::string what;     // "/dev/shm size"
  std::string value;    // "64.0 MiB"
  std::string verdict;  // "ok", "low" or "missing"
  std::string fix;      // what to do when the verdict is not ok (may be empty)
};
// One check per limit that matters (see docs/cleanup.md and README "Tools").
std::vector<Check> doctor_checks(const SystemLimits& limits);
// The CUDA driver and one check per device (docs/cuda.md). A machine without CUDA gets
// the verdict "n/a", which --strict does not count as a failure.
std::vector<Check> cuda_checks(const cuda::CudaProbe& probe);
std::string format_checks(const std::vector<Check>& checks);
std::string checks_json(const std::vector<Check>& checks);

std::string format_segments(const std::vector<SegmentInfo>& segments);
std::string segments_json(const std::vector<SegmentInfo>& segments);

std::string format_sweep(const SweepReport& report, bool dry_run);

// "4.0 KiB"
std::string human_size(std::uint64_t bytes);

}  // namespace shmtensor::internal::manager
