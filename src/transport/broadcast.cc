// Broadcast (include/shmtensor/broadcast.h): a control block (broadcast_control.h) and one
// bounded queue per reader (queue.h), of which the writer is the one producer. A message is
// put to every reader's queue or to none: the writer first waits until each queue has room
// (it alone fills them, so the room stays), then puts a copy to each. Each copy is framed
// as a Queue frames it, so a tensor's block is one for all the readers, held by one
// in-flight count per reader's copy. Readers wait in Queue::get (busy poll, spin, futex),
// in slices, between which they look at whether the writer lives.
#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shmtensor/broadcast.h"
#include "transport/broadcast_state.h"
#include "transport/endpoint.h"
#include "transport/ring_local.h"

namespace shmtensor::internal {

int BroadcastCore::readers() const noexcept { return state_->readers; }
int BroadcastCore::carried_reader() const noexcept { return state_->carried; }
std::size_t BroadcastCore::depth() const noexcept { return state_->depth; }
int BroadcastCore::control_fd() const noexcept { return state_->control_fd.get(); }
QueueCore& BroadcastCore::queue(int reader) const { return state_->queue(reader); }

std::size_t BroadcastCore::behind(int reader) const { return state_->queue(reader).size(); }

int BroadcastCore::reader_pid(int reader) const noexcept {
  if (reader < 0 || reader >= state_->readers) return 0;
  const std::uint64_t v = state_->control()->reader[reader].load(std::memory_order_seq_cst);
  return v > kReaderLeft && !is_reader_dropping(v) ? owner_pid(v) : 0;
}

void BroadcastCore::close() noexcept {
  for (auto& q : state_->queues)
    if (q) q->close();
}

bool BroadcastCore::State::drop_messages(int i, std::uint64_t from) {
  const std::uint64_t mine = reader_dropping(current_slot_owner());
  std::uint64_t expected = from;
  if (!control()->reader[i].compare_exchange_strong(expected, mine, std::memory_order_seq_cst))
    return false;
  QueueCore& q = queue(i);
  // A message that cannot be parsed is consumed, so errors in a row mean the queue itself
  // is broken (a broken ring, a forged lock): the drop stops there. A dropper killed in
  // the middle leaves what a consumer killed in a get leaves, which the queue repairs.
  int errors_in_a_row = 0;
  while (errors_in_a_row < kDropErrorsInARow) {
    try {
      if (!q.get(std::chrono::nanoseconds(0))) break;
      errors_in_a_row = 0;
    } catch (const QueueClosed&) {
      break;
    } catch (const Error&) {
      ++errors_in_a_row;
    }
  }
  expected = mine;
  (void)control()->reader[i].compare_exchange_strong(expected, kReaderLeft,
                                                     std::memory_order_seq_cst);
  return true;
}

bool BroadcastCore::State::attach(int i, const Deadline& deadline) {
  const auto at = static_cast<std::size_t>(i);
  std::lock_guard lock(attach_mu);
  const std::uint32_t generation = fork_generation();
  // Attached in this very process (a forked child's copy names its parent: it attaches anew).
  if (attached[at] != 0 && attached_in[at] == generation) {
    if (reader_word(i) != attached[at])
      fail("reader " + std::to_string(i) + "'s slot no longer names its process");
    return true;
  }
  const std::uint64_t me = current_slot_owner();
  if (attached[at] == me) {
    attached_in[at] = generation;
    if (reader_word(i) != me)
      fail("reader " + std::to_string(i) + "'s slot no longer names its process");
    return true;
  }
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::uint64_t v = reader_word(i);
    if (drop_if_dead(i, v)) continue;  // a dead reader's or dead dropper's: dropped here
    if (is_reader_dropping(v)) {
      // A live process drops the slot's messages: a millisecond's sleep (ended early only
      // by the broken flag), then a look again.
      const auto now = std::chrono::steady_clock::now();
      if (deadline && now >= *deadline) return false;
      if (!deadline && now - start > kBroadcastDroppingLimit)
        throw ProtocolError("Broadcast: reader " + std::to_string(i) +
                            "'s messages are still being dropped by pid " +
                            std::to_string(owner_pid(reader_dropper(v))) + " after " +
                            std::to_string(kBroadcastDroppingLimit.count()) +
                            " s (a wedged process, or a peer wrote its id there)");
      futex_wait(&control()->broken, 0, std::chrono::milliseconds(1));
      check_broken();
      continue;
    }
    if (v != kReaderNone && v != kReaderLeft)
      throw std::logic_error("Broadcast reader " + std::to_string(i) +
                             " is attached in another process (pid " +
                             std::to_string(owner_pid(v)) + ")");
    if (control()->reader[i].compare_exchange_strong(v, me, std::memory_order_seq_cst)) break;
  }
  attached[at] = me;
  attached_in[at] = generation;
  // Where the writer and the readers outnumber the CPUs this process may run on, a reader
  // neither busy-polls nor spins before it sleeps: a reader spinning after its message
  // keeps a CPU from the next reader being woken (3 readers on 2 CPUs: delivery p50 36.8 ->
  // 23.4-28.6 µs; docs/benchmarks.md, "Broadcast (1 → N)").
  const int cpus = allowed_cpus();
  const bool spare_cpu = cpus == 0 || cpus > readers;
  queue(i).set_busy_poll(spare_cpu ? kBroadcastReaderPoll : std::chrono::microseconds(0));
  queue(i).set_spin_before_sleep(spare_cpu);
  predict.store(spare_cpu, std::memory_order_relaxed);
  return true;
}

bool BroadcastCore::State::wait_for_reader(int i, const Deadline& deadline,
                                           std::chrono::steady_clock::time_point now) {
  auto& looked = looked_at[static_cast<std::size_t>(i)];
  for (;;) {
    const std::uint64_t v = reader_word(i);
    if (v == kReaderLeft) return false;
    if (is_reader_dropping(v)) {
      if (drop_if_dead(i, v)) continue;  // its dropper died: the drop is taken over
      return false;                      // a live process drops it
    }
    QueueCore& q = queue(i);
    const bool room = q.wait_for_room(std::chrono::nanoseconds(0));
    // A dead reader is looked for when its queue is full, and before that at a bounded
    // rate (more often once it is half full), so its messages' blocks come back early.
    if (v != kReaderNone &&
        (!room || now - looked >= (q.size() * 2 > depth ? kBroadcastLivenessBusy
                                                         : kBroadcastLivenessEvery))) {
      looked = now;
      if (drop_if_dead(i, v)) continue;
    }
    if (room) return true;
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kBroadcastLookEvery);
    if (deadline) {
      const auto left = *deadline - std::chrono::steady_clock::now();
      slice = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(left),
                         std::chrono::nanoseconds(0), slice);
    }
    if (slice.count() == 0) {
      const std::size_t n = q.size();
      throw BroadcastTimeout(
          "Broadcast::put timed out: reader " + std::to_string(i) +
              (v == kReaderNone ? std::string(" (not attached yet)")
                                : " (pid " + std::to_string(owner_pid(v)) + ")") +
              " is " + std::to_string(n) + " messages behind; the message went to no reader",
          i, v == kReaderNone ? 0 : owner_pid(v), n);
    }
    (void)q.wait_for_room(slice);
    now = std::chrono::steady_clock::now();
  }
}

namespace {

// "readers 0, 2 and 5" (or "reader 3", or "no reader").
std::string reader_list(const std::vector<int>& readers) {
  if (readers.empty()) return "no reader";
  std::string out = readers.size() == 1 ? "reader " : "readers ";
  for (std::size_t k = 0; k < readers.size(); ++k) {
    if (k > 0) out += k + 1 == readers.size() ? " and " : ", ";
    out += std::to_string(readers[k]);
  }
  return out;
}

}  // namespace

void BroadcastCore::put(std::vector<Encoder>& messages,
                        std::optional<std::chrono::nanoseconds> timeout) {
  State& st = *state_;
  st.check_broken();
  if (!st.is_writer())
    throw std::logic_error("Broadcast::put: only the process that made the broadcast puts");
  if (messages.size() != static_cast<std::size_t>(st.readers))
    throw std::invalid_argument("Broadcast::put: one encoded copy per reader");
  const Deadline deadline = deadline_after(timeout);
  st.looked_at.resize(static_cast<std::size_t>(st.readers));
  // First every reader's queue has room (only this writer fills them, so the room stays),
  // then a copy goes to each: every reader gets the message or none does.
  const auto now = std::chrono::steady_clock::now();
  std::vector<char> deliver(static_cast<std::size_t>(st.readers), 0);
  for (int i = 0; i < st.readers; ++i)
    deliver[static_cast<std::size_t>(i)] = st.wait_for_reader(i, deadline, now) ? 1 : 0;
  std::vector<int> got, missed;
  // Published to every reader first, then each reader asleep woken: a reader polling gets
  // its copy without waiting for the others' wakes (a put that must wait wakes them first).
  DeferredWakes wakes(static_cast<std::size_t>(st.readers));
  for (int i = 0; i < st.readers; ++i) {
    if (!deliver[static_cast<std::size_t>(i)]) continue;
    std::optional<std::chrono::nanoseconds> left;
    if (deadline) {
      left = std::chrono::duration_cast<std::chrono::nanoseconds>(
          *deadline - std::chrono::steady_clock::now());
      if (!got.empty()) left = std::max(*left, std::chrono::nanoseconds(kBroadcastDeliverGrace));
      left = std::max(*left, std::chrono::nanoseconds(0));
    }
    if (st.queue(i).put(std::move(messages[static_cast<std::size_t>(i)]), left, false, &wakes))
      got.push_back(i);
    else
      missed.push_back(i);
  }
  wakes.pay();
  if (missed.empty()) return;
  const int first = missed.front();
  const std::uint64_t v = st.reader_word(first);
  const bool attached = v > kReaderLeft && !is_reader_dropping(v);
  throw BroadcastTimeout("Broadcast::put timed out: the queue" +
                             std::string(missed.size() == 1 ? " of " : "s of ") +
                             reader_list(missed) + (missed.size() == 1 ? " had" : " each had") +
                             " room and still took no copy by the deadline (a forged count "
                             "or lock, or a full socket buffer); the message went to " +
                             reader_list(got) + ", not to " + reader_list(missed),
                         first, attached ? owner_pid(v) : 0, st.queue(first).size(), got);
}

namespace {

using Clock = std::chrono::steady_clock;

std::int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The reader's wait when its next message can be predicted (kBroadcastSpinAhead): nullopt
// when none came in the window (or none is predicted), and the caller waits as before.
std::optional<Decoder> wait_predicted(BroadcastCore::State::Cadence& c, QueueCore& q,
                                      const Deadline& deadline) {
  const std::int64_t due_ns = c.due();
  if (due_ns == 0) return std::nullopt;
  const Clock::time_point due = Clock::time_point(std::chrono::nanoseconds(due_ns));
  Clock::time_point until = due + kBroadcastSpinAfter;
  if (deadline) until = std::min(until, *deadline);
  Clock::time_point now = Clock::now();
  if (now < due - kBroadcastSpinAhead) {
    // Not past one look's slice: the writer's death is looked for as often as ever.
    if (due - kBroadcastSpinAhead - now > kBroadcastLookEvery) return std::nullopt;
    if (std::optional<Decoder> d = q.get(due - kBroadcastSpinAhead - now)) return d;
    now = Clock::now();
  }
  while (now < until) {
    if (std::optional<Decoder> d = q.get(std::chrono::nanoseconds(0))) return d;
    for (int k = 0; k < 16; ++k) ring_detail::pause_cpu();
    now = Clock::now();
  }
  return std::nullopt;
}

std::optional<Decoder> arrived(BroadcastCore::State::Cadence& c, std::optional<Decoder> d) {
  c.arrived(ns_of(Clock::now()));
  return d;
}

}  // namespace

std::optional<Decoder> BroadcastCore::get(int reader,
                                          std::optional<std::chrono::nanoseconds> timeout) {
  State& st = *state_;
  st.check_broken();
  QueueCore& q = st.queue(reader);
  const Deadline deadline = deadline_after(timeout);
  if (!st.attach(reader, deadline)) return std::nullopt;
  State::Cadence& cadence = st.cadence[static_cast<std::size_t>(reader)];
  if (st.predict.load(std::memory_order_relaxed) && (!timeout || timeout->count() > 0)) {
    std::optional<Decoder> d = wait_predicted(cadence, q, deadline);
    st.check_broken();
    if (d) return arrived(cadence, std::move(d));
  }
  for (;;) {
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kBroadcastLookEvery);
    if (deadline) {
      const auto left = *deadline - Clock::now();
      slice = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(left),
                         std::chrono::nanoseconds(0), slice);
    }
    std::optional<Decoder> d = q.get(slice);
    st.check_broken();
    if (d) return arrived(cadence, std::move(d));
    (void)st.attach(reader, deadline);  // still ours (validated)
    if (!st.writer_alive()) {
      // Nothing more comes: one more look takes what it published before it died (a place
      // it took and never filled counts in size(), so size() cannot say this).
      if (std::optional<Decoder> last = q.get(std::chrono::nanoseconds(0))) return last;
      throw QueueClosed("Broadcast: its writer (pid " + std::to_string(owner_pid(st.writer)) +
                        ") died and every message it put was taken");
    }
    if (slice.count() == 0 || (deadline && Clock::now() >= *deadline)) return std::nullopt;
  }
}

}  // namespace shmtensor::internal
