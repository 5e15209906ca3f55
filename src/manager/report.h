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

// One named channel as `shmtensor ls` found it (tools/shmtensor/ls.cc gathers it).
struct ChannelReport {
  struct Reader {
    int pid = 0;             // the process attached as the reader (0: none)
    std::size_t behind = 0;  // messages it has not taken
  };
  std::string name;
  std::string kind;  // "queue", "broadcast", or "kind N" for a kind this build does not know
  pid_t creator = 0;
  std::size_t depth = 0;     // a queue's items
  std::size_t maxsize = 0;   // a queue's bound (0: none)
  std::vector<pid_t> ends;   // a queue's live holders; another kind's openers
  std::vector<Reader> readers;  // a broadcast's, by index
  std::string error;  // why the channel could not be looked at (gone meanwhile, not its kind)
};
// Text: "channels:" and a line per channel, or nothing when there is none.
std::string format_channels(const std::vector<ChannelReport>& channels);
// `shmtensor ls --json`: {"segments": [...], "channels": [...]}.
std::string listing_json(const std::vector<SegmentInfo>& segments,
                         const std::vector<ChannelReport>& channels);

std::string format_sweep(const SweepReport& report, bool dry_run);

// "4.0 KiB"
std::string human_size(std::uint64_t bytes);

}  // namespace shmtensor::internal::manager
