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

namespace shmtensor::internal {

using namespace ring_word;

namespace {

// A sleep is at most this long, so that a claim of a process that died is noticed.
constexpr auto kSleepSlice = std::chrono::milliseconds(50);
// How often a consumer that sleeps with nothing published looks for hidden messages.
constexpr auto kIdleScanEvery = std::chrono::seconds(1);
// Spins on a slot a producer is writing (a copy of at most 64 KiB) before sleeping.
constexpr int kWritingSpins = 256;

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kSlotsOffset = (sizeof(RingHeader) + 63) / 64 * 64;

bool valid_geometry(std::uint32_t count, std::uint32_t bytes) {
  return count >= 2 && count <= Ring::kMaxSlotCount && (count & (count - 1)) == 0 &&
         bytes >= 64 && bytes <= Ring::kMaxSlotBytes && bytes % 64 == 0;
}

SlotHead* head_of(std::byte* slot) { return reinterpret_cast<SlotHead*>(slot); }

[[noreturn]] void corrupt(const char* what, std::uint64_t pos, std::uint64_t word) {
  throw ProtocolError(std::string("message ring: ") + what + " (position " +
                      std::to_string(pos) + ", slot word 0x" +
                      [&] {
                        char b[17];
                        std::snprintf(b, sizeof b, "%016llx",
                                      static_cast<unsigned long long>(word));
                        return std::string(b);
                      }() +
                      "): another process wrote over the ring's shared memory");
}

// Sleeps on `word` (expected value `seen`) for at most a slice and the deadline. False when
// the deadline has passed.
bool sleep_on(std::atomic<std::uint32_t>* word, std::uint32_t seen,
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

void pause_cpu() noexcept {
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

}  // namespace

// This process's claim, packed into one word (fork generation << 32 | holder << 8 | epoch:
// os/proc.h, fork_generation; 0: none) so that
// threads agree on it without a lock: a mutex here could be inherited locked by a child
// forked while another thread claimed, whose first push or pop would then hang.
struct Ring::Local {
  std::atomic<std::uint64_t> claim{0};
  // When this handle last looked for messages hidden behind the head after a sleep with
  // nothing published (steady clock, ns): at most once a second.
  std::atomic<std::int64_t> idle_scan_ns{0};
};

namespace {
constexpr std::uint64_t pack_claim(std::uint32_t generation, std::uint32_t holder,
                                   std::uint32_t epoch) {
  return std::uint64_t{generation} << 32 | std::uint64_t{holder} << 8 | epoch;
}
constexpr std::uint32_t claim_generation(std::uint64_t c) {
  return static_cast<std::uint32_t>(c >> 32);
}
constexpr std::uint32_t claim_holder(std::uint64_t c) { return (c >> 8) & 0xff; }
constexpr std::uint32_t claim_epoch(std::uint64_t c) { return c & 0xff; }
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
  if (!valid_geometry(slot_count, slot_bytes))
    throw std::invalid_argument("Ring: slot_count must be a power of two in [2, 2^20] and "
                                "slot_bytes a multiple of 64 in [64, 65536]");
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
  Ring r(std::move(fd), std::move(map), slot_count, slot_bytes);
  for (std::uint64_t pos = 0; pos < slot_count; ++pos)
    new (r.slot(pos)) SlotHead{{pack(pos, kFree)}, 0, 0};
  return r;
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

RingHeader* Ring::header() const noexcept { return reinterpret_cast<RingHeader*>(map_.data()); }

std::byte* Ring::slot(std::uint64_t pos) const noexcept {
  return map_.data() + slots_offset_ + (pos & (slot_count_ - 1)) * slot_bytes_;
}

std::pair<std::uint32_t, std::uint32_t> Ring::holder() {
  // Every push and pop asks: the claim made, a load and a compare (inlined), else the claim.
  const std::uint64_t seen = local_->claim.load(std::memory_order_acquire);
  if (claim_generation(seen) == fork_generation()) [[likely]]
    return {claim_holder(seen), claim_epoch(seen)};
  return claim_holder_record();
}

std::pair<std::uint32_t, std::uint32_t> Ring::claim_holder_record() {
  Local& l = *local_;
  const std::uint32_t me = fork_generation();
  std::uint64_t seen = l.claim.load(std::memory_order_acquire);
  if (claim_generation(seen) == me) return {claim_holder(seen), claim_epoch(seen)};
  // A forked child starts here too: the record it inherited is its parent's. Two threads
  // may both claim a record; the one that publishes second gives its record back.
  const std::uint64_t owner = current_slot_owner();
  RingHeader* h = header();
  std::uint32_t found = kNoHolder;
  for (std::uint32_t i = 0; i < kHolderRecords && found == kNoHolder; ++i) {
    std::uint64_t expected = 0;
    if (h->holders[i].owner.compare_exchange_strong(expected, owner)) found = i;
  }
  // None free: take over the record of a dead process. Its claims then belong to an old
  // epoch, which marks them abandoned.
  for (std::uint32_t i = 0; i < kHolderRecords && found == kNoHolder; ++i) {
    std::uint64_t dead = h->holders[i].owner.load();
    if (dead == 0 || slot_owner_alive(dead)) continue;
    if (h->holders[i].owner.compare_exchange_strong(dead, owner)) found = i;
  }
  const std::uint32_t epoch =
      found == kNoHolder ? 0 : (h->holders[found].epoch.fetch_add(1) + 1) & kEpochMask;
  const std::uint64_t mine = pack_claim(me, found, epoch);
  if (l.claim.compare_exchange_strong(seen, mine, std::memory_order_acq_rel)) return {found, epoch};
  if (found != kNoHolder) {  // another thread of ours published first: ours goes back
    std::uint64_t ours = owner;
    h->holders[found].epoch.fetch_add(1);
    h->holders[found].owner.compare_exchange_strong(ours, 0);
  }
  return {claim_holder(seen), claim_epoch(seen)};
}

void Ring::free_holder() noexcept {
  if (!local_ || !map_) return;
  const std::uint64_t c = local_->claim.load();
  if (claim_generation(c) != fork_generation() || claim_holder(c) == kNoHolder) return;
  std::uint64_t owner = current_slot_owner();
  RingHeader* h = header();
  // Bump the epoch first: a claim of ours left unfinished (an exception between claim and
  // publish cannot happen, but a thread may still be inside one) is abandoned from now on.
  h->holders[claim_holder(c)].epoch.fetch_add(1);
  h->holders[claim_holder(c)].owner.compare_exchange_strong(owner, 0);
  local_->claim.store(0);
}

bool Ring::claimer_dead(std::uint64_t word) const noexcept {
  const std::uint32_t who = holder_of(word);
  if (who >= kHolderRecords) return false;  // no record: never judged
  const HolderRecord& r = header()->holders[who];
  if ((r.epoch.load() & kEpochMask) != epoch_of(word)) return true;  // the record moved on
  const std::uint64_t owner = r.owner.load();
  return owner == 0 || !slot_owner_alive(owner);
}

void Ring::wake_producers() noexcept {
  RingHeader* h = header();
  h->freed.fetch_add(1);
  if (h->producers_asleep.load() != 0) futex_wake(&h->freed, 1);
}

Ring::Reservation Ring::reserve(Deadline deadline) {
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  // Hints are put back where the slot words say at most once a call: words a peer keeps
  // rewriting must not keep it looping.
  bool may_resync = true;
  auto resync = [&] { return std::exchange(may_resync, false) && resync_hints(); };
  for (;;) {
    if (h->closed.load()) return {Status::kClosed, 0};
    const std::uint64_t pos = h->tail.load();
    SlotHead* s = head_of(slot(pos));
    std::uint64_t w = s->word.load();
    const std::uint64_t wp = pos_of(w);
    if (wp == (pos & kPosMask)) {
      if (state_of(w) != kFree) {  // claimed by another producer: help the hint on
        std::uint64_t expected = pos;
        h->tail.compare_exchange_strong(expected, pos + 1);
        continue;
      }
      if (!s->word.compare_exchange_strong(w, pack(pos, kWriting, me, epoch))) continue;
      std::uint64_t expected = pos;
      h->tail.compare_exchange_strong(expected, pos + 1);
      // A close() that came before our claim wins: no message may appear after a consumer
      // found the ring closed and empty (pop reads `closed` before the slot).
      if (h->closed.load()) {
        s->word.store(pack(pos + slot_count_, kFree));
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
      if (wp > (pos & kPosMask) && h->tail.load() != pos) continue;
      // A tail hint a peer moved: the slot words say where the tail is.
      if (resync()) continue;
      if (!s->word.compare_exchange_strong(w, pack(pos, kFree))) continue;
      corrupt(wp > (pos & kPosMask) ? "slot word laps ahead of the tail"
                                    : "slot word behind the tail",
              pos, w);
    }
    if (state_of(w) == kFree) {
      // Free for the previous lap while the tail hint is a lap past it: the hint was moved
      // by a peer. Nobody wrote that position: the slot is made free for this one.
      if (!resync()) s->word.compare_exchange_strong(w, pack(pos, kFree));
      continue;
    }
    // The previous lap's message is still there: the ring is full. A claim by a process
    // that died is freed; otherwise sleep until a consumer frees a slot.
    if ((state_of(w) == kWriting || state_of(w) == kReading) && claimer_dead(w)) {
      if (s->word.compare_exchange_strong(w, pack(wp + slot_count_, kFree))) {
        h->abandoned.fetch_add(1);
        wake_producers();
      }
      continue;
    }
    const std::uint32_t seen = h->freed.load();
    h->producers_asleep.fetch_add(1);
    const bool unchanged = s->word.load() == w && h->tail.load() == pos && !h->closed.load();
    const bool in_time = !unchanged || sleep_on(&h->freed, seen, deadline);
    h->producers_asleep.fetch_sub(1);
    if (!in_time) return {Status::kTimeout, 0};
  }
}

bool Ring::commit(std::uint64_t pos, std::span<const std::span<const std::byte>> parts,
                  std::uint32_t tag, Wake wake) noexcept {
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  SlotHead* s = head_of(slot(pos));
  // Still ours? A claim is taken away only from a claimer judged dead (so not us, unless
  // the judgement was wrong) or by a peer writing over the ring.
  std::uint64_t mine = pack(pos, kWriting, me, epoch);
  if (s->word.load() != mine) return false;
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
  if (!s->word.compare_exchange_strong(mine, pack(pos, kReady, me, epoch),
                                       std::memory_order_acq_rel))
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
  // As an abandoned claim: consumers step over the position. Only if the claim is still
  // ours (see commit).
  const auto [me, epoch] = holder();
  std::uint64_t mine = pack(pos, kWriting, me, epoch);
  if (!head_of(slot(pos))->word.compare_exchange_strong(mine, pack(pos + slot_count_, kFree),
                                                        std::memory_order_acq_rel))
    return;
  RingHeader* h = header();
  h->published.fetch_add(1);
  if (h->consumers_asleep.load() != 0) futex_wake(&h->published, 1);
  wake_producers();
}

Ring::Status Ring::push_parts(std::span<const std::span<const std::byte>> parts,
                              std::uint32_t tag, Deadline deadline, Wake wake) {
  std::size_t total = 0;
  for (const auto& part : parts) total += part.size();
  if (total > max_message())
    throw std::invalid_argument("Ring::push: a message of " + std::to_string(total) +
                                " bytes does not fit a slot of " +
                                std::to_string(max_message()));
  for (;;) {
    const Reservation r = reserve(deadline);
    // A claim taken away from us (judged dead, wrongly) was not published: claim again.
    if (r.status != Status::kOk || commit(r.pos, parts, tag, wake)) return r.status;
  }
}



Ring::Popped Ring::pop(std::span<std::byte> out, Deadline deadline, std::uint32_t hold_tag) {
  if (out.size() < max_message())
    throw std::invalid_argument("Ring::pop: the buffer is smaller than a slot's message");
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  // A word no protocol state explains: its position is skipped (so the next pop goes on),
  // and this pop says why. Returns (to look again) when the word changed since it was read:
  // a word read before another process moved on is not evidence of anything.
  auto skip_corrupt = [&](const char* what, std::uint64_t pos, std::uint64_t w) {
    SlotHead* s = head_of(slot(pos));
    std::uint64_t seen = w;
    if (!s->word.compare_exchange_strong(seen, pack(pos + slot_count_, kFree))) return;
    wake_producers();
    std::uint64_t expected = pos;
    h->head.compare_exchange_strong(expected, pos + 1);
    resync_hints();
    corrupt(what, pos, w);
  };
  int spins = 0;
  bool spun = false;
  bool may_resync = true;  // once a call, as in reserve
  auto resync = [&] { return std::exchange(may_resync, false) && resync_hints(); };
  for (;;) {
    // `closed` before the slot: a push that claims after this sees it and withdraws.
    const bool was_closed = h->closed.load() != 0;
    const std::uint64_t pos = h->head.load();
    SlotHead* s = head_of(slot(pos));
    std::uint64_t w = s->word.load();
    const std::uint64_t wp = pos_of(w);
    if (wp == (pos & kPosMask)) {
      switch (state_of(w)) {
        case kReady: {
          if (!s->word.compare_exchange_strong(w, pack(pos, kReading, me, epoch))) continue;
          std::uint64_t expected = pos;
          h->head.compare_exchange_strong(expected, pos + 1);
          const std::uint32_t size = s->size, tag = s->tag;
          const bool fits = size <= max_message();
          if (fits && size != 0)
            std::memcpy(out.data(), reinterpret_cast<std::byte*>(s) + kSlotHeaderBytes, size);
          if (fits && tag == hold_tag) return {Status::kOk, tag, size, pos};
          s->word.store(pack(pos + slot_count_, kFree), std::memory_order_release);
          wake_producers();
          if (!fits)  // the slot is free again: the next pop goes on
            corrupt(("message of " + std::to_string(size) + " bytes in a slot of " +
                     std::to_string(max_message()))
                        .c_str(),
                    pos, w);
          return {Status::kOk, tag, size, pos};
        }
        case kReading: {  // another consumer has it: help the hint on
          std::uint64_t expected = pos;
          h->head.compare_exchange_strong(expected, pos + 1);
          continue;
        }
        case kWriting:
          // A producer is writing the slot: it publishes within a few hundred nanoseconds,
          // so spin first. Whether it died is asked only after that (it reads
          // /proc/<pid>/stat: microseconds, and a consumer polling for a message catches
          // many slots mid-write).
          if (++spins < kWritingSpins) {
            pause_cpu();
            continue;
          }
          if (claimer_dead(w)) {
            // Its producer died mid-write: the position is skipped.
            if (s->word.compare_exchange_strong(w, pack(pos + slot_count_, kFree))) {
              h->abandoned.fetch_add(1);
              wake_producers();
            }
            spins = 0;
            continue;
          }
          break;  // a slow producer: sleep until it publishes
        case kFree:
          // Free for this position while the tail has passed it: nobody will ever write
          // it (a scribbled word made a producer skip it). Only corruption leads here.
          if (const std::uint64_t tail = h->tail.load(); tail > pos) {
            // A producer that claimed the slot after we read it moved the tail: look again.
            if (s->word.load() != w) continue;
            if (resync()) continue;
            // A hole: no producer will write the position (a peer moved the tail hint past
            // it). It is stepped over; nothing was lost there.
            std::uint64_t seen = w;
            if (s->word.compare_exchange_strong(seen, pack(pos + slot_count_, kFree))) {
              std::uint64_t expected = pos;
              h->head.compare_exchange_strong(expected, pos + 1);
              wake_producers();
            }
            continue;
          } else if (tail < pos && resync()) {
            continue;  // a head hint a peer moved past the tail
          }
          if (was_closed) return {Status::kClosed, 0, 0};
          break;  // empty
      }
    } else if (wp == ((pos + slot_count_) & kPosMask)) {
      std::uint64_t expected = pos;  // taken and freed while the hint stayed behind
      h->head.compare_exchange_strong(expected, pos + 1);
      continue;
    } else if (wp + slot_count_ == (pos & kPosMask)) {
      // The previous lap's message is still being read, so nothing for us is there yet.
      if (state_of(w) == kReading && claimer_dead(w)) {
        if (s->word.compare_exchange_strong(w, pack(pos, kFree))) {
          h->abandoned.fetch_add(1);
          wake_producers();
        }
        continue;
      }
      if (state_of(w) == kReady || state_of(w) == kWriting) {
        // A message the head hint went past (a peer moved it, or a consumer gave one back
        // with unread): the head goes back to it, and nothing is lost.
        std::uint64_t expected = pos;
        h->head.compare_exchange_strong(expected, pos - slot_count_);
        continue;
      }
      if (state_of(w) != kReading) {
        if (resync()) continue;
        skip_corrupt("slot word behind the head", pos, w);
        continue;
      }
      if (was_closed) return {Status::kClosed, 0, 0};
    } else {
      if (h->head.load() != pos) continue;  // the hint moved: look again
      if (resync()) continue;
      skip_corrupt("slot word from another lap", pos, w);
      continue;
    }
    if (deadline && (*deadline == kNoWait || Clock::now() >= *deadline)) {
      // A pop that may not wait (a poll: busy polling pops so, many times a microsecond)
      // looks once more, and does not count itself among the sleepers: counted, it would
      // make a producer publishing meanwhile call FUTEX_WAKE for nobody, and move the
      // count's cache line between the two CPUs at every poll.
      const bool unchanged = s->word.load() == w && h->head.load() == pos &&
                             (h->closed.load() != 0) == was_closed;
      if (unchanged) return {Status::kTimeout, 0, 0};
      spins = 0;
      continue;
    }
    const std::uint32_t seen = h->published.load();
    if (!spun) {
      // Once per pop, before sleeping: a short spin on the publish count (busy_poll.h,
      // spin_before_sleep), so that a producer producing right now need not wake us.
      // It watches the slot too: a publish between the look at the slot and the read of
      // `seen` above changed the slot, and must not cost the whole spin.
      spun = true;
      if (const auto until = spin_before_sleep_until(deadline)) {
        (void)spin_while(
            [&] {
              return h->published.load(std::memory_order_acquire) == seen && s->word.load() == w;
            },
            *until);
        continue;  // look again; the next pass sleeps if nothing changed
      }
    }
    h->consumers_asleep.fetch_add(1);
    const bool unchanged = s->word.load() == w && h->head.load() == pos &&
                           (h->closed.load() != 0) == was_closed;
    const bool in_time = !unchanged || sleep_on(&h->published, seen, deadline);
    h->consumers_asleep.fetch_sub(1);
    if (unchanged && h->published.load() == seen) idle_scan();
    if (!in_time) return {Status::kTimeout, 0, 0};
    spins = 0;
  }
}

void Ring::idle_scan() noexcept {
  // A sleep with nothing published: messages a peer hid behind a head hint it moved forward
  // are looked for, with a scan of the slot words, at most once a second per handle (a
  // scan reads every slot's line).
  const std::int64_t now = Clock::now().time_since_epoch().count();
  std::int64_t last = local_->idle_scan_ns.load(std::memory_order_relaxed);
  if (now - last < std::chrono::nanoseconds(kIdleScanEvery).count()) return;
  if (!local_->idle_scan_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) return;
  (void)resync_hints();
}

bool Ring::resync_hints() noexcept {
  // The hints as the slot words put them (ring.h): the tail is one past the last position
  // claimed (a slot not free for its position was claimed; a slot free for a later lap had
  // its previous position claimed), and the head is the oldest position published or being
  // written, or the tail when there is none. In a ring nobody wrote over, the head is never
  // past the tail, and the tail never more than a lap past any slot's position.
  RingHeader* h = header();
  const std::uint64_t n = slot_count_;
  // The hints before the scan, and only those are replaced: a claim or a take that moves a
  // hint while the scan runs makes the CAS fail, so a scan older than the hint never pulls
  // it back (claims and takes only move the words forward: an honest hint read before the
  // scan is never ahead of what the scan finds).
  const std::uint64_t tail0 = h->tail.load();
  const std::uint64_t head0 = h->head.load();
  std::uint64_t tail = 0;
  std::uint64_t oldest = UINT64_MAX;  // the oldest position published or being written
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t w = head_of(slot(i))->word.load();
    const std::uint64_t p = pos_of(w);
    if (state_of(w) != kFree)
      tail = std::max(tail, p + 1);
    else if (p >= n)
      tail = std::max(tail, p - n + 1);
    if (state_of(w) == kReady || state_of(w) == kWriting) oldest = std::min(oldest, p);
  }
  std::uint64_t head = tail;
  if (oldest == UINT64_MAX || oldest + n >= tail) {
    head = std::min(head, oldest);
  } else {  // a word more than a lap behind the tail (a peer's): not the head
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t w = head_of(slot(i))->word.load();
      if ((state_of(w) == kReady || state_of(w) == kWriting) && pos_of(w) + n >= tail)
        head = std::min(head, pos_of(w));
    }
  }
  // A hint ahead of the words is moved back (consumers and producers then step forward
  // over what was taken, one CAS a position); one far behind is moved up to them.
  bool moved = false;
  std::uint64_t seen = tail0;
  if (seen > tail || seen + n < tail) moved |= h->tail.compare_exchange_strong(seen, tail);
  seen = head0;
  if (seen > head || seen + n < head) moved |= h->head.compare_exchange_strong(seen, head);
  return moved;
}

void Ring::close() noexcept {
  RingHeader* h = header();
  h->closed.store(1);
  h->published.fetch_add(1);
  h->freed.fetch_add(1);
  futex_wake(&h->published, INT_MAX);
  futex_wake(&h->freed, INT_MAX);
}

bool Ring::closed() const noexcept { return header()->closed.load() != 0; }

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

std::uint64_t Ring::abandoned() const noexcept { return header()->abandoned.load(); }

void Ring::release(std::uint64_t pos) noexcept {
  SlotHead* s = head_of(slot(pos));
  std::uint64_t w = s->word.load();
  // Ours unless a peer wrote over it; then whatever is there stays for the checks of pop.
  if (pos_of(w) != (pos & kPosMask) || state_of(w) != kReading) return;
  if (s->word.compare_exchange_strong(w, pack(pos + slot_count_, kFree))) wake_producers();
}

void Ring::rewind_head(std::uint64_t pos) noexcept {
  RingHeader* h = header();
  std::uint64_t head = h->head.load();
  while (head > pos && !h->head.compare_exchange_weak(head, pos)) {
  }
}

void Ring::unread(std::uint64_t pos) noexcept {
  RingHeader* h = header();
  SlotHead* s = head_of(slot(pos));
  std::uint64_t w = s->word.load();
  if (pos_of(w) != (pos & kPosMask) || state_of(w) != kReading) return;
  if (!s->word.compare_exchange_strong(w, pack(pos, kReady))) return;
  rewind_head(pos);
  h->published.fetch_add(1);
  wake_consumers(INT_MAX);  // rare; and a connection's sleepers include poll() callers
}

Ring::SlotView Ring::inspect(std::uint64_t pos) const noexcept {
  const std::uint64_t w = head_of(slot(pos))->word.load();
  if (pos_of(w) != (pos & kPosMask)) return {};
  switch (state_of(w)) {
    case kWriting:
      return {Where::kWriting, !claimer_dead(w)};
    case kReady:
      return {Where::kReady, true};
    case kReading:
      return {Where::kReading, !claimer_dead(w)};
    default:
      return {};
  }
}

bool Ring::pending(std::uint64_t pos, std::uint32_t tag) const noexcept {
  SlotHead* s = head_of(slot(pos));
  const std::uint64_t w = s->word.load();
  // The tag as an atomic: the slot may move on meanwhile and a producer write it.
  return pos_of(w) == (pos & kPosMask) && (state_of(w) == kReading || state_of(w) == kReady) &&
         std::atomic_ref<std::uint32_t>(s->tag).load(std::memory_order_relaxed) == tag;
}

bool Ring::maybe_nonempty() const noexcept {
  const RingHeader* h = header();
  return h->tail.load() != h->head.load();
}

bool Ring::has_ready() const noexcept {
  const RingHeader* h = header();
  std::uint64_t pos = h->head.load();
  const std::uint64_t tail = h->tail.load();
  for (std::uint32_t n = 0; pos < tail && n < slot_count_; ++pos, ++n) {
    const std::uint64_t w = head_of(slot(pos))->word.load();
    if (pos_of(w) == (pos & kPosMask) && state_of(w) == kReady) return true;
  }
  return false;
}

std::uint64_t Ring::size() const noexcept {
  std::uint64_t n = 0;
  for (std::uint64_t i = 0; i < slot_count_; ++i)
    if (state_of(head_of(slot(i))->word.load()) == kReady) ++n;
  return n;
}

bool Ring::test_claim_and_abandon(bool as_consumer) {
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  const std::uint64_t pos = as_consumer ? h->head.load() : h->tail.load();
  SlotHead* s = head_of(slot(pos));
  std::uint64_t w = s->word.load();
  if (pos_of(w) != (pos & kPosMask) || state_of(w) != (as_consumer ? kReady : kFree))
    return false;
  if (!s->word.compare_exchange_strong(w, pack(pos, as_consumer ? kReading : kWriting, me,
                                               epoch)))
    return false;
  std::uint64_t expected = pos;
  (as_consumer ? h->head : h->tail).compare_exchange_strong(expected, pos + 1);
  return true;
}

}  // namespace shmtensor::internal
