// libFuzzer harness for the message ring (src/transport/ring.h) as a hostile peer writes
// it: the input is laid over the tail and head hints and every slot's word, size and tag
// of a small ring, then drives a sequence of pushes and pops that never wait. Every call
// must return or throw ProtocolError — never crash, overrun or spin without end.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "shmtensor/error.h"
#include "transport/ring.h"

namespace {

using shmtensor::internal::Ring;

constexpr std::uint32_t kSlots = 8;
constexpr std::uint32_t kSlotBytes = 64;
// What the input covers, in order: tail, head, then each slot's 16-byte head.
constexpr std::size_t kHintBytes = 16;
constexpr std::size_t kStateBytes = kHintBytes + kSlots * Ring::kSlotHeaderBytes;

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
    } else {
      const std::size_t k = i - kHintBytes;
      off = ring.slots_offset() + (k / Ring::kSlotHeaderBytes) * kSlotBytes +
            k % Ring::kSlotHeaderBytes;
    }
    mem[off] = static_cast<std::byte>(data[i]);
  }
  std::vector<std::byte> out(ring.max_message());
  const auto now = [] { return std::chrono::steady_clock::now(); };
  for (std::size_t i = state; i < size && i < state + 64; ++i) {
    try {
      if (data[i] & 1) {
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
