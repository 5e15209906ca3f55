// A message ring's pop (ring.h): the oldest message taken off the ring, stepping over
// claims of dead processes and words a peer wrote; the heart of a consumer.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>

#include "transport/busy_poll.h"
#include "transport/ring.h"
#include "transport/ring_layout.h"
#include "transport/ring_local.h"

namespace shmtensor::internal {

using namespace ring_word;
using namespace ring_detail;

namespace {
// Spins on a slot a producer is writing (a copy of at most 64 KiB) before sleeping.
constexpr int kWritingSpins = 256;
}  // namespace

Ring::Popped Ring::pop(std::span<std::byte> out, Deadline deadline, std::uint32_t hold_tag) {
  if (out.size() < max_message())
    throw std::invalid_argument("Ring::pop: the buffer is smaller than a slot's message");
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  // A word no protocol state explains: its position is skipped (so the next pop goes on),
  // and this pop says why. Returns (to look again) when the word changed since it was read:
  // a word read before another process moved on is not evidence of anything.
  auto skip_corrupt = [&](const char* what, std::uint64_t pos, std::uint64_t w) {
    std::uint64_t seen = w;
    if (!cas_word(pos, seen, pack(pos + slot_count_, kFree))) return;
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
  // Empty and closed: kClosed, or the ProtocolError of a broken ring.
  auto closed_and_empty = [&]() -> Popped {
    if (h->closed.load() & kRingBroken) throw_broken();
    return {Status::kClosed, 0, 0};
  };
  for (;;) {
    // `closed` before the slot: a push that claims after this sees it and withdraws.
    const bool was_closed = h->closed.load() != 0;
    const std::uint64_t pos = load_hint(h->head);
    if (pos >= kPosLimit) [[unlikely]] {
      // A head a peer moved there goes back where the words say; if they say so too, the
      // ring has no position left.
      if (!may_resync) corrupt_hint("head", pos);
      if (resync()) continue;
      break_ring();
    }
    SlotHead* s = head_of(slot(pos));
    std::uint64_t w = load_word(pos);
    const std::uint64_t wp = pos_of(w);
    if (wp == (pos & kPosMask)) {
      switch (state_of(w)) {
        case kReady: {
          if (!cas_word(pos, w, pack(pos, kReading, me, epoch))) continue;
          std::uint64_t expected = pos;
          h->head.compare_exchange_strong(expected, pos + 1);
          const std::uint32_t size = s->size, tag = s->tag;
          const bool fits = size <= max_message();
          if (fits && size != 0)
            std::memcpy(out.data(), reinterpret_cast<std::byte*>(s) + kSlotHeaderBytes, size);
          if (fits && tag == hold_tag) {
            // Held until release or unread, while the caller may wait (HolderRecord::waiting).
            start_waiting(me, pos);
            return {Status::kOk, tag, size, pos};
          }
          store_word(pos, pack(pos + slot_count_, kFree), std::memory_order_release);
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
          if (const Claimer claimer = look_at_claimer(pos, w); claimer != Claimer::kGone) {
            watch_claim(pos, w, claimer);  // throws for a claim a peer wrote
            break;                         // a slow producer: sleep until it publishes
          }
          // Its producer died mid-write: the position is skipped.
          if (cas_word(pos, w, pack(pos + slot_count_, kFree))) {
            h->abandoned.fetch_add(1);
            wake_producers();
          }
          spins = 0;
          continue;
        case kFree:
          // Free for this position while the tail has passed it: nobody will ever write
          // it (a scribbled word made a producer skip it). Only corruption leads here.
          if (const std::uint64_t tail = load_hint(h->tail); tail > pos) {
            // A producer that claimed the slot after we read it moved the tail: look again.
            if (load_word(pos) != w) continue;
            if (resync()) continue;
            // An honest tail is at most a lap past the oldest position not taken: one further
            // was moved by a peer, and stepping to it hole by hole could take 2^50 steps.
            if (tail - pos > slot_count_) far_tail_hint(tail, pos);
            // A hole: no producer will write the position (a peer moved the tail hint past
            // it). It is stepped over; nothing was lost there.
            std::uint64_t seen = w;
            if (cas_word(pos, seen, pack(pos + slot_count_, kFree))) {
              std::uint64_t expected = pos;
              h->head.compare_exchange_strong(expected, pos + 1);
              wake_producers();
            }
            continue;
          } else if (tail < pos && resync()) {
            continue;  // a head hint a peer moved past the tail
          }
          if (was_closed) return closed_and_empty();
          break;  // empty
      }
    } else if (wp == ((pos + slot_count_) & kPosMask)) {
      std::uint64_t expected = pos;  // taken and freed while the hint stayed behind
      h->head.compare_exchange_strong(expected, pos + 1);
      continue;
    } else if (wp + slot_count_ == (pos & kPosMask)) {
      // The previous lap's message is still being read, so nothing for us is there yet.
      if (state_of(w) == kReading && claimer_dead(w)) {
        if (cas_word(pos, w, pack(pos, kFree))) {
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
      if (state_of(w) == kFree) {
        // Free for the previous lap: a position the tail stepped over that no consumer
        // passed (the head was moved past it). Nothing was written there: the slot is made
        // free for this position, as a producer does.
        cas_word(pos, w, pack(pos, kFree));
        continue;
      }
      if (was_closed) return closed_and_empty();
    } else {
      if (load_hint(h->head) != pos) continue;  // the hint moved: look again
      if (resync()) continue;
      if (wp < (pos & kPosMask) && state_of(w) == kFree) {
        // Free for a lap long gone: nothing was written there (as one lap behind, below).
        cas_word(pos, w, pack(pos, kFree));
        continue;
      }
      skip_corrupt("slot word from another lap", pos, w);
      continue;
    }
    if (deadline && (*deadline == kNoWait || Clock::now() >= *deadline)) {
      // A pop that may not wait (a poll: busy polling pops so, many times a microsecond)
      // looks once more, and does not count itself among the sleepers: counted, it would
      // make a producer publishing meanwhile call FUTEX_WAKE for nobody, and move the
      // count's cache line between the two CPUs at every poll.
      const bool unchanged =
          load_word(pos) == w && load_hint(h->head) == pos && (h->closed.load() != 0) == was_closed;
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
      const auto until = local_->spin_before_sleep.load(std::memory_order_relaxed)
                             ? spin_before_sleep_until(deadline)
                             : std::nullopt;
      if (until) {
        (void)spin_while(
            [&] {
              return h->published.load(std::memory_order_acquire) == seen && load_word(pos) == w;
            },
            *until);
        continue;  // look again; the next pass sleeps if nothing changed
      }
    }
    h->consumers_asleep.fetch_add(1);
    const bool unchanged =
        load_word(pos) == w && load_hint(h->head) == pos && (h->closed.load() != 0) == was_closed;
    const bool in_time = !unchanged || sleep_on(&h->published, seen, deadline);
    h->consumers_asleep.fetch_sub(1);
    if (unchanged && h->published.load() == seen) idle_scan();
    if (!in_time) return {Status::kTimeout, 0, 0};
    spins = 0;
  }
}

void Ring::set_spin_before_sleep(bool on) noexcept {
  local_->spin_before_sleep.store(on, std::memory_order_relaxed);
}

bool Ring::spins_before_sleep() const noexcept {
  return local_->spin_before_sleep.load(std::memory_order_relaxed);
}

}  // namespace shmtensor::internal
