// What the manager, `shmtensor ls` and `shmtensor gc` know about named segments: the facts
// in a segment's header (read without mapping it), who maps it, and the sweep that removes
// orphans. Reads only /dev/shm names of this effective uid that start with "shmtensor_".
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "os/proc_scan.h"

namespace shmtensor::internal::manager {

struct SegmentFacts {
  bool exists = false;        // the name exists now
  bool header_valid = false;  // magic and layout version are this library's
  std::uint64_t size = 0;
  pid_t creator_pid = 0;  // from the header, or from the name when the header is not valid
  std::uint64_t creator_start_time = 0;  // 0 when the header is not valid
  std::int64_t refcount = 0;             // meaningful only when header_valid
  pid_t creator_pgid = 0;                // 0 when the header is not valid
};
SegmentFacts read_segment_facts(const std::string& name) noexcept;

// Whether the process that created the segment still lives. With a valid header it must
// also have the same start time (not a recycled pid); without one (a segment whose creator
// died before writing it, or is writing it now) the pid in the name must be alive.
bool creator_alive(const SegmentFacts& facts) noexcept;

// The "<pid>" of "/shmtensor_<pid>_..." (0 if the name has no such part).
pid_t creator_pid_from_name(const std::string& name) noexcept;

// Takes one count off the header's refcount on behalf of a process that died holding it
// (maps the header for a moment). Returns the new value; nullopt when the name is gone or
// its header is not valid.
std::optional<std::int64_t> drop_count_of_dead_holder(const std::string& name) noexcept;

struct SegmentInfo {
  std::string name;
  SegmentFacts facts;
  bool creator_alive = false;
  std::vector<pid_t> holders;      // live processes that map it
  std::vector<pid_t> live_groups;  // (sweep) process groups that keep it for a receiver
  std::int64_t mtime = 0;
};
// Every named shmtensor segment of this user, with holders from one scan of /proc.
std::vector<SegmentInfo> list_segments();

struct SweepReport {
  std::vector<SegmentInfo> removed;  // (or, with dry_run, what would be)
  std::vector<SegmentInfo> kept;
};
// Removes every segment whose creator is gone, that no live process maps, none of whose
// `groups` (process groups of its past holders, from the managers' journals) has a live
// member, and that has no count left while its creator's process group (from the header)
// has a live member (a message in flight that no journal recorded): the rule a daemon applies when it replaces a killed one, and `shmtensor gc`.
// With dry_run removes nothing. `exclude` is left out of the holder scan (the caller);
// names in `skip` are neither removed nor reported.
SweepReport sweep_orphans(bool dry_run, pid_t exclude = 0,
                          const std::map<std::string, std::set<pid_t>>& groups = {},
                          const std::set<std::string>& skip = {});

}  // namespace shmtensor::internal::manager
