// Broadcast (include/shmtensor/broadcast.h): a control block (broadcast_control.h) and one
// bounded queue per reader (queue.h), of which the writer is the one producer. A message is
// put to every reader's queue or to none: the writer first waits until each queue has room
// (it alone fills them, so the room stays), then puts a copy to each. Each copy is framed
// as a Queue frames it, so a tensor's block is one for all the readers, held by one
// in-flight count per reader's copy. Readers wait in Queue::get (busy poll, spin, futex),
// in slices, between which they look at whether the writer lives.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "os/futex.h"
#include "os/mapping.h"
#include "os/proc.h"
#include "os/shm.h"
#include "os/unique_fd.h"
#include "shmtensor/broadcast.h"
#include "shmtensor/error.h"
#include "shmtensor/queue.h"
#include "transport/broadcast_control.h"
#include "transport/channel.h"

namespace shmtensor::internal {

namespace {

constexpr std::size_t kMaxDepth = 4096;
// How long a reader's get() waits in its queue before it looks at the writer again, and
// the writer's wait for room before it looks at the slow reader again.
constexpr std::chrono::milliseconds kLookEvery{100};
// A reader's busy-poll budget (busy_poll.h): it adapts down to 1/64 of this when messages
// come further apart, so a reader at a slow cadence spends little polling.
constexpr std::chrono::microseconds kReaderPoll{50};
// The highest pid Linux hands out (PID_MAX_LIMIT).
constexpr std::uint64_t kPidLimit = 4194304;
// Longer than an honest drop of a reader's messages takes (at most `depth` parses, each of
// which waits at most 1 s for a depot's lock).
constexpr std::chrono::seconds kDroppingLimit{2};

int owner_pid(std::uint64_t owner) noexcept { return static_cast<int>(owner >> 32); }

// What the reader's encoded form says about which queues follow.
constexpr std::uint32_t kAllReaders = 0xffffffffu;

}  // namespace

struct BroadcastCore::State {
  UniqueFd control_fd;
  Mapping control_map;
  int readers = 0;
  std::size_t depth = 0;
  std::uint64_t writer = 0;  // as read at creation or decode
  int carried = -1;          // the reader whose queue alone this handle has; -1: all
  std::vector<std::shared_ptr<QueueCore>> queues;
  // Per reader: the slot_owner this process attached as (0: not attached here). A forked
  // child's copy names its parent, so it attaches anew.
  std::mutex attach_mu;
  std::vector<std::uint64_t> attached;
  BroadcastControl* control() const {
    return reinterpret_cast<BroadcastControl*>(control_map.data());
  }

  [[noreturn]] void fail(const std::string& what) const {
    control()->broken.store(1, std::memory_order_seq_cst);
    throw ProtocolError("Broadcast: " + what + " (a peer wrote its shared memory)");
  }
  void check_broken() const {
    if (control()->broken.load(std::memory_order_acquire) != 0)
      throw ProtocolError("Broadcast is broken: a process found words in its shared memory "
                          "that no honest peer writes");
  }
  // A reader slot's value, validated: a marker, or a slot_owner with a possible pid.
  std::uint64_t reader_word(int i) const {
    const std::uint64_t v = control()->reader[i].load(std::memory_order_seq_cst);
    if (v > kReaderDropping && (owner_pid(v) <= 0 || static_cast<std::uint64_t>(owner_pid(v)) >
                                                         kPidLimit))
      fail("reader " + std::to_string(i) + "'s slot holds " + std::to_string(v));
    return v;
  }
  QueueCore& queue(int i) const {
    if (i < 0 || i >= readers || !queues[static_cast<std::size_t>(i)])
      throw std::out_of_range("Broadcast: this handle has no reader " + std::to_string(i));
    return *queues[static_cast<std::size_t>(i)];
  }
  // Drops reader i's unread messages (their blocks' holds are given back as each is
  // dropped) once this process moved its slot from `from` to kReaderDropping, then marks
  // the slot left. Messages that cannot be parsed are dropped as well.
  void drop_messages(int i, std::uint64_t from) {
    std::uint64_t expected = from;
    if (!control()->reader[i].compare_exchange_strong(expected, kReaderDropping,
                                                      std::memory_order_seq_cst))
      return;
    QueueCore& q = queue(i);
    for (;;) {
      try {
        if (!q.get(std::chrono::nanoseconds(0))) break;
      } catch (const QueueClosed&) {
        break;
      } catch (const Error&) {
      }
    }
    control()->reader[i].store(kReaderLeft, std::memory_order_seq_cst);
  }
  // Attaches this process as reader i (once per process). False when the deadline passed
  // while another process dropped the slot's messages; a slot that stays "dropping" longer
  // than any drop takes (kDroppingLimit) was written by a peer.
  bool attach(int i, const Deadline& deadline) {
    const std::uint64_t me = current_slot_owner();
    std::lock_guard lock(attach_mu);
    if (attached[static_cast<std::size_t>(i)] == me) {
      if (reader_word(i) != me)
        fail("reader " + std::to_string(i) + "'s slot no longer names its process");
      return true;
    }
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      std::uint64_t v = reader_word(i);
      if (v == kReaderDropping) {
        const auto now = std::chrono::steady_clock::now();
        if (now - start > kDroppingLimit)
          fail("reader " + std::to_string(i) + "'s slot stayed 'dropping' for 2 s");
        if (deadline && now >= *deadline) return false;
        // Another process drops the slot's messages: a millisecond's sleep (ended early
        // only by the broken flag).
        futex_wait(&control()->broken, 0, std::chrono::milliseconds(1));
        check_broken();
        continue;
      }
      if (v != kReaderNone && v != kReaderLeft) {
        if (slot_owner_alive(v))
          throw std::logic_error("Broadcast reader " + std::to_string(i) +
                                 " is attached in another process (pid " +
                                 std::to_string(owner_pid(v)) + ")");
        drop_messages(i, v);  // a dead reader's: dropped, then the slot is left
        continue;
      }
      if (control()->reader[i].compare_exchange_strong(v, me, std::memory_order_seq_cst)) break;
    }
    attached[static_cast<std::size_t>(i)] = me;
    queue(i).set_busy_poll(kReaderPoll);
    return true;
  }
  bool writer_alive() const {
    const std::uint64_t w = control()->writer;
    if (w != writer) fail("its writer word changed");
    return slot_owner_alive(w);
  }
};

std::shared_ptr<BroadcastCore> BroadcastCore::create(int readers, std::size_t depth) {
  if (readers < 1 || readers > kBroadcastMaxReaders)
    throw std::invalid_argument("Broadcast: readers must be 1 to " +
                                std::to_string(kBroadcastMaxReaders) + ", not " +
                                std::to_string(readers));
  if (depth < 1 || depth > kMaxDepth)
    throw std::invalid_argument("Broadcast: depth must be 1 to " + std::to_string(kMaxDepth) +
                                ", not " + std::to_string(depth));
  auto st = std::make_unique<State>();
  st->control_fd = create_sealed_memfd(sizeof(BroadcastControl));
  st->control_map =
      Mapping::map_shared(st->control_fd.get(), sizeof(BroadcastControl), "broadcast control");
  BroadcastControl* c = st->control();
  c->layout_version = kBroadcastLayoutVersion;
  c->size_of = sizeof(BroadcastControl);
  c->readers = static_cast<std::uint32_t>(readers);
  c->depth = static_cast<std::uint32_t>(depth);
  c->writer = current_slot_owner();
  c->broken.store(0, std::memory_order_relaxed);
  for (auto& r : c->reader) r.store(kReaderNone, std::memory_order_relaxed);
  std::atomic_ref<std::uint64_t>(c->magic).store(kBroadcastMagic, std::memory_order_release);
  st->readers = readers;
  st->depth = depth;
  st->writer = c->writer;
  for (int i = 0; i < readers; ++i) st->queues.push_back(QueueCore::create(depth));
  st->attached.assign(static_cast<std::size_t>(readers), 0);
  return std::make_shared<BroadcastCore>(std::move(st));
}

std::shared_ptr<BroadcastCore> BroadcastCore::from_parts(
    int control_fd, std::vector<std::shared_ptr<QueueCore>> queues, int reader) {
  auto st = std::make_unique<State>();
  st->control_fd.reset(control_fd);
  const FdFacts facts = inspect_fd(st->control_fd.get());
  if (!facts.sealed_against_resize || facts.size != sizeof(BroadcastControl))
    throw ProtocolError("received broadcast control block has the wrong size or is not sealed");
  st->control_map =
      Mapping::map_shared(st->control_fd.get(), sizeof(BroadcastControl), "broadcast control");
  const BroadcastControl* c = st->control();
  const std::uint32_t readers = c->readers;
  const std::uint32_t depth = c->depth;
  const std::uint64_t writer = c->writer;
  if (std::atomic_ref<const std::uint64_t>(c->magic).load(std::memory_order_acquire) !=
          kBroadcastMagic ||
      c->layout_version != kBroadcastLayoutVersion || c->size_of != sizeof(BroadcastControl) ||
      readers < 1 || readers > kBroadcastMaxReaders || depth < 1 || depth > kMaxDepth ||
      owner_pid(writer) <= 0 || static_cast<std::uint64_t>(owner_pid(writer)) > kPidLimit ||
      queues.size() != readers || reader < -1 || reader >= static_cast<int>(readers))
    throw ProtocolError("received broadcast control block is invalid");
  for (std::size_t i = 0; i < queues.size(); ++i) {
    const bool carried = reader < 0 || static_cast<int>(i) == reader;
    if (carried != static_cast<bool>(queues[i]) ||
        (queues[i] && queues[i]->maxsize() != depth))
      throw ProtocolError("received broadcast's queues do not match its control block");
  }
  st->readers = static_cast<int>(readers);
  st->depth = depth;
  st->writer = writer;
  st->carried = reader;
  st->queues = std::move(queues);
  st->attached.assign(readers, 0);
  return std::make_shared<BroadcastCore>(std::move(st));
}

// Encoded: the control block's fd, which reader's queue follows (kAllReaders: every
// reader's, in order), then the queue(s).
void BroadcastCore::encode(Encoder& e, int reader) const {
  state_->check_broken();
  e.write_fd(state_->control_fd.get());
  e.write_pod<std::uint32_t>(reader < 0 ? kAllReaders : static_cast<std::uint32_t>(reader));
  if (reader >= 0) {
    state_->queue(reader).encode(e);
    return;
  }
  for (int i = 0; i < state_->readers; ++i) state_->queue(i).encode(e);
}

std::shared_ptr<BroadcastCore> BroadcastCore::decode(Decoder& d) {
  UniqueFd control(d.take_fd());
  const auto which = d.read_pod<std::uint32_t>();
  if (which != kAllReaders && which >= static_cast<std::uint32_t>(kBroadcastMaxReaders))
    throw ProtocolError("received broadcast names reader " + std::to_string(which));
  // The count of queues comes from the control block, which from_parts validates; read it
  // here only to know how many follow.
  const FdFacts facts = inspect_fd(control.get());
  if (!facts.sealed_against_resize || facts.size != sizeof(BroadcastControl))
    throw ProtocolError("received broadcast control block has the wrong size or is not sealed");
  std::uint32_t readers = 0;
  {
    Mapping m = Mapping::map_shared(control.get(), sizeof(BroadcastControl), "broadcast control");
    readers = reinterpret_cast<const BroadcastControl*>(m.data())->readers;
  }
  if (readers < 1 || readers > kBroadcastMaxReaders ||
      (which != kAllReaders && which >= readers))
    throw ProtocolError("received broadcast control block is invalid");
  std::vector<std::shared_ptr<QueueCore>> queues(readers);
  if (which == kAllReaders) {
    for (auto& q : queues) q = QueueCore::decode(d);
  } else {
    queues[which] = QueueCore::decode(d);
  }
  return from_parts(control.release(), std::move(queues),
                    which == kAllReaders ? -1 : static_cast<int>(which));
}

BroadcastCore::BroadcastCore(std::unique_ptr<State> state) : state_(std::move(state)) {}

// A reader attached here leaves (its unread messages dropped); the writer's last handle
// closes the broadcast.
BroadcastCore::~BroadcastCore() {
  const std::uint64_t me = current_slot_owner();
  for (int i = 0; i < state_->readers; ++i) {
    if (state_->attached[static_cast<std::size_t>(i)] != me) continue;
    try {
      state_->drop_messages(i, me);
    } catch (const std::exception&) {
    }
  }
  if (state_->carried < 0 && state_->writer == me) close();
}

int BroadcastCore::readers() const noexcept { return state_->readers; }
int BroadcastCore::carried_reader() const noexcept { return state_->carried; }
std::size_t BroadcastCore::depth() const noexcept { return state_->depth; }
int BroadcastCore::control_fd() const noexcept { return state_->control_fd.get(); }

std::size_t BroadcastCore::behind(int reader) const { return state_->queue(reader).size(); }

int BroadcastCore::reader_pid(int reader) const noexcept {
  if (reader < 0 || reader >= state_->readers) return 0;
  const std::uint64_t v = state_->control()->reader[reader].load(std::memory_order_seq_cst);
  return v > kReaderDropping ? owner_pid(v) : 0;
}

void BroadcastCore::close() noexcept {
  for (auto& q : state_->queues)
    if (q) q->close();
}

void BroadcastCore::put(std::vector<Encoder>& messages,
                        std::optional<std::chrono::nanoseconds> timeout) {
  State& st = *state_;
  st.check_broken();
  if (st.carried >= 0 || st.writer != current_slot_owner())
    throw std::logic_error("Broadcast::put: only the process that made the broadcast puts");
  if (messages.size() != static_cast<std::size_t>(st.readers))
    throw std::invalid_argument("Broadcast::put: one encoded copy per reader");
  const Deadline deadline = deadline_after(timeout);
  std::vector<char> skip(static_cast<std::size_t>(st.readers), 0);
  for (int i = 0; i < st.readers; ++i) {
    for (;;) {
      const std::uint64_t v = st.reader_word(i);
      if (v == kReaderLeft || v == kReaderDropping) {
        skip[static_cast<std::size_t>(i)] = 1;
        break;
      }
      QueueCore& q = st.queue(i);
      auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kLookEvery);
      if (deadline) {
        const auto left = *deadline - std::chrono::steady_clock::now();
        slice = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(left),
                           std::chrono::nanoseconds(0), slice);
      }
      if (q.wait_for_room(std::chrono::nanoseconds(0))) break;
      if (v != kReaderNone && !slot_owner_alive(v)) {
        st.drop_messages(i, v);
        continue;
      }
      if (slice.count() == 0) {
        const std::size_t n = q.size();
        throw BroadcastTimeout("Broadcast::put timed out: reader " + std::to_string(i) +
                                   (v == kReaderNone ? std::string(" (not attached yet)")
                                                     : " (pid " + std::to_string(owner_pid(v)) +
                                                           ")") +
                                   " is " + std::to_string(n) + " messages behind",
                               i, v == kReaderNone ? 0 : owner_pid(v), n);
      }
      (void)q.wait_for_room(slice);
    }
  }
  for (int i = 0; i < st.readers; ++i) {
    if (skip[static_cast<std::size_t>(i)]) continue;
    // Room is there (only this writer fills the queue); a peer that forged the count
    // could make it wait: then the deadline holds.
    std::optional<std::chrono::nanoseconds> left;
    if (deadline)
      left = std::max(std::chrono::nanoseconds(0),
                      std::chrono::duration_cast<std::chrono::nanoseconds>(
                          *deadline - std::chrono::steady_clock::now()));
    if (!st.queue(i).put(std::move(messages[static_cast<std::size_t>(i)]), left)) {
      const std::uint64_t v = st.reader_word(i);
      throw BroadcastTimeout("Broadcast::put timed out: reader " + std::to_string(i) +
                                 "'s queue stayed full (the message went to readers 0 to " +
                                 std::to_string(i - 1) + ")",
                             i, v > kReaderDropping ? owner_pid(v) : 0, st.queue(i).size());
    }
  }
}

std::optional<Decoder> BroadcastCore::get(int reader,
                                          std::optional<std::chrono::nanoseconds> timeout) {
  State& st = *state_;
  st.check_broken();
  QueueCore& q = st.queue(reader);
  const Deadline deadline = deadline_after(timeout);
  if (!st.attach(reader, deadline)) return std::nullopt;
  for (;;) {
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kLookEvery);
    if (deadline) {
      const auto left = *deadline - std::chrono::steady_clock::now();
      slice = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(left),
                         std::chrono::nanoseconds(0), slice);
    }
    std::optional<Decoder> d = q.get(slice);
    st.check_broken();
    if (d) return d;
    (void)st.attach(reader, deadline);  // still ours (validated)
    if (!st.writer_alive() && q.size() == 0)
      throw QueueClosed("Broadcast: its writer (pid " + std::to_string(owner_pid(st.writer)) +
                        ") died and every message it put was taken");
    if (slice.count() == 0 || (deadline && std::chrono::steady_clock::now() >= *deadline))
      return std::nullopt;
  }
}

}  // namespace shmtensor::internal
