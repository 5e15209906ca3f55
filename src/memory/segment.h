// Segment: one shared-memory object (memfd or named /dev/shm object), mapped once in this
// process. Storages live in a segment at an offset; many may share one segment.
//
// Lifetime: held by shared_ptr from the storages in it. For file_system segments each
// process holds one count in the header's refcount while it maps the segment; the process
// whose release takes it to zero unlinks the name. memfd segments are freed by the kernel
// when the last fd and mapping are gone.
//
// Thread-safe: the object is immutable after construction except for the atomic refcount.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "memory/segment_header.h"
#include "os/mapping.h"
#include "os/unique_fd.h"
#include "shmtensor/sharing_strategy.h"

namespace shmtensor::internal {

class Segment {
 public:
  // A new segment with room for `payload_bytes` (> 0) in the given strategy, registered in
  // this process's SegmentRegistry.
  static std::shared_ptr<Segment> create(SharingStrategy strategy, std::size_t payload_bytes,
                                         SegmentKind kind = SegmentKind::kDedicated);
  // Maps a segment received as an fd (file_descriptor). Checks size and seals before
  // mapping and validates the header after; throws ProtocolError on any mismatch.
  // `uid` is what the message claimed; it must match the header.
  static std::shared_ptr<Segment> attach_fd(UniqueFd fd, std::uint64_t uid);
  // Opens and maps a named segment (file_system), adopting one count of its refcount that
  // the sender added for the message (so it does not increment).
  static std::shared_ptr<Segment> attach_name(const std::string& name, std::uint64_t uid);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  SharingStrategy strategy() const noexcept { return strategy_; }
  std::uint64_t uid() const noexcept { return header()->uid; }
  const SegmentHeader* header() const noexcept {
    return reinterpret_cast<const SegmentHeader*>(mapping_.data());
  }
  SegmentHeader* header() noexcept { return reinterpret_cast<SegmentHeader*>(mapping_.data()); }
  std::byte* payload() const noexcept { return mapping_.data() + kSegmentHeaderSize; }
  std::size_t payload_size() const noexcept { return mapping_.size() - kSegmentHeaderSize; }
  std::size_t mapped_size() const noexcept { return mapping_.size(); }
  // file_descriptor: the memfd (kept open to send it again). -1 for file_system.
  int fd() const noexcept { return fd_.get(); }
  // file_system: "/shmtensor_<pid>_<hex>_<n>". Empty for file_descriptor.
  const std::string& name() const noexcept { return name_; }

  // file_system: adds one count for a message about to carry the name (the receiver adopts
  // it). Release it with drop_in_flight_count() if the message is never sent.
  void add_in_flight_count() noexcept;
  void drop_in_flight_count() noexcept;

  // Private: use the factories.
  Segment(SharingStrategy strategy, UniqueFd fd, Mapping mapping, std::string name);

 private:
  SharingStrategy strategy_;
  UniqueFd fd_;
  Mapping mapping_;
  std::string name_;
};

// Checks a mapped header against what the mapping allows. Throws ProtocolError naming the
// first bad field.
void validate_segment_header(const SegmentHeader& h, std::size_t mapped_size,
                             std::uint64_t expected_uid);

// Removes one count from a named segment's refcount, unlinking it at zero. Used by
// Segment's destructor and for in-flight counts of messages that were never received.
void release_named_segment_count(SegmentHeader* header, const std::string& name) noexcept;

}  // namespace shmtensor::internal
