// Queue mechanism: a message ring in shared memory for the items (an item with fds is a
// datagram on a SOCK_SEQPACKET pair, announced by a marker in the ring), a readiness
// eventfd, and a sealed memfd control block for the item count (maxsize), the closed flag,
// the locks of the datagram path and the table of processes holding the queue.
//
// Why a holder table: an item that is put carries counts in shared memory (its blocks'
// in-flight counts, a named segment's refcount). Closing sockets does not give them back,
// so an item never received would pin its memory until its creator exits. The process that
// drops the last live hold of a queue therefore drains it (receives every item left and
// drops it), which gives the counts back. "Last" is decided from the table: one slot per
// holding process, keyed by pid + start time like arena slots, plus a count of encoded
// copies of the queue that are inside messages not yet received (docs/transport.md).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <exception>
#include <thread>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "memory/registry.h"
#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/event_fd.h"
#include "os/fork_handlers.h"
#include "os/futex.h"
#include "os/mapping.h"
#include "os/proc.h"
#include "os/shm.h"
#include "os/socket.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/queue.h"
#include "transport/busy_poll.h"
#include "transport/announced.h"
#include "transport/channel.h"
#include "transport/depot.h"
#include "transport/queue_control.h"
#include "transport/ring.h"
#include "wire/wire.h"

namespace shmtensor::internal {


namespace {

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

// One item's place in the queue, taken at admission: given back unless sent() was called.
class ItemPlace {
 public:
  ItemPlace() noexcept = default;
  ItemPlace(const ItemPlace&) = delete;
  ItemPlace& operator=(const ItemPlace&) = delete;
  ~ItemPlace() {
    if (control_ == nullptr) return;
    done_sending();
    release_item(control_);
  }
  // `slot`: the taking process's holder slot (-1: it has none, and a death while sending
  // loses the place).
  void take(QueueControl* c, int slot) noexcept {
    control_ = c;
    slot_ = slot;
    if (slot_ >= 0) control_->sending[slot_].fetch_add(1, std::memory_order_acq_rel);
  }
  void sent() noexcept {
    done_sending();
    control_ = nullptr;
  }

 private:
  void done_sending() noexcept {
    if (slot_ < 0) return;
    // Never below 0: a reclaimer may have taken this count already (see above).
    auto& sending = control_->sending[slot_];
    std::uint32_t n = sending.load(std::memory_order_relaxed);
    while (n > 0 && !sending.compare_exchange_weak(n, n - 1, std::memory_order_acq_rel)) {
    }
  }
  QueueControl* control_ = nullptr;
  int slot_ = -1;
};

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

// Admission, decided before the item is framed (so a refused put moves nothing into shared
// memory): the queue must be open and, when bounded, have room. Takes the item's place for
// holder slot `slot` by CAS on `count` (acq_rel pairs with a consumer's release of a
// place), so at most maxsize items are ever in the socket; an unbounded queue just counts.
// Throws QueueClosed; false when the deadline passed first.
bool admit(QueueControl* c, const Deadline& deadline, int slot, ItemPlace* place) {
  const auto maxsize = static_cast<std::uint32_t>(c->maxsize);
  for (;;) {
    if (c->closed.load(std::memory_order_acquire)) throw QueueClosed("put() on a closed queue");
    std::uint32_t n = c->count.load(std::memory_order_acquire);
    if (maxsize == 0 || n < maxsize) {
      if (c->count.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) {
        place->take(c, slot);
        return true;
      }
      continue;
    }
    reclaim_dead_senders(c);
    // Waits are sliced: close() wakes the futex but does not change `count`, so a close()
    // that lands between our check of `closed` and the wait would otherwise wake nobody.
    if (!sleep_slice(&c->count, n, &c->waiters, deadline)) return false;
  }
}

}  // namespace

struct QueueCore::State {
  UniqueFd send_fd;
  UniqueFd recv_fd;
  UniqueFd control_fd;
  Mapping control_map;
  // Items without fds that fit a slot travel here; the others as datagrams, each announced
  // by a marker slot (docs/transport.md, "The message ring").
  Ring ring;
  // Readable while an item may be in the ring or the queue is closed, for poll/select
  // callers (multiprocessing.Pool waits on it); signalled only once `readiness_wanted`.
  UniqueFd ready_fd;
  int slot = -1;       // our holder slot (-1: none, overflow was set)
  int fork_slot = -1;  // claimed in prepare_fork for the child about to be forked
  // This handle's side of the queue's depot: the receive queue of the sending end (a
  // producer deposits by sending on the receiving end; nobody takes from the sending end's).
  DepotSide depot;
  // An error get_many() met after it had taken items: thrown by the next get or get_many.
  // One per item that failed, thrown one per call, oldest first. deferred_mu is held
  // across fork (fork handlers); a child starts with none (they are its parent's).
  std::mutex deferred_mu;
  std::deque<std::exception_ptr> deferred;
  std::atomic<bool> has_deferred{false};
  // wait_for_signallers' memory of a count left by producers that died (announced.h).
  std::atomic<std::uint32_t> stuck_signalling{0};
  // This handle's own busy-poll budget (set_busy_poll), in nanoseconds; -1: the process's.
  // It holds in the process that set it: a forked child (whose copy of this state is its
  // parent's) follows its own process's setting, as a process the queue is sent to does.
  std::atomic<std::int64_t> busy_poll_ns{-1};
  std::atomic<std::uint32_t> busy_poll_fork_generation{0};
  std::optional<std::chrono::nanoseconds> busy_poll() const {
    const std::int64_t ns = busy_poll_ns.load(std::memory_order_relaxed);
    if (ns < 0 || busy_poll_fork_generation.load(std::memory_order_relaxed) !=
                      internal::fork_generation())
      return std::nullopt;
    return std::chrono::nanoseconds(ns);
  }
  QueueControl* control() const { return reinterpret_cast<QueueControl*>(control_map.data()); }
  // The datagram path (transport/announced.h); `depot` is this handle's depot fetcher.
  AnnouncedPath path(const SegmentFetcher* depot = nullptr) {
    QueueControl* c = control();
    return {&ring, send_fd.get(), recv_fd.get(), &c->send_lock, &c->recv_lock,
            &c->taken_below, depot, "queue"};
  }
};

namespace {

// Every live QueueCore of this process, for the fork handlers. The mutex is held across
// fork (prepare → parent/child), so the child never inherits it locked by another thread.
std::mutex g_live_mu;
std::vector<QueueCore::State*>* g_live = nullptr;
std::uint64_t g_fork_owner = 0;  // the value prepare_fork put in the child's slots

void prepare_fork() noexcept {
  g_live_mu.lock();
  if (g_live == nullptr) return;
  // The child will hold every queue we hold. Its slot is taken now, in our name, so that no
  // holder of ours can see "no other holder" and drain between fork and the child's start.
  g_fork_owner = current_slot_owner();
  for (auto* st : *g_live) {
    st->deferred_mu.lock();  // held until after fork: no child inherits it locked
    st->fork_slot = claim_holder(st->control(), g_fork_owner);
  }
}

void parent_after_fork(bool /*fork_failed*/) noexcept {
  // The slot is the child's now. If the fork failed, it stays in our name until we exit:
  // that queue is then drained late, never too soon.
  if (g_live != nullptr)
    for (auto* st : *g_live) {
      st->fork_slot = -1;
      st->deferred_mu.unlock();
    }
  g_live_mu.unlock();
}

void child_after_fork() noexcept {
  if (g_live != nullptr) {
    const std::uint64_t me = current_slot_owner();  // recomputed: our pid changed
    for (auto* st : *g_live) {
      st->slot = std::exchange(st->fork_slot, -1);
      if (st->slot >= 0) {
        // A CAS: had the parent died already, its slot could have been taken over.
        std::uint64_t parent = g_fork_owner;
        if (!st->control()->holders[st->slot].compare_exchange_strong(
                parent, me, std::memory_order_seq_cst)) {
          st->slot = claim_holder(st->control(), me);
        }
      }
      st->deferred.clear();  // errors of items the parent took: the parent reports them
      st->has_deferred.store(false, std::memory_order_relaxed);
      st->deferred_mu.unlock();
    }
  }
  g_live_mu.unlock();
}

constexpr ForkHandlers kForkHandlers{prepare_fork, parent_after_fork, child_after_fork};

void register_live(QueueCore::State* st) {
  install_fork_handlers(ForkStage::kQueues, &kForkHandlers);
  std::lock_guard lock(g_live_mu);
  if (g_live == nullptr) g_live = new std::vector<QueueCore::State*>();  // never freed
  g_live->push_back(st);
}

void unregister_live(QueueCore::State* st) noexcept {
  std::lock_guard lock(g_live_mu);
  if (g_live == nullptr) return;
  std::erase(*g_live, st);
}


// One item taken off the ring, not parsed yet: its bytes at `data` (in `buffer`), or its
// datagram.
struct TakenItem {
  Ring::Status status = Ring::Status::kTimeout;
  std::shared_ptr<std::byte[]> buffer;
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::uint32_t tag = 0;
  std::uint64_t pos = 0;  // a marker's, whose slot stays claimed until released
};

// Into `at`, max_message() bytes of `buffer`; by default this thread's receive buffer.
TakenItem take_item(Ring& ring, const Deadline& deadline,
                    std::shared_ptr<std::byte[]> buffer = nullptr, std::byte* at = nullptr) {
  TakenItem t;
  if (buffer) {
    t.buffer = std::move(buffer);
    t.data = at;
  } else {
    t.buffer = receive_buffer();
    t.data = t.buffer.get();
  }
  Ring::Popped p = ring.pop(std::span(t.data, ring.max_message()), deadline, kRingMarkerTag);
  t.status = p.status;
  t.size = p.size;
  t.tag = p.tag;
  t.pos = p.pos;
  return t;
}

// Opt-in busy polling (busy_poll.h): looks at the ring without sleeping for up to the
// thread's budget, then waits as usual; the time to the item adapts the next budget.
// `set`: the handle's own budget (nullopt: the process's).
TakenItem take_item_polling(Ring& ring, const Deadline& deadline,
                            std::optional<std::chrono::nanoseconds> set) {
  using Clock = std::chrono::steady_clock;
  if (deadline && Clock::now() >= *deadline) return take_item(ring, deadline);
  const auto budget = busy_poll_budget(set);
  if (budget.count() <= 0) return take_item(ring, deadline);
  const auto start = Clock::now();
  auto until = start + std::chrono::duration_cast<Clock::duration>(budget);
  if (deadline) until = std::min(until, *deadline);
  // Pops when the ring's publish count moves, spinning on it in between.
  TakenItem t;
  for (;;) {
    const std::uint32_t seen = ring.publish_count();
    t = take_item(ring, Ring::kNoWait);
    // The clock before each spin: a publish count that keeps moving with nothing for us
    // must not keep us polling past the budget or the deadline.
    if (t.status != Ring::Status::kTimeout || Clock::now() >= until ||
        !ring.spin_for_publish(seen, until))
      break;
  }
  if (t.status == Ring::Status::kTimeout) t = take_item(ring, deadline);
  busy_poll_observe(t.status == Ring::Status::kTimeout
                        ? std::nullopt
                        : std::optional<std::chrono::nanoseconds>(Clock::now() - start),
                    set);
  return t;
}

// How long the last holder's drop may wait on the receive lock and for markers.
constexpr auto kDrainLimit = std::chrono::seconds(1);

// Receives and drops every item left, so their counts go back. Errors are skipped: what
// cannot be parsed cannot be given back either (it was malformed or is gone). Datagrams no
// marker announced (their producer was killed between send and marker) are taken last.
void drain(QueueCore::State& st) noexcept {
  auto* c = st.control();
  const Deadline until = std::chrono::steady_clock::now() + kDrainLimit;
  bool markers_stuck = false;  // past `until`: markers are dropped without their datagrams
  for (;;) {
    try {
      TakenItem t = take_item(st.ring, std::chrono::steady_clock::now());
      if (t.status != Ring::Status::kOk) break;
      release_item(c);
      if (t.tag == kRingMessageTag) {
        const SegmentFetcher depot = st.depot.fetcher();
        (void)parse_frame(std::span(t.data, t.size), {}, t.buffer, &depot);
      } else if (t.tag == kRingMarkerTag) {
        t.buffer.reset();
        const SegmentFetcher depot = st.depot.fetcher();
        const AnnouncedPath path = st.path(&depot);
        // Nobody else holds the queue: an earlier marker held past the drain's deadline was
        // a peer's, and what is left is dropped with the socket.
        if (markers_stuck) {  // its datagram, if any, goes with the socket below
          st.ring.release(t.pos);
          continue;
        }
        std::optional<Datagram> d = take_announced(path, t.pos, until);
        if (!d) {
          markers_stuck = std::chrono::steady_clock::now() >= *until;
          continue;
        }
        drop_datagram(path, std::move(*d));
      }
    } catch (...) {
    }
  }
  for (;;) {
    Datagram d;
    try {
      d = receive_datagram(st.recv_fd.get(), std::chrono::steady_clock::now());
    } catch (const ProtocolError&) {
      continue;  // taken, and lost
    } catch (...) {
      return;  // the socket itself failed: nothing more to read
    }
    if (d.status != RecvStatus::kOk) return;
    const SegmentFetcher depot = st.depot.fetcher();
    drop_datagram(st.path(&depot), std::move(d));  // dropping it gives back what it adopted
  }
}

}  // namespace

QueueCore::QueueCore(std::unique_ptr<State> state) : state_(std::move(state)) {
  register_live(state_.get());
}

QueueCore::~QueueCore() {
  unregister_live(state_.get());
  auto* c = state_->control();
  if (state_->slot >= 0) {
    std::uint64_t expected = c->holders[state_->slot].load(std::memory_order_relaxed);
    c->holders[state_->slot].compare_exchange_strong(expected, 0, std::memory_order_seq_cst);
  }
  // Last holder? In-flight copies first: a process that decodes one takes its slot before
  // it gives the in-flight count back, so if we read 0 here, its slot is visible below.
  if (c->overflow.load(std::memory_order_seq_cst) != 0) return;
  if (c->in_flight.load(std::memory_order_seq_cst) != 0) return;
  for (const auto& h : c->holders) {
    const std::uint64_t owner = h.load(std::memory_order_seq_cst);
    if (owner != 0 && slot_owner_alive(owner)) return;
  }
  drain(*state_);
}

namespace {

UniqueFd make_ready_fd() { return make_event_fd("a queue's readiness fd", "raise `ulimit -n`"); }

// Makes the readiness fd readable.
void signal_ready(const QueueCore::State& st) noexcept { signal_event_fd(st.ready_fd.get()); }

// After a put: signals the readiness fd when some process asked for it. The publish in the
// ring (a seq_cst read-modify-write) comes before this load, and rearm_ready's check of
// the ring comes after its seq_cst store: either the producer sees the flag, or the process
// that set it sees the item.
void notify_ready(const QueueCore::State& st) noexcept {
  if (st.control()->readiness_wanted.load(std::memory_order_seq_cst) != 0) signal_ready(st);
}

// After a get (or when the fd is asked for): the fd stays readable while the ring may hold
// an item or the queue is closed, and is cleared otherwise. Cleared first and the ring
// looked at after, so that an item published in between signals again (by its producer, or
// here).
void rearm_ready(QueueCore::State& st) noexcept {
  const QueueControl* c = st.control();
  if (c->readiness_wanted.load(std::memory_order_seq_cst) == 0) return;
  if (st.ring.has_ready() || c->closed.load(std::memory_order_seq_cst) != 0) return;
  wait_for_signallers(c->signalling, st.stuck_signalling);
  drain_event_fd(st.ready_fd.get());
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (st.ring.has_ready() || c->closed.load(std::memory_order_seq_cst) != 0)
    signal_ready(st);
}

}  // namespace

std::shared_ptr<QueueCore> QueueCore::create(std::size_t maxsize, bool joinable) {
  if (maxsize > 0x7fffffff)
    throw std::invalid_argument("Queue maxsize " + std::to_string(maxsize) +
                                " is larger than 2147483647 (2^31 - 1)");
  auto st = std::make_unique<State>();
  auto [a, b] = seqpacket_pair();
  st->send_fd = std::move(a);
  st->recv_fd = std::move(b);
  st->ring = Ring::create(kQueueRingSlots, kQueueRingSlotBytes);
  st->ready_fd = make_ready_fd();
  st->control_fd = create_sealed_memfd(sizeof(QueueControl));
  st->control_map =
      Mapping::map_shared(st->control_fd.get(), sizeof(QueueControl), "queue control");
  auto* c = st->control();
  c->layout_version = kQueueLayoutVersion;
  c->size_of = sizeof(QueueControl);
  c->maxsize = maxsize;
  c->count.store(0, std::memory_order_relaxed);
  c->closed.store(0, std::memory_order_relaxed);
  c->in_flight.store(0, std::memory_order_relaxed);
  c->overflow.store(0, std::memory_order_relaxed);
  c->waiters.store(0, std::memory_order_relaxed);
  c->readiness_wanted.store(0, std::memory_order_relaxed);
  c->signalling.store(0, std::memory_order_relaxed);
  c->unfinished.store(0, std::memory_order_relaxed);
  c->joiners.store(0, std::memory_order_relaxed);
  c->joinable = joinable ? 1 : 0;
  c->send_lock.state.store(0, std::memory_order_relaxed);
  c->recv_lock.state.store(0, std::memory_order_relaxed);
  c->taken_below = 0;
  for (auto& h : c->holders) h.store(0, std::memory_order_relaxed);
  for (auto& n : c->sending) n.store(0, std::memory_order_relaxed);
  init_depot(&c->depot);
  st->depot.bind(&c->depot, st->recv_fd.get(), &c->depot, st->send_fd.get());
  st->slot = claim_holder(c, current_slot_owner());
  std::atomic_ref<std::uint64_t>(c->magic).store(kQueueMagic, std::memory_order_release);
  return std::make_shared<QueueCore>(std::move(st));
}

std::shared_ptr<QueueCore> QueueCore::decode(Decoder& d) {
  // Each fd is owned at once, so a message missing the later ones leaks none.
  auto st = std::make_unique<State>();
  st->send_fd.reset(d.take_fd());
  st->recv_fd.reset(d.take_fd());
  st->control_fd.reset(d.take_fd());
  UniqueFd ring_fd(d.take_fd());
  st->ready_fd.reset(d.take_fd());
  // A peer could send another kind of fd, or a blocking one (os/event_fd.h).
  require_event_fd(st->ready_fd.get(), "queue readiness");
  FdFacts facts = inspect_fd(st->control_fd.get());
  if (!facts.sealed_against_resize || facts.size != sizeof(QueueControl))
    throw ProtocolError("received queue control block has the wrong size or is not sealed");
  st->control_map =
      Mapping::map_shared(st->control_fd.get(), sizeof(QueueControl), "queue control");
  auto* c = st->control();
  if (std::atomic_ref<std::uint64_t>(c->magic).load(std::memory_order_acquire) != kQueueMagic ||
      c->layout_version != kQueueLayoutVersion || c->size_of != sizeof(QueueControl) ||
      c->maxsize > 0x7fffffff || c->joinable > 1)
    throw ProtocolError("received queue control block is invalid");
  st->ring = Ring::attach(std::move(ring_fd));
  if (st->ring.slot_count() != kQueueRingSlots || st->ring.slot_bytes() != kQueueRingSlotBytes)
    throw ProtocolError("received queue ring has another geometry than a queue's");
  // Our slot first, then the message's in-flight count back (see ~QueueCore). Never below
  // 0: a raw peer may send a queue nobody counted.
  st->depot.bind(&c->depot, st->recv_fd.get(), &c->depot, st->send_fd.get());
  st->slot = claim_holder(c, current_slot_owner());
  std::uint32_t n = c->in_flight.load(std::memory_order_seq_cst);
  while (n > 0 && !c->in_flight.compare_exchange_weak(n, n - 1, std::memory_order_seq_cst)) {
  }
  return std::make_shared<QueueCore>(std::move(st));
}

std::size_t QueueCore::put_many(std::span<Encoder> items,
                               std::optional<std::chrono::nanoseconds> timeout, bool counted) {
  const Deadline deadline = deadline_after(timeout);
  QueueControl* c = state_->control();
  Ring& ring = state_->ring;
  const FdElision elision = state_->depot.elision();
  // Consumers asleep are woken once for the items published so far, at the end and
  // before any wait (for room, for the ring, for send_lock): a consumer is never left
  // asleep while this producer waits for it.
  std::size_t put = 0;
  // Items put and not signalled yet: consumers asleep on the ring, and the readiness fd
  // (a consumer may wait in poll() on it rather than in the ring).
  struct Batch {
    State& st;
    std::size_t& put;
    int unwoken = 0;
    std::size_t notified = 0;
    bool signalling = false;  // counted in the control block's `signalling`
    // Before each publish: counted from before the first one not signalled yet.
    void before_publish() noexcept {
      if (signalling) return;
      QueueControl* c = st.control();
      if (c->readiness_wanted.load(std::memory_order_relaxed) == 0) return;
      c->signalling.fetch_add(1, std::memory_order_seq_cst);
      signalling = true;
    }
    void wake() noexcept {
      st.ring.wake_consumers(unwoken);
      unwoken = 0;
      if (put > notified) notify_ready(st);
      notified = put;
      if (signalling) st.control()->signalling.fetch_sub(1, std::memory_order_seq_cst);
      signalling = false;
    }
    ~Batch() { wake(); }  // also when an error ends the batch
  } batch{*state_, put};
  // A deadline already past: a first try that does not wait (and reads no clock).
  const Deadline now = std::chrono::steady_clock::time_point{};
  // A JoinableQueue's item is an unfinished task from before it is published until it
  // is, or until its put gives up.
  struct Task {
    QueueControl* c;
    bool counted = false;
    void count(bool already) noexcept {
      if (c->joinable == 0) return;
      if (!already) c->unfinished.fetch_add(1, std::memory_order_seq_cst);
      counted = true;
    }
    ~Task() {
      if (counted) (void)finish_task(c);
    }
  };
  if (counted && items.size() != 1)
    throw std::invalid_argument("QueueCore::put_many: counted is for one item");
  for (Encoder& e : items) {
    // Counted (or taken over) before admission: a put refused there finishes it too.
    Task task{c};
    task.count(counted);
    ItemPlace place;
    if (!admit(c, now, state_->slot, &place)) {
      batch.wake();
      if (!admit(c, deadline, state_->slot, &place)) break;
    }
    try {
      OutgoingFrame frame = finish_frame(std::move(e), &elision);
      const auto parts = frame.parts();
      std::size_t size = 0;
      for (const auto& part : parts) size += part.size();
      batch.before_publish();
      if (frame.fds().empty() && size <= ring.max_message()) {
        Ring::Status status = ring.push_parts(parts, kRingMessageTag, now, Ring::Wake::kDeferred);
        if (status == Ring::Status::kTimeout) {
          batch.wake();
          batch.before_publish();
          status = ring.push_parts(parts, kRingMessageTag, deadline, Ring::Wake::kDeferred);
        }
        if (status == Ring::Status::kTimeout) break;
        if (status == Ring::Status::kClosed) throw QueueClosed("put() on a closed queue");
        frame.sent = true;  // the receiver now owns the in-flight counts
        ++batch.unwoken;
      } else {
        batch.wake();
        batch.before_publish();
        const SegmentFetcher depot = state_->depot.fetcher();  // for dead datagrams it drops
        const AnnouncedSend sent = send_announced(state_->path(&depot), frame, deadline);
        if (sent == AnnouncedSend::kTimeout) break;
        if (sent == AnnouncedSend::kClosed) throw QueueClosed("put() on a closed queue");
      }
    } catch (const SystemError& err) {
      if (err.error_code() == EPIPE) throw QueueClosed("put() on a closed queue");
      throw;
    }
    place.sent();
    task.counted = false;  // the item's, until its consumer's task_done()
    ++put;
  }
  return put;
}

namespace {

// The rest of a get once the item left the ring: frees its place, then parses it. Empty
// when the item is a marker whose datagram is behind one that another consumer holds past
// `deadline` (take_announced): the marker is back in the ring, and so is its place.
std::optional<Decoder> receive_taken(QueueCore::State& st, TakenItem&& t, const Deadline& deadline) {
  // The place is free once the item left the ring, before it is parsed: parsing may wait
  // seconds (mapping a named segment may have to start the manager daemon), and a consumer
  // SIGKILLed meanwhile would take the place with it. An item that fails to parse
  // (malformed, or a segment that cannot be mapped here) frees it all the same.
  // acq_rel (release_item): a producer that sees the freed place may reuse it.
  const bool freed = release_item(st.control());
  if (t.tag == kRingMessageTag) {
    const std::span<const std::byte> bytes(t.data, t.size);
    const SegmentFetcher depot = st.depot.fetcher();
    // Aliasing: the decoder keeps the whole buffer alive, and reads its own bytes.
    return parse_frame(bytes, {}, std::shared_ptr<const void>(std::move(t.buffer), t.data),
                       &depot);
  }
  if (t.tag != kRingMarkerTag)
    throw ProtocolError("a slot of the queue's ring has tag " + std::to_string(t.tag) +
                        ", neither an item nor a marker");
  t.buffer.reset();  // the datagram is received into the same per-thread buffer
  const SegmentFetcher depot = st.depot.fetcher();
  const AnnouncedPath path = st.path(&depot);
  std::optional<Datagram> datagram = take_announced(path, t.pos, deadline);
  if (!datagram) {
    // Its place again (the queue may hold maxsize + 1 items until one is taken), and a
    // readiness fd cleared meanwhile says "ready" again.
    if (freed) st.control()->count.fetch_add(1, std::memory_order_seq_cst);
    notify_ready(st);
    return std::nullopt;
  }
  Decoder d = parse_announced(path, std::move(*datagram));
  st.depot.pin_received(d);
  return d;
}

}  // namespace

void QueueCore::defer_error(std::exception_ptr error) noexcept {
  std::lock_guard lock(state_->deferred_mu);
  try {
    state_->deferred.push_back(std::move(error));
  } catch (...) {  // no memory for it: that error is lost, not the queue
  }
  state_->has_deferred.store(!state_->deferred.empty(), std::memory_order_release);
}

void QueueCore::rethrow_deferred() {
  if (!state_->has_deferred.load(std::memory_order_acquire)) return;
  std::exception_ptr error;
  {
    std::lock_guard lock(state_->deferred_mu);
    if (state_->deferred.empty()) return;
    error = std::move(state_->deferred.front());
    state_->deferred.pop_front();
    state_->has_deferred.store(!state_->deferred.empty(), std::memory_order_release);
  }
  std::rethrow_exception(error);
}

void QueueCore::set_busy_poll(std::optional<std::chrono::nanoseconds> budget) {
  if (budget && (budget->count() < 0 || *budget > std::chrono::seconds(1)))
    throw std::invalid_argument("Queue::set_busy_poll: the budget must be from 0 to 1 second, not " +
                                std::to_string(budget->count()) + " ns");
  state_->busy_poll_fork_generation.store(fork_generation(), std::memory_order_relaxed);
  state_->busy_poll_ns.store(budget ? budget->count() : -1, std::memory_order_relaxed);
}

std::optional<std::chrono::nanoseconds> QueueCore::busy_poll() const noexcept {
  return state_->busy_poll();
}

std::optional<Decoder> QueueCore::get(std::optional<std::chrono::nanoseconds> timeout) {
  rethrow_deferred();
  const Deadline deadline = deadline_after(timeout);
  for (;;) {
    TakenItem t = take_item_polling(state_->ring, deadline, state_->busy_poll());
    rearm_ready(*state_);
    if (t.status == Ring::Status::kTimeout) return std::nullopt;
    if (t.status == Ring::Status::kClosed) throw QueueClosed("get() on a closed and empty queue");
    if (std::optional<Decoder> d = receive_taken(*state_, std::move(t), deadline)) return d;
    if (!pop_again_after_give_back(deadline)) return std::nullopt;
  }
}

std::vector<Decoder> QueueCore::get_many(std::size_t max_items,
                                         std::optional<std::chrono::nanoseconds> timeout) {
  rethrow_deferred();
  std::vector<Decoder> out;
  if (max_items == 0) return out;
  struct Rearm {
    State& st;
    ~Rearm() { rearm_ready(st); }
  } rearm{*state_};
  // Before anything is taken: nothing below may fail between taking an item and keeping it.
  out.reserve(std::min<std::size_t>(max_items, 1024));
  const Deadline deadline = deadline_after(timeout);
  for (;;) {
    TakenItem first = take_item_polling(state_->ring, deadline, state_->busy_poll());
    if (first.status == Ring::Status::kTimeout) return out;
    if (first.status == Ring::Status::kClosed)
      throw QueueClosed("get() on a closed and empty queue");
    if (std::optional<Decoder> got = receive_taken(*state_, std::move(first), deadline)) {
      out.push_back(std::move(*got));
      break;
    }
    if (!pop_again_after_give_back(deadline)) return out;
  }
  // The rest only if they are there already, copied from their slots into buffers of 64
  // slots each (one allocation per 64 items, not a 64 KiB receive buffer per item; none
  // when the ring looks empty).
  constexpr std::size_t kPerBuffer = 64;
  const std::size_t stride = state_->ring.max_message();
  std::shared_ptr<std::byte[]> buffer;
  std::size_t used = kPerBuffer;
  const Deadline no_wait = std::chrono::steady_clock::time_point{};
  try {
    while (out.size() < max_items && state_->ring.maybe_nonempty()) {
      if (used == kPerBuffer) {
        buffer.reset(new std::byte[kPerBuffer * stride]);
        used = 0;
      }
      TakenItem t = take_item(state_->ring, no_wait, buffer, buffer.get() + used * stride);
      if (t.status != Ring::Status::kOk) break;  // empty now (or closed: the next get says so)
      ++used;
      if (out.size() == out.capacity()) out.reserve(out.size() * 2);
      std::optional<Decoder> next = receive_taken(*state_, std::move(t), no_wait);
      if (!next) break;  // behind another consumer's: the next get takes it
      out.push_back(std::move(*next));
    }
  } catch (...) {
    // An item consumed and not received (as by get()), a slot the ring refused, or no
    // memory: the items taken are returned, and the next get throws the error.
    defer_error(std::current_exception());
  }
  return out;
}

void QueueCore::close() noexcept {
  auto* c = state_->control();
  c->closed.store(1, std::memory_order_release);
  // Readers everywhere get QueueClosed once the ring is drained; writers are refused.
  state_->ring.close();
  shutdown_write(state_->send_fd.get());
  // Wake producers waiting for room so they see `closed`.
  c->count.fetch_add(0, std::memory_order_acq_rel);
  futex_wake(&c->count, 0x7fffffff);
  signal_ready(*state_);  // a closed queue is readable (get says QueueClosed once drained)
}

bool QueueCore::joinable() const noexcept { return state_->control()->joinable != 0; }

void QueueCore::begin_task() noexcept {
  QueueControl* c = state_->control();
  if (c->joinable != 0) c->unfinished.fetch_add(1, std::memory_order_seq_cst);
}

void QueueCore::abandon_task() noexcept {
  QueueControl* c = state_->control();
  if (c->joinable != 0) (void)finish_task(c);
}

void QueueCore::task_done() {
  QueueControl* c = state_->control();
  if (c->joinable == 0) throw std::logic_error("task_done() on a queue that is not joinable");
  if (!finish_task(c)) throw std::logic_error("task_done() called too many times");
}

bool QueueCore::join(std::optional<std::chrono::nanoseconds> timeout) {
  QueueControl* c = state_->control();
  if (c->joinable == 0) throw std::logic_error("join() on a queue that is not joinable");
  const Deadline deadline = deadline_after(timeout);
  for (;;) {
    const std::uint32_t n = c->unfinished.load(std::memory_order_seq_cst);
    if (n == 0) return true;
    // Sliced: a peer may write the word (the wait then re-reads it), and the slices keep
    // a wake-up lost to a task_done() SIGKILLed between its decrement and its wake short.
    if (!sleep_slice(&c->unfinished, n, &c->joiners, deadline)) return false;
  }
}

int QueueCore::readiness_fd() noexcept {
  state_->control()->readiness_wanted.store(1, std::memory_order_seq_cst);
  // Items put before the flag was seen signalled nothing: look now.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (state_->ring.maybe_nonempty() || closed()) signal_ready(*state_);
  return state_->ready_fd.get();
}

QueueCore::FdCounts QueueCore::fd_counts() const noexcept {
  return state_->depot.counts();
}

QueueCore::SharedFds QueueCore::shared_fds() const noexcept {
  return {state_->control_fd.get(), state_->ring.fd()};
}

bool QueueCore::closed() const noexcept {
  return state_->control()->closed.load(std::memory_order_acquire) != 0;
}

std::size_t QueueCore::size() const noexcept {
  return state_->control()->count.load(std::memory_order_relaxed);
}

std::size_t QueueCore::maxsize() const noexcept { return state_->control()->maxsize; }

void QueueCore::encode(Encoder& e) const {
  e.write_fd(state_->send_fd.get());
  e.write_fd(state_->recv_fd.get());
  e.write_fd(state_->control_fd.get());
  e.write_fd(state_->ring.fd());
  e.write_fd(state_->ready_fd.get());
  // A copy of the queue is in flight until a process decodes it: no one may drain it
  // meanwhile. If the message is never sent, the count is taken back.
  state_->control()->in_flight.fetch_add(1, std::memory_order_seq_cst);
  CodecAccess::state(e).undo_if_unsent.push_back([core = shared_from_this()] {
    core->state_->control()->in_flight.fetch_sub(1, std::memory_order_seq_cst);
  });
}

}  // namespace shmtensor::internal
