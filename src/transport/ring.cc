// A message ring (ring.h): made, attached, and pushed into; its waits and its looks. The pop
// is in ring_pop.cc, the judgement of claims and the repair of what a dead process or a
// peer left in ring_repair.cc.
#include "transport/ring.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "os/futex.h"
#include "os/proc.h"
#include "os/shm.h"
#include "shmtensor/error.h"
#include "transport/busy_poll.h"
#include "transport/ring_layout.h"
#include "transport/ring_local.h"

namespace shmtensor::internal {

using namespace ring_word;
using namespace ring_detail;

namespace {

constexpr std::uint32_t kSlotsOffset = (sizeof(RingHeader) + 63) / 64 * 64;

bool valid_geometry(std::uint32_t count, std::uint32_t bytes) {
  return count >= 2 && count <= Ring::kMaxSlotCount && (count & (count - 1)) == 0 && bytes >= 64 &&
         bytes <= Ring::kMaxSlotBytes && bytes % 64 == 0;
}

}  // namespace

Ring::Ring(UniqueFd fd, Mapping map, std::uint32_t slot_count, std::uint32_t slot_bytes)
    : fd_(std::move(fd)),
      map_(std::move(map)),
      slot_count_(slot_count),
      slot_bytes_(slot_bytes),
      slots_offset_(kSlotsOffset),
      local_(std::make_unique<Local>()) {}

Ring::Ring() noexcept = default;
Ring::Ring(Ring&&) noexcept = default;

Ring& Ring::operator=(Ring&& o) noexcept {
  if (this != &o) {
    free_holder();
    fd_ = std::move(o.fd_);
    map_ = std::move(o.map_);
    slot_count_ = o.slot_count_;
    slot_bytes_ = o.slot_bytes_;
    slots_offset_ = o.slots_offset_;
    local_ = std::move(o.local_);
  }
  return *this;
}

Ring::~Ring() { free_holder(); }

Ring Ring::create(std::uint32_t slot_count, std::uint32_t slot_bytes) {
  if (!valid_geometry(slot_count, slot_bytes)) {
    // Names each argument that is wrong, with its value (both when both are).
    const bool count_ok = valid_geometry(slot_count, 64);
    const bool bytes_ok = valid_geometry(2, slot_bytes);
    std::string what = "Ring::create(slot_count=" + std::to_string(slot_count) +
                       ", slot_bytes=" + std::to_string(slot_bytes) + "): ";
    if (!count_ok) {
      what += "slot_count " + std::to_string(slot_count) +
              " is not a power of two in [2, 2^20]";
    }
    if (!bytes_ok) {
      if (!count_ok) what += "; ";
      what += "slot_bytes " + std::to_string(slot_bytes) +
              " is not a multiple of 64 in [64, 65536]";
    }
    throw std::invalid_argument(what);
  }
  const std::uint64_t total = kSlotsOffset + std::uint64_t{slot_count} * slot_bytes;
  UniqueFd fd = create_sealed_memfd(total);
  Mapping map = Mapping::map_shared(fd.get(), total, "message ring");
  auto* h = new (map.data()) RingHeader{};
  h->magic = kRingMagic;
  h->version = kRingVersion;
  h->slot_count = slot_count;
  h->slot_bytes = slot_bytes;
  h->slots_offset = kSlotsOffset;
  h->total_bytes = total;
  // The slots are left as the memfd made them, zero: free, each for its index's position
  // (ring_layout.h, index_bias); their pages are allocated when messages reach them.
  return Ring(std::move(fd), std::move(map), slot_count, slot_bytes);
}

Ring Ring::attach(UniqueFd fd) {
  const FdFacts facts = inspect_fd(fd.get());
  if (!facts.sealed_against_resize)
    throw ProtocolError("message ring: the memfd is not sealed against resizing");
  if (facts.size < sizeof(RingHeader))
    throw ProtocolError("message ring: the memfd is smaller than a ring header");
  Mapping map = Mapping::map_shared(fd.get(), facts.size, "message ring");
  // Validated once, from a copy: a peer that rewrites the header afterwards changes nothing.
  RingHeader copy;
  std::memcpy(static_cast<void*>(&copy), map.data(), offsetof(RingHeader, tail));
  if (copy.magic != kRingMagic) throw ProtocolError("message ring: bad magic");
  if (copy.version != kRingVersion)
    throw ProtocolError("message ring: layout version " + std::to_string(copy.version) +
                        ", this library reads " + std::to_string(kRingVersion));
  if (!valid_geometry(copy.slot_count, copy.slot_bytes) || copy.slots_offset != kSlotsOffset ||
      copy.total_bytes != kSlotsOffset + std::uint64_t{copy.slot_count} * copy.slot_bytes ||
      copy.total_bytes != facts.size)
    throw ProtocolError("message ring: the header's geometry disagrees with its memfd");
  return Ring(std::move(fd), std::move(map), copy.slot_count, copy.slot_bytes);
}

Ring::Reservation Ring::reserve(Deadline deadline) {
  const Reservation r = claim_tail(deadline);
  // Held while waiting until commit or cancel: the caller sends a datagram, and may wait
  // for room, in between (HolderRecord::waiting).
  if (r.status == Status::kOk) start_waiting(holder().first, r.pos);
  return r;
}

Ring::Reservation Ring::claim_tail(Deadline deadline) {
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  // Hints are put back where the slot words say at most once a call: words a peer keeps
  // rewriting must not keep it looping.
  bool may_resync = true;
  auto resync = [&] { return std::exchange(may_resync, false) && resync_hints(); };
  for (;;) {
    if (const std::uint32_t closed = h->closed.load()) {
      if (closed & kRingBroken) throw_broken();
      return {Status::kClosed, 0};
    }
    const std::uint64_t pos = load_hint(h->tail);
    if (pos >= kPosLimit) [[unlikely]] {
      // A tail a peer moved there goes back where the words say; if they say so too, the
      // ring has no position left.
      if (!may_resync) corrupt_hint("tail", pos);
      if (resync()) continue;
      break_ring();
    }
    std::uint64_t w = load_word(pos);
    const std::uint64_t wp = pos_of(w);
    if (wp == (pos & kPosMask)) {
      if (state_of(w) != kFree) {  // claimed by another producer: help the hint on
        std::uint64_t expected = pos;
        h->tail.compare_exchange_strong(expected, pos + 1);
        continue;
      }
      if (!cas_word(pos, w, pack(pos, kWriting, me, epoch))) continue;
      std::uint64_t expected = pos;
      h->tail.compare_exchange_strong(expected, pos + 1);
      // A close() that came before our claim wins: no message may appear after a consumer
      // found the ring closed and empty (pop reads `closed` before the slot).
      if (h->closed.load()) {
        store_word(pos, pack(pos + slot_count_, kFree));
        return {Status::kClosed, 0};
      }
      return {Status::kOk, pos};
    }
    if (wp == ((pos + slot_count_) & kPosMask)) {
      // Finished and freed for a later lap while the hint stayed behind (its claimer died
      // before moving it): move it.
      std::uint64_t expected = pos;
      h->tail.compare_exchange_strong(expected, pos + 1);
      continue;
    }
    if (wp + slot_count_ != (pos & kPosMask)) {
      // Laps ahead (after a tail we read before others moved it on: look again), or
      // behind: no protocol state explains it. The slot is made claimable for this position
      // again (the ring goes on), and the push says so.
      if (wp > (pos & kPosMask) && load_hint(h->tail) != pos) continue;
      // A tail hint a peer moved: the slot words say where the tail is.
      if (resync()) continue;
      if (wp < (pos & kPosMask) && state_of(w) == kFree) {
        // Free for a lap long gone (a position stepped over, which nobody passed since):
        // nothing was written there; the slot is made free for this position.
        cas_word(pos, w, pack(pos, kFree));
        continue;
      }
      if (wp < (pos & kPosMask) && state_of(w) == kReady) {
        // A message two laps or more behind the tail (claimed behind the head after a peer
        // moved the tail back, then passed by claims after it moved the tail forward): it
        // is kept, renumbered to this position, which the tail then passes. Only while the
        // tail hint is still this position (a tail read before another producer's resync
        // moved it back would renumber the message two laps above every other word, and the
        // ring would jump to that lap).
        if (load_hint(h->tail) != pos) continue;
        if (renumber(pos, w, pos)) {
          std::uint64_t expected = pos;
          h->tail.compare_exchange_strong(expected, pos + 1);
        }
        continue;
      }
      if (!cas_word(pos, w, pack(pos, kFree))) continue;
      corrupt(
          wp > (pos & kPosMask) ? "slot word laps ahead of the tail" : "slot word behind the tail",
          pos, w);
    }
    if (state_of(w) == kFree) {
      // Free for the previous lap while the tail hint is a lap past it: the hint was moved
      // by a peer. Nobody wrote that position: the slot is made free for this one.
      if (!resync()) cas_word(pos, w, pack(pos, kFree));
      continue;
    }
    // The previous lap's message is still there: the ring is full. A claim by a process
    // that died is freed; one a peer wrote is reported (watch_claim); otherwise sleep until
    // a consumer frees a slot.
    if (state_of(w) == kWriting || state_of(w) == kReading) {
      const Claimer claimer = look_at_claimer(pos - slot_count_, w);
      if (claimer == Claimer::kGone) {
        if (cas_word(pos, w, pack(wp + slot_count_, kFree))) {
          h->abandoned.fetch_add(1);
          wake_producers();
        }
        continue;
      }
      watch_claim(pos - slot_count_, w, claimer);
    }
    const std::uint32_t seen = h->freed.load();
    h->producers_asleep.fetch_add(1);
    const bool unchanged = load_word(pos) == w && load_hint(h->tail) == pos && !h->closed.load();
    const bool in_time = !unchanged || sleep_on(&h->freed, seen, deadline);
    h->producers_asleep.fetch_sub(1);
    if (!in_time) return {Status::kTimeout, 0};
  }
}

bool Ring::commit(std::uint64_t pos, std::span<const std::span<const std::byte>> parts,
                  std::uint32_t tag, Wake wake) noexcept {
  stop_waiting(pos);
  return publish(pos, parts, tag, wake);
}

bool Ring::publish(std::uint64_t pos, std::span<const std::span<const std::byte>> parts,
                   std::uint32_t tag, Wake wake) noexcept {
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  SlotHead* s = head_of(slot(pos));
  // Still ours? A claim is taken away only from a claimer judged dead (so not us, unless
  // the judgement was wrong) or by a peer writing over the ring.
  std::uint64_t mine = pack(pos, kWriting, me, epoch);
  if (load_word(pos) != mine) return false;
  std::size_t total = 0;
  std::byte* to = reinterpret_cast<std::byte*>(s) + kSlotHeaderBytes;
  for (const auto& part : parts) {
    if (part.empty()) continue;
    std::memcpy(to, part.data(), part.size());
    to += part.size();
    total += part.size();
  }
  s->size = static_cast<std::uint32_t>(total);
  std::atomic_ref<std::uint32_t>(s->tag).store(tag, std::memory_order_relaxed);  // pending
  if (!cas_word(pos, mine, pack(pos, kReady, me, epoch), std::memory_order_acq_rel))
    return false;
  h->published.fetch_add(1);
  if (wake == Wake::kNow) wake_consumers(1);
  return true;
}

void Ring::wake_consumers(int n) noexcept {
  // The publish (a seq_cst increment of `published`) came before this load, and a sleeper
  // counts itself before it looks: either we see it, or its FUTEX_WAIT sees the new value.
  RingHeader* h = header();
  if (n > 0 && h->consumers_asleep.load() != 0) futex_wake(&h->published, n);
}

void Ring::cancel(std::uint64_t pos) noexcept {
  stop_waiting(pos);
  // As an abandoned claim: consumers step over the position. Only if the claim is still
  // ours (see commit).
  const auto [me, epoch] = holder();
  std::uint64_t mine = pack(pos, kWriting, me, epoch);
  if (!cas_word(pos, mine, pack(pos + slot_count_, kFree), std::memory_order_acq_rel))
    return;
  RingHeader* h = header();
  h->published.fetch_add(1);
  if (h->consumers_asleep.load() != 0) futex_wake(&h->published, 1);
  wake_producers();
}

Ring::Status Ring::push_parts(std::span<const std::span<const std::byte>> parts, std::uint32_t tag,
                              Deadline deadline, Wake wake) {
  std::size_t total = 0;
  for (const auto& part : parts) total += part.size();
  if (total > max_message())
    throw std::invalid_argument("Ring::push: a message of " + std::to_string(total) +
                                " bytes does not fit a slot of " + std::to_string(max_message()));
  for (;;) {
    const Reservation r = claim_tail(deadline);
    // A claim taken away from us (judged dead, wrongly) was not published: claim again.
    if (r.status != Status::kOk || publish(r.pos, parts, tag, wake)) return r.status;
  }
}

void Ring::close() noexcept {
  RingHeader* h = header();
  h->closed.fetch_or(kRingClosed);
  h->published.fetch_add(1);
  h->freed.fetch_add(1);
  futex_wake(&h->published, INT_MAX);
  futex_wake(&h->freed, INT_MAX);
}

bool Ring::closed() const noexcept { return header()->closed.load() != 0; }

bool Ring::broken() const noexcept { return (header()->closed.load() & kRingBroken) != 0; }

std::byte* Ring::user_area() const noexcept { return header()->user; }

std::uint32_t Ring::publish_count() const noexcept { return header()->published.load(); }

bool Ring::spin_for_publish(std::uint32_t seen, Clock::time_point until) const noexcept {
  const RingHeader* h = header();
  return spin_while([&] { return h->published.load(std::memory_order_acquire) == seen; }, until);
}

bool Ring::wait_for_publish(std::uint32_t seen, Deadline deadline) noexcept {
  RingHeader* h = header();
  h->consumers_asleep.fetch_add(1);
  // consumers_asleep before the look at `published`, as in pop: a publish after this load
  // sees the sleeper and wakes it, or changed the word before the futex compares it.
  bool in_time = true;
  if (h->published.load() == seen) in_time = sleep_on(&h->published, seen, deadline);
  h->consumers_asleep.fetch_sub(1);
  if (h->published.load() == seen) idle_scan();  // as after a sleep in pop
  return in_time;
}

void Ring::wait_for_publish_untimed(std::uint32_t seen) noexcept {
  RingHeader* h = header();
  h->consumers_asleep.fetch_add(1);  // before the look, as in wait_for_publish
  if (h->published.load() == seen) futex_wait(&h->published, seen, std::nullopt);
  h->consumers_asleep.fetch_sub(1);
}

void Ring::kick() noexcept {
  RingHeader* h = header();
  h->published.fetch_add(1);
  futex_wake(&h->published, INT_MAX);
}

bool Ring::maybe_nonempty() const noexcept {
  const RingHeader* h = header();
  return peek_hint(h->tail) != peek_hint(h->head);
}

bool Ring::has_ready() const noexcept {
  const RingHeader* h = header();
  std::uint64_t pos = peek_hint(h->head);
  const std::uint64_t tail = peek_hint(h->tail);
  for (std::uint32_t n = 0; pos < tail && n < slot_count_; ++pos, ++n) {
    const std::uint64_t w = load_word(pos);
    if (pos_of(w) == (pos & kPosMask) && state_of(w) == kReady) return true;
  }
  return false;
}

std::uint64_t Ring::size() const noexcept {
  std::uint64_t n = 0;
  for (std::uint64_t i = 0; i < slot_count_; ++i)
    if (state_of(load_word(i)) == kReady) ++n;
  return n;
}

}  // namespace shmtensor::internal
