// MessageFrame and parse_message_frame: finish_frame and parse_frame (wire.h) for a message
// that travels inside another one.
#include "shmtensor/internal/frame.h"

#include <utility>

#include "memory/segment.h"
#include "wire/wire.h"

namespace shmtensor::internal {

MessageFrame::MessageFrame(Encoder&& message)
    : frame_(std::make_unique<OutgoingFrame>(finish_frame(std::move(message)))) {
  for (std::span<const std::byte> part : frame_->parts())
    bytes_.append(reinterpret_cast<const char*>(part.data()), part.size());
  // finish_frame's order: a device segment's memfd, then its allocation's fd (which gets
  // no uid: a uid names the memfd that maps the segment); a file_descriptor segment's memfd.
  for (const Segment* segment : frame_->segments()) {
    if (segment->is_device()) {
      fd_uids_.push_back(segment->uid());
      fd_uids_.push_back(0);
    } else if (segment->strategy() == SharingStrategy::kFileDescriptor) {
      fd_uids_.push_back(segment->uid());
    }
  }
  fd_uids_.resize(frame_->fds().size(), 0);  // object fds and the blob: not a segment
}

MessageFrame::MessageFrame(MessageFrame&&) noexcept = default;
MessageFrame& MessageFrame::operator=(MessageFrame&&) noexcept = default;
MessageFrame::~MessageFrame() = default;

const std::vector<int>& MessageFrame::fds() const noexcept { return frame_->fds(); }

void MessageFrame::mark_sent() noexcept { frame_->sent = true; }

Decoder parse_message_frame(std::span<const std::byte> bytes, std::span<const int> fds) {
  std::vector<UniqueFd> owned;
  owned.reserve(fds.size());
  for (int fd : fds) owned.emplace_back(fd);
  return parse_frame(bytes, std::move(owned));
}

}  // namespace shmtensor::internal
