// DataLoader: which indices arrive, in which batches and order, for the option
// combinations; collation; worker info and seeds; iterable datasets; both start methods.
// Every test runs real worker processes and checks that nothing leaks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "shmtensor/shmtensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"

namespace shmtensor {
namespace {

using Batches = std::vector<std::vector<std::int64_t>>;

// Sample i is the number i; a batch is a 1-d int64 tensor.
struct Numbers {
  std::int64_t n = 10;
  SHMTENSOR_FIELDS(n)
  std::int64_t size() const { return n; }
  std::int64_t get(std::int64_t i) const { return i; }
};

std::vector<std::int64_t> values(const Tensor& t) {
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t[i].item<std::int64_t>());
  return v;
}

template <class Loader>
Batches epoch(Loader& loader) {
  Batches out;
  for (auto& batch : loader) out.push_back(values(batch));
  return out;
}

class DataLoaderTest : public testing::LeakCheckedTest {};

TEST_F(DataLoaderTest, MainProcessBatchesInOrderWithAndWithoutDropLast) {
  DataLoader loader(Numbers{10}, {.batch_size = 3});
  EXPECT_EQ(loader.size(), 4);
  EXPECT_EQ(epoch(loader), (Batches{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9}}));
  DataLoader dropping(Numbers{10}, {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(dropping.size(), 3);
  EXPECT_EQ(epoch(dropping), (Batches{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}}));
}

struct Combo {
  int workers;
  bool in_order;
  bool drop_last;
  int prefetch;
};

class DataLoaderCombos : public DataLoaderTest, public ::testing::WithParamInterface<Combo> {};

TEST_P(DataLoaderCombos, EveryIndexOnceInTheSamplersBatches) {
  const Combo c = GetParam();
  DataLoader loader(Numbers{23}, {.batch_size = 4,
                                  .drop_last = c.drop_last,
                                  .num_workers = c.workers,
                                  .prefetch_factor = c.prefetch,
                                  .in_order = c.in_order});
  Batches expected;
  for (std::int64_t b = 0; b < 23; b += 4) {
    std::vector<std::int64_t> batch;
    for (std::int64_t i = b; i < std::min<std::int64_t>(b + 4, 23); ++i) batch.push_back(i);
    if (!c.drop_last || batch.size() == 4) expected.push_back(batch);
  }
  EXPECT_EQ(loader.size(), static_cast<std::int64_t>(expected.size()));
  for (int e = 0; e < 2; ++e) {
    Batches got = epoch(loader);
    if (!c.in_order) std::sort(got.begin(), got.end());  // each batch is still whole
    EXPECT_EQ(got, expected) << "epoch " << e;
  }
  EXPECT_TRUE(loader.worker_pids().empty());  // not persistent: stopped at the end
}

INSTANTIATE_TEST_SUITE_P(Options, DataLoaderCombos,
                         ::testing::Values(Combo{1, true, false, 2}, Combo{2, true, true, 2},
                                           Combo{3, true, false, 1}, Combo{2, false, false, 2},
                                           Combo{3, false, true, 3}, Combo{1, false, true, 1}));

// Cells shared by the test and its (forked) workers: an int64 tensor in shared memory,
// read and written through std::atomic_ref (lock-free, so it works across processes).
struct Board {
  Tensor cells;
  explicit Board(std::int64_t n) : cells(Tensor::zeros({n}, DType::kInt64)) {
    cells.share_memory_();
  }
  std::atomic_ref<std::int64_t> operator[](std::int64_t i) const {
    return std::atomic_ref<std::int64_t>(const_cast<Tensor&>(cells).data_ptr<std::int64_t>()[i]);
  }
};

// Waits in a worker until ready() holds. A loader that does not behave as the test expects
// would make it wait forever: it gives up after 20 s with an exception, which the loader
// rethrows, so the test fails instead of hanging.
template <class Ready>
void wait_in_worker(Ready ready, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("gave up waiting for " + what);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Sample i is i. get() logs each index as it starts and as it finishes; get(held) first
// waits until release() says so. Board layout: [0] started count, [1, 1 + n) indices in
// the order get() started, [1 + n] finished count, [2 + n, 2 + 2n) indices in the order
// get() finished, [2 + 2n, 2 + 3n) the consumer's marks (the test sets [2 + 2n + i] when it
// has taken batch i), [2 + 3n] the started count when get(held) returned.
struct Held {
  std::int64_t n;
  std::int64_t held;
  std::function<bool(const Held&)> release;
  Board board{2 + 3 * n + 1};

  std::int64_t size() const { return n; }
  std::int64_t get(std::int64_t i) const {
    board[1 + board[0]++] = i;
    if (i == held) {
      wait_in_worker([&] { return release(*this); }, "the release of index " + std::to_string(i));
      board[2 + 3 * n] = board[0].load();
    }
    board[2 + n + board[1 + n]++] = i;
    return i;
  }
  std::vector<std::int64_t> started() const { return log(0); }
  std::vector<std::int64_t> finished() const { return log(1 + n); }
  bool finished_index(std::int64_t i) const {
    const auto done = finished();
    return std::find(done.begin(), done.end(), i) != done.end();
  }
  void take(std::int64_t i) const { board[2 + 2 * n + i] = 1; }
  bool taken(std::int64_t i) const { return board[2 + 2 * n + i] != 0; }
  std::int64_t started_when_released() const { return board[2 + 3 * n]; }

 private:
  std::vector<std::int64_t> log(std::int64_t at) const {
    std::vector<std::int64_t> out;
    for (std::int64_t k = 0; k < board[at]; ++k) out.push_back(board[at + 1 + k]);
    return out;
  }
};

TEST_F(DataLoaderTest, InOrderHandsOutSamplerOrderWhenWorkersFinishOutOfOrder) {
  // Two workers, prefetch 2: worker 0 loads batches 0 and 2, worker 1 batches 1 and 3.
  // get(0) waits until index 3 is loaded, so batches 1 and 3 are done before batch 0.
  const Held held{8, 0, [](const Held& h) { return h.finished_index(3); }};
  DataLoader loader(held, {.num_workers = 2, .prefetch_factor = 2, .in_order = true});
  EXPECT_EQ(epoch(loader), (Batches{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  const std::vector<std::int64_t> finished = loader.dataset().finished();
  ASSERT_GE(finished.size(), 3u);
  EXPECT_EQ(std::vector<std::int64_t>(finished.begin(), finished.begin() + 3),
            (std::vector<std::int64_t>{1, 3, 0}))
      << "the workers did not finish out of order";
  EXPECT_EQ(std::set<std::int64_t>(finished.begin(), finished.end()).size(), 8u);
}

TEST_F(DataLoaderTest, WithoutInOrderABatchIsHandedOutAsSoonAsItIsReady) {
  // Worker 0 has batches 0 and 2, worker 1 batches 1 and 3. get(0) waits until the
  // consumer has taken batches 1 and 3, which it can only do if they are handed out before
  // batch 0: the order is exactly 1, 3, 0, 2 (a loader that held 1 and 3 back for 0 would
  // leave get(0) waiting until it gives up, and fail the test).
  const Held held{4, 0, [](const Held& h) { return h.taken(1) && h.taken(3); }};
  DataLoader loader(held, {.num_workers = 2, .prefetch_factor = 2, .in_order = false});
  Batches got;
  for (auto& batch : loader) {
    got.push_back(values(batch));
    loader.dataset().take(got.back().at(0));
  }
  EXPECT_EQ(got, (Batches{{1}, {3}, {0}, {2}}));
}

TEST_F(DataLoaderTest, AtMostPrefetchFactorBatchesPerWorkerAreInFlight) {
  // Three workers, prefetch 2: batches 0..5 are asked for at begin(), round robin (worker
  // 0: 0, 3; worker 1: 1, 4; worker 2: 2, 5). get(0) holds batch 0 until every other
  // worker has started its two, then a little longer, so that a seventh batch asked for
  // too early would have its get() started too. No batch can be handed out before batch 0
  // (in order), so none may be asked for beyond the six: while get(0) runs, the gets
  // started are exactly 0 and the other workers' 1, 2, 4, 5.
  const Held held{30, 0, [](const Held& h) {
                    if (h.board[0] < 5) return false;
                    std::this_thread::sleep_for(std::chrono::milliseconds(200));
                    return true;
                  }};
  DataLoader loader(held, {.num_workers = 3, .prefetch_factor = 2, .in_order = true});
  Batches expected;
  for (std::int64_t i = 0; i < 30; ++i) expected.push_back({i});
  EXPECT_EQ(epoch(loader), expected);
  EXPECT_EQ(loader.dataset().started_when_released(), 5);
  const std::vector<std::int64_t> started = loader.dataset().started();
  ASSERT_GE(started.size(), 5u);
  EXPECT_EQ(std::set<std::int64_t>(started.begin(), started.begin() + 5),
            (std::set<std::int64_t>{0, 1, 2, 4, 5}));
  EXPECT_EQ(started.size(), 30u);
}

TEST_F(DataLoaderTest, ShuffleIsTheSeededPermutationNewEachEpochAndRepeatable) {
  DataLoader loader(Numbers{50}, {.batch_size = 50, .shuffle = true, .seed = 42, .num_workers = 2});
  const Batches first = epoch(loader), second = epoch(loader);
  EXPECT_EQ(first, Batches{random_permutation(50, epoch_seed(42, 0))});
  EXPECT_EQ(second, Batches{random_permutation(50, epoch_seed(42, 1))});
  EXPECT_NE(first, second);
  std::vector<std::int64_t> sorted = first[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, values(Tensor::arange(50)));
  DataLoader again(Numbers{50}, {.batch_size = 50, .shuffle = true, .seed = 42, .num_workers = 1});
  EXPECT_EQ(epoch(again), first);
}

TEST_F(DataLoaderTest, CustomSamplersGiveTheirOrder) {
  DataLoader by_sampler(
      Numbers{10},
      {.batch_size = 2, .sampler = std::vector<std::int64_t>{9, 3, 3, 0, 7}, .num_workers = 2});
  EXPECT_EQ(epoch(by_sampler), (Batches{{9, 3}, {3, 0}, {7}}));
  DataLoader per_epoch(Numbers{10}, {.sampler =
                                         [](std::int64_t e) {
                                           return std::vector<std::int64_t>{e, e};
                                         },
                                     .num_workers = 1});
  EXPECT_EQ(epoch(per_epoch), (Batches{{0}, {0}}));
  EXPECT_EQ(epoch(per_epoch), (Batches{{1}, {1}}));
  DataLoader by_batches(
      Numbers{10},
      {.batch_sampler = Batches{{5}, {1, 2, 3}, {8, 0}}, .num_workers = 2, .in_order = true});
  EXPECT_EQ(by_batches.size(), 3);
  EXPECT_EQ(epoch(by_batches), (Batches{{5}, {1, 2, 3}, {8, 0}}));
  DataLoader out_of_range(Numbers{10},
                          {.sampler = std::vector<std::int64_t>{10}, .num_workers = 1});
  EXPECT_ERROR(out_of_range.begin(), std::out_of_range,
               "sampler index 10 is out of range for a dataset of size 10");
}

TEST_F(DataLoaderTest, BatchesLongerThanATaskBoardEntryComeInOrderWithTheOthers) {
  // A task board entry holds the batch size's indices (at least 16, at most 512); a longer
  // batch's task travels as a message, between tasks on the board.
  Batches mixed{{4}, {}, {}, {0, 1}, {}, {9}};
  for (std::int64_t i = 0; i < 40; ++i) mixed[1].push_back(i % 50);
  for (std::int64_t i = 0; i < 17; ++i) mixed[2].push_back(49 - i);
  for (std::int64_t i = 0; i < 16; ++i) mixed[4].push_back(i * 3);
  for (StartMethod method : {StartMethod::kFork, StartMethod::kExec}) {
    for (bool in_order : {true, false}) {
      DataLoader loader(Numbers{50}, {.batch_sampler = mixed,
                                      .num_workers = 2,
                                      .in_order = in_order,
                                      .start_method = method});
      Batches got = epoch(loader);
      if (!in_order) std::sort(got.begin(), got.end());
      Batches want = mixed;
      if (!in_order) std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want) << "in_order " << in_order;
    }
  }
  // Batches of 600: every task in a message, the last batch (100) too.
  DataLoader large(Numbers{1300}, {.batch_size = 600, .num_workers = 1, .persistent_workers = true});
  for (int e = 0; e < 2; ++e) {
    const Batches got = epoch(large);
    ASSERT_EQ(got.size(), 3u);
    std::vector<std::int64_t> all;
    for (const auto& b : got) all.insert(all.end(), b.begin(), b.end());
    EXPECT_EQ(all, values(Tensor::arange(1300)));
    EXPECT_EQ(got[2].size(), 100u);
  }
}

TEST_F(DataLoaderTest, ASlowConsumerGetsEveryBatchFromAWorkerThatSleepsBetweenTasks) {
  // The consumer takes 2 ms per batch, longer than a worker spins (50 us at most), so the
  // worker sleeps for most tasks and the main process wakes it with a message. A lost
  // wake-up would leave a batch unmade: the timeout turns that into a DataLoaderTimeout.
  for (int prefetch : {1, 2, 5}) {
    DataLoader loader(Numbers{30}, {.batch_size = 3,
                                    .num_workers = 2,
                                    .prefetch_factor = prefetch,
                                    .persistent_workers = true,
                                    .timeout = std::chrono::seconds(20)});
    for (int e = 0; e < 2; ++e) {
      Batches got;
      for (auto& batch : loader) {
        got.push_back(values(batch));
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      Batches want;
      for (std::int64_t b = 0; b < 10; ++b) want.push_back({3 * b, 3 * b + 1, 3 * b + 2});
      EXPECT_EQ(got, want) << "prefetch " << prefetch << ", epoch " << e;
    }
  }
}

// Sample i: (i, worker id, worker seed, num_workers) as seen by get() in the worker.
struct WhoLoads {
  std::int64_t size() const { return 12; }
  std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t> get(std::int64_t i) const {
    auto info = get_worker_info();
    if (!info) return {i, -1, -1, 0};
    return {i, info->id, static_cast<std::int64_t>(info->seed), info->num_workers};
  }
};

TEST_F(DataLoaderTest, EachWorkerHasItsIdAndSeedAndBatchesGoRoundRobin) {
  EXPECT_FALSE(get_worker_info().has_value());
  DataLoader loader(WhoLoads{}, {.batch_size = 2, .seed = 100, .num_workers = 3});
  EXPECT_EQ(loader.base_seed(), 100u);
  std::int64_t k = 0;
  for (auto& [index, worker, seed, workers] : loader) {
    EXPECT_EQ(values(index), (std::vector<std::int64_t>{2 * k, 2 * k + 1}));
    EXPECT_EQ(values(worker), (std::vector<std::int64_t>{k % 3, k % 3}));
    EXPECT_EQ(values(seed), (std::vector<std::int64_t>{100 + k % 3, 100 + k % 3}));
    EXPECT_EQ(values(workers), (std::vector<std::int64_t>{3, 3}));
    ++k;
  }
  EXPECT_EQ(k, 6);
  DataLoader here(WhoLoads{}, {.batch_size = 12});
  for (auto& [index, worker, seed, workers] : here)
    EXPECT_EQ(values(worker), std::vector<std::int64_t>(12, -1));
}

struct Record {
  Tensor pixels;
  std::int32_t label = 0;
  std::string name;
  std::map<std::string, double> extra;
  SHMTENSOR_FIELDS(pixels, label, name, extra)
};
struct Records {
  std::int64_t size() const { return 4; }
  Record get(std::int64_t i) const {
    return {Tensor::full({2, 3}, static_cast<double>(i)),
            static_cast<std::int32_t>(10 * i),
            "r" + std::to_string(i),
            {{"w", 0.5 * static_cast<double>(i)}}};
  }
};

TEST_F(DataLoaderTest, DefaultCollateStacksFieldByFieldIntoSharedMemoryInWorkers) {
  for (int workers : {0, 2}) {
    DataLoader loader(Records{}, {.batch_size = 2, .num_workers = workers});
    std::int64_t b = 0;
    for (auto& [pixels, label, name, extra] : loader) {
      EXPECT_EQ(pixels.sizes(), (std::vector<std::int64_t>{2, 2, 3}));
      EXPECT_EQ(pixels.is_shared(), workers > 0);  // made in shared memory by the worker
      EXPECT_TRUE(pixels[1].equal(Tensor::full({2, 3}, static_cast<double>(2 * b + 1))));
      EXPECT_EQ(label.dtype(), DType::kInt32);
      EXPECT_EQ(values(label.to(DType::kInt64)), (std::vector<std::int64_t>{20 * b, 20 * b + 10}));
      EXPECT_EQ(name, (std::vector<std::string>{"r" + std::to_string(2 * b),
                                                "r" + std::to_string(2 * b + 1)}));
      EXPECT_EQ(extra.at("w").dtype(), DType::kFloat64);
      EXPECT_EQ(extra.at("w")[1].item<double>(), 0.5 * static_cast<double>(2 * b + 1));
      ++b;
    }
    EXPECT_EQ(b, 2);
  }
}

// Iterable: the numbers [0, limit), each worker taking every num_workers-th from its id.
struct Shards {
  std::int64_t limit = 10;
  struct It {
    std::int64_t value, step, limit;
    std::int64_t operator*() const { return value; }
    It& operator++() {
      value += step;
      return *this;
    }
    bool operator==(const It& o) const {
      return std::min(value, limit) == std::min(o.value, o.limit);
    }
  };
  It begin() const {
    auto info = get_worker_info();
    return info ? It{info->id, info->num_workers, limit} : It{0, 1, limit};
  }
  It end() const { return It{limit, 1, limit}; }
};

TEST_F(DataLoaderTest, IterableDatasetShardedByWorkerInfo) {
  DataLoader here(Shards{}, {.batch_size = 4});
  EXPECT_EQ(epoch(here), (Batches{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}));
  DataLoader two(Shards{}, {.batch_size = 2, .num_workers = 2});
  const Batches expected{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8}, {9}};
  EXPECT_EQ(epoch(two), expected);
  EXPECT_EQ(epoch(two), expected);  // a new epoch iterates again
  DataLoader dropping(
      Shards{}, {.batch_size = 2, .drop_last = true, .num_workers = 2, .persistent_workers = true});
  EXPECT_EQ(epoch(dropping), (Batches{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(epoch(dropping), (Batches{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  DataLoader three(Shards{7}, {.batch_size = 2, .num_workers = 3, .in_order = false});
  Batches got = epoch(three);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (Batches{{0, 3}, {1, 4}, {2, 5}, {6}}));
}

TEST_F(DataLoaderTest, PersistentWorkersServeEveryEpoch) {
  DataLoader loader(Numbers{9}, {.batch_size = 2, .num_workers = 2, .persistent_workers = true});
  EXPECT_TRUE(loader.worker_pids().empty());  // nothing starts before begin()
  const Batches expected{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8}};
  EXPECT_EQ(epoch(loader), expected);
  const std::vector<int> pids = loader.worker_pids();
  ASSERT_EQ(pids.size(), 2u);
  for (int e = 1; e < 4; ++e) {
    EXPECT_EQ(epoch(loader), expected);
    EXPECT_EQ(loader.worker_pids(), pids);
  }
  // An epoch left early: the next one starts clean on the same workers.
  for (auto& batch : loader) {
    EXPECT_EQ(values(batch), (std::vector<std::int64_t>{0, 1}));
    break;
  }
  EXPECT_EQ(epoch(loader), expected);
  EXPECT_EQ(loader.worker_pids(), pids);
  EXPECT_EQ(loader.epochs(), 6);
}

TEST_F(DataLoaderTest, AnEpochLeftEarlyLeavesPersistentWorkersTasksThatTheNextEpochWaitsFor) {
  // Each worker's board holds prefetch_factor tasks; an epoch left after one batch leaves
  // the others on it, unanswered. The next epoch's tasks go on the board only as the
  // workers answer those (their batches are dropped), and iterable workers start over.
  for (int prefetch : {1, 3}) {
    DataLoader map_style(Numbers{12}, {.batch_size = 2,
                                       .num_workers = 2,
                                       .prefetch_factor = prefetch,
                                       .persistent_workers = true,
                                       .timeout = std::chrono::seconds(20)});
    DataLoader iterable(Shards{}, {.batch_size = 2,
                                   .num_workers = 2,
                                   .prefetch_factor = prefetch,
                                   .persistent_workers = true,
                                   .timeout = std::chrono::seconds(20)});
    const std::vector<int> pids = [&] {
      (void)epoch(map_style);
      return map_style.worker_pids();
    }();
    for (int round = 0; round < 3; ++round) {
      for (auto& batch : map_style) {
        EXPECT_EQ(values(batch), (std::vector<std::int64_t>{0, 1}));
        break;
      }
      for (auto& batch : iterable) {
        EXPECT_EQ(values(batch), (std::vector<std::int64_t>{0, 2}));
        break;
      }
    }
    EXPECT_EQ(epoch(map_style), (Batches{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}}))
        << "prefetch " << prefetch;
    EXPECT_EQ(epoch(iterable), (Batches{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8}, {9}}))
        << "prefetch " << prefetch;
    EXPECT_EQ(map_style.worker_pids(), pids);
  }
}

// In a worker process: the id worker_init_fn was called with there (-1: it was not).
std::int64_t g_initialized_as = -1;
void remember_worker(int id) {
  if (id < 0) throw std::logic_error("worker ids start at 0");
  g_initialized_as = id;
}

// Sample i: (i, the id this process's worker_init_fn got). Encodable, for kExec.
struct NumbersAndInit {
  std::int64_t n = 7;
  SHMTENSOR_FIELDS(n)
  std::int64_t size() const { return n; }
  std::tuple<std::int64_t, std::int64_t> get(std::int64_t i) const { return {i, g_initialized_as}; }
};

TEST_F(DataLoaderTest, ExecStartMethodRunsEncodableDatasets) {
  DataLoader loader(NumbersAndInit{7}, {.batch_size = 2,
                                        .num_workers = 2,
                                        .worker_init_fn = &remember_worker,
                                        .start_method = StartMethod::kExec});
  Batches indices;
  for (auto& [index, initialized_as] : loader) {
    // Batch b comes from worker b % 2, whose worker_init_fn ran before its get().
    const auto b = static_cast<std::int64_t>(indices.size());
    indices.push_back(values(index));
    EXPECT_EQ(values(initialized_as), std::vector<std::int64_t>(index.numel(), b % 2))
        << "batch " << b;
  }
  EXPECT_EQ(indices, (Batches{{0, 1}, {2, 3}, {4, 5}, {6}}));
  EXPECT_EQ(g_initialized_as, -1);  // it ran in the workers only
  DataLoader seeded(
      WhoLoads{},
      {.batch_size = 6, .seed = 7, .num_workers = 2, .start_method = StartMethod::kExec});
  std::int64_t k = 0;
  for (auto& [index, worker, seed, workers] : seeded) {
    EXPECT_EQ(values(seed), std::vector<std::int64_t>(6, 7 + k));
    EXPECT_TRUE(index.is_shared());
    ++k;
  }
  EXPECT_EQ(k, 2);
}

std::int64_t sum_of(std::vector<std::int64_t> samples) {
  return std::accumulate(samples.begin(), samples.end(), std::int64_t{0});
}

TEST_F(DataLoaderTest, CustomCollateFunctionWithBothStartMethods) {
  for (StartMethod method : {StartMethod::kFork, StartMethod::kExec}) {
    // A function pointer: a re-executed worker finds it again by module and offset.
    DataLoader loader(
        Numbers{7},
        DataLoaderOptions{
            .batch_size = 2, .num_workers = 2, .start_method = method, .collate_fn = &sum_of});
    static_assert(std::is_same_v<decltype(loader)::Batch, std::int64_t>);
    std::vector<std::int64_t> sums;
    for (std::int64_t sum : loader) sums.push_back(sum);
    EXPECT_EQ(sums, (std::vector<std::int64_t>{1, 5, 9, 6}))
        << (method == StartMethod::kFork ? "fork" : "exec");
  }
  // kFork runs the loader's own collate_fn in the forked worker, captures and all.
  const std::int64_t scale = 10;
  auto scaled_batch = [scale](std::vector<std::int64_t> samples) {
    Tensor out = empty_batch({static_cast<std::int64_t>(samples.size())}, DType::kInt64);
    for (std::size_t k = 0; k < samples.size(); ++k)
      out.data_ptr<std::int64_t>()[k] = scale * samples[k];
    return out;
  };
  DataLoader scaled(
      Numbers{5}, DataLoaderOptions{.batch_size = 2, .num_workers = 2, .collate_fn = scaled_batch});
  Batches got;
  for (auto& batch : scaled) {
    EXPECT_TRUE(batch.is_shared());  // empty_batch in a worker: shared memory
    got.push_back(values(batch));
  }
  EXPECT_EQ(got, (Batches{{0, 10}, {20, 30}, {40}}));
}

// The seed workload at a size the tests can afford: every batch kept, and the consumer
// ends up with a handful of segments, not one per tensor.
struct FourTensors {
  std::int64_t size() const { return 20000; }
  std::array<Tensor, 4> get(std::int64_t i) const {
    const auto v = static_cast<double>(i);
    return {Tensor::full({10}, v), Tensor::full({10}, v + 1), Tensor::full({10}, v + 2),
            Tensor::full({10}, v + 3)};
  }
};

TEST_F(DataLoaderTest, KeepsTwentyThousandSamplesInAFewSegments) {
  DataLoader loader(FourTensors{}, {.num_workers = 2, .prefetch_factor = 16});
  std::vector<std::array<Tensor, 4>> kept;
  for (auto& batch : loader) kept.push_back(batch);
  ASSERT_EQ(kept.size(), 20000u);
  for (std::size_t i = 0; i < kept.size(); i += 997)
    for (std::size_t k = 0; k < 4; ++k)
      EXPECT_EQ(kept[i][k][0][9].item<float>(), static_cast<float>(i + k));
  EXPECT_EQ(kept[19999][3][0][0].item<float>(), 20002.0f);
  // 80,000 batch tensors of 40 bytes in 64-byte arena blocks (1, 2, 4 MiB segments per
  // worker): a few segments.
  EXPECT_LT(testing::shmtensor_mappings().size(), 20u);
}

// Two processes of a job of two (here two loaders in one process, with their own workers)
// together load every sample of each epoch exactly once, each in its sampler's order.
TEST_F(DataLoaderTest, DistributedSamplersOfEveryRankTogetherLoadEachSampleOnce) {
  auto loader_of = [](std::int64_t rank) {
    return DataLoader(Numbers{14}, {.batch_size = 3,
                                    .sampler = DistributedSampler(
                                        14, {.num_replicas = 2, .rank = rank, .seed = 9}),
                                    .num_workers = 2});
  };
  auto rank0 = loader_of(0), rank1 = loader_of(1);
  EXPECT_EQ(rank0.size(), 3);  // 7 samples each, in batches of 3
  std::vector<std::int64_t> first_epoch;
  for (std::int64_t e = 0; e < 2; ++e) {
    std::vector<std::int64_t> seen;
    for (auto* loader : {&rank0, &rank1}) {
      std::vector<std::int64_t> order;
      for (const auto& batch : epoch(*loader))
        order.insert(order.end(), batch.begin(), batch.end());
      const std::int64_t rank = loader == &rank0 ? 0 : 1;
      EXPECT_EQ(order,
                DistributedSampler(14, {.num_replicas = 2, .rank = rank, .seed = 9}).indices(e))
          << "rank " << rank << " epoch " << e;
      seen.insert(seen.end(), order.begin(), order.end());
    }
    if (e == 0)
      first_epoch = seen;
    else
      EXPECT_NE(seen, first_epoch);  // a new shuffle each epoch
    std::vector<std::int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, values(Tensor::arange(14))) << "epoch " << e;
  }
}

}  // namespace
}  // namespace shmtensor
