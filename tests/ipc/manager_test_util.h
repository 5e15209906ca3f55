// Helpers for the manager daemon's tests: a private daemon group per test, waiting for
// names and processes to go, and segments created the way the library does.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "manager/client.h"
#include "manager/paths.h"
#include "os/proc_scan.h"
#include "shmtensor/sharing_strategy.h"
#include "support/leak_check.h"
#include "support/pipe.h"

namespace shmtensor::testing::manager_test {

inline bool name_exists(const std::string& name) {
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

// Polls `pred` every 10 ms for up to `timeout`; returns its last value.
inline bool eventually(const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// A process (not necessarily our child) that lives and is not a zombie.
inline bool process_lives(pid_t pid) { return internal::identify_process(pid).start_time != 0; }

using testing::Pipe;

// Every test gets its own daemon (a group of its own) with a short grace period, so that
// tests neither see each other's daemons nor wait long for one to exit, and uses the
// file_system strategy.
class ManagerTest : public LeakCheckedTest {
 protected:
  void SetUp() override {
    LeakCheckedTest::SetUp();
    static std::atomic<int> counter{0};
    group_ = "t" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    ::setenv("SHMTENSOR_MANAGER_GROUP", group_.c_str(), 1);
    ::setenv("SHMTENSOR_MANAGER_GRACE_MS", "300", 1);
    set_sharing_strategy(SharingStrategy::kFileSystem);
  }
  void TearDown() override {
    set_sharing_strategy(SharingStrategy::kFileDescriptor);
    LeakCheckedTest::TearDown();
    EXPECT_EQ(internal::manager::connected_daemon_pid(), 0)
        << "the client stays connected while holding nothing";
    // The group is this test's alone: its files go (a daemon still in its grace period
    // keeps its open lock and exits by itself).
    const auto loc = location();
    if (std::getenv("SHMTENSOR_TEST_KEEP_MANAGER_FILES") == nullptr)  // to read its log
      for (const auto& f : {loc.socket_path, loc.lock_path, loc.log_path, loc.journal_path})
        ::unlink(f.c_str());
    ::unsetenv("SHMTENSOR_MANAGER_GROUP");
    ::unsetenv("SHMTENSOR_MANAGER_GRACE_MS");
  }
  internal::manager::ManagerLocation location() const {
    return internal::manager::manager_location();
  }
  std::string group_;
};

}  // namespace shmtensor::testing::manager_test
