// A queue's lifetime (queue_state.h): made (create), sent to another process and received
// there (encode, decode: a copy in flight holds the queue), held by processes (one holder
// slot each, taken over by a forked child at fork), and drained by the last holder's drop.
//
// Why a holder table: an item that is put carries counts in shared memory (its blocks'
// in-flight counts, a named segment's refcount). Closing sockets does not give them back,
// so an item never received would pin its memory until its creator exits. The process that
// drops the last live hold of a queue therefore drains it (receives every item left and
// drops it), which gives the counts back. "Last" is decided from the table: one slot per
// holding process, keyed by pid + start time like arena slots, plus a count of encoded
// copies of the queue that are inside messages not yet received (docs/transport.md).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "memory/channel_registry.h"
#include "os/event_fd.h"
#include "os/fork_handlers.h"
#include "os/mapping.h"
#include "os/proc.h"
#include "os/shm.h"
#include "os/socket.h"
#include "shmtensor/error.h"
#include "shmtensor/queue.h"
#include "transport/announced.h"
#include "transport/queue_state.h"
#include "wire/wire.h"

namespace shmtensor::internal {

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
        if (!st->control()->holders[st->slot].compare_exchange_strong(parent, me,
                                                                      std::memory_order_seq_cst)) {
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
      TakenItem t = take_item(st.ring(), std::chrono::steady_clock::now());
      if (t.status != Ring::Status::kOk) break;
      release_item(c);
      if (t.tag == kRingMessageTag) {
        const SegmentFetcher depot = st.endpoint.depot().fetcher();
        (void)parse_frame(std::span(t.data, t.size), {}, t.buffer, &depot);
      } else if (t.tag == kRingMarkerTag) {
        t.buffer.reset();
        const SegmentFetcher depot = st.endpoint.depot().fetcher();
        const AnnouncedPath path = st.endpoint.path(&depot);
        // Nobody else holds the queue: an earlier marker held past the drain's deadline was
        // a peer's, and what is left is dropped with the socket.
        if (markers_stuck) {  // its datagram, if any, goes with the socket below
          st.ring().release(t.pos);
          continue;
        }
        std::optional<Datagram> d;
        try {
          d = take_announced(path, t.pos, until);
        } catch (const ProtocolError&) {
          // Behind a marker a peer claimed (its marker given back: the next pop takes it
          // again), or its datagram missing: the rest go with the socket below.
          markers_stuck = true;
          continue;
        }
        if (!d) {
          markers_stuck = std::chrono::steady_clock::now() >= *until;
          continue;
        }
        drop_datagram(path, std::move(*d));
      }
    } catch (...) {
      // A broken ring throws at every pop once it is empty: nothing more comes from it. Nor
      // does one whose pop throws past the drain's deadline (a claim a peer wrote at the
      // head is reported at every look): what is left goes with the socket below.
      if (st.ring().broken() || std::chrono::steady_clock::now() >= *until) break;
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
    const SegmentFetcher depot = st.endpoint.depot().fetcher();
    drop_datagram(st.endpoint.path(&depot),
                  std::move(d));  // dropping it gives back what it adopted
  }
}

UniqueFd make_ready_fd() { return make_event_fd("a queue's readiness fd", "raise `ulimit -n`"); }

}  // namespace

QueueCore::QueueCore(std::unique_ptr<State> state) : state_(std::move(state)) {
  register_live(state_.get());
}

QueueCore::~QueueCore() {
  unregister_live(state_.get());
  // First the name, so that nobody opens a queue about to be drained. A name another
  // process holds now (unlinked, then created again) is not ours to remove.
  if (!state_->name.empty() && state_->name_owner == own_pid()) {
    try {
      unlink_channel(state_->name, state_->name_token);
    } catch (...) {
    }
  }
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

std::shared_ptr<QueueCore> QueueCore::create(std::size_t maxsize, bool joinable) {
  if (maxsize > 0x7fffffff)
    throw std::invalid_argument("Queue maxsize " + std::to_string(maxsize) +
                                " is larger than 2147483647 (2^31 - 1)");
  auto st = std::make_unique<State>();
  auto [a, b] = seqpacket_pair();
  st->send_fd = std::move(a);
  st->recv_fd = std::move(b);
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
  st->bind(Ring::create(kQueueRingSlots, kQueueRingSlotBytes), make_ready_fd());
  st->slot = claim_holder(c, current_slot_owner());
  std::atomic_ref<std::uint64_t>(c->magic).store(kQueueMagic, std::memory_order_release);
  return std::make_shared<QueueCore>(std::move(st));
}

namespace {

// The five fds of an encoded queue, in encode()'s order.
constexpr std::size_t kQueueFds = 5;

// A handle from a queue's five fds (a message's, or the manager's for a named queue),
// validated. in_flight_copy: the fds came in a message that encode() counted.
std::shared_ptr<QueueCore> attach(std::array<UniqueFd, kQueueFds> fds, bool in_flight_copy);

}  // namespace

std::shared_ptr<QueueCore> QueueCore::decode(Decoder& d, bool counted) {
  // Each fd is owned at once, so a message missing the later ones leaks none.
  std::array<UniqueFd, kQueueFds> fds;
  for (auto& fd : fds) fd.reset(d.take_fd());
  return attach(std::move(fds), counted);
}

std::shared_ptr<QueueCore> QueueCore::create_named(const std::string& name, std::size_t maxsize,
                                                   bool joinable) {
  std::shared_ptr<QueueCore> q = create(maxsize, joinable);
  State& st = *q->state_;
  const int fds[kQueueFds] = {st.send_fd.get(), st.recv_fd.get(), st.control_fd.get(),
                              st.ring().fd(), st.endpoint.ready_fd()};
  st.name_token = publish_channel(name, ChannelKind::kQueue, fds, {});
  st.name = name;
  st.name_owner = own_pid();
  return q;
}

std::shared_ptr<QueueCore> QueueCore::open_named(const std::string& name) {
  OpenedChannel ch = open_channel(name, ChannelKind::kQueue);
  if (ch.fds.size() != kQueueFds || !ch.bytes.empty())
    throw ProtocolError("the named queue \"" + name + "\" came with " +
                        std::to_string(ch.fds.size()) + " fds and " +
                        std::to_string(ch.bytes.size()) + " bytes, not a queue's 5 and 0");
  std::array<UniqueFd, kQueueFds> fds;
  for (std::size_t i = 0; i < kQueueFds; ++i) fds[i] = std::move(ch.fds[i]);
  // The manager's copy was never counted in flight: the creator holds the queue while the
  // name lives.
  return attach(std::move(fds), false);
}

void QueueCore::unlink_named(const std::string& name) { unlink_channel(name); }

QueueCore::NamedFacts QueueCore::inspect_named(const std::string& name) {
  OpenedChannel ch = open_channel(name, ChannelKind::kQueue, true);
  if (ch.fds.size() != kQueueFds)
    throw ProtocolError("the named queue \"" + name + "\" came with " +
                        std::to_string(ch.fds.size()) + " fds, not a queue's 5");
  const int control_fd = ch.fds[2].get();
  FdFacts facts = inspect_fd(control_fd);
  if (!facts.sealed_against_resize || facts.size != sizeof(QueueControl))
    throw ProtocolError("the named queue's control block has the wrong size or is not sealed");
  Mapping map = Mapping::map_shared(control_fd, sizeof(QueueControl), "queue control");
  auto* c = reinterpret_cast<QueueControl*>(map.data());
  if (std::atomic_ref<std::uint64_t>(c->magic).load(std::memory_order_acquire) !=
      kQueueMagic)
    throw ProtocolError("the named queue's control block is invalid");
  NamedFacts f;
  f.size = c->count.load(std::memory_order_relaxed);
  f.maxsize = c->maxsize;
  for (const auto& h : c->holders) {
    const std::uint64_t owner = h.load(std::memory_order_relaxed);
    if (owner != 0 && slot_owner_alive(owner))
      f.holders.push_back(static_cast<std::int32_t>(owner >> 32));
  }
  std::sort(f.holders.begin(), f.holders.end());
  f.holders.erase(std::unique(f.holders.begin(), f.holders.end()), f.holders.end());
  return f;
}

namespace {

std::shared_ptr<QueueCore> attach(std::array<UniqueFd, kQueueFds> fds, bool in_flight_copy) {
  auto st = std::make_unique<QueueCore::State>();
  st->send_fd = std::move(fds[0]);
  st->recv_fd = std::move(fds[1]);
  st->control_fd = std::move(fds[2]);
  UniqueFd ring_fd = std::move(fds[3]);
  UniqueFd ready_fd = std::move(fds[4]);
  // A peer could send another kind of fd, or a blocking one (os/event_fd.h).
  require_event_fd(ready_fd.get(), "queue readiness");
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
  Ring ring = Ring::attach(std::move(ring_fd));
  if (ring.slot_count() != kQueueRingSlots || ring.slot_bytes() != kQueueRingSlotBytes)
    throw ProtocolError("received queue ring has another geometry than a queue's");
  st->bind(std::move(ring), std::move(ready_fd));
  // Our slot first, then the message's in-flight count back (see ~QueueCore). Never below
  // 0: a raw peer may send a queue nobody counted.
  st->slot = claim_holder(c, current_slot_owner());
  std::uint32_t n = in_flight_copy ? c->in_flight.load(std::memory_order_seq_cst) : 0;
  while (n > 0 && !c->in_flight.compare_exchange_weak(n, n - 1, std::memory_order_seq_cst)) {
  }
  return std::make_shared<QueueCore>(std::move(st));
}

}  // namespace

void QueueCore::encode(Encoder& e) const {
  e.write_fd(state_->send_fd.get());
  e.write_fd(state_->recv_fd.get());
  e.write_fd(state_->control_fd.get());
  e.write_fd(state_->ring().fd());
  e.write_fd(state_->endpoint.ready_fd());
  // A copy of the queue is in flight until a process decodes it: no one may drain it
  // meanwhile. If the message is never sent, the count is taken back.
  state_->control()->in_flight.fetch_add(1, std::memory_order_seq_cst);
  CodecAccess::state(e).undo_if_unsent.push_back([core = shared_from_this()] {
    core->state_->control()->in_flight.fetch_sub(1, std::memory_order_seq_cst);
  });
}

}  // namespace shmtensor::internal
