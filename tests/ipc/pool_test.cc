// Pool for both start methods: map/imap/imap_unordered/apply_async, tensors both ways
// through shared memory (torch's test_fd_pool / test_fs_pool), task errors, a worker dying
// mid-task, close/join/terminate, and nothing left behind.
#include "shmtensor/pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "process/pool_protocol.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace pool_test {

using namespace std::chrono_literals;
using shmtensor::DType;
using shmtensor::Pool;
using shmtensor::PoolOptions;
using shmtensor::SharingStrategy;
using shmtensor::StartMethod;
using shmtensor::Tensor;
using ::testing::HasSubstr;

int square(int x) { return x * x; }
std::string join_words(std::string a, std::string b, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += a + b;
  return out;
}
void do_nothing(int) {}
int fail_on_odd(int x) {
  if (x % 2 == 1) throw std::invalid_argument("odd input " + std::to_string(x));
  return x;
}
int die_on(int x) {
  if (x == 3) ::raise(SIGKILL);
  return x;
}
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
int my_pid(int) { return static_cast<int>(::getpid()); }

// Appends this worker's pid to the file at `path` through a stdio buffer that is never
// flushed here: the line reaches the file only if the worker ends in an orderly way (a
// child flushes its stdio before _exit), not if it is killed.
int append_pid_unflushed(std::string path) {
  static std::FILE* file = nullptr;
  if (file == nullptr) {
    file = std::fopen(path.c_str(), "a");
    if (file == nullptr) throw std::runtime_error("cannot open " + path);
    std::setvbuf(file, nullptr, _IOFBF, 1 << 16);
  }
  std::fprintf(file, "%d\n", static_cast<int>(::getpid()));
  return static_cast<int>(::getpid());
}

// A file name of its own for this test and process.
std::string scratch_file(const std::string& what) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name() + "_" + what;
  std::replace(name.begin(), name.end(), '/', '_');
  return (std::filesystem::temp_directory_path() /
          ("shmtensor_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

std::vector<int> read_pids(const std::string& path) {
  std::ifstream in(path);
  std::vector<int> out;
  for (int pid; in >> pid;) out.push_back(pid);
  return out;
}

// torch's pool tests: the worker writes into the tensor it was given (visible in the
// parent: same memory) and returns a new tensor (it arrives shared, not copied).
Tensor add_one_and_double(Tensor t) {
  t.add_(1.0);
  Tensor out = t.clone();            // private memory in the worker
  out.add_(t.data_ptr<float>()[0]);  // out = 2 * t for a constant tensor
  return out;
}

using Param = std::tuple<StartMethod, SharingStrategy>;

class PoolTest : public shmtensor::testing::StrategyRestoringTest,
                 public ::testing::WithParamInterface<Param> {
 protected:
  void SetUp() override {
    StrategyRestoringTest::SetUp();
    shmtensor::set_sharing_strategy(std::get<1>(GetParam()));
  }
  void TearDown() override {
    shmtensor::testing::expect_no_children();
    StrategyRestoringTest::TearDown();
  }
  PoolOptions options() const { return PoolOptions{.start_method = std::get<0>(GetParam())}; }
};

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  return std::string(std::get<0>(info.param) == StartMethod::kFork ? "Fork" : "Exec") +
         (std::get<1>(info.param) == SharingStrategy::kFileDescriptor ? "Fd" : "Fs");
}

TEST_P(PoolTest, MapKeepsInputOrder) {
  Pool pool(3, options());
  std::vector<int> inputs(50);
  std::iota(inputs.begin(), inputs.end(), 0);
  std::vector<int> out = pool.map(square, inputs);
  ASSERT_EQ(out.size(), inputs.size());
  for (int i = 0; i < 50; ++i) EXPECT_EQ(out[i], i * i);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, MapTensorsBothWays) {
  Pool pool(2, options());
  std::vector<Tensor> inputs;
  for (int i = 0; i < 8; ++i) inputs.push_back(Tensor::full({5, 5}, i, DType::kFloat32));
  std::vector<Tensor> out = pool.map(add_one_and_double, inputs);
  ASSERT_EQ(out.size(), inputs.size());
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(inputs[i].is_shared());
    EXPECT_TRUE(inputs[i].equal(Tensor::full({5, 5}, i + 1, DType::kFloat32)))
        << "the worker's in-place write is not visible: " << inputs[i].to_string();
    EXPECT_TRUE(out[i].is_shared());
    EXPECT_TRUE(out[i].equal(Tensor::full({5, 5}, 2 * (i + 1), DType::kFloat32)))
        << out[i].to_string();
  }
  pool.close();
  pool.join();
}

TEST_P(PoolTest, ApplyAsyncWithSeveralArguments) {
  Pool pool(2, options());
  auto f = pool.apply_async(join_words, std::string("ab"), std::string("c"), 3);
  auto g = pool.apply_async(do_nothing, 1);
  EXPECT_TRUE(g.wait_for(std::nullopt));  // no limit: waits until it is done
  EXPECT_TRUE(g.ready());
  EXPECT_EQ(f.get(), "abcabcabc");
  g.get();
  EXPECT_EQ(pool.apply(square, 12), 144);
  auto lambda = [](long a, long b) { return a - b; };
  EXPECT_EQ(pool.apply(lambda, 10L, 3L), 7);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, TaskExceptionIsRethrownAndThePoolGoesOn) {
  Pool pool(2, options());
  auto f = pool.apply_async(fail_on_odd, 7);
  try {
    f.get();
    ADD_FAILURE() << "no exception";
  } catch (const shmtensor::TaskError& e) {
    EXPECT_STREQ(e.what(), "std::invalid_argument: odd input 7");
    EXPECT_EQ(e.type_name(), "std::invalid_argument");
    EXPECT_EQ(e.message(), "odd input 7");
    auto pids = pool.pids();
    EXPECT_NE(std::find(pids.begin(), pids.end(), e.pid()), pids.end());
  }
  EXPECT_ERROR(pool.map(fail_on_odd, std::vector<int>{0, 2, 3, 4}), shmtensor::TaskError,
               "std::invalid_argument: odd input 3");
  EXPECT_EQ(pool.apply(fail_on_odd, 8), 8);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, StarmapUnpacksTuplesAndPairs) {
  Pool pool(2, options());
  std::vector<std::tuple<std::string, std::string, int>> words{
      {"ab", "c", 2}, {"x", "", 3}, {"", "", 5}, {"q", "r", 1}};
  EXPECT_EQ(pool.starmap(join_words, words), (std::vector<std::string>{"abcabc", "xxx", "", "qr"}));
  auto subtract = [](long a, long b) { return a - b; };
  std::vector<std::pair<long, long>> pairs{{10, 3}, {0, 5}, {7, 7}};
  EXPECT_EQ(pool.starmap(subtract, pairs), (std::vector<long>{7, -5, 0}));
  EXPECT_EQ(pool.starmap(subtract, pairs, /*chunksize=*/2), (std::vector<long>{7, -5, 0}));
  pool.close();
  pool.join();
}

TEST_P(PoolTest, ChunksizeKeepsOrderValuesAndPerInputErrors) {
  Pool pool(2, options());
  std::vector<int> inputs(23);
  std::iota(inputs.begin(), inputs.end(), 0);
  for (std::size_t chunksize : {1u, 2u, 5u, 23u, 100u}) {
    std::vector<int> out = pool.map(square, inputs, chunksize);
    ASSERT_EQ(out.size(), inputs.size()) << "chunksize " << chunksize;
    for (int i = 0; i < 23; ++i) EXPECT_EQ(out[i], i * i) << "chunksize " << chunksize;
    std::vector<int> unordered;
    for (int r : pool.imap_unordered(square, inputs, chunksize)) unordered.push_back(r);
    std::sort(unordered.begin(), unordered.end());
    EXPECT_EQ(unordered, (std::vector<int>(out.begin(), out.end()))) << "chunksize " << chunksize;
  }
  // In a chunk, an input that throws fails alone: the stream delivers the others' results
  // and that input's error in its place.
  auto stream = pool.imap(fail_on_odd, std::vector<int>{0, 2, 3, 4}, /*chunksize=*/4);
  EXPECT_EQ(stream.next(), 0);
  EXPECT_EQ(stream.next(), 2);
  try {
    (void)stream.next();
    ADD_FAILURE() << "no exception for input 3";
  } catch (const shmtensor::TaskError& e) {
    EXPECT_STREQ(e.what(), "std::invalid_argument: odd input 3");
    auto pids = pool.pids();
    EXPECT_NE(std::find(pids.begin(), pids.end(), e.pid()), pids.end());
  }
  EXPECT_EQ(stream.next(), 4);
  EXPECT_EQ(stream.next(), std::nullopt);
  // Tensors in chunks travel through shared memory both ways, as single tasks do.
  std::vector<Tensor> tensors;
  for (int i = 0; i < 6; ++i) tensors.push_back(Tensor::full({3}, i, DType::kFloat32));
  std::vector<Tensor> doubled = pool.map(add_one_and_double, tensors, /*chunksize=*/4);
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(tensors[i].equal(Tensor::full({3}, i + 1, DType::kFloat32)));
    EXPECT_TRUE(doubled[i].equal(Tensor::full({3}, 2 * (i + 1), DType::kFloat32)));
  }
  EXPECT_ERROR(pool.map(square, inputs, /*chunksize=*/0), std::invalid_argument,
               "Pool: chunksize must be at least 1");
  pool.close();
  pool.join();
}

TEST_P(PoolTest, WorkerDeathFailsItsWholeChunk) {
  Pool pool(1, options());
  auto stream = pool.imap(die_on, std::vector<int>{1, 2, 3, 4, 5, 6}, /*chunksize=*/3);
  // The first chunk (1, 2, 3) dies at 3: all three fail; the next chunk runs in a new worker.
  for (int i = 0; i < 3; ++i)
    EXPECT_ERROR((void)stream.next(), shmtensor::ProcessExitedException,
                 "terminated with signal SIGKILL while running this task");
  EXPECT_EQ(stream.next(), 4);
  EXPECT_EQ(stream.next(), 5);
  EXPECT_EQ(stream.next(), 6);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, MaxTasksPerChildReplacesWorkersAfterThatManyTasks) {
  PoolOptions opts = options();
  opts.max_tasks_per_child = 2;
  Pool pool(1, opts);
  std::vector<int> pids = pool.map(my_pid, std::vector<int>(6, 0));
  // One worker at a time, two tasks each: three processes, each for two tasks in a row.
  ASSERT_EQ(pids.size(), 6u);
  for (std::size_t i = 0; i < 6; i += 2) EXPECT_EQ(pids[i], pids[i + 1]) << i;
  EXPECT_NE(pids[0], pids[2]);
  EXPECT_NE(pids[2], pids[4]);
  EXPECT_NE(pids[0], pids[4]);
  // A chunk is one task.
  std::vector<int> chunked = pool.map(my_pid, std::vector<int>(8, 0), /*chunksize=*/4);
  EXPECT_EQ(std::set<int>(chunked.begin(), chunked.begin() + 4).size(), 1u);
  EXPECT_EQ(std::set<int>(chunked.begin() + 4, chunked.end()).size(), 1u);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, ReplacementWorkersEndInAnOrderlyWayAtJoin) {
  // One worker, two tasks each: the first worker is forked by the constructor, the later
  // ones by the dispatcher thread, and the last of them is still alive, its line in its
  // stdio buffer, when close() is called. Linux SIGKILLs a child (PR_SET_PDEATHSIG) when
  // the thread that forked it ends, so the dispatcher must outlive the workers it started:
  // then every worker exits by itself, flushing its line into the file.
  PoolOptions opts = options();
  opts.max_tasks_per_child = 2;
  const std::string path = scratch_file("pids");
  std::filesystem::remove(path);
  std::vector<int> pids;
  {
    Pool pool(1, opts);
    pids = pool.map(append_pid_unflushed, std::vector<std::string>(5, path));
    pool.close();
    pool.join();
  }
  ASSERT_EQ(pids.size(), 5u);
  EXPECT_EQ(std::set<int>(pids.begin(), pids.end()).size(), 3u);  // workers of 2, 2 and 1 tasks
  std::vector<int> written = read_pids(path);
  std::filesystem::remove(path);
  std::sort(pids.begin(), pids.end());
  std::sort(written.begin(), written.end());
  EXPECT_EQ(written, pids) << "a worker was killed instead of exiting (its lines are missing)";
}

TEST_P(PoolTest, WorkerExitsWhenTheParentClosesItsEnd) {
  // Two workers started as the Pool starts them (the second one knows the parent's end of
  // the first one's connection). Closing the parent's end, with no stop message and no
  // signal, is EOF for each worker: neither it nor its sibling holds a copy of that end.
  // reap() closes the parent's end, waits up to 20 s and only then kills: exit code 0 says
  // the worker saw EOF.
  using shmtensor::internal::WorkerGroup;
  using shmtensor::internal::WorkerLink;
  WorkerGroup group(std::get<0>(GetParam()), [](int index, WorkerLink link) {
    return shmtensor::internal::make_launch<true>(index, shmtensor::internal::pool_worker_main,
                                                  std::move(link));
  });
  group.start(0);
  group.start(1);
  EXPECT_EQ(group.reap(0, 20s).exit_code, 0) << "the first worker did not see EOF";
  EXPECT_FALSE(group.ended(1));
  EXPECT_EQ(group.reap(1, 20s).exit_code, 0) << "the second worker did not see EOF";
}

TEST_P(PoolTest, ImapOrderedAndUnordered) {
  Pool pool(3, options());
  std::vector<int> inputs{60, 0, 30, 10, 0, 20};
  std::vector<int> ordered;
  for (int r : pool.imap(sleep_ms, inputs)) ordered.push_back(r);
  EXPECT_EQ(ordered, inputs);
  auto stream = pool.imap_unordered(sleep_ms, inputs);
  std::vector<int> unordered;
  while (auto r = stream.next()) unordered.push_back(*r);
  EXPECT_FALSE(stream.next().has_value());
  std::sort(unordered.begin(), unordered.end());
  std::vector<int> sorted = inputs;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(unordered, sorted);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, WorkerDeathFailsItsTaskAndIsReplaced) {
  Pool pool(2, options());
  EXPECT_EQ(pool.apply(square, 2), 4);  // both workers are up
  auto before = pool.pids();
  auto f = pool.apply_async(die_on, 3);
  try {
    f.get();
    ADD_FAILURE() << "no exception";
  } catch (const shmtensor::ProcessExitedException& e) {
    EXPECT_THAT(e.what(), HasSubstr("terminated with signal SIGKILL while running this task"));
    EXPECT_EQ(e.signal_name(), "SIGKILL");
  }
  std::vector<int> inputs{1, 2, 4, 5, 6};
  EXPECT_EQ(pool.map(die_on, inputs), inputs);
  auto after = pool.pids();
  EXPECT_NE(before, after);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, UsesAllWorkers) {
  Pool pool(3, options());
  EXPECT_EQ(pool.processes(), 3);
  std::vector<int> inputs(30, 0);
  // Each task is slow enough that one worker cannot take them all.
  auto slow_pid = [](int) {
    std::this_thread::sleep_for(5ms);
    return static_cast<int>(::getpid());
  };
  auto pids = pool.map(slow_pid, inputs);
  std::sort(pids.begin(), pids.end());
  pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
  auto workers = pool.pids();
  std::sort(workers.begin(), workers.end());
  EXPECT_EQ(pids, workers);
  pool.close();
  pool.join();
}

TEST_P(PoolTest, CloseThenJoinFinishesSubmittedTasks) {
  Pool pool(2, options());
  auto f = pool.apply_async(sleep_ms, 200);
  EXPECT_ERROR(pool.join(), shmtensor::Error,
               "Pool::join: call close() or terminate() first");  // not closed yet
  pool.close();
  EXPECT_ERROR(pool.apply_async(square, 1), shmtensor::Error,
               "no tasks can be added after close() or terminate()");
  pool.join();
  EXPECT_EQ(f.get(), 200);
}

TEST_P(PoolTest, TerminateFailsUnfinishedTasks) {
  Pool pool(1, options());
  auto running = pool.apply_async(sleep_ms, 10000);
  auto queued = pool.apply_async(square, 3);
  std::this_thread::sleep_for(100ms);
  auto t0 = std::chrono::steady_clock::now();
  pool.terminate();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
  EXPECT_ERROR(running.get(), shmtensor::Error, "Pool: terminated before this task finished");
  EXPECT_ERROR(queued.get(), shmtensor::Error, "Pool: terminated before this task finished");
  pool.join();
}

TEST_P(PoolTest, DestructorStopsTheWorkers) {
  std::vector<int> pids;
  {
    Pool pool(2, options());
    pids = pool.pids();
    (void)pool.apply_async(sleep_ms, 10000);
  }
  for (int pid : pids) EXPECT_EQ(::kill(pid, 0), -1) << "worker " << pid << " survived";
}

INSTANTIATE_TEST_SUITE_P(StartMethodsAndStrategies, PoolTest,
                         ::testing::Combine(::testing::Values(StartMethod::kFork,
                                                              StartMethod::kExec),
                                            ::testing::Values(SharingStrategy::kFileDescriptor,
                                                              SharingStrategy::kFileSystem)),
                         name_of);

}  // namespace pool_test
