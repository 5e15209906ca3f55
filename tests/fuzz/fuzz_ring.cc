// libFuzzer harness for the message ring (src/transport/ring.h) and the shared lock
// (src/os/shared_lock.h) as a hostile peer writes them. The input's first byte picks one of
// two games:
//   - Everything: the input is laid over the tail and head hints, every slot's word, size
//     and tag of a small ring, and a lock in the ring's user area (where a connection keeps
//     its locks); then a sequence of pushes, pops, two-step pushes (reserve, then commit or
//     cancel), pops that hold their message (then release or unread), lock/unlock pairs,
//     none of which waits, and writes between them of any of those words, of the holder
//     records' (owner, epoch, positions and count of claims held while waiting) and of the
//     count of claimers with no record. Every call must return or throw ProtocolError: never
//     crash, overrun or spin without end.
//   - Hints and locks only: the slot words stay the ring's own, a hint takes any value
//     between two calls (moved by a multiple of 2^50, which slot words cannot tell apart, by
//     a little, anywhere, near the last position a ring uses), as often as the input says,
//     and the lock's words any values between calls. Until the second hint write no call
//     may throw (after it, a call may throw ProtocolError: a tail written far ahead again
//     after a pop put it back); throughout, no message may come out twice or come out that
//     was not pushed, and every message a push acknowledged is either popped or still
//     published in its slot when the sequence ends (docs/transport.md, "What a peer that
//     writes the shared memory can do").
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <span>
#include <vector>

#include "os/proc.h"
#include "os/shared_lock.h"
#include "fuzz_input.h"
#include "shmtensor/error.h"
#include "transport/ring.h"
#include "transport/ring_layout.h"

namespace {

using shmtensor::internal::Ring;
using shmtensor::internal::SharedLock;
namespace word = shmtensor::internal::ring_word;

constexpr std::uint32_t kSlots = 8;
constexpr std::uint32_t kSlotBytes = 64;
// What the input covers in the first game, in order: tail, head, each slot's 16-byte head,
// then the lock.
constexpr std::size_t kHintBytes = 16;
constexpr std::size_t kSlotsEnd = kHintBytes + kSlots * Ring::kSlotHeaderBytes;
constexpr std::size_t kStateBytes = kSlotsEnd + sizeof(SharedLock);
constexpr std::uint64_t kAlias = std::uint64_t{1} << 50;

using shmtensor::fuzz::Input;

struct Memory {
  std::byte* base = nullptr;
  std::size_t size = 0;
  std::atomic<std::uint64_t>& u64(std::size_t offset) const {
    return *reinterpret_cast<std::atomic<std::uint64_t>*>(base + offset);
  }
};

// A value for a hint now at `now`, as a peer might write it.
std::uint64_t forged_hint(Input& in, std::uint64_t now) {
  switch (in.byte() % 5) {
    case 0:
      return in.u64();  // anything
    case 1:
      return now + (in.u64() << 50);  // the same position, aliased
    case 2:
      return now + static_cast<std::int8_t>(in.byte()) + (std::uint64_t{in.byte()} << 50);
    case 3:
      return word::kPosLimit - 64 + in.byte();  // near the last position
    default:
      return now | (in.u64() & ~word::kPosMask);  // high bits only
  }
}

// Writes one lock word as a peer might: any state, this thread's ids (which it does not
// hold then), a dead or made-up thread, or a bump of the wake counter.
void forge_lock(Input& in, SharedLock& lock) {
  using namespace shmtensor::internal;
  switch (in.byte() % 4) {
    case 0:
      lock.state.store(in.u64());
      break;
    case 1:
      lock.state.store(thread_lock_state(static_cast<std::uint32_t>(::getpid()),
                                         static_cast<std::uint32_t>(::syscall(SYS_gettid))));
      break;
    case 2:
      lock.state.store(lock_state(0x3ffff0u + (in.byte() & 7), 12345, in.byte()));
      break;
    default:
      lock.wake.fetch_add(1 + in.byte());
      break;
  }
}

// Writes a word of a holder record, or the count of claimers with no record, as a peer
// might: any value, the fuzzing process's own owner value, an epoch moved on, a count or a
// position held while waiting set or cleared.
void forge_holder(Input& in, const Memory& mem) {
  using shmtensor::internal::HolderRecord;
  using shmtensor::internal::RingHeader;
  const std::uint8_t b = in.byte();
  if (b % 8 == 7) {
    auto& n = *reinterpret_cast<std::atomic<std::uint32_t>*>(
        mem.base + offsetof(RingHeader, nobody_waiting));
    n.store(b & 0x80 ? 0 : in.byte());
    return;
  }
  auto& r = reinterpret_cast<HolderRecord*>(mem.base + offsetof(RingHeader, holders))
      [in.byte() % shmtensor::internal::kHolderRecords];
  switch (b % 8) {
    case 0:
      r.owner.store(in.u64());
      break;
    case 1:
      r.owner.store(shmtensor::internal::current_slot_owner());
      break;
    case 2:
    case 3:
      r.epoch.store(b % 8 == 2 ? in.byte() : r.epoch.load() + 1);
      break;
    case 4:
      r.overflow.store(b & 0x80 ? 0 : in.byte());
      break;
    default:  // a position named as held while waiting: any, one near the tail, or none
      r.waiting[b & 1].store(b & 0x80 ? 0 : (b & 0x40 ? in.u64() : in.byte()));
      break;
  }
}

void lock_once(Input& in, SharedLock& lock) {
  using namespace shmtensor::internal;
  const auto got = lock_shared(lock, std::chrono::steady_clock::now(),
                               in.byte() & 1 ? LockHold::kBrief : LockHold::kLong, "fuzzed lock");
  if (got != Locked::kTimeout) unlock_shared(lock);
}

void everything(Input& in, Ring& ring, const Memory& mem) {
  for (std::size_t i = 0; i < kStateBytes && !in.done(); ++i) {
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
    mem.base[off] = static_cast<std::byte>(in.byte());
  }
  std::vector<std::byte> out(ring.max_message());
  const auto now = [] { return std::chrono::steady_clock::now(); };
  auto* lock = reinterpret_cast<SharedLock*>(ring.user_area());
  for (int op = 0; op < 64 && !in.done(); ++op) {
    const std::uint8_t b = in.byte();
    try {
      switch (b % 8) {
        case 0:
          lock_once(in, *lock);
          break;
        case 1: {  // a word written between calls: a hint, a slot word, size or tag, or a
                   // holder record's word
          const std::uint8_t which = in.byte() % (3 + kSlots);
          if (which < 2) {
            auto& hint = mem.u64(which == 0 ? Ring::kTailOffset : Ring::kHeadOffset);
            hint.store(forged_hint(in, hint.load()));
          } else if (which == 2) {
            forge_holder(in, mem);
          } else {
            mem.u64(ring.slots_offset() + (which - 3) * kSlotBytes + (b & 8)).store(in.u64());
          }
          break;
        }
        case 6: {  // a message held, then released or given back
          const auto p = ring.pop(out, now(), b & 0x70);
          if (p.status == Ring::Status::kOk && p.tag == (b & 0x70u)) {
            if (b & 0x80)
              ring.unread(p.pos);
            else
              ring.release(p.pos);
          }
          break;
        }
        case 7: {  // a position reserved, then committed or cancelled
          const Ring::Reservation r = ring.reserve(now());
          if (r.status != Ring::Status::kOk) break;
          if (b & 0x80) {
            ring.cancel(r.pos);
          } else {
            std::byte msg[8] = {};
            const std::span<const std::byte> part(msg, b % 9);
            (void)ring.commit(r.pos, std::span(&part, 1), b);
          }
          break;
        }
        case 2:
          forge_lock(in, *lock);
          break;
        case 3:
        case 4: {
          std::byte msg[8] = {};
          (void)ring.push(std::span(msg, b % 9), b, now());
          break;
        }
        default: {
          const auto p = ring.pop(out, now());
          if (p.status == Ring::Status::kOk && p.size > ring.max_message()) __builtin_trap();
        }
      }
    } catch (const shmtensor::ProtocolError&) {
    }
  }
}

void hints_and_locks(Input& in, Ring& ring, const Memory& mem) {
  const auto now = [] { return std::chrono::steady_clock::now(); };
  auto* lock = reinterpret_cast<SharedLock*>(ring.user_area());
  auto& tail = mem.u64(Ring::kTailOffset);
  auto& head = mem.u64(Ring::kHeadOffset);
  std::set<std::uint64_t> pushed, popped;
  int hint_writes = 0;
  std::uint64_t next = 1;
  std::vector<std::byte> out(ring.max_message());
  for (int op = 0; op < 96 && !in.done(); ++op) {
    const std::uint8_t b = in.byte();
    try {
      switch (b % 6) {
        case 0:
        case 1: {
          auto& hint = b % 6 == 0 ? tail : head;
          hint.store(forged_hint(in, hint.load()));
          ++hint_writes;
          break;
        }
        case 2:
          forge_lock(in, *lock);
          lock_once(in, *lock);
          break;
        case 3:
        case 4: {
          const std::uint64_t id = next++;
          std::byte msg[8];
          std::memcpy(msg, &id, 8);
          // Throws nothing after one hint write: the words are the ring's own.
          if (ring.push(msg, 7, now()) == Ring::Status::kOk) pushed.insert(id);
          break;
        }
        default: {
          const auto p = ring.pop(out, now());
          if (p.status != Ring::Status::kOk) break;
          std::uint64_t id = 0;
          if (p.size != 8 || p.tag != 7) __builtin_trap();  // not a message that was pushed
          std::memcpy(&id, out.data(), 8);
          if (!pushed.count(id) || !popped.insert(id).second) __builtin_trap();  // forged, twice
        }
      }
    } catch (const shmtensor::ProtocolError&) {
      if (hint_writes < 2) throw;  // one write between calls fails no call
    }
  }
  // Every acknowledged message not popped is still published in its slot.
  std::size_t waiting = 0;
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    const std::byte* s = mem.base + ring.slots_offset() + i * kSlotBytes;
    const std::uint64_t w = reinterpret_cast<const std::atomic<std::uint64_t>*>(s)->load();
    if (word::state_of(w) != word::kReady) continue;
    std::uint64_t id = 0;
    std::memcpy(&id, s + Ring::kSlotHeaderBytes, 8);
    if (!pushed.count(id) || popped.count(id)) __builtin_trap();
    ++waiting;
  }
  if (popped.size() + waiting != pushed.size()) __builtin_trap();  // a message was lost
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A fresh ring per input: what one input leaves must not decide the next one's outcome.
  Ring ring = Ring::create(kSlots, kSlotBytes);
  Memory mem;
  mem.size = ring.slots_offset() + kSlots * kSlotBytes;
  mem.base = static_cast<std::byte*>(
      ::mmap(nullptr, mem.size, PROT_READ | PROT_WRITE, MAP_SHARED, ring.fd(), 0));
  if (mem.base == MAP_FAILED) return 0;
  Input in(data, size);
  const bool honest_words = in.byte() & 1;
  // A few honest messages first, so that some slots hold real ones (the first game: the
  // second counts every message it pushes).
  for (std::uint32_t i = 0; i < 3 && !honest_words; ++i) {
    std::byte b[4];
    std::memcpy(b, &i, 4);
    (void)ring.push(b, i, std::chrono::steady_clock::now());
  }
  try {
    if (honest_words)
      hints_and_locks(in, ring, mem);
    else
      everything(in, ring, mem);
  } catch (const shmtensor::ProtocolError& e) {
    if (honest_words) {  // nothing a peer wrote there may fail a call
      std::fprintf(stderr, "%s\n", e.what());
      __builtin_trap();
    }
  }
  ::munmap(mem.base, mem.size);
  return 0;
}
