// A message ring's claims and their repair (ring.h): the holder records that say whose a
// claim is and whether its process lives, the hints put back where the slot words say after
// a peer moved them, and the steps a reader takes back (release, unread) or looks with.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "os/proc.h"
#include "os/shm.h"
#include "shmtensor/error.h"
#include "transport/ring.h"
#include "transport/ring_layout.h"
#include "transport/ring_local.h"

namespace shmtensor::internal {

using namespace ring_word;
using namespace ring_detail;

namespace {
// How often a consumer that sleeps with nothing published looks for hidden messages.
constexpr auto kIdleScanEvery = std::chrono::seconds(1);

// What a thread has seen of the claim it waits behind (Ring::watch_claim): which ring handle
// and position, when it last looked, for how long in all the claimer was running, and the
// word it reported (0: none yet).
struct ClaimWatch {
  std::uint64_t handle = 0;
  std::uint64_t pos = 0;
  Clock::time_point last{};
  Clock::duration stood{};
  std::uint64_t reported = 0;
};
thread_local ClaimWatch t_claim_watch;

[[noreturn]] void stuck_claim(std::uint64_t pos, std::uint64_t word, std::uint64_t owner) {
  const std::string by = holder_of(word) >= kHolderRecords
                             ? "a process with no holder record"
                             : "process " + std::to_string(owner >> 32);
  throw ProtocolError(
      "message ring: the slot of position " + std::to_string(pos) + " has been claimed " +
      (state_of(word) == kWriting ? "for writing" : "for reading") + " by " + by +
      " for more than " + std::to_string(Ring::kClaimStuckAfter.count() / 1000) +
      " s while this thread waited behind it, and that process was neither stopped nor "
      "waiting, as every claim held longer than a copy is: another process wrote over the "
      "ring's shared memory");
}
}  // namespace

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
  // A record taken over names none of its new owner's claims as waiting yet.
  if (found != kNoHolder) {
    for (auto& w : h->holders[found].waiting) w.store(0);
    h->holders[found].overflow.store(0);
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
  return look_at_claimer(pos_of(word), word) == Claimer::kGone;
}

Ring::Claimer Ring::look_at_claimer(std::uint64_t pos, std::uint64_t word) const noexcept {
  const std::uint32_t who = holder_of(word);
  // No record: no process to look at; taken as waiting while any process without one waits.
  if (who >= kHolderRecords)
    return header()->nobody_waiting.load() != 0 ? Claimer::kWaiting : Claimer::kRunning;
  const HolderRecord& r = header()->holders[who];
  if ((r.epoch.load() & kEpochMask) != epoch_of(word)) return Claimer::kGone;
  const std::uint64_t owner = r.owner.load();
  const auto pid = static_cast<pid_t>(owner >> 32);
  if (owner == 0 || pid <= 0) return Claimer::kGone;
  const ProcessStatus st = read_process_status(pid);
  // Not known (this process cannot read /proc now: its fd limit): alive, and waited for.
  if (st.unknown) return Claimer::kStopped;
  if (st.start_time == 0 || (st.start_time & 0xffffffffu) != (owner & 0xffffffffu))
    return Claimer::kGone;
  if (st.stopped) return Claimer::kStopped;
  for (const auto& w : r.waiting)
    if (w.load() == (pos & kPosMask) + 1) return Claimer::kWaiting;
  return r.overflow.load() != 0 ? Claimer::kWaiting : Claimer::kRunning;
}

void Ring::watch_claim(std::uint64_t pos, std::uint64_t word, Claimer claimer) {
  // A look at most kClaimWatchStep of time apart from the last counts that long: the time
  // between two calls of a caller that returned in between is not watched time.
  // The time adds up across words until a report (a peer may swap the process a forged
  // claim names); after one, another word there (the reported one written back, or
  // replaced) starts afresh: a later honest claim there is not judged by the forged one's
  // time.
  ClaimWatch& watch = t_claim_watch;
  const auto now = Clock::now();
  if (watch.handle != local_->id || watch.pos != pos ||
      (watch.reported != 0 && watch.reported != word)) {
    watch = {local_->id, pos, now, {}, 0};
    return;
  }
  const Clock::duration step = std::min<Clock::duration>(now - watch.last, kClaimWatchStep);
  watch.last = now;
  if (claimer != Claimer::kRunning) return;
  watch.stood += step;
  if (watch.stood < kClaimStuckAfter) return;
  watch.reported = word;
  stuck_claim(pos, word,
              holder_of(word) < kHolderRecords ? header()->holders[holder_of(word)].owner.load()
                                               : 0);
}

void Ring::watch_claim(std::uint64_t pos) {
  const std::uint64_t w = load_word(pos);
  if (pos_of(w) != (pos & kPosMask) || (state_of(w) != kWriting && state_of(w) != kReading))
    return;
  if (const Claimer claimer = look_at_claimer(pos, w); claimer != Claimer::kGone)
    watch_claim(pos, w, claimer);
}

namespace {
void decrement_to_zero(std::atomic<std::uint32_t>& n) noexcept {
  std::uint32_t v = n.load();
  while (v != 0 && !n.compare_exchange_weak(v, v - 1)) {
  }
}
}  // namespace

void Ring::start_waiting(std::uint32_t who, std::uint64_t pos) noexcept {
  RingHeader* h = header();
  if (who >= kHolderRecords) {
    h->nobody_waiting.fetch_add(1);
    return;
  }
  HolderRecord& r = h->holders[who];
  for (auto& w : r.waiting) {
    std::uint64_t none = 0;
    if (w.compare_exchange_strong(none, (pos & kPosMask) + 1)) return;
  }
  r.overflow.fetch_add(1);  // more threads of ours wait with claims than the record names
}

void Ring::stop_waiting(std::uint64_t pos) noexcept {
  const std::uint64_t c = local_->claim.load(std::memory_order_acquire);
  if (claim_generation(c) != fork_generation()) return;
  RingHeader* h = header();
  if (claim_holder(c) >= kHolderRecords) {
    decrement_to_zero(h->nobody_waiting);
    return;
  }
  HolderRecord& r = h->holders[claim_holder(c)];
  for (auto& w : r.waiting) {
    std::uint64_t mine = (pos & kPosMask) + 1;
    if (w.compare_exchange_strong(mine, 0)) return;
  }
  decrement_to_zero(r.overflow);
}

void Ring::idle_scan() noexcept {
  // A sleep with nothing published: messages a peer hid behind a head hint it moved forward
  // are looked for, with a scan of the slot words, at most once a second per handle (a
  // scan reads every written slot's line).
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
  //
  // Each word says where the tail T is at least: past a claimed position p, or past p - n
  // for a free one (p - n was claimed or stepped over); T is the highest of those. A word
  // for another slot's index or past kPosLimit is a peer's and is not followed. Any other
  // word is, however far above the rest: tail hints a peer moved ahead again and again leave
  // one slot claimed lap after lap while the skipped slots keep their first lap's words, so
  // an honest word can be laps above every other (docs/transport.md, "The highest word
  // leads").
  RingHeader* h = header();
  const std::uint64_t n = slot_count_;
  // The hints before the scan, and only those are replaced: a claim or a take that moves a
  // hint while the scan runs makes the CAS fail, so a scan older than the hint never pulls
  // it back (claims and takes only move the words forward: an honest hint read before the
  // scan is never ahead of what the scan finds).
  const std::uint64_t tail0 = load_hint(h->tail);
  const std::uint64_t head0 = load_hint(h->head);
  std::vector<std::uint64_t> words;
  // The memfd's pages that hold data: a slot in a hole was never written (its word is zero,
  // free for its index's position: ring_layout.h), and is not read, which would allocate
  // its page (a tmpfs page is allocated on a read fault too).
  std::vector<std::pair<std::size_t, std::size_t>> extents;
  try {
    words.resize(n);
    extents = data_extents(fd_.get(), slots_offset_, slots_offset_ + n * slot_bytes_);
  } catch (const std::bad_alloc&) {
    return false;  // no memory: the hints stay; the next call looks again
  }
  bool any = false;
  auto extent = extents.begin();
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::size_t at = slots_offset_ + i * slot_bytes_;
    while (extent != extents.end() && extent->second <= at) ++extent;
    const bool written = extent != extents.end() && extent->first <= at;
    words[i] = written ? load_word(i) : pack(i, kFree);
    const std::uint64_t p = pos_of(words[i]);
    if ((p & (n - 1)) == i && p < kPosLimit)
      any = true;
    else
      words[i] = ~std::uint64_t{0};  // not counted
  }
  if (!any) return false;  // every word is a peer's: nothing says where to go
  auto counted = [](std::uint64_t w) { return w != ~std::uint64_t{0}; };
  std::uint64_t tail = 0;
  for (const std::uint64_t w : words) {
    if (!counted(w)) continue;
    const std::uint64_t p = pos_of(w);
    if (state_of(w) != kFree)
      tail = std::max(tail, p + 1);
    else if (p >= n)
      tail = std::max(tail, p - n + 1);
  }
  // The oldest position published or being written among those words, at most a lap
  // behind the tail. A message published more than a lap behind it (claimed behind the head
  // after a peer moved the tail back, then passed by claims after a peer moved it forward)
  // is renumbered to its slot's position in the lap behind the tail, where the head finds
  // it: a message is never left where the next claim of its slot would free it.
  std::uint64_t head = tail;
  bool renumbered = false;
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t w = words[i];
    if ((state_of(w) != kReady && state_of(w) != kWriting) || !counted(w)) continue;
    std::uint64_t p = pos_of(w);
    if (p + n < tail) {
      if (state_of(w) == kWriting) continue;  // its commit publishes it; a later scan moves it
      const std::uint64_t lap_behind = tail - n + ((i - (tail - n)) & (n - 1));
      if (!renumber(i, w, lap_behind)) continue;  // taken meanwhile
      renumbered = true;
      p = lap_behind;
    }
    head = std::min(head, p);
  }
  // A hint ahead of the words is moved back (consumers and producers then step forward
  // over what was taken, one CAS a position); one behind is moved up to them (a head
  // behind slots freed laps ahead of it, after a peer moved it, would otherwise meet them).
  bool moved = false;
  std::uint64_t seen = tail0;
  if (seen != tail) moved |= h->tail.compare_exchange_strong(seen, tail);
  seen = head0;
  if (seen != head) moved |= h->head.compare_exchange_strong(seen, head);
  return moved || renumbered;
}

bool Ring::renumber(std::uint64_t pos, std::uint64_t word, std::uint64_t to) noexcept {
  // The same holder and epoch: only the position changes. A sleeping consumer is woken, as
  // for a publish.
  if (!cas_word(pos, word, pack(to, kReady, holder_of(word), epoch_of(word))))
    return false;
  header()->published.fetch_add(1);
  wake_consumers(1);
  return true;
}

void Ring::break_ring() {
  RingHeader* h = header();
  h->closed.fetch_or(kRingClosed | kRingBroken);
  h->published.fetch_add(1);
  h->freed.fetch_add(1);
  futex_wake(&h->published, INT_MAX);
  futex_wake(&h->freed, INT_MAX);
  throw_broken();
}

void Ring::release(std::uint64_t pos) noexcept {
  stop_waiting(pos);
  std::uint64_t w = load_word(pos);
  // Ours unless a peer wrote over it; then whatever is there stays for the checks of pop.
  if (pos_of(w) != (pos & kPosMask) || state_of(w) != kReading) return;
  if (cas_word(pos, w, pack(pos + slot_count_, kFree))) wake_producers();
}

void Ring::rewind_head(std::uint64_t pos) noexcept {
  RingHeader* h = header();
  for (std::uint64_t head = load_hint(h->head); head > pos; head = load_hint(h->head))
    if (h->head.compare_exchange_weak(head, pos)) return;
}

void Ring::unread(std::uint64_t pos) noexcept {
  stop_waiting(pos);
  RingHeader* h = header();
  std::uint64_t w = load_word(pos);
  if (pos_of(w) != (pos & kPosMask) || state_of(w) != kReading) return;
  if (!cas_word(pos, w, pack(pos, kReady))) return;
  rewind_head(pos);
  h->published.fetch_add(1);
  wake_consumers(INT_MAX);  // rare; and a connection's sleepers include poll() callers
}

Ring::SlotView Ring::inspect(std::uint64_t pos) const noexcept {
  const std::uint64_t w = load_word(pos);
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
  const std::uint64_t w = load_word(pos);
  // The tag as an atomic: the slot may move on meanwhile and a producer write it.
  return pos_of(w) == (pos & kPosMask) && (state_of(w) == kReading || state_of(w) == kReady) &&
         std::atomic_ref<std::uint32_t>(s->tag).load(std::memory_order_relaxed) == tag;
}

std::uint64_t Ring::abandoned() const noexcept { return header()->abandoned.load(); }

bool Ring::test_claim_and_abandon(bool as_consumer) {
  RingHeader* h = header();
  const auto [me, epoch] = holder();
  const std::uint64_t pos = load_hint(as_consumer ? h->head : h->tail);
  std::uint64_t w = load_word(pos);
  if (pos_of(w) != (pos & kPosMask) || state_of(w) != (as_consumer ? kReady : kFree)) return false;
  if (!cas_word(pos, w, pack(pos, as_consumer ? kReading : kWriting, me, epoch)))
    return false;
  std::uint64_t expected = pos;
  (as_consumer ? h->head : h->tail).compare_exchange_strong(expected, pos + 1);
  return true;
}

}  // namespace shmtensor::internal
