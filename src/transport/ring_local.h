// What the message ring's files share beyond its layout (ring_layout.h): this process's
// claim of a holder record (Ring::Local) and how it is packed, a slot's head, and the ring's
// waits. ring.cc makes a ring and pushes, ring_pop.cc pops, ring_repair.cc judges claims and
// puts back what a dead process or a peer that wrote the words left.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "os/futex.h"
#include "os/proc.h"
#include "shmtensor/error.h"
#include "transport/ring.h"
#include "transport/ring_layout.h"

namespace shmtensor::internal {

namespace ring_detail {

// A sleep is at most this long, so that a claim of a process that died is noticed.
inline constexpr auto kSleepSlice = std::chrono::milliseconds(50);

// Only the ring's files include this header (and say `using namespace ring_detail`).
using Clock = std::chrono::steady_clock;

inline SlotHead* head_of(std::byte* slot) { return reinterpret_cast<SlotHead*>(slot); }

// A slot word no protocol state explains, as a ProtocolError.
[[noreturn]] inline void corrupt(const char* what, std::uint64_t pos, std::uint64_t word) {
  throw ProtocolError(std::string("message ring: ") + what + " (position " + std::to_string(pos) +
                      ", slot word 0x" +
                      [&] {
                        char b[17];
                        std::snprintf(b, sizeof b, "%016llx",
                                      static_cast<unsigned long long>(word));
                        return std::string(b);
                      }() +
                      "): another process wrote over the ring's shared memory");
}

// A hint read as a position: the bits a slot word keeps. Higher bits (which no honest
// process writes: positions stay below kPosLimit) would make the hint alias the position
// of its low bits, so they are dropped, and dropped in the hint too, so that a CAS from the
// position read can move it.
inline std::uint64_t load_hint(std::atomic<std::uint64_t>& hint) noexcept {
  std::uint64_t v = hint.load();
  if (v > ring_word::kPosMask) [[unlikely]] {
    std::uint64_t seen = v;
    hint.compare_exchange_strong(seen, v & ring_word::kPosMask);
    v &= ring_word::kPosMask;
  }
  return v;
}
// The same for a look that changes nothing.
inline std::uint64_t peek_hint(const std::atomic<std::uint64_t>& hint) noexcept {
  return hint.load() & ring_word::kPosMask;
}

// A hint at or past kPosLimit that the slot words do not explain, as a ProtocolError.
[[noreturn]] inline void corrupt_hint(const char* which, std::uint64_t hint) {
  throw ProtocolError(std::string("message ring: the ") + which + " hint (" +
                      std::to_string(hint) +
                      ") is past the last position a ring uses: another process wrote over the "
                      "ring's shared memory");
}

// A tail hint more than a lap past the oldest position not taken (`pos`), which the slot
// words do not explain either, as a ProtocolError.
[[noreturn]] inline void far_tail_hint(std::uint64_t tail, std::uint64_t pos) {
  throw ProtocolError("message ring: the tail hint (" + std::to_string(tail) +
                      ") is more than a lap past the oldest position not taken (" +
                      std::to_string(pos) +
                      "): another process wrote over the ring's shared memory");
}

// The ProtocolError of a broken ring (kRingBroken).
[[noreturn]] inline void throw_broken() {
  throw ProtocolError(
      "message ring: broken: it has no position left (2^50 - 2^21 messages in its life, or "
      "another process wrote positions near the end over the ring's shared memory)");
}

// Sleeps on `word` (expected value `seen`) for at most a slice and the deadline. False when
// the deadline has passed.
inline bool sleep_on(std::atomic<std::uint32_t>* word, std::uint32_t seen,
                     const Ring::Deadline& deadline) {
  auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice);
  if (deadline) {
    const auto now = Clock::now();
    if (now >= *deadline) return false;
    slice = std::min(slice, std::chrono::duration_cast<std::chrono::nanoseconds>(*deadline - now));
  }
  futex_wait(word, seen, slice);
  return true;
}

inline void pause_cpu() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins (loads and pauses, no store; the clock every 32 spins) while `unchanged()` holds
// and `until` has not passed. True when it stopped because something changed.
template <class Unchanged>
bool spin_while(const Unchanged& unchanged, Clock::time_point until) noexcept {
  for (std::uint32_t i = 0;; ++i) {
    if (!unchanged()) return true;
    if (i % 32 == 31 && Clock::now() >= until) return false;
    pause_cpu();
  }
}

// This process's claim (Ring::Local::claim), packed and unpacked.
constexpr std::uint64_t pack_claim(std::uint32_t generation, std::uint32_t holder,
                                   std::uint32_t epoch) {
  return std::uint64_t{generation} << 32 | std::uint64_t{holder} << 8 | epoch;
}
constexpr std::uint32_t claim_generation(std::uint64_t c) {
  return static_cast<std::uint32_t>(c >> 32);
}
constexpr std::uint32_t claim_holder(std::uint64_t c) { return (c >> 8) & 0xff; }
constexpr std::uint32_t claim_epoch(std::uint64_t c) { return c & 0xff; }

}  // namespace ring_detail

// A number for each ring handle made in this process (Ring::Local::id).
inline std::uint64_t next_handle_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

struct Ring::Local {
  // Which handle this is, unique in the process: what a thread's watch of a claim is kept
  // for (Ring::watch_claim; a ring mapped where a dropped one was is another handle).
  const std::uint64_t id = next_handle_id();
  // This process's claim, packed into one word (fork generation << 32 | holder << 8 |
  // epoch: os/proc.h, fork_generation; 0: none) so that threads agree on it without a lock:
  // a mutex here could be inherited locked by a child forked while another thread claimed,
  // whose first push or pop would then hang.
  std::atomic<std::uint64_t> claim{0};
  // When this handle last looked for messages hidden behind the head after a sleep with
  // nothing published (steady clock, ns): at most once a second.
  std::atomic<std::int64_t> idle_scan_ns{0};
  std::atomic<bool> spin_before_sleep{true};  // Ring::set_spin_before_sleep
};

// The accessors every step of the ring uses, inline in each of its files.
inline RingHeader* Ring::header() const noexcept {
  return reinterpret_cast<RingHeader*>(map_.data());
}

inline std::byte* Ring::slot(std::uint64_t pos) const noexcept {
  return map_.data() + slots_offset_ + (pos & (slot_count_ - 1)) * slot_bytes_;
}

inline std::uint64_t Ring::load_word(std::uint64_t pos) const noexcept {
  const std::uint64_t bias = ring_word::index_bias(pos & (slot_count_ - 1));
  return ring_detail::head_of(slot(pos))->stored.load() + bias;
}

inline void Ring::store_word(std::uint64_t pos, std::uint64_t word,
                             std::memory_order order) noexcept {
  const std::uint64_t bias = ring_word::index_bias(pos & (slot_count_ - 1));
  ring_detail::head_of(slot(pos))->stored.store(word - bias, order);
}

inline bool Ring::cas_word(std::uint64_t pos, std::uint64_t& expected, std::uint64_t desired,
                           std::memory_order order) noexcept {
  const std::uint64_t bias = ring_word::index_bias(pos & (slot_count_ - 1));
  std::uint64_t stored = expected - bias;
  if (ring_detail::head_of(slot(pos))->stored.compare_exchange_strong(stored, desired - bias,
                                                                      order))
    return true;
  expected = stored + bias;
  return false;
}

inline void Ring::wake_producers() noexcept {
  RingHeader* h = header();
  h->freed.fetch_add(1);
  if (h->producers_asleep.load() != 0) futex_wake(&h->freed, 1);
}

inline std::pair<std::uint32_t, std::uint32_t> Ring::holder() {
  // Every push and pop asks: the claim made, a load and a compare (inlined), else the claim.
  const std::uint64_t seen = local_->claim.load(std::memory_order_acquire);
  if (ring_detail::claim_generation(seen) == fork_generation()) [[likely]]
    return {ring_detail::claim_holder(seen), ring_detail::claim_epoch(seen)};
  return claim_holder_record();
}

}  // namespace shmtensor::internal
