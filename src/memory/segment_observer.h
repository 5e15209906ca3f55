// Who the memory layer tells about the names of file_system segments: the manager client
// (src/manager/client.h), which sits above this layer and installs itself here when the
// program starts (a static initializer; src/manager/client.cc says why then and how a
// static link keeps it). Memory knows nothing of the manager; it only calls these three
// functions.
//
// Contract: `created` runs before shm_open(O_CREAT|O_EXCL) of a name (so that no crash
// window exists in which a name exists that the manager was not told about) and may throw
// (the segment is then not created); `opened` runs after this process mapped an existing
// name and took over a count of it; `released` runs after this process gave back its count
// (`unlinked`: it took the count to 0 and removed the name). Called from any thread, and
// `released` also from destructors and at exit: the last two never throw.
#pragma once

#include <string>

namespace shmtensor::internal {

struct SegmentObserver {
  void (*created)(const std::string& name);
  void (*opened)(const std::string& name) noexcept;
  void (*released)(const std::string& name, bool unlinked) noexcept;
};

// Installs `observer` (static storage; replaces an earlier one). Until one is installed,
// creating or opening a named segment throws Error: a name the manager cannot know of
// would outlive a crash.
void set_segment_observer(const SegmentObserver* observer) noexcept;

}  // namespace shmtensor::internal
