// Queue mechanism: a message ring in shared memory for the items (an item with fds is a
// datagram on a SOCK_SEQPACKET pair, announced by a marker in the ring), a readiness
// eventfd, and a sealed memfd control block for the item count (maxsize), the closed flag,
// the locks of the datagram path and the table of processes holding the queue — together an
// Endpoint (endpoint.h) and the queue's own words (queue_control.h). This file: puts and
// gets; queue_lifetime.cc: making, sending and dropping a queue; queue_places.cc: its
// places and holder slots.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "os/event_fd.h"
#include "os/futex.h"
#include "os/proc.h"
#include "os/socket.h"
#include "shmtensor/error.h"
#include "shmtensor/queue.h"
#include "transport/announced.h"
#include "transport/busy_poll.h"
#include "transport/queue_state.h"
#include "transport/receive_loop.h"
#include "wire/wire.h"

namespace shmtensor::internal {

TakenItem take_item(Ring& ring, const Deadline& deadline, std::shared_ptr<std::byte[]> buffer,
                    std::byte* at) {
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

namespace {

// Opt-in busy polling (busy_poll.h, poll_then_wait): looks at the ring without sleeping
// for up to the thread's budget, popping whenever its publish count moves, then waits as
// usual. `set`: the handle's own budget (nullopt: the process's).
TakenItem take_item_polling(Ring& ring, const Deadline& deadline,
                            std::optional<std::chrono::nanoseconds> set) {
  std::uint32_t seen = 0;
  return poll_then_wait(
      deadline, set,
      [&] {
        seen = ring.publish_count();
        return take_item(ring, Ring::kNoWait);
      },
      [&](std::chrono::steady_clock::time_point until) {
        return ring.spin_for_publish(seen, until);
      },
      [&] { return take_item(ring, deadline); });
}

}  // namespace

std::size_t QueueCore::put_many(std::span<Encoder> items,
                                std::optional<std::chrono::nanoseconds> timeout, bool counted,
                                DeferredWakes* defer) {
  const Deadline deadline = deadline_after(timeout);
  QueueControl* c = state_->control();
  Endpoint& endpoint = state_->endpoint;
  // Consumers asleep are woken once for the items published so far, at the end (or, with
  // `defer`, when its owner pays) and before any wait (for room, for the ring, for
  // send_lock): a consumer is never left asleep while this producer waits for it.
  std::size_t put = 0;
  OwedWake own;
  own.endpoint = &endpoint;
  OwedWake& owed = defer != nullptr ? defer->owe(endpoint) : own;
  struct PayAtEnd {
    OwedWake& own;
    ~PayAtEnd() { own.pay(); }  // also when an error ends the batch
  } pay_at_end{own};
  auto wake = [&]() noexcept {
    if (defer != nullptr) defer->pay();
    else own.pay();
  };
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
      wake();
      if (!admit(c, deadline, state_->slot, &place)) break;
    }
    try {
      OutgoingFrame frame = endpoint.frame(std::move(e));
      owed.before_publish();
      if (endpoint.fits_slot(frame)) {
        const auto parts = frame.parts();
        Ring::Status status = endpoint.push(parts, now);
        if (status == Ring::Status::kTimeout) {
          wake();
          owed.before_publish();
          status = endpoint.push(parts, deadline);
        }
        if (status == Ring::Status::kTimeout) break;
        if (status == Ring::Status::kClosed) throw QueueClosed("put() on a closed queue");
        frame.sent = true;  // the receiver now owns the in-flight counts
        ++owed.unwoken;
      } else {
        wake();
        owed.before_publish();
        const AnnouncedSend sent = endpoint.send_datagram(frame, deadline);
        if (sent == AnnouncedSend::kTimeout) break;
        if (sent == AnnouncedSend::kClosed) throw QueueClosed("put() on a closed queue");
      }
    } catch (const SystemError& err) {
      if (err.error_code() == EPIPE) throw QueueClosed("put() on a closed queue");
      throw;
    }
    place.sent();
    owed.unsignalled = true;
    task.counted = false;  // the item's, until its consumer's task_done()
    ++put;
  }
  return put;
}

namespace {

// The rest of a get once the item left the ring: frees its place, then parses it. Empty
// when the item is a marker whose datagram is behind one that another consumer holds past
// `deadline` (Endpoint::receive): the marker is back in the ring, and so is its place (the
// queue may then hold maxsize + 1 items until one is taken; the readiness fd says "ready"
// again before the place is back, which no reader of either can tell apart).
std::optional<Decoder> receive_taken(QueueCore::State& st, TakenItem&& t,
                                     const Deadline& deadline) {
  // The place is free once the item left the ring, before it is parsed: parsing may wait
  // seconds (mapping a named segment may have to start the manager daemon), and a consumer
  // SIGKILLed meanwhile would take the place with it. An item that fails to parse
  // (malformed, or a segment that cannot be mapped here) frees it all the same.
  // acq_rel (release_item): a producer that sees the freed place may reuse it.
  const bool freed = release_item(st.control());
  const Ring::Popped p{t.status, t.tag, t.size, t.pos};
  std::optional<Decoder> d = st.endpoint.receive(std::move(t.buffer), t.data, p, deadline);
  if (!d && freed) st.control()->count.fetch_add(1, std::memory_order_seq_cst);
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
    throw std::invalid_argument(
        "Queue::set_busy_poll: the budget must be from 0 to 1 second, not " +
        std::to_string(budget->count()) + " ns");
  state_->busy_poll_fork_generation.store(fork_generation(), std::memory_order_relaxed);
  state_->busy_poll_ns.store(budget ? budget->count() : -1, std::memory_order_relaxed);
}

std::optional<std::chrono::nanoseconds> QueueCore::busy_poll() const noexcept {
  return state_->busy_poll();
}

void QueueCore::set_spin_before_sleep(bool on) noexcept { state_->ring().set_spin_before_sleep(on); }

bool QueueCore::spins_before_sleep() const noexcept { return state_->ring().spins_before_sleep(); }

namespace {

// The next item off the ring (take_item_polling, with the handle's budget); false when the
// deadline passed first. Throws QueueClosed for a closed queue that is empty. `rearm`: the
// readiness fd is rearmed after the pop (get_many rearms once, at its end).
TakenItem next_item(QueueCore::State& st, const Deadline& deadline, bool rearm) {
  TakenItem t = take_item_polling(st.ring(), deadline, st.busy_poll());
  if (rearm) st.endpoint.rearm();
  if (t.status == Ring::Status::kClosed) throw QueueClosed("get() on a closed and empty queue");
  return t;
}

// The first item of a get (receive_loop.h): popped, received, popped again after a marker
// given back.
std::optional<Decoder> get_one(QueueCore::State& st, const Deadline& deadline, bool rearm) {
  return receive_retrying(
      deadline, [&] { return next_item(st, deadline, rearm); },
      [&](TakenItem&& t) { return receive_taken(st, std::move(t), deadline); });
}

}  // namespace

std::optional<Decoder> QueueCore::get(std::optional<std::chrono::nanoseconds> timeout) {
  rethrow_deferred();
  return get_one(*state_, deadline_after(timeout), /*rearm=*/true);
}

std::vector<Decoder> QueueCore::get_many(std::size_t max_items,
                                         std::optional<std::chrono::nanoseconds> timeout) {
  rethrow_deferred();
  std::vector<Decoder> out;
  if (max_items == 0) return out;
  struct Rearm {
    Endpoint& endpoint;
    ~Rearm() { endpoint.rearm(); }
  } rearm{state_->endpoint};
  // Before anything is taken: nothing below may fail between taking an item and keeping it.
  out.reserve(std::min<std::size_t>(max_items, 1024));
  std::optional<Decoder> first = get_one(*state_, deadline_after(timeout), /*rearm=*/false);
  if (!first) return out;
  out.push_back(std::move(*first));
  // The rest only if they are there already, copied from their slots into buffers of 64
  // slots each (one allocation per 64 items, not a 64 KiB receive buffer per item; none
  // when the ring looks empty).
  constexpr std::size_t kPerBuffer = 64;
  const std::size_t stride = state_->ring().max_message();
  std::shared_ptr<std::byte[]> buffer;
  std::size_t used = kPerBuffer;
  const Deadline no_wait = std::chrono::steady_clock::time_point{};
  try {
    while (out.size() < max_items && state_->ring().maybe_nonempty()) {
      if (used == kPerBuffer) {
        buffer.reset(new std::byte[kPerBuffer * stride]);
        used = 0;
      }
      // Room first: nothing may fail between taking an item and receiving it (a marker
      // taken stays claimed in our name until it is received).
      if (out.size() == out.capacity()) out.reserve(out.size() * 2);
      TakenItem t = take_item(state_->ring(), no_wait, buffer, buffer.get() + used * stride);
      if (t.status != Ring::Status::kOk) break;  // empty now (or closed: the next get says so)
      ++used;
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
  state_->ring().close();
  shutdown_write(state_->send_fd.get());
  // Wake producers waiting for room so they see `closed`.
  c->count.fetch_add(0, std::memory_order_acq_rel);
  futex_wake(&c->count, 0x7fffffff);
  // A closed queue is readable (get says QueueClosed once drained).
  signal_event_fd(state_->endpoint.ready_fd());
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
  // Counted once per handle, for good: nobody knows when its caller polls.
  if (!state_->readiness_counted.exchange(true, std::memory_order_acq_rel)) state_->endpoint.want();
  return state_->endpoint.ready_fd();
}

bool QueueCore::ready_now() noexcept { return state_->endpoint.ready_now(); }

void QueueCore::allow_dedicated_deposits(int segments, std::size_t bytes) noexcept {
  state_->endpoint.depot().allow_dedicated({segments, bytes});
}

QueueCore::FdCounts QueueCore::fd_counts() const noexcept {
  return state_->endpoint.depot().counts();
}

QueueCore::SharedFds QueueCore::shared_fds() const noexcept {
  return {state_->control_fd.get(), state_->ring().fd()};
}

bool QueueCore::closed() const noexcept {
  return state_->control()->closed.load(std::memory_order_acquire) != 0;
}

std::size_t QueueCore::size() const noexcept {
  return state_->control()->count.load(std::memory_order_relaxed);
}

std::size_t QueueCore::maxsize() const noexcept { return state_->control()->maxsize; }

}  // namespace shmtensor::internal
