// Fences: how a message orders the device work its sender queued before sending, with
// neither host waiting for the device (docs/cuda.md, "Ordering"; the wire's fence table:
// docs/wire_format.md, "Fences").
//
// A process has one fence per CUDA device it sends from: the first 8 bytes of a device
// segment of its own (one block, outside the arena, so that no storage ever reuses them),
// which count the messages it signalled from that device. For each device a message
// carries, signal_fence queues on the device's legacy default stream the write of the next
// count, done once everything queued before on that stream and on every blocking stream is
// done; the message names the fence (its segment, offset and count). A receiver's
// wait_for_fence queues on its own legacy default stream a wait until the fence holds that
// count or more, so its later work on the message's tensors (copies, kernels on the legacy
// or a blocking stream) starts after what the sender queued before the send. Work the
// sender queued on a non-blocking stream is its to order, as with torch.
//
// Where the device lacks 64-bit stream memory operations, or SHMTENSOR_CUDA_ORDERING is
// "synchronize", signal_fence synchronizes the device (cuCtxSynchronize) and the message
// names no fence for it.
//
// A process that signalled a fence synchronizes those devices when it exits (an atexit
// handler; a child of Process or spawn, which ends with _exit, calls
// complete_fences_before_exit), so that the fence writes it queued are done; a SIGKILLed
// sender's may not be (docs/cuda.md).
//
// Thread-safe: each count is taken and its write queued under the device's mutex, so that
// the writes, all on one stream, land in count order.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

namespace shmtensor::internal {

class Segment;

struct SignalledFence {
  std::shared_ptr<Segment> segment;  // this process's fence segment of the device
  std::uint64_t offset;              // from the segment's payload start
  std::uint64_t value;
};

// Orders what this process queued on device `ordinal` before a message: the fence the
// message names, or nothing when the device was synchronized instead. Throws CudaError.
std::optional<SignalledFence> signal_fence(int ordinal);

// Queues this process's wait for a received fence: `segment` is a device segment mapped
// here and `offset` an 8-aligned offset of 8 bytes inside its blocks (the decoder checked
// both). The segment stays mapped while the wait may read it (the last 16 such segments
// are kept; dropping one first synchronizes its device). Throws CudaError.
void wait_for_fence(const std::shared_ptr<Segment>& segment, std::uint64_t offset,
                    std::uint64_t value);

// Synchronizes every device this process signalled a fence on, so that the fence writes
// it queued are done before it ends (a GPU drops a dead process's queued work). Never
// throws; does nothing in a forked child or a process that signalled none.
void complete_fences_before_exit() noexcept;

// empty_cache(): synchronizes every device that has a fence or a kept fence segment here,
// then drops them (receivers keep a dropped fence segment's memory while they map it; the
// next send makes a new fence). Never throws.
void release_fences() noexcept;

}  // namespace shmtensor::internal
