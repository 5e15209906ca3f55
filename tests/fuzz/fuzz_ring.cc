// libFuzzer harness for the message ring (src/transport/ring.h) and the shared lock
// (src/os/shared_lock.h) as a hostile peer writes them: the input is laid over the tail and
// head hints, every slot's word, size and tag of a small ring, and a lock in the ring's
// user area (where a connection keeps its locks), then drives a sequence of pushes, pops
// and lock/unlock pairs that never wait. Every call must return or throw ProtocolError —
// never crash, overrun or spin without end.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "os/shared_lock.h"
#include "shmtensor/error.h"
#include "transport/ring.h"
#include "transport/ring_layout.h"

namespace {

using shmtensor::internal::Ring;

constexpr std::uint32_t kSlots = 8;
constexpr std::uint32_t kSlotBytes = 64;
// What the input covers, in order: tail, head, each slot's 16-byte head, then the lock.
constexpr std::size_t kHintBytes = 16;
constexpr std::size_t kSlotsEnd = kHintBytes + kSlots * Ring::kSlotHeaderBytes;
constexpr std::size_t kStateBytes = kSlotsEnd + sizeof(shmtensor::internal::SharedLock);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A fresh ring per input: what one input leaves must not decide the next one's outcome.
  Ring ring = Ring::create(kSlots, kSlotBytes);
  std::byte* mem = static_cast<std::byte*>(
      ::mmap(nullptr, ring.slots_offset() + kSlots * kSlotBytes, PROT_READ | PROT_WRITE,
             MAP_SHARED, ring.fd(), 0));
  if (mem == MAP_FAILED) return 0;
  // A few honest messages first, so that some slots hold real ones.
  for (std::uint32_t i = 0; i < 3; ++i) {
    std::byte b[4];
    std::memcpy(b, &i, 4);
    (void)ring.push(b, i, std::chrono::steady_clock::now());
  }
  const std::size_t state = std::min(size, kStateBytes);
  for (std::size_t i = 0; i < state; ++i) {
    std::size_t off;
    if (i < 8) {
      off = Ring::kTailOffset + i;
    } else if (i < 16) {
      off = Ring::kHeadOffset + (i - 8);
    } else if (i >= kSlotsEnd) {
      off = offsetof(shmtensor::internal::RingHeader, user) + (i - kSlotsEnd);
    } else {
      const std::size_t k = i - kHintBytes;
      off = ring.slots_offset() + (k / Ring::kSlotHeaderBytes) * kSlotBytes +
            k % Ring::kSlotHeaderBytes;
    }
    mem[off] = static_cast<std::byte>(data[i]);
  }
  std::vector<std::byte> out(ring.max_message());
  const auto now = [] { return std::chrono::steady_clock::now(); };
  auto* lock = reinterpret_cast<shmtensor::internal::SharedLock*>(ring.user_area());
  for (std::size_t i = state; i < size && i < state + 64; ++i) {
    try {
      if (data[i] % 5 == 4) {
        using shmtensor::internal::LockHold;
        const auto got = shmtensor::internal::lock_shared(
            *lock, now(), data[i] & 8 ? LockHold::kBrief : LockHold::kLong, "fuzzed lock");
        if (got != shmtensor::internal::Locked::kTimeout) shmtensor::internal::unlock_shared(*lock);
      } else if (data[i] & 1) {
        std::byte b[8] = {};
        (void)ring.push(std::span(b, data[i] % 9), data[i], now());
      } else {
        auto p = ring.pop(out, now());
        if (p.status == Ring::Status::kOk && p.size > ring.max_message()) __builtin_trap();
      }
    } catch (const shmtensor::ProtocolError&) {
    }
  }
  ::munmap(mem, ring.slots_offset() + kSlots * kSlotBytes);
  return 0;
}
