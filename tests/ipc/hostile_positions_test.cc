// Positions a peer cannot alias (docs/transport.md, "What a peer that writes the shared
// memory can do"): a peer that writes a ring's hints, one of its slot words, or a live
// thread's ids into a receive lock, as the outside probe of the transport did. An item a
// put or send acknowledged is received, or a call fails with a ProtocolError; a receive
// without a deadline fails within the documented bound; a forged slot word costs one call.
// Queue and Pipe, real processes (a forked bystander whose thread a forged lock names).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <string>
#include <thread>
#include <vector>

#include "os/mapping.h"
#include "os/shared_lock.h"
#include "os/unique_fd.h"
#include "shmtensor/connection.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/queue_core.h"
#include "shmtensor/queue.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/pipe.h"
#include "transport/link_control.h"
#include "transport/queue_control.h"
#include "transport/ring.h"
#include "transport/ring_layout.h"

namespace shmtensor {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using internal::Mapping;
using internal::Ring;
using testing::fork_child;
using testing::wait_child;
using testing::wait_child_within;

// What slot words keep of a position: 50 bits. A hint moved by this aliases its position.
constexpr std::uint64_t kAlias = std::uint64_t{1} << 50;

// A ring's whole memfd, mapped as a peer would map it.
class RingMemory {
 public:
  explicit RingMemory(int fd) {
    struct stat st {};
    EXPECT_EQ(::fstat(fd, &st), 0);
    map_ = Mapping::map_shared(fd, static_cast<std::size_t>(st.st_size), "test");
    const Ring ring = Ring::attach(internal::dup_cloexec(fd));
    slots_offset_ = ring.slots_offset();
    slot_bytes_ = ring.slot_bytes();
    slot_count_ = ring.slot_count();
  }
  std::atomic<std::uint64_t>& tail() { return word(Ring::kTailOffset); }
  std::atomic<std::uint64_t>& head() { return word(Ring::kHeadOffset); }
  // Writes the word of pos's slot as the ring keeps it (less its index's bias).
  void store_slot_word(std::uint64_t pos, std::uint64_t w) {
    const std::uint64_t index = pos % slot_count_;
    word(slots_offset_ + index * slot_bytes_).store(w - internal::ring_word::index_bias(index));
  }
  std::uint32_t slot_count() const { return slot_count_; }
  std::byte* user() { return map_.data() + offsetof(internal::RingHeader, user); }
  internal::HolderRecord& holder(std::uint32_t i) {
    return reinterpret_cast<internal::HolderRecord*>(
        map_.data() + offsetof(internal::RingHeader, holders))[i];
  }
  // A claim of `pos` in `state` that names the holder record of process `pid` with its
  // epoch, as the protocol writes one (pid 0: a process with no record, kNoHolder).
  std::uint64_t claim_by(pid_t pid, std::uint64_t pos, internal::ring_word::State state) {
    using namespace internal::ring_word;
    if (pid == 0) return pack(pos, state, internal::kNoHolder, 0);
    for (std::uint32_t i = 0; i < internal::kHolderRecords; ++i)
      if (holder(i).owner.load() >> 32 == static_cast<std::uint64_t>(pid))
        return pack(pos, state, i, holder(i).epoch.load());
    ADD_FAILURE() << "process " << pid << " holds no record of the ring";
    return 0;
  }

 private:
  std::atomic<std::uint64_t>& word(std::size_t offset) {
    return *reinterpret_cast<std::atomic<std::uint64_t>*>(map_.data() + offset);
  }
  Mapping map_;
  std::size_t slots_offset_ = 0;
  std::uint32_t slot_bytes_ = 0;
  std::uint32_t slot_count_ = 0;
};

int queue_ring_fd(Queue<std::string>& q) {
  return internal::QueueAccess::core(q).shared_fds().ring;
}
int queue_control_fd(Queue<std::string>& q) {
  return internal::QueueAccess::core(q).shared_fds().control;
}
// The ring a → b of a pipe (a's outgoing one, b's incoming one).
int pipe_ring_fd(const Connection& a) { return internal::ConnectionAccess::fds(a).at(2); }

// Items of both paths: small ones travel in a ring slot, big ones (larger than a slot) as a
// datagram announced by a marker slot.
std::string item(int i) {
  return i % 3 == 0 ? "big " + std::to_string(i) + std::string(1100, '.')
                    : "item " + std::to_string(i);
}
// What a receive returned, short enough for a failure message: its first words and size.
std::string label(const std::optional<std::string>& v) {
  return v ? v->substr(0, v->find('.')) + " (" + std::to_string(v->size()) + " bytes)" : "nothing";
}


class HostilePositionsTest : public testing::LeakCheckedTest {};

// The probe's first finding: the head moved by 2^50 made a consumer take the same marker
// again and again (try_get empty, no exception; get() without a deadline never returned).
TEST_F(HostilePositionsTest, AQueuesHeadMovedByTwoToTheFiftyLosesNothing) {
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  for (int i = 0; i < 12; ++i) q.put(item(i));
  EXPECT_EQ(label(q.try_get(2s)), label(item(0)));
  ring.head().fetch_add(kAlias);
  for (int i = 12; i < 24; ++i) q.put(item(i));
  // One producer, one consumer: every item, in order, none twice.
  for (int i = 1; i < 24; ++i) EXPECT_EQ(label(q.try_get(2s)), label(item(i))) << i;
  EXPECT_EQ(q.try_get(20ms), std::nullopt);
  // A get() without a deadline, in a child that is killed if it does not return.
  ring.head().fetch_add(3 * kAlias);
  q.put(item(24));
  const pid_t consumer = fork_child([&] {
    if (q.get() != item(24)) std::_Exit(3);
  });
  EXPECT_EQ(wait_child_within(consumer, 10s), 0) << "-1: get() did not return";
}

TEST_F(HostilePositionsTest, APipesHeadMovedByTwoToTheFiftyLosesNothing) {
  auto [a, b] = pipe();
  RingMemory ring(pipe_ring_fd(a));
  for (int i = 0; i < 12; ++i) a.send(item(i));
  EXPECT_EQ(label(b.recv<std::string>()), label(item(0)));
  ring.head().fetch_add(kAlias);
  for (int i = 12; i < 24; ++i) a.send(item(i));
  for (int i = 1; i < 24; ++i) EXPECT_EQ(label(b.recv<std::string>()), label(item(i))) << i;
  EXPECT_FALSE(b.poll());
  ring.head().fetch_add(kAlias);
  a.send(item(24));
  const pid_t receiver = fork_child([&] {
    if (b.recv<std::string>() != item(24)) std::_Exit(3);
  });
  EXPECT_EQ(wait_child_within(receiver, 10s), 0) << "-1: recv() did not return";
}

// The fourth finding: the tail moved by 2^50 lost items (each with an exception).
TEST_F(HostilePositionsTest, AQueuesTailMovedByTwoToTheFiftyLosesNothing) {
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  for (int i = 0; i < 12; ++i) q.put(item(i));
  EXPECT_EQ(label(q.try_get(2s)), label(item(0)));
  ring.tail().fetch_add(kAlias);
  for (int i = 12; i < 24; ++i) q.put(item(i));
  ring.tail().fetch_add(5 * kAlias);
  for (int i = 24; i < 36; ++i) q.put(item(i));
  for (int i = 1; i < 36; ++i) EXPECT_EQ(label(q.try_get(2s)), label(item(i))) << i;
  EXPECT_EQ(q.try_get(20ms), std::nullopt);
}

TEST_F(HostilePositionsTest, APipesTailMovedByTwoToTheFiftyLosesNothing) {
  auto [a, b] = pipe();
  RingMemory ring(pipe_ring_fd(a));
  for (int i = 0; i < 12; ++i) a.send(item(i));
  ring.tail().fetch_add(kAlias);
  for (int i = 12; i < 24; ++i) a.send(item(i));
  for (int i = 0; i < 24; ++i) EXPECT_EQ(label(b.recv<std::string>()), label(item(i))) << i;
  EXPECT_FALSE(b.poll());
}

// A ring of eight 64-byte slots whose messages are one byte, their id (tag 7), and the
// mapping of its shared words.
struct EightSlots {
  static constexpr std::uint64_t n = 8;
  Ring r = Ring::create(n, 64);
  RingMemory ring{r.fd()};
  std::vector<std::byte> out = std::vector<std::byte>(r.max_message());
  Ring::Status push(std::uint8_t id) {
    const std::byte msg[1] = {std::byte{id}};
    return r.push(msg, 7, Clock::now());
  }
  // The id and position of the message taken, nullopt when there is none.
  std::optional<std::pair<int, std::uint64_t>> pop() {
    const Ring::Popped p = r.pop(out, Clock::now());
    if (p.status != Ring::Status::kOk) return std::nullopt;
    EXPECT_EQ(p.size, 1u);
    return std::pair{static_cast<int>(out[0]), p.pos};
  }
};

// The fifth finding (fuzz_ring, repeated hint writes): the tail moved back onto a position
// the head had passed (a hole a forward move left), where a put claimed, then moved forward
// so that puts passed that message by more than a lap. The put that met its slot freed it
// ("slot word behind the tail", a ProtocolError) and the acknowledged message was lost.
// A message that far behind is renumbered forward now, and delivered. The ring alone, with
// eight slots: every step and position is the one the fuzzer found.
TEST_F(HostilePositionsTest, ATailMovedBackThenForwardPastAMessageLosesNothing) {
  EightSlots e;
  constexpr std::uint64_t n = EightSlots::n;
  RingMemory& ring = e.ring;
  auto push = [&](std::uint8_t id) { return e.push(id); };
  std::vector<int> got;
  std::vector<std::uint64_t> where;
  auto pop = [&] {
    const auto p = e.pop();
    if (!p) return false;
    got.push_back(p->first);
    where.push_back(p->second);
    return true;
  };
  using S = Ring::Status;
  ring.tail().store(n - 1);  // forward: positions 0..6 are holes
  ASSERT_EQ(push(1), S::kOk);
  ASSERT_EQ(push(2), S::kOk);
  EXPECT_EQ(ring.tail().load(), n + 1);
  ring.tail().store(4);  // back, onto a hole the head passed
  ASSERT_TRUE(pop());
  ASSERT_EQ(push(3), S::kOk);  // claimed at 4, behind the head
  ASSERT_TRUE(pop());
  ASSERT_EQ(push(4), S::kOk);  // at 5
  ring.tail().store(2 * n);  // forward again, more than a lap past messages 3 and 4
  for (std::uint8_t id = 5; id <= 8; ++id) ASSERT_EQ(push(id), S::kOk) << int{id};
  // Position 2n + 4 is message 3's slot: it is kept (moved to the lap behind the tail, where
  // the head finds it), so the ring is full there until it is taken.
  EXPECT_EQ(push(9), S::kTimeout);
  while (got.size() < 20 && pop()) {
  }
  for (std::uint8_t id = 9; id <= 12; ++id) ASSERT_EQ(push(id), S::kOk) << int{id};
  while (got.size() < 20 && pop()) {
  }
  // Every message once: 3 and 4 renumbered to the lap behind the tail, before 5..8.
  EXPECT_EQ(got, (std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(where, (std::vector<std::uint64_t>{7, 8, 12, 13, 16, 17, 18, 19, 20, 21, 22, 23}));
  EXPECT_EQ(e.r.pop(e.out, Clock::now()).status, S::kTimeout);
}

// A tail moved ahead again and again, a little each time (onto the next lap of the slot just
// used), and a head moved far ahead once: one slot is claimed lap after lap while the others
// keep their first lap's words, so the only published message's word is laps above every
// other. It leads (found by fuzz_ring: a rule that dropped a word two laps above every other
// dropped this one, and the pop that met it freed the message as corrupt).
TEST_F(HostilePositionsTest, ATailMovedALittleAheadAgainAndAgainLosesNothing) {
  EightSlots e;
  constexpr std::uint64_t n = EightSlots::n;
  RingMemory& ring = e.ring;
  auto push = [&](std::uint8_t id) { return e.push(id); };
  auto pop = [&]() -> int {
    const auto p = e.pop();
    return p ? p->first : -1;
  };
  using S = Ring::Status;
  ASSERT_EQ(push(1), S::kOk);  // at 0
  ring.tail().store(n);        // onto slot 0's next lap, which message 1 still holds
  EXPECT_EQ(push(2), S::kTimeout);
  EXPECT_EQ(pop(), 1);
  ASSERT_EQ(push(3), S::kOk);  // at n
  EXPECT_EQ(pop(), 3);
  ring.tail().store(2 * n);
  ASSERT_EQ(push(4), S::kOk);  // at 2n
  ring.head().store(ring.head().load() + (std::uint64_t{1} << 40));
  EXPECT_EQ(pop(), 4);
  ring.tail().store(3 * n);
  ASSERT_EQ(push(5), S::kOk);  // at 3n: slots 1..7 still hold words of positions 1..7
  EXPECT_EQ(pop(), 5);
  EXPECT_EQ(pop(), -1);
  ASSERT_EQ(push(6), S::kOk);
  EXPECT_EQ(pop(), 6);
}

// The same through a queue (4,096 slots). Without the renumbering, items 3 and 4 were
// never got: the head went to item 5, past them.
TEST_F(HostilePositionsTest, AQueuesTailMovedBackThenForwardPastAnItemLosesNothing) {
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  const std::uint64_t n = ring.slot_count();
  auto small = [](int i) { return "item " + std::to_string(i); };
  std::vector<std::string> got;
  auto get = [&] { got.push_back(q.try_get(2s).value_or("none")); };
  ring.tail().store(n - 1);
  q.put(small(1));
  q.put(small(2));
  ring.tail().store(4);
  get();
  q.put(small(3));  // behind the head
  get();
  q.put(small(4));
  ring.tail().store(2 * n);
  q.put(small(5));
  q.put(small(6));
  for (int i = 0; i < 4; ++i) get();
  EXPECT_EQ(q.try_get(20ms), std::nullopt);
  for (int i = 7; i < 12; ++i) q.put(small(i));
  for (int i = 7; i < 12; ++i) get();
  std::vector<std::string> want;
  for (int i = 1; i < 12; ++i) want.push_back(small(i));
  EXPECT_EQ(got, want);
}

// Hints with any bits above the 50 a slot word keeps: flipped one by one, all together, or
// moved back by 2^50 (which borrows from them). Puts and gets interleave; nothing is lost,
// nothing fails, and one producer's items come to one consumer in order.
TEST_F(HostilePositionsTest, HintsWithAnyHighBitsLoseNothingAndFailNothing) {
  const std::uint64_t kHigh = ~(kAlias - 1);
  const std::uint64_t flips[] = {kAlias, std::uint64_t{1} << 63, kHigh,
                                 kHigh & 0x5555555555555555u};
  int move = 0;
  for (const std::uint64_t flip : flips) {
    for (const bool back : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "high bits 0x" << std::hex << flip << ", back " << back);
      Queue<std::string> q;
      RingMemory ring(queue_ring_fd(q));
      int put = 0, got = 0;
      for (int round = 0; round < 4; ++round) {
        for (int k = 0; k < 9; ++k) ASSERT_NO_THROW(q.put(item(put++)));
        auto& hint = (++move % 2 == 0 ? ring.head() : ring.tail());
        if (back)
          hint.fetch_sub(kAlias);
        else
          hint.fetch_xor(flip);
        for (int k = 0; k < 5; ++k) EXPECT_EQ(label(q.try_get(2s)), label(item(got++)));
      }
      while (got < put) EXPECT_EQ(label(q.try_get(2s)), label(item(got++)));
      EXPECT_EQ(q.try_get(20ms), std::nullopt);
    }
  }
}

// The third finding: one slot word forged far ahead of the tail made every second put fail
// for a whole lap. The ring now moves to the forged word's lap (a hint-only peer leaves
// honest words that far apart, which must be followed: docs/transport.md): no put fails,
// nothing is lost, and a word forged as published is one message that is not one, which
// the get that meets it reports.
TEST_F(HostilePositionsTest, OneSlotWordForgedFarAheadCostsNoPutAndLosesNothing) {
  using namespace internal::ring_word;
  for (const State state : {kFree, kReady, kWriting}) {
    SCOPED_TRACE("forged state " + std::to_string(state));
    Queue<std::string> q;
    RingMemory ring(queue_ring_fd(q));
    const std::uint64_t n = ring.slot_count();
    for (int i = 0; i < 10; ++i) q.put(item(i));
    for (int i = 0; i < 10; ++i) ASSERT_EQ(label(q.try_get(2s)), label(item(i)));
    // Positions 0..9 were used; the word of position 15 now names a position 100 laps on.
    ring.store_slot_word(15, pack(15 + 100 * n, state));
    int got = 0, failed_gets = 0;
    for (int i = 10; i < 1210; ++i) {
      q.put(item(i));
      for (;;) {
        try {
          const std::optional<std::string> v = q.try_get(2s);
          ASSERT_TRUE(v.has_value()) << i;
          EXPECT_EQ(label(v), label(item(10 + got++)));  // in order, none missing
          break;
        } catch (const ProtocolError& e) {
          ++failed_gets;
          EXPECT_THAT(e.what(), ::testing::HasSubstr("has tag 0, neither a message nor a marker"));
        }
      }
    }
    EXPECT_EQ(failed_gets, state == kReady ? 1 : 0);
    EXPECT_EQ(got, 1200);
    EXPECT_EQ(q.try_get(20ms), std::nullopt);
  }
}

TEST_F(HostilePositionsTest, OneSlotWordForgedFarAheadCostsNoSendAndLosesNothing) {
  using namespace internal::ring_word;
  auto [a, b] = pipe();
  RingMemory ring(pipe_ring_fd(a));
  const std::uint64_t n = ring.slot_count();
  ring.store_slot_word(7, pack(7 + 1000 * n, kReady));
  int got = 0, failed_recvs = 0;
  for (int i = 0; i < 1200; ++i) {
    a.send(item(i));
    for (;;) {
      try {
        const std::string v = b.recv<std::string>();
        EXPECT_EQ(label(v), label(item(got++)));  // in order, none missing
        break;
      } catch (const ProtocolError& e) {
        ++failed_recvs;
        EXPECT_THAT(e.what(), ::testing::HasSubstr("has tag 0, neither a message nor a marker"));
      }
    }
  }
  EXPECT_EQ(failed_recvs, 1);
  EXPECT_EQ(got, 1200);
  EXPECT_FALSE(b.poll());
}

// A peer that keeps writing the tail hint far past every slot word, between and during a
// consumer's calls (each pop resyncs the hints once). Stepping hole by hole toward such a
// hint would take 2^49 steps: a pop finds the queue empty or, meeting a tail more than a
// lap past its position, says so; every call returns by its deadline, and once the peer
// stops nothing is lost.
TEST_F(HostilePositionsTest, ATailHintRewrittenFarAheadDuringPopsCostsNoCallItsDeadline) {
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  for (int i = 0; i < 5; ++i) q.put(item(i));
  for (int i = 0; i < 5; ++i) ASSERT_EQ(label(q.try_get(2s)), label(item(i)));
  const pid_t consumer = fork_child([&] {
    std::atomic<bool> stop{false};
    std::thread peer([&] {
      const std::uint64_t far = ring.head().load() + (std::uint64_t{1} << 49);
      while (!stop.load(std::memory_order_relaxed)) ring.tail().store(far);
    });
    int failed = 0, empty = 0;
    for (int call = 0; call < 400; ++call) {
      try {
        if (q.try_get(1ms)) std::_Exit(3);  // nothing was put
        ++empty;
      } catch (const ProtocolError& e) {
        if (std::string(e.what()).find("is more than a lap past the oldest position not taken") ==
            std::string::npos)
          std::_Exit(4);
        ++failed;
      }
    }
    stop = true;
    peer.join();
    // Honest puts after the peer stopped: each one got, in order.
    for (int i = 5; i < 20; ++i) q.put(item(i));
    for (int i = 5; i < 20; ++i)
      if (q.try_get(2s) != item(i)) std::_Exit(5);
    std::fprintf(stderr, "%d pops failed, %d found the queue empty\n", failed, empty);
    std::_Exit(failed + empty == 400 ? 0 : 6);
  });
  EXPECT_EQ(wait_child_within(consumer, 60s), 0) << "-1: a pop walked toward the tail";
}

// A peer that writes most slot words near the last position a ring uses (kPosLimit) moves
// the ring there; once its positions run out, the ring is broken, and every caller is told:
// a consumer asleep in get() without a deadline in another process, a put, a try_get.
TEST_F(HostilePositionsTest, AQueueWhosePositionsRunOutIsBrokenForEveryCaller) {
  using namespace internal::ring_word;
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  const std::uint64_t n = ring.slot_count();
  // Each slot free for its position in the last lap below the limit.
  for (std::uint64_t i = 0; i < n; ++i) ring.store_slot_word(i, pack(kPosLimit - n + i, kFree));
  for (std::uint64_t i = 0; i < n; ++i) {
    q.put(item(static_cast<int>(i)));
    ASSERT_EQ(label(q.try_get(2s)), label(item(static_cast<int>(i))));
  }
  EXPECT_EQ(ring.tail().load(), kPosLimit);
  const pid_t consumer = fork_child([&] {
    try {
      (void)q.get();
    } catch (const ProtocolError& e) {
      if (std::string(e.what()).find("broken: it has no position left") != std::string::npos)
        std::_Exit(0);
    }
    std::_Exit(3);
  });
  std::this_thread::sleep_for(50ms);  // the child is likely asleep in get() by now
  EXPECT_ERROR(q.put(item(0)), ProtocolError, "message ring: broken: it has no position left");
  EXPECT_EQ(wait_child_within(consumer, 10s), 0);
  EXPECT_ERROR((void)q.try_get(0s), ProtocolError, "message ring: broken: it has no position left");
  EXPECT_ERROR(q.put(item(1)), ProtocolError, "message ring: broken: it has no position left");
}

// The second finding: a peer that names a live thread in a receive lock and keeps bumping
// its wake counter, or swaps the named thread, kept a receive without a deadline waiting
// past 6 s. docs/transport.md promises an error once others held the lock for 1 s while
// the caller waited; the bound checked here is a generous 5 s (no timed assertion tighter
// than the promise on a shared machine).
class LockForger {
 public:
  // Names `pids` (each a live process's main thread) in `lock` in turn, swapping every
  // `swap_every`, and bumps the wake counter every millisecond, until stop() (or 8 s).
  LockForger(internal::SharedLock& lock, std::vector<pid_t> pids,
             std::chrono::milliseconds swap_every)
      : first_(forge(lock, pids[0])), thread_([this, &lock, pids, swap_every] {
          const auto start = Clock::now();
          std::size_t k = 0;
          auto swapped = start;
          while (!stop_.load() && Clock::now() - start < 8s) {
            forge(lock, pids[k % pids.size()]);
            if (Clock::now() - swapped >= swap_every) {
              ++k;
              swapped = Clock::now();
            }
            std::this_thread::sleep_for(1ms);
          }
        }) {}
  ~LockForger() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 private:
  // Names the main thread of `pid` in `lock` and bumps its wake counter.
  static bool forge(internal::SharedLock& lock, pid_t pid) {
    const auto who = static_cast<std::uint32_t>(pid);
    lock.state.store(internal::thread_lock_state(who, who));
    lock.wake.fetch_add(1);
    return true;
  }
  bool first_;  // the lock is forged before the constructor returns
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Two live processes that take no lock: the threads a peer names.
struct Bystanders {
  pid_t first = fork_child([] { ::pause(); });
  pid_t second = fork_child([] { ::pause(); });
  ~Bystanders() {
    for (pid_t p : {first, second}) {
      ::kill(p, SIGKILL);
      (void)wait_child(p);
    }
  }
};

// A queue's get() without a deadline while a LockForger forges its receive lock: a
// ProtocolError within the bound, and the item, whose marker was given back, is there once
// the lock is free.
void expect_get_reports_the_forged_lock(const std::vector<pid_t>& named,
                                        std::chrono::milliseconds swap_every) {
  Queue<std::string> q;
  Mapping control =
      Mapping::map_shared(queue_control_fd(q), sizeof(internal::QueueControl), "test");
  auto* c = reinterpret_cast<internal::QueueControl*>(control.data());
  q.put(item(0));  // a datagram: its receive takes recv_lock
  {
    LockForger forger(c->recv_lock, named, swap_every);
    const auto start = Clock::now();
    EXPECT_ERROR((void)q.get(), ProtocolError,
                 "the queue's receive lock has been held by other threads for more than 1 s");
    EXPECT_LT(Clock::now() - start, 5s);
  }
  c->recv_lock.state.store(0);
  EXPECT_EQ(label(q.try_get(2s)), label(item(0)));
}

TEST_F(HostilePositionsTest, AQueuesGetWithoutDeadlineFailsWhileAPeerBumpsTheLocksWakeCounter) {
  Bystanders live;
  expect_get_reports_the_forged_lock({live.first}, 1h);
}

TEST_F(HostilePositionsTest, AQueuesGetWithoutDeadlineFailsWhileAPeerSwapsTheNamedHolder) {
  Bystanders live;
  expect_get_reports_the_forged_lock({live.first, live.second}, 100ms);
}

TEST_F(HostilePositionsTest, APipesRecvWithoutDeadlineFailsWhileAPeerForgesTheLock) {
  Bystanders live;
  auto [a, b] = pipe();
  RingMemory ring(pipe_ring_fd(a));
  auto* link = reinterpret_cast<internal::LinkControl*>(ring.user());
  a.send(item(0));
  {
    LockForger forger(link->recv_lock, {live.first, live.second}, 100ms);
    const auto start = Clock::now();
    EXPECT_ERROR((void)b.recv<std::string>(), ProtocolError,
                 "the connection's receive lock has been held by other threads for more than 1 s");
    EXPECT_LT(Clock::now() - start, 5s);
  }
  link->recv_lock.state.store(0);
  EXPECT_EQ(label(b.recv<std::string>()), label(item(0)));
}

// Item 6 of the channels issue: a slot word forged as a claim (WRITING or READING) that
// names a live process's holder record, or "nobody", kept a get() or recv() without a
// deadline waiting for as long as the word stood. A claim lasts a copy, or as long as its
// claimer waits with it counted in its record; one that names a process neither stopped
// nor waiting is reported once a waiter has stood behind it for 1 s in all
// (Ring::watch_claim). The bound checked is a generous 5 s, as for the locks above.

// A live process that holds a record of the ring (it looked at the ring once) and waits in
// pause(): a claim naming it is neither finished nor waiting.
class Claimant {
 public:
  explicit Claimant(int ring_fd) {
    testing::Pipe ready;
    pid_ = fork_child([&] {
      Ring r = Ring::attach(internal::dup_cloexec(ring_fd));
      std::vector<std::byte> out(r.max_message());
      if (r.pop(out, Ring::kNoWait).status != Ring::Status::kTimeout) std::_Exit(2);
      ready.send();
      for (;;) ::pause();
    });
    EXPECT_EQ(ready.receive(), 'x');
  }
  Claimant(const Claimant&) = delete;
  Claimant& operator=(const Claimant&) = delete;
  ~Claimant() {
    ::kill(pid_, SIGKILL);
    (void)wait_child(pid_);
  }
  pid_t pid() const { return pid_; }
  void stop() {
    int status = 0;
    ASSERT_EQ(::kill(pid_, SIGSTOP), 0);
    ASSERT_EQ(::waitpid(pid_, &status, WUNTRACED), pid_);
    ASSERT_TRUE(WIFSTOPPED(status));
  }
  void resume() { ASSERT_EQ(::kill(pid_, SIGCONT), 0); }

 private:
  pid_t pid_ = 0;
};

// `call` throws ProtocolError saying a claim of `what` was reported, within the bound.
template <class Call>
void expect_reported_claim(Call&& call, const std::string& what) {
  const auto start = Clock::now();
  EXPECT_ERROR(call(), ProtocolError, "has been claimed " + what);
  EXPECT_LT(Clock::now() - start, 5s);
}

// The claim at a queue's head names each kind of live claimer in turn: a get() without a
// deadline reports it, in a thread of its own; the items put behind it arrive, in order,
// once the peer writes the word back.
TEST_F(HostilePositionsTest, AGetWithoutDeadlineReportsAClaimForgedForALiveProcessOrNobody) {
  using namespace internal::ring_word;
  for (const char* who : {"another process", "this process", "nobody"}) {
    SCOPED_TRACE(who);
    Queue<std::string> q;
    RingMemory ring(queue_ring_fd(q));
    Claimant other(queue_ring_fd(q));
    const std::uint64_t n = ring.slot_count();
    q.put(item(1));
    EXPECT_EQ(label(q.try_get(2s)), label(item(1)));  // this process holds a record now
    const pid_t named = std::string(who) == "another process" ? other.pid()
                        : std::string(who) == "this process"  ? ::getpid()
                                                              : 0;
    ring.store_slot_word(1, ring.claim_by(named, 1, kWriting));
    for (int i = 2; i <= 4; ++i) q.put(item(i));  // at positions 2, 3, 4
    std::thread([&] {
      expect_reported_claim([&] { (void)q.get(); }, "for writing by " +
                                                         (named == 0 ? std::string("a process with no holder record")
                                                                     : "process " + std::to_string(named)));
    }).join();
    ring.store_slot_word(1, pack(1 + n, kFree));  // the peer gives the position up
    for (int i = 2; i <= 4; ++i) EXPECT_EQ(label(q.try_get(2s)), label(item(i)));
    EXPECT_EQ(q.try_get(20ms), std::nullopt);
  }
}

// A stopped claimer is waited for (a debugger, SIGSTOP), and so is one whose record names
// the claim's position as held while it waits (a queue's producer that holds a marker's
// position while it waits for room); running again, its record naming another position
// only, its claim is reported.
TEST_F(HostilePositionsTest, AClaimOfAStoppedOrWaitingProcessIsWaitedFor) {
  using namespace internal::ring_word;
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  Claimant other(queue_ring_fd(q));
  ring.store_slot_word(0, ring.claim_by(other.pid(), 0, kWriting));
  q.put(item(1));
  internal::HolderRecord* record = nullptr;
  for (std::uint32_t i = 0; i < internal::kHolderRecords; ++i)
    if (ring.holder(i).owner.load() >> 32 == static_cast<std::uint64_t>(other.pid()))
      record = &ring.holder(i);
  ASSERT_NE(record, nullptr);
  std::thread([&] {
    other.stop();
    EXPECT_EQ(q.try_get(1500ms), std::nullopt);  // no error: stopped time does not count
    other.resume();
    record->waiting[1].store(0 + 1);             // position 0
    EXPECT_EQ(q.try_get(1500ms), std::nullopt);  // no error: it waits with its claim
    record->waiting[1].store(7 + 1);             // a claim of position 7: not this one
    expect_reported_claim([&] { (void)q.get(); }, "for writing by process " +
                                                       std::to_string(other.pid()));
  }).join();
  ring.store_slot_word(0, pack(0 + ring.slot_count(), kFree));
  EXPECT_EQ(label(q.try_get(2s)), label(item(1)));
}

TEST_F(HostilePositionsTest, ARecvWithoutDeadlineReportsAClaimForgedForALiveProcess) {
  using namespace internal::ring_word;
  auto [a, b] = pipe();
  RingMemory ring(pipe_ring_fd(a));
  Claimant other(pipe_ring_fd(a));
  ring.store_slot_word(0, ring.claim_by(other.pid(), 0, kWriting));
  for (int i = 1; i <= 3; ++i) a.send(item(i));
  expect_reported_claim([&] { (void)b.recv<std::string>(); },
                        "for writing by process " + std::to_string(other.pid()));
  ring.store_slot_word(0, pack(0 + ring.slot_count(), kFree));
  for (int i = 1; i <= 3; ++i) EXPECT_EQ(label(b.recv<std::string>()), label(item(i)));
  EXPECT_FALSE(b.poll());
}

// The claim forged over a published marker, as a consumer's that takes its datagram: the
// consumer of the next marker waits for it behind that datagram (take_announced) and reports
// it; its own marker goes back, and both items arrive once the peer writes the word back.
// Named as the consumer's own process too, whose record names the marker it holds while it
// waits: the forged one is not that one.
TEST_F(HostilePositionsTest, AConsumerBehindAMarkerForgedAsTakenReportsIt) {
  using namespace internal::ring_word;
  for (const bool by_itself : {false, true}) {
    SCOPED_TRACE(by_itself ? "named as the consumer's process" : "named as another process");
    Queue<std::string> q;
    RingMemory ring(queue_ring_fd(q));
    Claimant other(queue_ring_fd(q));
    q.put(item(0));  // big: a marker at position 0, its datagram first in the socket
    q.put(item(3));  // at 1
    const pid_t named = by_itself ? ::getpid() : other.pid();
    ring.store_slot_word(0, ring.claim_by(named, 0, kReading));
    std::thread([&] {  // a thread of its own: no watch carried over from another test
      expect_reported_claim([&] { (void)q.get(); },
                            "for reading by process " + std::to_string(named));
    }).join();
    ring.store_slot_word(0, pack(0, kReady));
    EXPECT_EQ(label(q.try_get(2s)), label(item(0)));
    EXPECT_EQ(label(q.try_get(2s)), label(item(3)));
    EXPECT_EQ(q.try_get(20ms), std::nullopt);
  }
}

// The last handle's drop drains the queue, waiting at most 1 s for markers: behind a marker
// forged as taken by a live process, or by nobody, or a head forged as being written whose
// claim the dropping thread has had reported already (its pops throw at every look), it
// returns all the same, and leaves nothing behind (the leak check).
TEST_F(HostilePositionsTest, TheLastDropOfAQueueBehindAForgedClaimReturns) {
  using namespace internal::ring_word;
  for (const int kind : {0, 1, 2}) {
    SCOPED_TRACE(kind == 0 ? "a marker, a live process" : kind == 1 ? "a marker, nobody"
                                                                    : "the head, reported");
    const pid_t dropper = fork_child([kind] {
      auto start = Clock::now();
      {
        Queue<std::string> q;
        RingMemory ring(queue_ring_fd(q));
        Claimant other(queue_ring_fd(q));
        if (kind == 2) ring.store_slot_word(0, ring.claim_by(other.pid(), 0, kWriting));
        q.put(item(0));
        q.put(item(3));
        q.put(item(6));
        if (kind == 2) {
          try {
            (void)q.get();
            std::_Exit(4);
          } catch (const ProtocolError&) {
          }
        } else {
          ring.store_slot_word(0, ring.claim_by(kind == 1 ? 0 : other.pid(), 0, kReading));
        }
        start = Clock::now();
      }
      std::_Exit(Clock::now() - start < 5s ? 0 : 3);
    });
    EXPECT_EQ(wait_child_within(dropper, 30s), 0) << "-1: the drop did not return";
  }
}

// A reported claim that the peer writes over with another forged claim: the time starts
// afresh (what a thread saw of the first is not held against a later word there: an
// honest claim made there later would be judged by it), and the new one is reported
// within the bound in its turn.
TEST_F(HostilePositionsTest, AReportedClaimWrittenOverIsJudgedAfresh) {
  using namespace internal::ring_word;
  Queue<std::string> q;
  RingMemory ring(queue_ring_fd(q));
  Claimant other(queue_ring_fd(q));
  q.put(item(1));
  EXPECT_EQ(label(q.try_get(2s)), label(item(1)));  // this process holds a record
  ring.store_slot_word(1, ring.claim_by(other.pid(), 1, kWriting));
  q.put(item(2));
  std::thread([&] {
    expect_reported_claim([&] { (void)q.get(); },
                          "for writing by process " + std::to_string(other.pid()));
    ring.store_slot_word(1, ring.claim_by(::getpid(), 1, kWriting));
    EXPECT_EQ(q.try_get(500ms), std::nullopt);  // no error: half a second of a new word
    expect_reported_claim([&] { (void)q.get(); },
                          "for writing by process " + std::to_string(::getpid()));
  }).join();
  ring.store_slot_word(1, pack(1 + ring.slot_count(), kFree));
  EXPECT_EQ(label(q.try_get(2s)), label(item(2)));
}

}  // namespace
}  // namespace shmtensor
