// Helpers for the manager daemon's tests: a private daemon group per test, waiting for
// names and processes to go, and segments created the way the library does.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "manager/client.h"
#include "manager/paths.h"
#include "memory/storage_impl.h"
#include "os/private_dir.h"
#include "os/proc_scan.h"
#include "shmtensor/internal/storage_access.h"
#include "support/strategy_test.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/storage.h"
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

// The name of a file_system storage's segment, and its refcount now.
inline std::string segment_name(const Storage& s) {
  return internal::StorageAccess::impl(s)->segment()->name();
}
inline std::int64_t refcount_of(const Storage& s) {
  return internal::StorageAccess::impl(s)->segment()->header()->refcount.load();
}

// A process (not necessarily our child) that lives and is not a zombie.
inline bool process_lives(pid_t pid) { return internal::identify_process(pid).start_time != 0; }

using testing::Pipe;

// The live daemons serving `group` (or starting to), from /proc/*/cmdline. Not an
// ifstream read through istreambuf_iterator: a process that exits between the open and the
// read makes read() fail with ESRCH, which libstdc++'s filebuf throws as ios_base::failure
// ("basic_filebuf::underflow error reading the file: No such process"); that ended a
// `make asan` run's job early. read_small_file returns "" then.
inline std::vector<pid_t> daemons_of(const std::string& group) {
  std::vector<pid_t> found;
  DIR* d = ::opendir("/proc");
  while (dirent* e = ::readdir(d)) {
    pid_t pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::string cmd = internal::read_small_file("/proc/" + std::string(e->d_name) + "/cmdline");
    if (cmd.find("shmtensor-manager") != std::string::npos &&
        cmd.find(std::string("--group") + '\0' + group + '\0') != std::string::npos &&
        process_lives(pid))
      found.push_back(pid);
  }
  ::closedir(d);
  return found;
}

// The state letter of /proc/<pid>/stat ('T' when stopped), 0 when it cannot be read.
inline char process_state(pid_t pid) {
  std::string stat = internal::read_small_file("/proc/" + std::to_string(pid) + "/stat");
  std::size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : 0;
}

// Stops a process (SIGSTOP; returns once it is stopped) and lets it go on (SIGCONT) when
// destroyed, also when an assertion returns early: a stopped daemon would make every later
// client wait 10 s.
class Stopped {
 public:
  explicit Stopped(pid_t pid) : pid_(pid) {
    EXPECT_EQ(::kill(pid_, SIGSTOP), 0);
    EXPECT_TRUE(eventually([&] { return process_state(pid_) == 'T'; })) << "pid " << pid_;
  }
  ~Stopped() { ::kill(pid_, SIGCONT); }
  Stopped(const Stopped&) = delete;
  Stopped& operator=(const Stopped&) = delete;

 private:
  pid_t pid_;
};

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

// The output of `shmtensor <args>` (the tool next to the manager program), asserting that
// it exits with 0.
inline std::string run_tool(const std::string& args) {
  const std::string manager = internal::manager::manager_program_candidates().at(0);
  const std::string tool = manager.substr(0, manager.rfind('/')) + "/shmtensor";
  EXPECT_EQ(::access(tool.c_str(), X_OK), 0) << tool;
  std::FILE* p = ::popen((tool + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) {
    ADD_FAILURE() << "popen " << tool;
    return "";
  }
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << out;
  return out;
}

// A test under each sharing strategy with a manager group of its own (so its own daemon),
// "<prefix><pid>-<n>"; TearDown removes the group's files. Named channels' tests use it.
class OwnManagerGroupTest : public StrategyTest {
 protected:
  explicit OwnManagerGroupTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    StrategyTest::SetUp();
    static int counter = 0;
    group_ = prefix_ + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    ::setenv("SHMTENSOR_MANAGER_GROUP", group_.c_str(), 1);
    ::setenv("SHMTENSOR_MANAGER_GRACE_MS", "300", 1);
  }
  void TearDown() override {
    StrategyTest::TearDown();
    const auto loc = internal::manager::manager_location();
    for (const auto& f : {loc.socket_path, loc.lock_path, loc.log_path, loc.journal_path})
      ::unlink(f.c_str());
    ::unsetenv("SHMTENSOR_MANAGER_GROUP");
    ::unsetenv("SHMTENSOR_MANAGER_GRACE_MS");
  }
  std::string group_;

 private:
  std::string prefix_;
};

}  // namespace shmtensor::testing::manager_test
