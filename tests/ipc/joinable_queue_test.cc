// JoinableQueue<T>: unfinished tasks counted in the queue's shared control block across real
// forked processes, both sharing strategies: join() waits for every consumer's task_done(),
// try_join() times out while tasks are left, one task_done() too many is refused, a put
// that gives up counts no task, and a joinable queue travels as one.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "shmtensor/connection.h"
#include "shmtensor/queue.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

using namespace std::chrono_literals;
using testing::fork_child;
using testing::wait_child;

class JoinableQueueTest : public testing::StrategyTest {};

using Item = std::pair<std::int64_t, Tensor>;

TEST_P(JoinableQueueTest, JoinWaitsForEveryConsumersTaskDone) {
  constexpr std::int64_t kTotal = 300;
  JoinableQueue<Item> q;
  Queue<std::int64_t> done;  // what consumers report, after each task_done()
  std::vector<pid_t> consumers;
  for (int c = 0; c < 3; ++c) {
    consumers.push_back(fork_child([q, done]() mutable {
      for (;;) {
        auto [i, t] = q.get();
        if (i < 0) {
          q.task_done();
          return;
        }
        if (t.data_ptr<double>()[0] != static_cast<double>(i)) std::_Exit(3);
        std::this_thread::sleep_for(100us);  // work that outlasts the producer's puts
        done.put(i);
        q.task_done();
      }
    }));
  }
  for (std::int64_t i = 0; i < kTotal; ++i)
    q.put({i, Tensor::full({4}, static_cast<double>(i), DType::kFloat64)});
  q.join();
  // Every item was reported before its task_done(), so all of them are in `done` now.
  std::vector<bool> seen(kTotal, false);
  for (std::int64_t n = 0; n < kTotal; ++n) {
    auto i = done.try_get();
    ASSERT_TRUE(i.has_value()) << "join() returned with " << kTotal - n << " tasks not done";
    ASSERT_GE(*i, 0);
    ASSERT_LT(*i, kTotal);
    EXPECT_FALSE(seen[*i]);
    seen[*i] = true;
  }
  for (std::size_t c = 0; c < consumers.size(); ++c) q.put({-1, Tensor()});
  q.join();
  for (pid_t p : consumers) EXPECT_EQ(wait_child(p), 0);
  EXPECT_TRUE(q.try_join(0s));
}

TEST_P(JoinableQueueTest, TryJoinTimesOutWhileATaskIsLeftAndTaskDoneTooManyIsRefused) {
  JoinableQueue<std::int64_t> q;
  EXPECT_TRUE(q.try_join(0s));  // nothing put: nothing to wait for
  EXPECT_ERROR(q.task_done(), std::logic_error, "task_done() called too many times");
  q.put(7);
  q.put(8);
  EXPECT_FALSE(q.try_join(20ms));
  EXPECT_EQ(q.get(), 7);
  q.task_done();
  EXPECT_FALSE(q.try_join(0s));
  pid_t child = fork_child([q]() mutable {
    if (q.get() != 8) std::_Exit(2);
    std::this_thread::sleep_for(50ms);
    q.task_done();
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(q.try_join(30s));  // woken by the child's task_done(), not by the timeout
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_ERROR(q.task_done(), std::logic_error, "task_done() called too many times");
  EXPECT_TRUE(q.try_join(0s));
}

TEST_P(JoinableQueueTest, APutThatGivesUpCountsNoTask) {
  JoinableQueue<std::int64_t> q(1);
  q.put(1);
  EXPECT_FALSE(q.try_put(2, 10ms));  // full: refused
  EXPECT_EQ(q.get(), 1);
  q.task_done();
  EXPECT_TRUE(q.try_join(0s));
  q.close();
  EXPECT_ERROR(q.put(3), QueueClosed, "put() on a closed queue");
  EXPECT_TRUE(q.try_join(0s));
}

// Admitted, then refused: the ring (4,096 slots) is full, so the put times out after it
// was counted; its task is taken back. And a put of a task counted beforehand (begin_task,
// as Python's feeder thread does) that is refused finishes that task.
TEST_P(JoinableQueueTest, APutRefusedAfterItsTaskWasCountedTakesItBack) {
  JoinableQueue<std::int64_t> q;
  std::int64_t n = 0;
  while (q.try_put(n, 10ms)) ++n;
  ASSERT_GE(n, 4096);  // the ring, then what the socket's buffer holds
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(q.get(), i);
    q.task_done();
  }
  EXPECT_TRUE(q.try_join(0s));
  EXPECT_ERROR(q.task_done(), std::logic_error, "task_done() called too many times");

  internal::QueueCore& core = internal::QueueAccess::core(q);
  core.begin_task();
  EXPECT_FALSE(q.try_join(0s));
  q.close();
  Encoder e;
  e.encode(std::int64_t{1});
  EXPECT_ERROR((void)core.put(std::move(e), std::nullopt, true), QueueClosed,
               "put() on a closed queue");
  EXPECT_TRUE(q.try_join(0s));
  core.begin_task();
  core.abandon_task();
  EXPECT_TRUE(q.try_join(0s));
}

TEST_P(JoinableQueueTest, TravelsAsAJoinableQueueAndAPlainOneIsRefusedAsOne) {
  auto [a, b] = pipe();
  JoinableQueue<std::int64_t> q;
  pid_t child = fork_child([&b] {
    auto received = b.recv<JoinableQueue<std::int64_t>>();
    if (received.get() != 5) std::_Exit(2);
    received.task_done();
    try {
      (void)b.recv<JoinableQueue<std::int64_t>>();
      std::_Exit(3);
    } catch (const ProtocolError&) {
    }
  });
  q.put(5);
  a.send(q);
  EXPECT_TRUE(q.try_join(30s));
  a.send(Queue<std::int64_t>());
  EXPECT_EQ(wait_child(child), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, JoinableQueueTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
