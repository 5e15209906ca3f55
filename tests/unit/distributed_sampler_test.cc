// DistributedSampler: torch's exact index lists (hand-computed and, where /usr/bin/python3
// has torch, torch's own), coverage and duplicates over ranks, the seeded shuffle, and
// num_replicas / rank from the launchers' environment variables with every error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "shmtensor/error.h"
#include "shmtensor/sampler.h"

namespace shmtensor {
namespace {

using Indices = std::vector<std::int64_t>;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<Indices> every_rank(std::int64_t n, std::int64_t replicas, bool drop_last,
                                bool shuffle = false, std::uint64_t seed = 0,
                                std::int64_t epoch = 0) {
  std::vector<Indices> out;
  for (std::int64_t r = 0; r < replicas; ++r)
    out.push_back(DistributedSampler(n, {.num_replicas = replicas,
                                         .rank = r,
                                         .shuffle = shuffle,
                                         .seed = seed,
                                         .drop_last = drop_last})
                      .indices(epoch));
  return out;
}

TEST(DistributedSamplerTest, WithoutDropLastTheOrderIsPaddedFromItsStart) {
  // 10 over 4: padded to 12 with 0, 1.
  EXPECT_EQ(every_rank(10, 4, false),
            (std::vector<Indices>{{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}}));
  // 10 over 3: padded to 12 with 0, 1.
  EXPECT_EQ(every_rank(10, 3, false),
            (std::vector<Indices>{{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}}));
  // 2 over 5: the padding (3) is longer than the order, which repeats: 0 1 | 0 1 0.
  EXPECT_EQ(every_rank(2, 5, false), (std::vector<Indices>{{0}, {1}, {0}, {1}, {0}}));
  EXPECT_EQ(every_rank(8, 4, false), (std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(every_rank(0, 3, false), (std::vector<Indices>{{}, {}, {}}));

  const DistributedSampler s(10, {.num_replicas = 4, .rank = 2, .shuffle = false});
  EXPECT_EQ(s.num_samples(), 3);
  EXPECT_EQ(s.total_size(), 12);
  EXPECT_EQ(s.num_replicas(), 4);
  EXPECT_EQ(s.rank(), 2);
  EXPECT_EQ(s.indices(5), (Indices{2, 6, 0}));  // without shuffle every epoch is the same
}

TEST(DistributedSamplerTest, WithDropLastTheTailIsDropped) {
  EXPECT_EQ(every_rank(10, 4, true), (std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(every_rank(10, 3, true), (std::vector<Indices>{{0, 3, 6}, {1, 4, 7}, {2, 5, 8}}));
  EXPECT_EQ(every_rank(8, 4, true), (std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(every_rank(3, 4, true), (std::vector<Indices>{{}, {}, {}, {}}));

  const DistributedSampler s(10, {.num_replicas = 3, .rank = 0, .drop_last = true});
  EXPECT_EQ(s.num_samples(), 3);
  EXPECT_EQ(s.total_size(), 9);
  const DistributedSampler none(3, {.num_replicas = 4, .rank = 3, .drop_last = true});
  EXPECT_EQ(none.num_samples(), 0);
  EXPECT_EQ(none.total_size(), 0);
}

std::optional<std::string> run_python(const std::string& program) {
  const std::string command = "/usr/bin/python3 -c '" + program + "' 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buffer[4096];
  for (std::size_t got; (got = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;)
    out.append(buffer, got);
  if (::pclose(pipe) != 0) return std::nullopt;
  return out;
}

TEST(DistributedSamplerTest, IndexListsAreTorchsOwnWithoutShuffle) {
  if (!run_python("import torch.utils.data.distributed"))
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (Debian: apt-get install python3-torch)";
  struct Case {
    std::int64_t n, replicas, rank;
    bool drop_last;
  };
  std::vector<Case> cases;
  for (std::int64_t n : {0, 1, 2, 3, 5, 7, 10, 12, 13})
    for (std::int64_t replicas : {1, 2, 3, 4, 5, 8})
      for (std::int64_t rank = 0; rank < replicas; ++rank)
        for (bool drop_last : {false, true}) cases.push_back({n, replicas, rank, drop_last});
  std::string list;
  for (const Case& c : cases)
    list += "(" + std::to_string(c.n) + "," + std::to_string(c.replicas) + "," +
            std::to_string(c.rank) + "," + (c.drop_last ? "True" : "False") + "),";
  const std::optional<std::string> out = run_python(
      "from torch.utils.data.distributed import DistributedSampler as D\n"
      "for n, r, k, d in [" +
      list +
      "]:\n"
      "  s = D(range(n), num_replicas=r, rank=k, shuffle=False, drop_last=d)\n"
      "  print(len(s), s.total_size, *list(s))\n");
  ASSERT_TRUE(out) << "the torch program failed";
  std::istringstream lines(*out);
  std::string line;
  for (const Case& c : cases) {
    ASSERT_TRUE(std::getline(lines, line)) << "torch printed too few lines";
    std::istringstream fields(line);
    std::int64_t num_samples = -1, total_size = -1;
    fields >> num_samples >> total_size;
    Indices expected;
    for (std::int64_t i; fields >> i;) expected.push_back(i);
    const DistributedSampler s(
        c.n,
        {.num_replicas = c.replicas, .rank = c.rank, .shuffle = false, .drop_last = c.drop_last});
    const std::string where = "N=" + std::to_string(c.n) + " R=" + std::to_string(c.replicas) +
                              " r=" + std::to_string(c.rank) +
                              " drop_last=" + std::to_string(c.drop_last);
    EXPECT_EQ(s.num_samples(), num_samples) << where;
    EXPECT_EQ(s.total_size(), total_size) << where;
    EXPECT_EQ(s.indices(0), expected) << where;
  }
  EXPECT_FALSE(std::getline(lines, line)) << "torch printed too many lines";
}

TEST(DistributedSamplerTest, RanksCoverEveryIndexAndRepeatOnlyThePadding) {
  for (bool shuffle : {false, true})
    for (std::int64_t n = 0; n <= 20; ++n)
      for (std::int64_t replicas = 1; replicas <= 6; ++replicas) {
        const std::string where = "N=" + std::to_string(n) + " R=" + std::to_string(replicas) +
                                  " shuffle=" + std::to_string(shuffle);
        const std::int64_t total =
            DistributedSampler(n, {.num_replicas = replicas, .rank = 0}).total_size();
        std::map<std::int64_t, int> seen;
        for (const Indices& rank : every_rank(n, replicas, false, shuffle, 7, 3)) {
          EXPECT_EQ(static_cast<std::int64_t>(rank.size()), total / replicas) << where;
          for (std::int64_t i : rank) ++seen[i];
        }
        EXPECT_EQ(static_cast<std::int64_t>(seen.size()), n) << where;  // every index seen
        EXPECT_TRUE(seen.empty() || (seen.begin()->first == 0 && seen.rbegin()->first == n - 1))
            << where;
        std::int64_t duplicates = 0;
        for (const auto& [index, count] : seen) duplicates += count - 1;
        EXPECT_EQ(duplicates, total - n) << where;
        if (n % replicas == 0) EXPECT_EQ(duplicates, 0) << where;

        std::set<std::int64_t> kept;  // with drop_last: disjoint, total_size of them
        std::int64_t count = 0;
        for (const Indices& rank : every_rank(n, replicas, true, shuffle, 7, 3)) {
          kept.insert(rank.begin(), rank.end());
          count += static_cast<std::int64_t>(rank.size());
        }
        EXPECT_EQ(count, replicas * (n / replicas)) << where;
        EXPECT_EQ(static_cast<std::int64_t>(kept.size()), count) << where;
        EXPECT_TRUE(kept.empty() || (*kept.begin() >= 0 && *kept.rbegin() < n)) << where;
      }
}

// The whole padded order of an epoch, put back together from every rank's share.
Indices interleave(const std::vector<Indices>& ranks) {
  Indices order;
  for (std::size_t k = 0; k < ranks.front().size(); ++k)
    for (const Indices& rank : ranks) order.push_back(rank[k]);
  return order;
}

TEST(DistributedSamplerTest, ShuffleIsOneSeededPermutationPerEpochSharedByEveryRank) {
  const Indices epoch2 = interleave(every_rank(12, 3, false, true, 5, 2));
  // Every rank took its share of the same permutation: random_permutation(N, seed + epoch).
  EXPECT_EQ(epoch2, random_permutation(12, 7));
  EXPECT_NE(epoch2, interleave(every_rank(12, 3, false, true, 5, 0)));
  EXPECT_NE(epoch2, interleave(every_rank(12, 3, false, true, 6, 2)));
  // Only seed + epoch counts, as in torch.
  EXPECT_EQ(epoch2, interleave(every_rank(12, 3, false, true, 7, 0)));
  // Repeatable: a new sampler, or the same one asked again, gives the same list.
  const DistributedSampler s(12, {.num_replicas = 3, .rank = 1, .seed = 5});
  EXPECT_EQ(s.indices(2),
            DistributedSampler(12, {.num_replicas = 3, .rank = 1, .seed = 5}).indices(2));
  EXPECT_EQ(s.indices(2), s.indices(2));
  // Padding repeats the start of the shuffled order.
  const Indices padded = interleave(every_rank(10, 4, false, true, 5, 2));
  const Indices permutation = random_permutation(10, 7);
  Indices expected = permutation;
  expected.push_back(permutation[0]);
  expected.push_back(permutation[1]);
  EXPECT_EQ(padded, expected);
}

TEST(DistributedSamplerTest, ConvertsToASamplerThatGivesItsIndicesPerEpoch) {
  const DistributedSampler d(10, {.num_replicas = 3, .rank = 2, .seed = 1});
  const Sampler s = d;
  ASSERT_TRUE(s);
  EXPECT_EQ(s.indices(0), d.indices(0));
  EXPECT_EQ(s.indices(4), d.indices(4));
  EXPECT_NE(s.indices(0), s.indices(4));
}

// Clears the six launcher variables for one test and restores them after it.
class DistributedSamplerEnvTest : public ::testing::Test {
 protected:
  static constexpr const char* kNames[] = {
      "WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK"};
  void SetUp() override {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      if (value != nullptr) saved_[name] = value;
      ::unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kNames) {
      auto it = saved_.find(name);
      if (it == saved_.end())
        ::unsetenv(name);
      else
        ::setenv(name, it->second.c_str(), 1);
    }
  }
  static void set(const char* name, const char* value) { ::setenv(name, value, 1); }

  // The message of the ConfigurationError that constructing the sampler throws.
  static std::string error_of(std::int64_t n, DistributedSamplerOptions o = {}) {
    try {
      DistributedSampler s(n, o);
    } catch (const ConfigurationError& e) {
      const Error& base = e;  // callers catch every library failure as shmtensor::Error
      return base.what();
    }
    ADD_FAILURE() << "no ConfigurationError";
    return {};
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(DistributedSamplerEnvTest, TorchrunsWorldSizeAndRank) {
  set("WORLD_SIZE", "4");
  set("RANK", "3");
  const DistributedSampler s(10, {.shuffle = false});
  EXPECT_EQ(s.num_replicas(), 4);
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.indices(0), (Indices{3, 7, 1}));
}

TEST_F(DistributedSamplerEnvTest, OpenMpiThenMpichWhenTorchrunsAreAbsent) {
  set("OMPI_COMM_WORLD_SIZE", "5");
  set("OMPI_COMM_WORLD_RANK", "2");
  set("PMI_SIZE", "7");
  set("PMI_RANK", "6");
  DistributedSampler ompi(10);
  EXPECT_EQ(ompi.num_replicas(), 5);
  EXPECT_EQ(ompi.rank(), 2);
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  DistributedSampler pmi(10);
  EXPECT_EQ(pmi.num_replicas(), 7);
  EXPECT_EQ(pmi.rank(), 6);
  set("WORLD_SIZE", "2");
  set("RANK", "1");
  DistributedSampler torchrun(10);  // WORLD_SIZE / RANK come first
  EXPECT_EQ(torchrun.num_replicas(), 2);
  EXPECT_EQ(torchrun.rank(), 1);
}

TEST_F(DistributedSamplerEnvTest, OptionsOverrideTheEnvironment) {
  set("WORLD_SIZE", "not a number");
  set("RANK", "9");
  DistributedSampler s(10, {.num_replicas = 2, .rank = 0});
  EXPECT_EQ(s.num_replicas(), 2);
  EXPECT_EQ(s.rank(), 0);
  set("WORLD_SIZE", "3");
  DistributedSampler half(10, {.rank = 1});  // num_replicas from WORLD_SIZE, rank given
  EXPECT_EQ(half.num_replicas(), 3);
  EXPECT_EQ(half.rank(), 1);
}

TEST_F(DistributedSamplerEnvTest, MissingVariablesNameWhatToSet) {
  EXPECT_THAT(error_of(10), AllOf(HasSubstr("num_replicas is not set and none of WORLD_SIZE, "
                                            "OMPI_COMM_WORLD_SIZE, PMI_SIZE is in the environment"),
                                  HasSubstr("set WORLD_SIZE to the number of processes in the job"),
                                  HasSubstr("DistributedSamplerOptions::num_replicas")));
  set("WORLD_SIZE", "2");
  EXPECT_THAT(error_of(10),
              AllOf(HasSubstr("rank is not set and none of RANK, OMPI_COMM_WORLD_RANK, PMI_RANK "
                              "is in the environment"),
                    HasSubstr("set RANK to this process's number"),
                    HasSubstr("DistributedSamplerOptions::rank")));
}

TEST_F(DistributedSamplerEnvTest, MalformedValuesAreErrorsNotSkipped) {
  set("OMPI_COMM_WORLD_SIZE", "4");  // would be valid, but WORLD_SIZE is set and wrong
  set("RANK", "0");
  for (const char* bad : {"", "abc", "4x", " 4", "+4", "4.0", "99999999999999999999"}) {
    set("WORLD_SIZE", bad);
    EXPECT_THAT(error_of(10), HasSubstr("DistributedSampler: WORLD_SIZE='" + std::string(bad) +
                                        "' is not a decimal integer: set WORLD_SIZE to the "
                                        "number of processes in the job"))
        << bad;
  }
  set("WORLD_SIZE", "4");
  set("PMI_RANK", "x");
  ::unsetenv("RANK");
  EXPECT_THAT(error_of(10), HasSubstr("PMI_RANK='x' is not a decimal integer: set PMI_RANK to "
                                      "this process's number in [0, number of processes)"));
}

TEST_F(DistributedSamplerEnvTest, OutOfRangeValuesAreErrors) {
  set("WORLD_SIZE", "0");
  set("RANK", "0");
  EXPECT_THAT(error_of(10), HasSubstr("num_replicas must be at least 1, got 0 from "
                                      "WORLD_SIZE='0': set it to the number of processes"));
  EXPECT_THAT(error_of(10, {.num_replicas = -2}),
              HasSubstr("num_replicas must be at least 1, got -2 from "
                        "DistributedSamplerOptions::num_replicas"));
  set("WORLD_SIZE", "4");
  set("RANK", "4");
  EXPECT_THAT(error_of(10), HasSubstr("rank 4 from RANK='4' is outside [0, 4) for num_replicas "
                                      "4 from WORLD_SIZE='4': set rank to this process's number "
                                      "in [0, 4)"));
  set("RANK", "-1");
  EXPECT_THAT(error_of(10), HasSubstr("rank -1 from RANK='-1' is outside [0, 4)"));
  EXPECT_THAT(error_of(10, {.num_replicas = 2, .rank = 2}),
              HasSubstr("rank 2 from DistributedSamplerOptions::rank is outside [0, 2) for "
                        "num_replicas 2 from DistributedSamplerOptions::num_replicas"));
  EXPECT_THAT(error_of(-1, {.num_replicas = 2, .rank = 0}),
              HasSubstr("DistributedSampler: dataset_size must be >= 0, got -1"));
}

}  // namespace
}  // namespace shmtensor
