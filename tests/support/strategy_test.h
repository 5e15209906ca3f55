// Fixtures for tests that run under a sharing strategy, around LeakCheckedTest's checks.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "shmtensor/sharing_strategy.h"
#include "support/leak_check.h"

namespace shmtensor::testing {

// Puts back at TearDown the sharing strategy there was at SetUp: a test, or a subclass's
// SetUp, may switch it meanwhile without leaking the switch into the next test.
class StrategyRestoringTest : public LeakCheckedTest {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  SharingStrategy saved_{};
};

// Runs each test under the strategy that is its parameter:
//   class MyTest : public testing::StrategyTest {};
//   INSTANTIATE_TEST_SUITE_P(Strategies, MyTest, testing::kAllStrategies,
//                            testing::strategy_name);
class StrategyTest : public StrategyRestoringTest,
                     public ::testing::WithParamInterface<SharingStrategy> {
 protected:
  void SetUp() override;
};

// Every strategy, as the parameters of a test suite.
inline const auto kAllStrategies =
    ::testing::Values(SharingStrategy::kFileDescriptor, SharingStrategy::kFileSystem);

// The test-name suffix of a strategy parameter: "file_descriptor", "file_system".
std::string strategy_name(const ::testing::TestParamInfo<SharingStrategy>& info);

}  // namespace shmtensor::testing
