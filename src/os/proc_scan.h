// Which processes map which shared-memory objects, from /proc/<pid>/maps: how the manager
// finds the holders of a name, and how an arena tells a holder that exec'd (its holds went
// with its old address space) from one that still maps the segment.
//
// /proc/<pid>/maps is read without a lock against the owner's concurrent mmap/munmap, so
// a single "does not map it" may be wrong (docs/design.md, Limits): callers that act on a
// miss confirm it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "os/proc.h"

namespace shmtensor::internal {

// Maps each /dev/shm name starting with `prefix` (e.g. "shmtensor_") that some process maps
// to the processes that map it, from /proc/<pid>/maps of every process this process may
// read (all, for root; else those of its uid), except `exclude`. A process that exits or
// cannot be read during the scan is skipped. Names are returned with a leading '/', as
// shm_open spells them ("/shmtensor_1_ab_0"). Throws SystemError if /proc cannot be read.
std::unordered_map<std::string, std::vector<ProcessId>> scan_shm_mappers(const std::string& prefix,
                                                                         pid_t exclude);

// True when process `pid` maps the /dev/shm object `name` ("/shmtensor_..."). False when
// it does not, or cannot be read.
bool process_maps_shm(pid_t pid, const std::string& name);

// True when process `pid` maps the file with this device and inode (as fstat gives them).
// False when it does not, or cannot be read.
bool process_maps_file(pid_t pid, std::uint64_t device, std::uint64_t inode);

}  // namespace shmtensor::internal
