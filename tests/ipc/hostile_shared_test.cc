// A peer that writes the transport's shared memory (docs/transport.md, "What a peer that
// writes the shared memory can do"): the shared locks (os/shared_lock.h) and a queue's
// locks and ring hints written over as such a peer would, across real processes. Nothing
// it writes crashes a process or keeps a call past its deadline, and hints it moves lose
// no item.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <functional>
#include <new>
#include <thread>

#include "os/mapping.h"
#include "os/shared_lock.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/queue_core.h"
#include "shmtensor/queue.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "transport/queue_control.h"
#include "transport/ring.h"

namespace shmtensor {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using internal::kLockContended;
using internal::LockHold;
using internal::Locked;
using internal::lock_shared;
using internal::lock_state;
using internal::Mapping;
using internal::SharedLock;
using internal::unlock_shared;
using testing::fork_child;
using testing::wait_child;

// A lock in a shared anonymous mapping, so that forked children use the same one.
class SharedLockTest : public testing::LeakCheckedTest {
 protected:
  void SetUp() override {
    LeakCheckedTest::SetUp();
    mem_ = Mapping::map_anonymous_shared(4096);
    lock_ = new (mem_.data()) SharedLock{};
  }
  void TearDown() override {
    mem_ = Mapping();
    LeakCheckedTest::TearDown();
  }
  // A child that takes the lock, reports it through `ready`, then does `then`.
  pid_t child_holding(const std::function<void()>& then) {
    auto* ready = reinterpret_cast<std::atomic<std::uint32_t>*>(mem_.data() + 1024);
    ready->store(0);
    const pid_t pid = fork_child([this, ready, then] {
      if (lock_shared(*lock_, std::nullopt, LockHold::kBrief, "test lock") != Locked::kYes)
        std::_Exit(2);
      ready->store(1);
      then();
    });
    while (ready->load() == 0) std::this_thread::sleep_for(1ms);
    return pid;
  }
  Mapping mem_;
  SharedLock* lock_ = nullptr;
};

TEST_F(SharedLockTest, ZeroBytesAreAFreeLockAndTheStateNamesItsHolder) {
  ASSERT_EQ(lock_shared(*lock_, std::nullopt, LockHold::kBrief, "test lock"), Locked::kYes);
  const std::uint64_t me = internal::thread_lock_state(
      static_cast<std::uint32_t>(::getpid()), static_cast<std::uint32_t>(::syscall(SYS_gettid)));
  EXPECT_EQ(lock_->state.load(), me);
  EXPECT_NE(me >> internal::kLockStartShift, 0u) << "this thread's start time is in the state";
  // Held: another thread's try (a deadline that has passed) times out.
  std::thread([&] {
    EXPECT_EQ(lock_shared(*lock_, Clock::now(), LockHold::kBrief, "test lock"), Locked::kTimeout);
  }).join();
  unlock_shared(*lock_);
  EXPECT_EQ(lock_->state.load(), 0u);
}

TEST_F(SharedLockTest, AHolderThatExitsHoldingItIsTakenOverAndThreadsExcludeEachOther) {
  const pid_t pid = child_holding([] { std::this_thread::sleep_for(100ms); });
  // The child unlocks nothing: it exits holding the lock, which is then taken over.
  const auto start = Clock::now();
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 5s, LockHold::kBrief, "test lock"),
            Locked::kRecovered);
  EXPECT_GE(Clock::now() - start, 50ms);
  EXPECT_EQ(wait_child(pid), 0);
  unlock_shared(*lock_);
  // Two threads of this process contending: each gets it, one after the other.
  std::atomic<int> inside{0}, most{0};
  auto work = [&] {
    for (int i = 0; i < 2000; ++i) {
      ASSERT_NE(lock_shared(*lock_, std::nullopt, LockHold::kBrief, "test lock"), Locked::kTimeout);
      most = std::max(most.load(), ++inside);
      --inside;
      unlock_shared(*lock_);
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  EXPECT_EQ(most.load(), 1);
  EXPECT_EQ(lock_->state.load(), 0u);
}

TEST_F(SharedLockTest, AHolderSigkilledWhileHoldingIsTakenOver) {
  const pid_t pid = child_holding([] { ::pause(); });
  ::kill(pid, SIGKILL);
  // Not reaped yet: a zombie holds nothing either.
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 5s, LockHold::kBrief, "test lock"),
            Locked::kRecovered);
  unlock_shared(*lock_);
  EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
}

TEST_F(SharedLockTest, ValuesNoThreadHoldsAreTakenOver) {
  for (const std::uint64_t forged :
       {lock_state(0x3ffff0u, 12345, 0), lock_state(0, 77, 0), lock_state(1, 0, 0),
        kLockContended, ~std::uint64_t{0},
        lock_state(static_cast<std::uint32_t>(::getpid()), 0x3fffffu, 0),
        // This very thread, which does not hold it (with its start time, and without).
        internal::thread_lock_state(static_cast<std::uint32_t>(::getpid()),
                                    static_cast<std::uint32_t>(::syscall(SYS_gettid))),
        lock_state(static_cast<std::uint32_t>(::getpid()),
                   static_cast<std::uint32_t>(::syscall(SYS_gettid)), 0),
        // Live ids with another start time: a dead holder's ids, reused.
        internal::thread_lock_state(1, 1) + (std::uint64_t{1} << internal::kLockStartShift)}) {
    lock_->state.store(forged);
    EXPECT_EQ(lock_shared(*lock_, Clock::now() + 2s, LockHold::kBrief, "test lock"),
              Locked::kRecovered)
        << std::hex << forged;
    unlock_shared(*lock_);
    EXPECT_EQ(lock_->state.load(), 0u);
  }
}

TEST_F(SharedLockTest, ALiveThreadNamedByAPeerCostsTheDeadlineThenABriefLockSaysSo) {
  // A live process that never took the lock: its ids, written by a peer.
  const pid_t pid = fork_child([] { ::pause(); });
  lock_->state.store(internal::thread_lock_state(static_cast<std::uint32_t>(pid),
                                                 static_cast<std::uint32_t>(pid)));
  auto start = Clock::now();
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 250ms, LockHold::kBrief, "test lock"),
            Locked::kTimeout);
  auto took = Clock::now() - start;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 750ms);
  start = Clock::now();
  EXPECT_ERROR((void)lock_shared(*lock_, std::nullopt, LockHold::kBrief, "the test's lock"),
               ProtocolError,
               "the test's lock has been held by other threads for more than 1 s while this "
               "thread waited for it (last by thread " +
                   std::to_string(pid) + " of process " + std::to_string(pid) + ")");
  took = Clock::now() - start;
  EXPECT_GE(took, 1s);
  EXPECT_LT(took, 3s);
  // A long lock waits for it as long as its caller lets it.
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 1200ms, LockHold::kLong, "test lock"),
            Locked::kTimeout);
  ::kill(pid, SIGKILL);
  EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 2s, LockHold::kBrief, "test lock"),
            Locked::kRecovered);
  unlock_shared(*lock_);
}

TEST_F(SharedLockTest, AStoppedHolderIsWaitedForNotReported) {
  auto* release = reinterpret_cast<std::atomic<std::uint32_t>*>(mem_.data() + 2048);
  release->store(0);
  const pid_t pid = child_holding([this, release] {
    while (release->load() == 0) std::this_thread::sleep_for(1ms);
    unlock_shared(*lock_);
  });
  ::kill(pid, SIGSTOP);
  const auto start = Clock::now();
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 1500ms, LockHold::kBrief, "test lock"),
            Locked::kTimeout);
  EXPECT_GE(Clock::now() - start, 1500ms);
  release->store(1);
  ::kill(pid, SIGCONT);
  EXPECT_EQ(lock_shared(*lock_, Clock::now() + 5s, LockHold::kBrief, "test lock"), Locked::kYes);
  unlock_shared(*lock_);
  EXPECT_EQ(wait_child(pid), 0);
}

TEST_F(SharedLockTest, GarbageOverTheWholeLockIsSurvived) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 300; ++round) {
    for (int i = 0; i < 16; ++i) mem_.data()[i] = static_cast<std::byte>(rng());
    try {
      const Locked got = lock_shared(*lock_, Clock::now() + 20ms, LockHold::kLong, "test lock");
      if (got != Locked::kTimeout) unlock_shared(*lock_);
    } catch (const ProtocolError&) {
    }
  }
  std::memset(mem_.data(), 0, sizeof(SharedLock));
  EXPECT_EQ(lock_shared(*lock_, Clock::now(), LockHold::kBrief, "test lock"), Locked::kYes);
  unlock_shared(*lock_);
}

// A queue's shared memory, mapped as a peer would map it.
struct QueueMemory {
  Mapping control;
  Mapping ring;
  template <class Q>
  explicit QueueMemory(Q& q) {
    const auto fds = internal::QueueAccess::core(q).shared_fds();
    control = Mapping::map_shared(fds.control, sizeof(internal::QueueControl), "test");
    ring = Mapping::map_shared(fds.ring, internal::Ring::kHeadOffset + 8, "test");
  }
  internal::QueueControl* c() { return reinterpret_cast<internal::QueueControl*>(control.data()); }
  std::atomic<std::uint64_t>& hint(std::size_t offset) {
    return *reinterpret_cast<std::atomic<std::uint64_t>*>(ring.data() + offset);
  }
};

// An item that travels as a datagram announced by a marker (larger than a ring slot).
std::string big(int i) { return std::to_string(i) + std::string(2000, 'x'); }

class HostileQueueTest : public testing::LeakCheckedTest {};

TEST_F(HostileQueueTest, WordsWrittenIntoTheReceiveLockAbortNobody) {
  Queue<std::string> q;
  QueueMemory mem(q);
  auto* words = reinterpret_cast<std::uint32_t*>(&mem.c()->recv_lock);
  // The writes that made glibc's robust mutex abort its next taker, and others.
  std::mt19937 rng(3);
  for (int round = 0; round < 20; ++round) {
    q.put(big(round));
    for (int k = 0; k < 3; ++k) words[rng() % 4] = rng();
    const std::optional<std::string> got = [&]() -> std::optional<std::string> {
      for (;;) {
        try {
          return q.try_get(2s);
        } catch (const ProtocolError&) {
          return std::nullopt;  // a live thread named by the garbage: said, not hung
        }
      }
    }();
    if (got) EXPECT_EQ(*got, big(round));
    std::memset(words, 0, sizeof(internal::SharedLock));
  }
  q.put(big(99));
  EXPECT_EQ(q.try_get(2s), big(99));
}

TEST_F(HostileQueueTest, AForgedLiveOwnerCostsATryGetItsDeadlineNotMore) {
  Queue<std::string> q;
  QueueMemory mem(q);
  const pid_t bystander = fork_child([] { ::pause(); });
  q.put(big(1));
  mem.c()->recv_lock.state.store(
      internal::thread_lock_state(static_cast<std::uint32_t>(bystander),
                                  static_cast<std::uint32_t>(bystander)));
  const auto start = Clock::now();
  EXPECT_EQ(q.try_get(250ms), std::nullopt);
  EXPECT_LT(Clock::now() - start, 1s);
  // The item was given back, not lost: once the named thread is gone, it is there.
  ::kill(bystander, SIGKILL);
  EXPECT_EQ(wait_child(bystander), 128 + SIGKILL);
  EXPECT_EQ(q.try_get(2s), big(1));
}

TEST_F(HostileQueueTest, DroppingTheLastHoldIsNotHungByAForgedOwner) {
  const pid_t bystander = fork_child([] { ::pause(); });
  auto start = Clock::now();
  {
    Queue<std::string> q;
    QueueMemory mem(q);
    q.put(big(1));
    q.put(big(2));
    mem.c()->recv_lock.state.store(internal::thread_lock_state(
        static_cast<std::uint32_t>(bystander), static_cast<std::uint32_t>(bystander)));
    start = Clock::now();
  }  // the drain
  EXPECT_LT(Clock::now() - start, 3s);
  ::kill(bystander, SIGKILL);
  EXPECT_EQ(wait_child(bystander), 128 + SIGKILL);
}

// A child that takes the queue's first marker, as a consumer about to take its datagram,
// and stops there (SIGSTOP); its pid once it is stopped, or -1.
pid_t stopped_marker_holder(Queue<std::string>& q) {
  const int ring_fd = internal::QueueAccess::core(q).shared_fds().ring;
  const pid_t holder = fork_child([ring_fd] {
    internal::Ring ring = internal::Ring::attach(internal::UniqueFd(::dup(ring_fd)));
    if (!ring.test_claim_and_abandon(/*as_consumer=*/true)) std::_Exit(2);
    ::raise(SIGSTOP);
  });
  int status = 0;
  if (::waitpid(holder, &status, WUNTRACED) != holder || !WIFSTOPPED(status)) return -1;
  return holder;
}

TEST_F(HostileQueueTest, AConsumerStoppedWhileItHoldsAMarkerCostsOthersTheirDeadlineOnly) {
  Queue<std::string> q;
  q.put(big(1));
  q.put(big(2));
  const pid_t holder = stopped_marker_holder(q);
  ASSERT_GT(holder, 0);
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    EXPECT_EQ(q.try_get(200ms), std::nullopt);
    const auto took = Clock::now() - start;
    EXPECT_GE(took, 200ms);
    EXPECT_LT(took, 700ms);
  }
  // The stopped consumer dies: its marker's datagram is nobody's, and the second item,
  // given back three times, is taken whole.
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
  EXPECT_EQ(q.try_get(2s), big(2));
  EXPECT_EQ(q.try_get(50ms), std::nullopt);
}

TEST_F(HostileQueueTest, AConsumerWithoutDeadlineIsNotLeftBehindAMarkerAnotherGaveBack) {
  Queue<std::string> q;
  for (int i = 0; i < 3; ++i) q.put(big(i));
  const pid_t holder = stopped_marker_holder(q);
  ASSERT_GT(holder, 0);
  // B takes the second marker and gives it up; meanwhile A, with no deadline, took the
  // third. Then the first marker's holder dies: A must not wait for ever behind the second,
  // which nobody holds now.
  std::optional<std::string> b_got = big(-1);
  std::thread b([&] { b_got = q.try_get(300ms); });
  std::this_thread::sleep_for(100ms);
  auto a = std::async(std::launch::async, [&] { return q.get(); });
  b.join();
  EXPECT_EQ(b_got, std::nullopt);
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
  ASSERT_EQ(a.wait_for(5s), std::future_status::ready) << "the untimed get is stuck";
  // One producer's items, to one consumer, in order: the second, then the third.
  EXPECT_EQ(a.get(), big(1));
  EXPECT_EQ(q.try_get(2s), big(2));
}

// Every item of [0, n) exactly once, in whatever order.
void expect_all(Queue<std::int64_t>& q, std::int64_t n) {
  std::set<std::int64_t> got;
  for (std::int64_t i = 0; i < n; ++i) {
    std::optional<std::int64_t> v;
    try {
      v = q.try_get(2s);
    } catch (const ProtocolError& e) {
      ADD_FAILURE() << "item " << i << ": " << e.what();
      continue;
    }
    ASSERT_TRUE(v.has_value()) << "lost: " << n - i << " of " << n;
    EXPECT_TRUE(got.insert(*v).second) << *v << " twice";
  }
  EXPECT_EQ(q.try_get(20ms), std::nullopt);
  EXPECT_EQ(got.size(), static_cast<std::size_t>(n));
}

TEST_F(HostileQueueTest, AHeadHintMovedForwardLosesNoItem) {
  for (const std::uint64_t ahead : {1u, 5u, 40u, 4095u, 4096u * 3}) {
    Queue<std::int64_t> q;
    QueueMemory mem(q);
    for (std::int64_t i = 0; i < 40; ++i) q.put(i);
    mem.hint(internal::Ring::kHeadOffset).fetch_add(ahead);
    for (std::int64_t i = 40; i < 60; ++i) q.put(i);
    SCOPED_TRACE("head moved " + std::to_string(ahead));
    expect_all(q, 60);
  }
}

TEST_F(HostileQueueTest, ATailHintMovedAheadOrBackLosesNoItemAndFailsNoPut) {
  for (const std::int64_t moved : {3 * 4096, 4096, 7, -5, -3 * 4096}) {
    Queue<std::int64_t> q;
    QueueMemory mem(q);
    for (std::int64_t i = 0; i < 40; ++i) q.put(i);
    (void)q.try_get(0s);  // 0 is taken: the head is past the first slot
    mem.hint(internal::Ring::kTailOffset).fetch_add(static_cast<std::uint64_t>(moved));
    SCOPED_TRACE("tail moved " + std::to_string(moved));
    for (std::int64_t i = 40; i < 5000; ++i) {
      ASSERT_NO_THROW(q.put(i)) << i;
      if (i % 2 == 0) ASSERT_TRUE(q.try_get(2s).has_value());
    }
    // 4,960 put, 2,480 of them and item 0 taken: 2,519 left.
    std::int64_t left = 0;
    while (q.try_get(20ms)) ++left;
    EXPECT_EQ(left, 2519);
  }
}

}  // namespace
}  // namespace shmtensor
