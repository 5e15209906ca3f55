// Opt-in busy polling (include/shmtensor/busy_poll.h): receives poll before they block,
// and everything a blocking receive does still holds — values and order, end of stream,
// timeouts — across real processes, for both strategies.
#include "shmtensor/busy_poll.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <thread>

#include "shmtensor/connection.h"
#include "shmtensor/queue.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"
#include "transport/busy_poll.h"

namespace shmtensor {
namespace {

using namespace std::chrono_literals;
using testing::fork_child;
using testing::wait_child;

// Puts the process's budget back to off after each test.
class BusyPollTest : public testing::StrategyTest {
 protected:
  void TearDown() override {
    set_busy_poll(Duration(0));
    StrategyTest::TearDown();
  }
};

TEST(BusyPollSettingTest, SetGetAndValuesOutOfRange) {
  set_busy_poll(50us);
  EXPECT_DOUBLE_EQ(get_busy_poll().count(), 50e-6);
  EXPECT_ERROR(set_busy_poll(Duration(-1e-6)), std::invalid_argument,
               "the budget must be from 0 to 1 second, not -0.000001 s");
  EXPECT_ERROR(set_busy_poll(2s), std::invalid_argument,
               "the budget must be from 0 to 1 second, not 2.000000 s");
  EXPECT_DOUBLE_EQ(get_busy_poll().count(), 50e-6) << "a refused value changes nothing";
  set_busy_poll(1s);  // the largest
  EXPECT_DOUBLE_EQ(get_busy_poll().count(), 1.0);
  set_busy_poll(Duration(0));
  EXPECT_EQ(get_busy_poll().count(), 0.0);
  EXPECT_EQ(internal::busy_poll_budget().count(), 0);
}

TEST(BusyPollSettingTest, EnvironmentValueIsWholeMicroseconds) {
  using internal::parse_busy_poll_us;
  EXPECT_EQ(parse_busy_poll_us("50"), std::chrono::nanoseconds(50'000));
  EXPECT_EQ(parse_busy_poll_us("0"), std::chrono::nanoseconds(0));
  EXPECT_EQ(parse_busy_poll_us("1000000"), std::chrono::nanoseconds(1'000'000'000));
  for (const char* bad : {"", "abc", "-1", "1000001", "5x", "2.5", " 7"})
    EXPECT_EQ(parse_busy_poll_us(bad), std::nullopt) << '"' << bad << '"';
  EXPECT_EQ(parse_busy_poll_us(nullptr), std::nullopt);
}

TEST(BusyPollSettingTest, AdaptsPerThreadAndNeverPollsOnOneCpu) {
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof all, &all), 0);
  set_busy_poll(64us);
  if (CPU_COUNT(&all) > 1) {
    using internal::busy_poll_budget;
    using internal::busy_poll_observe;
    EXPECT_EQ(busy_poll_budget(), 64us);
    busy_poll_observe(std::nullopt);  // nothing came: half
    EXPECT_EQ(busy_poll_budget(), 32us);
    busy_poll_observe(100us);  // longer than the budget set could cover: half
    EXPECT_EQ(busy_poll_budget(), 16us);
    for (int i = 0; i < 20; ++i) busy_poll_observe(std::nullopt);
    EXPECT_EQ(busy_poll_budget(), 1us) << "never below 1/64 of the budget";
    busy_poll_observe(10us);  // a poll of twice that would have caught it
    EXPECT_EQ(busy_poll_budget(), 20us);
    busy_poll_observe(3us);
    EXPECT_EQ(busy_poll_budget(), 6us);
    busy_poll_observe(40us);
    EXPECT_EQ(busy_poll_budget(), 64us) << "never above the budget set";
    busy_poll_observe(0us);
    EXPECT_EQ(busy_poll_budget(), 1us) << "never below 1/64 of the budget";
    // Every 64th call is a probe with the whole budget; the calls above were 8.
    for (int call = 9; call < 64; ++call) EXPECT_EQ(busy_poll_budget(), 1us) << call;
    EXPECT_EQ(busy_poll_budget(), 64us) << "the 64th call probes";
    EXPECT_EQ(busy_poll_budget(), 1us);
    // A blocking receive spins a few microseconds before it sleeps, polling on or off.
    EXPECT_EQ(internal::spin_before_sleep(), 4us);
    set_busy_poll(0us);
    EXPECT_EQ(internal::spin_before_sleep(), 4us);
    set_busy_poll(64us);
  }
  // A process that may run on one CPU only never polls: its peer needs that CPU.
  pid_t child = fork_child([] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
    set_busy_poll(64us);  // a new setting: the thread reads its affinity again
    EXPECT_EQ(internal::busy_poll_budget().count(), 0);
    EXPECT_EQ(internal::spin_before_sleep().count(), 0) << "nor spins before it sleeps";
  });
  EXPECT_EQ(wait_child(child), 0);
}

// The mask is read again in a forked child (whose copy of the thread's state is its
// parent's) and every so many receives, without a new set_busy_poll: a DataLoader worker
// that pins itself, or a process moved by `taskset -p`, stops spinning.
TEST(BusyPollSettingTest, AChildOrAThreadThatPinsItselfStopsSpinning) {
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof all, &all), 0);
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "needs two CPUs";
  ASSERT_EQ(internal::spin_before_sleep(), 4us);  // the parent's state: several CPUs
  auto pin_to_one = [] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    return ::sched_setaffinity(0, sizeof one, &one) == 0;
  };
  pid_t child = fork_child([&] {
    ASSERT_TRUE(pin_to_one());
    EXPECT_EQ(internal::spin_before_sleep().count(), 0) << "a forked child reads its own mask";
  });
  EXPECT_EQ(wait_child(child), 0);
  std::thread t([&] {
    EXPECT_EQ(internal::spin_before_sleep(), 4us);
    ASSERT_TRUE(pin_to_one());
    int spinning = 0;
    for (int i = 0; i < 2048; ++i) spinning += internal::spin_before_sleep().count() > 0;
    EXPECT_LE(spinning, 1024) << "the mask is read again within 1,024 uses";
    EXPECT_EQ(internal::spin_before_sleep().count(), 0);
  });
  t.join();
}

// A queue's own budget (Queue::set_busy_poll) replaces the process's for its gets: the
// thread's adaptation is clamped to it, and polling off in the process does not stop it.
TEST(BusyPollSettingTest, AQueuesOwnBudgetReplacesTheProcesss) {
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof all, &all), 0);
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "needs two CPUs (one CPU never polls)";
  using internal::busy_poll_budget;
  using internal::busy_poll_observe;
  set_busy_poll(Duration(0));  // restarts this thread's adaptation, at 0
  const std::optional<std::chrono::nanoseconds> own = 64us;
  EXPECT_EQ(busy_poll_budget().count(), 0) << "the process's: off";
  EXPECT_EQ(busy_poll_budget(own), 1us) << "from 0, clamped to 1/64 of the queue's";
  busy_poll_observe(10us, own);
  EXPECT_EQ(busy_poll_budget(own), 20us);
  EXPECT_EQ(busy_poll_budget().count(), 0) << "the process's stays off";
  EXPECT_EQ(busy_poll_budget(std::chrono::nanoseconds(0)).count(), 0) << "0: never polls";
  busy_poll_observe(std::nullopt, own);
  EXPECT_EQ(busy_poll_budget(own), 10us);

  Queue<int> q;
  EXPECT_EQ(q.busy_poll(), std::nullopt) << "follows the process's by default";
  q.set_busy_poll(200us);
  ASSERT_TRUE(q.busy_poll());
  EXPECT_DOUBLE_EQ(q.busy_poll()->count(), 200e-6);
  Queue<int> copy = q;  // a copy in this process shares it
  ASSERT_TRUE(copy.busy_poll());
  EXPECT_DOUBLE_EQ(copy.busy_poll()->count(), 200e-6);
  EXPECT_ERROR(q.set_busy_poll(Duration(-1e-6)), std::invalid_argument,
               "Queue::set_busy_poll: a negative budget");
  EXPECT_ERROR(q.set_busy_poll(2s), std::invalid_argument,
               "the budget must be from 0 to 1 second, not 2000000000 ns");
  EXPECT_DOUBLE_EQ(q.busy_poll()->count(), 200e-6) << "a refused value changes nothing";
  pid_t child = fork_child([&] {
    EXPECT_EQ(q.busy_poll(), std::nullopt) << "a forked child follows its own process's";
  });
  EXPECT_EQ(wait_child(child), 0);
  ASSERT_TRUE(q.busy_poll()) << "and the parent keeps it";
  // A get on it that finds nothing adapts the thread's budget within the queue's (half of
  // 200 us), where a queue that follows the process (off) leaves it alone.
  busy_poll_observe(100us, std::chrono::nanoseconds(200us));
  ASSERT_EQ(busy_poll_budget(std::chrono::nanoseconds(200us)), 200us);
  Queue<int> plain;
  EXPECT_EQ(plain.try_get(1ms), std::nullopt);
  EXPECT_EQ(busy_poll_budget(std::chrono::nanoseconds(200us)), 200us) << "no poll, no change";
  EXPECT_EQ(q.try_get(1ms), std::nullopt);
  EXPECT_EQ(busy_poll_budget(std::chrono::nanoseconds(200us)), 100us) << "it polled";
  q.set_busy_poll(std::nullopt);
  EXPECT_EQ(q.busy_poll(), std::nullopt);
}

// A child puts 2,000 numbered tensors on q (pausing 1 ms every `pause_every`, 0: never) and
// closes it; they must come out in order with their values, then QueueClosed.
void expect_2000_items_in_order(Queue<std::pair<int, Tensor>>& q, int pause_every) {
  pid_t child = fork_child([&] {
    for (int i = 0; i < 2000; ++i) {
      q.put({i, Tensor::full({3}, static_cast<double>(i))});
      if (pause_every > 0 && i % pause_every == 0) std::this_thread::sleep_for(1ms);
    }
    q.close();
  });
  for (int i = 0; i < 2000; ++i) {
    auto [n, t] = q.get();
    ASSERT_EQ(n, i);
    ASSERT_EQ(t.data_ptr<float>()[2], static_cast<float>(i));
  }
  EXPECT_ERROR(q.get(), QueueClosed, "get() on a closed and empty queue");
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(BusyPollTest, AQueueThatPollsCarriesExactValuesWhileTheProcessDoesNot) {
  Queue<std::pair<int, Tensor>> q(16);
  q.set_busy_poll(200us);
  expect_2000_items_in_order(q, 100);  // the pauses: some gets find it empty
}

TEST_P(BusyPollTest, RoundTripsCarryExactValuesAndEndOfStreamIsSeen) {
  set_busy_poll(200us);
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    for (int i = 0; i < 500; ++i) {
      Tensor t = b.recv<Tensor>();
      t.data_ptr<std::int64_t>()[0] += 1;
      b.send(t);
    }
  });
  b.close();
  Tensor t = Tensor::zeros({4}, DType::kInt64);
  for (int i = 0; i < 500; ++i) {
    a.send(t);
    t = a.recv<Tensor>();
  }
  EXPECT_EQ(t.data_ptr<std::int64_t>()[0], 500);
  EXPECT_ERROR(a.recv<Tensor>(), ConnectionClosed,
               "the peer closed the connection");  // the child exited: end of stream
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(BusyPollTest, QueueKeepsOrderAndTimeoutsWhilePolling) {
  set_busy_poll(200us);
  Queue<std::pair<int, Tensor>> q(16);
  expect_2000_items_in_order(q, 0);
  Queue<int> empty;
  EXPECT_EQ(empty.try_get(20ms), std::nullopt);
  EXPECT_EQ(empty.try_get(0ms), std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(Strategies, BusyPollTest, testing::kAllStrategies, testing::strategy_name);

}  // namespace
}  // namespace shmtensor
