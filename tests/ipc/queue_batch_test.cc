// Queue::put_many / try_put_many / get_many / try_get_many across real forked processes,
// both sharing strategies: order, exact values, bounded queues smaller than a batch,
// timeouts, close. (A batch that meets a malformed item: hostile_frames_test.cc.)
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "shmtensor/queue.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

using namespace std::chrono_literals;
using testing::fork_child;
using testing::wait_child;

class QueueBatchTest : public testing::StrategyTest {};

using Item = std::pair<std::int64_t, Tensor>;

std::vector<Item> items(std::int64_t from, std::int64_t count) {
  std::vector<Item> out;
  for (std::int64_t i = from; i < from + count; ++i)
    out.emplace_back(i, Tensor::full({3}, static_cast<double>(i), DType::kFloat64));
  return out;
}

// A bounded queue of 8 and batches of 100: a producer that waits for room must wake the
// consumer first, or both would wait (the consumer for ever, in get_many).
TEST_P(QueueBatchTest, BatchesLargerThanABoundedQueueCrossProcessesInOrder) {
  constexpr std::int64_t kTotal = 2000;
  Queue<Item> q(8);
  pid_t producer = fork_child([&q] {
    for (std::int64_t from = 0; from < kTotal; from += 100) q.put_many(items(from, 100));
  });
  std::int64_t next = 0;
  std::size_t batches = 0;
  while (next < kTotal) {
    std::vector<Item> got = q.get_many(50);
    ASSERT_GE(got.size(), 1u);
    ASSERT_LE(got.size(), 50u);
    ++batches;
    for (const auto& [i, t] : got) {
      ASSERT_EQ(i, next);
      ASSERT_EQ(t.numel(), 3);
      EXPECT_EQ(t.data_ptr<double>()[2], static_cast<double>(next));
      ++next;
    }
  }
  EXPECT_EQ(wait_child(producer), 0);
  EXPECT_LE(batches, static_cast<std::size_t>(kTotal));
  EXPECT_TRUE(q.try_get_many(10).empty());
}

// A consumer that waits in poll() on the readiness fd, not in the ring: a batch larger than
// the bounded queue must signal the fd before it waits for room, or both would wait (the
// consumer until its poll times out, the producer for ever).
TEST_P(QueueBatchTest, ABatchSignalsTheReadinessFdBeforeItWaitsForRoom) {
  Queue<std::int64_t> q(8);
  const int ready = q.readiness_fd();
  pid_t consumer = fork_child([&q, ready] {
    std::vector<std::int64_t> got;
    const auto start = std::chrono::steady_clock::now();
    while (got.size() < 100) {
      pollfd p{ready, POLLIN, 0};
      ASSERT_EQ(::poll(&p, 1, 10000), 1) << "the readiness fd stayed silent with "
                                          << got.size() << " items taken";
      std::vector<std::int64_t> more = q.try_get_many(100);
      got.insert(got.end(), more.begin(), more.end());
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
    for (std::int64_t i = 0; i < 100; ++i) EXPECT_EQ(got[i], i);
  });
  std::vector<std::int64_t> values(100);
  for (std::int64_t i = 0; i < 100; ++i) values[i] = i;
  q.put_many(values);
  EXPECT_EQ(wait_child(consumer), 0);
}

// More than the 64 items of one receive buffer in one call.
TEST_P(QueueBatchTest, GetManyTakesMoreThanOneBuffersWorth) {
  Queue<Item> q;
  q.put_many(items(0, 150));
  std::vector<Item> got = q.get_many(1000);
  ASSERT_EQ(got.size(), 150u);
  for (std::int64_t i = 0; i < 150; ++i) {
    EXPECT_EQ(got[i].first, i);
    EXPECT_EQ(got[i].second.data_ptr<double>()[0], static_cast<double>(i));
  }
}

TEST_P(QueueBatchTest, TryPutManyPutsThePrefixThatFitsBeforeItsTimeout) {
  Queue<std::int64_t> q(5);
  const std::vector<std::int64_t> values{0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(q.try_put_many(values, 20ms), 5u);
  EXPECT_EQ(q.size(), 5u);
  EXPECT_EQ(q.try_put_many(values), 0u);  // full, and no time to wait
  EXPECT_EQ(q.try_get_many(10), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  EXPECT_TRUE(q.try_get_many(10).empty());
  EXPECT_TRUE(q.try_get_many(10, 10ms).empty());
  EXPECT_TRUE(q.try_get_many(0).empty());
}

// get_many waits for the first item only, then takes what is there; a consumer asleep in
// it is woken by a batch put in another process.
TEST_P(QueueBatchTest, GetManyWaitsForTheFirstItemThenTakesWhatIsThere) {
  Queue<std::int64_t> q;
  Queue<int> go;
  pid_t producer = fork_child([&] {
    (void)go.get();
    std::this_thread::sleep_for(20ms);  // the consumer is asleep in get_many by now
    q.put_many(std::vector<std::int64_t>{10, 11, 12, 13});
  });
  go.put(1);
  std::vector<std::int64_t> got = q.get_many(100);
  ASSERT_GE(got.size(), 1u);
  while (got.size() < 4) {
    std::vector<std::int64_t> more = q.get_many(100);
    got.insert(got.end(), more.begin(), more.end());
  }
  EXPECT_EQ(got, (std::vector<std::int64_t>{10, 11, 12, 13}));
  EXPECT_EQ(wait_child(producer), 0);
}

TEST_P(QueueBatchTest, AClosedQueueRefusesBatchesAndDrainsThenSaysClosed) {
  Queue<std::int64_t> q;
  q.put_many(std::vector<std::int64_t>{1, 2, 3});
  q.close();
  EXPECT_ERROR(q.put_many(std::vector<std::int64_t>{4}), QueueClosed, "put() on a closed queue");
  EXPECT_ERROR((void)q.try_put_many(std::vector<std::int64_t>{4}, 10ms), QueueClosed,
               "put() on a closed queue");
  EXPECT_EQ(q.get_many(2), (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(q.get_many(2), (std::vector<std::int64_t>{3}));
  EXPECT_ERROR((void)q.get_many(2), QueueClosed, "get() on a closed and empty queue");
  EXPECT_ERROR((void)q.try_get_many(2, 10ms), QueueClosed, "get() on a closed and empty queue");
}

// Many producers' batches to many consumers' batches: each item exactly once, each
// producer's in order.
TEST_P(QueueBatchTest, ManyProducersAndConsumersGetEachItemOnceInEachProducersOrder) {
  constexpr int kProducers = 3, kConsumers = 2;
  static constexpr std::int64_t kPerProducer = 3000;
  Queue<std::pair<int, std::int64_t>> q(64);
  Queue<std::vector<std::pair<int, std::int64_t>>> results;
  std::vector<pid_t> children;
  for (int p = 0; p < kProducers; ++p)
    children.push_back(fork_child([&q, p] {
      for (std::int64_t from = 0; from < kPerProducer; from += 37) {
        std::vector<std::pair<int, std::int64_t>> batch;
        for (std::int64_t i = from; i < std::min(from + 37, kPerProducer); ++i)
          batch.emplace_back(p, i);
        q.put_many(batch);
      }
    }));
  std::vector<pid_t> consumers;
  for (int c = 0; c < kConsumers; ++c)
    consumers.push_back(fork_child([&q, &results] {
      std::vector<std::pair<int, std::int64_t>> mine;
      try {
        for (;;) {
          std::vector<std::pair<int, std::int64_t>> got = q.get_many(16);
          mine.insert(mine.end(), got.begin(), got.end());
        }
      } catch (const QueueClosed&) {
      }
      results.put(mine);
    }));
  for (pid_t pid : children) EXPECT_EQ(wait_child(pid), 0);
  q.close();  // every producer is done: consumers drain, then stop
  std::vector<std::vector<std::int64_t>> seen(kProducers);
  for (int c = 0; c < kConsumers; ++c) {
    std::vector<std::int64_t> last(kProducers, -1);
    for (const auto& [p, i] : results.get()) {
      ASSERT_GE(p, 0);
      ASSERT_LT(p, kProducers);
      EXPECT_GT(i, last[p]) << "producer " << p << "'s items out of order";
      last[p] = i;
      seen[p].push_back(i);
    }
  }
  for (pid_t pid : consumers) EXPECT_EQ(wait_child(pid), 0);
  for (int p = 0; p < kProducers; ++p) {
    std::sort(seen[p].begin(), seen[p].end());
    ASSERT_EQ(seen[p].size(), static_cast<std::size_t>(kPerProducer));
    for (std::int64_t i = 0; i < kPerProducer; ++i) ASSERT_EQ(seen[p][i], i);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, QueueBatchTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
