// Lets the exec start method re-execute ipc_tests: the binary's main is gtest_main, so
// shmtensor::init() runs from a global test environment's SetUp(), which GoogleTest calls
// after all static initialization and before the first test. In a re-executed child it
// runs the child's function and exits there; in the test process it does nothing.
#include <gtest/gtest.h>

#include "shmtensor/start_method.h"

namespace {

class ExecChildEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { shmtensor::init(0, nullptr); }
};

[[maybe_unused]] const bool kRegistered = [] {
  if (shmtensor::is_exec_child()) {
    // A child should not print GoogleTest's banner into its parent's output.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  ::testing::AddGlobalTestEnvironment(new ExecChildEnvironment);
  return true;
}();

}  // namespace
