#include "support/strategy_test.h"

namespace shmtensor::testing {

void StrategyRestoringTest::SetUp() {
  LeakCheckedTest::SetUp();
  saved_ = get_sharing_strategy();
}

void StrategyRestoringTest::TearDown() {
  set_sharing_strategy(saved_);
  LeakCheckedTest::TearDown();
}

void StrategyTest::SetUp() {
  StrategyRestoringTest::SetUp();
  set_sharing_strategy(GetParam());
}

std::string strategy_name(const ::testing::TestParamInfo<SharingStrategy>& info) {
  return to_string(info.param);
}

}  // namespace shmtensor::testing
