// Places and holder slots of a queue (queue_state.h): `count` (the places taken, at most
// maxsize), the places a holder took whose items it has not sent (`sending`), the slots of
// the processes holding the queue, and JoinableQueue's unfinished tasks.
#include <algorithm>
#include <atomic>
#include <chrono>

#include "os/futex.h"
#include "os/proc.h"
#include "shmtensor/queue.h"
#include "transport/queue_state.h"

namespace shmtensor::internal {

namespace {

// Gives back the places that holders which died while sending took: their items never
// reached the socket. exchange() hands a dead slot's count to one reclaimer. If a new holder
// took the slot over in between (claim_holder), one of its own places may be given back
// early: one item more than maxsize may then be in the socket, never a place lost.
void reclaim_dead_senders(QueueControl* c) noexcept {
  for (int s = 0; s < kQueueHolderSlots; ++s) {
    if (c->sending[s].load(std::memory_order_relaxed) == 0) continue;
    const std::uint64_t owner = c->holders[s].load(std::memory_order_seq_cst);
    if (owner == 0 || slot_owner_alive(owner)) continue;
    for (std::uint32_t n = c->sending[s].exchange(0, std::memory_order_acq_rel); n > 0; --n)
      release_item(c);
  }
}

}  // namespace

// Frees one reserved item slot; never below 0 (a raw peer may send a datagram for which no
// producer reserved one).
// Returns whether it freed one (false: the count was 0 already).
bool release_item(QueueControl* c) noexcept {
  std::uint32_t n = c->count.load(std::memory_order_relaxed);
  while (n > 0 && !c->count.compare_exchange_weak(n, n - 1, std::memory_order_seq_cst)) {
  }
  if (n == 0) return false;
  // seq_cst store of count (above) then load of waiters, against admit's seq_cst increment
  // of waiters then the kernel's read of count in FUTEX_WAIT: either we see the waiter, or
  // its FUTEX_WAIT sees the new count and does not sleep.
  if (c->maxsize && c->waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&c->count, 1);
  return true;
}

// One unfinished task fewer (task_done(), or a put that published nothing); join()s asleep
// are woken when none is left. False, and nothing changes, when there was none.
bool finish_task(QueueControl* c) noexcept {
  std::uint32_t n = c->unfinished.load(std::memory_order_relaxed);
  do {
    if (n == 0) return false;
  } while (!c->unfinished.compare_exchange_weak(n, n - 1, std::memory_order_seq_cst));
  // As release_item: the seq_cst decrement, then the look at joiners, against join()'s
  // seq_cst increment of joiners, then the kernel's read of the word in FUTEX_WAIT.
  if (n == 1 && c->joiners.load(std::memory_order_seq_cst) != 0)
    futex_wake(&c->unfinished, 0x7fffffff);
  return true;
}

// Takes a free holder slot for `owner`; -1 (and the overflow flag) if none is free.
int claim_holder(QueueControl* c, std::uint64_t owner) noexcept {
  for (int s = 0; s < kQueueHolderSlots; ++s) {
    std::uint64_t expected = 0;
    if (c->holders[s].compare_exchange_strong(expected, owner, std::memory_order_seq_cst)) return s;
  }
  // None is free: take over the slot of a holder that died (a SIGKILLed process never frees
  // its slot, so a long job that forks and kills workers would otherwise run out). One CAS
  // from the dead owner's value decides who; the winner first gives back the places the
  // dead one held unsent.
  for (int s = 0; s < kQueueHolderSlots; ++s) {
    std::uint64_t dead = c->holders[s].load(std::memory_order_seq_cst);
    if (dead == 0 || slot_owner_alive(dead)) continue;
    if (!c->holders[s].compare_exchange_strong(dead, owner, std::memory_order_seq_cst)) continue;
    for (std::uint32_t n = c->sending[s].exchange(0, std::memory_order_acq_rel); n > 0; --n)
      release_item(c);
    return s;
  }
  c->overflow.store(1, std::memory_order_seq_cst);
  return -1;
}

// Sleeps on `word` while it holds `seen`, for at most 50 ms and until the deadline, counted
// in `sleepers` (whoever changes the word calls FUTEX_WAKE only while that is not 0). False,
// without sleeping, when the deadline has passed.
bool sleep_slice(std::atomic<std::uint32_t>* word, std::uint32_t seen,
                 std::atomic<std::uint32_t>* sleepers, const Deadline& deadline) {
  std::chrono::nanoseconds left = std::chrono::milliseconds(50);
  if (deadline) {
    const auto until = *deadline - std::chrono::steady_clock::now();
    if (until <= until.zero()) return false;
    left = std::min(left, std::chrono::duration_cast<std::chrono::nanoseconds>(until));
  }
  sleepers->fetch_add(1, std::memory_order_seq_cst);
  futex_wait(word, seen, left);
  sleepers->fetch_sub(1, std::memory_order_relaxed);
  return true;
}

namespace {

// Waits until a bounded queue has room (an unbounded one always has), or the deadline
// passed (false). Throws QueueClosed.
bool wait_for_room(QueueControl* c, const Deadline& deadline, std::uint32_t* seen) {
  const auto maxsize = static_cast<std::uint32_t>(c->maxsize);
  for (;;) {
    if (c->closed.load(std::memory_order_acquire)) throw QueueClosed("put() on a closed queue");
    const std::uint32_t n = c->count.load(std::memory_order_acquire);
    if (maxsize == 0 || n < maxsize) {
      *seen = n;
      return true;
    }
    reclaim_dead_senders(c);
    // Waits are sliced: close() wakes the futex but does not change `count`, so a close()
    // that lands between our check of `closed` and the wait would otherwise wake nobody.
    if (!sleep_slice(&c->count, n, &c->waiters, deadline)) return false;
  }
}

}  // namespace

// Admission, decided before the item is framed (so a refused put moves nothing into shared
// memory): the queue must be open and, when bounded, have room. Takes the item's place for
// holder slot `slot` by CAS on `count` (acq_rel pairs with a consumer's release of a
// place), so at most maxsize items are ever in the socket; an unbounded queue just counts.
// Throws QueueClosed; false when the deadline passed first.
bool admit(QueueControl* c, const Deadline& deadline, int slot, ItemPlace* place) {
  for (;;) {
    std::uint32_t n = 0;
    if (!wait_for_room(c, deadline, &n)) return false;
    if (c->count.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) {
      place->take(c, slot);
      return true;
    }
  }
}

bool QueueCore::wait_for_room(std::optional<std::chrono::nanoseconds> timeout) {
  std::uint32_t n = 0;
  return internal::wait_for_room(state_->control(), deadline_after(timeout), &n);
}

}  // namespace shmtensor::internal
