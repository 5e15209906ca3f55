// DataLoader: which indices arrive, in which batches and order, for the option
// combinations; collation; worker info and seeds; iterable datasets; both start methods.
// Every test runs real worker processes and checks that nothing leaks.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "shmtensor/shmtensor.h"
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
  DataLoader loader(Numbers{23}, {.batch_size = 4, .drop_last = c.drop_last,
                                  .num_workers = c.workers, .prefetch_factor = c.prefetch,
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
  DataLoader by_sampler(Numbers{10}, {.batch_size = 2, .sampler = std::vector<std::int64_t>{9, 3, 3, 0, 7},
                                      .num_workers = 2});
  EXPECT_EQ(epoch(by_sampler), (Batches{{9, 3}, {3, 0}, {7}}));
  DataLoader per_epoch(Numbers{10}, {.sampler = [](std::int64_t e) { return std::vector<std::int64_t>{e, e}; },
                                     .num_workers = 1});
  EXPECT_EQ(epoch(per_epoch), (Batches{{0}, {0}}));
  EXPECT_EQ(epoch(per_epoch), (Batches{{1}, {1}}));
  DataLoader by_batches(Numbers{10}, {.batch_sampler = Batches{{5}, {1, 2, 3}, {8, 0}}, .num_workers = 2,
                                      .in_order = true});
  EXPECT_EQ(by_batches.size(), 3);
  EXPECT_EQ(epoch(by_batches), (Batches{{5}, {1, 2, 3}, {8, 0}}));
  DataLoader out_of_range(Numbers{10}, {.sampler = std::vector<std::int64_t>{10}, .num_workers = 1});
  EXPECT_THROW(out_of_range.begin(), std::out_of_range);
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
  for (auto& [index, worker, seed, workers] : here) EXPECT_EQ(values(worker), std::vector<std::int64_t>(12, -1));
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
    return {Tensor::full({2, 3}, static_cast<double>(i)), static_cast<std::int32_t>(10 * i),
            "r" + std::to_string(i), {{"w", 0.5 * static_cast<double>(i)}}};
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
      EXPECT_EQ(name, (std::vector<std::string>{"r" + std::to_string(2 * b), "r" + std::to_string(2 * b + 1)}));
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
    bool operator==(const It& o) const { return std::min(value, limit) == std::min(o.value, o.limit); }
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
  DataLoader dropping(Shards{}, {.batch_size = 2, .drop_last = true, .num_workers = 2,
                                 .persistent_workers = true});
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

void remember_worker(int id) {
  if (id < 0) throw std::logic_error("worker ids start at 0");
}

TEST_F(DataLoaderTest, ExecStartMethodRunsEncodableDatasets) {
  DataLoader loader(Numbers{7}, {.batch_size = 2, .num_workers = 2, .worker_init_fn = &remember_worker,
                                 .start_method = StartMethod::kExec});
  EXPECT_EQ(epoch(loader), (Batches{{0, 1}, {2, 3}, {4, 5}, {6}}));
  DataLoader seeded(WhoLoads{}, {.batch_size = 6, .seed = 7, .num_workers = 2,
                                 .start_method = StartMethod::kExec});
  std::int64_t k = 0;
  for (auto& [index, worker, seed, workers] : seeded) {
    EXPECT_EQ(values(seed), std::vector<std::int64_t>(6, 7 + k));
    EXPECT_TRUE(index.is_shared());
    ++k;
  }
  EXPECT_EQ(k, 2);
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

}  // namespace
}  // namespace shmtensor
