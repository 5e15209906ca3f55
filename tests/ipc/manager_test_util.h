// Helpers for the manager daemon's tests: a private daemon group per test, waiting for
// names and processes to go, a byte pipe, and segments created the way the library does.
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

// One-way channel between a parent and a forked child, for bytes and lines.
class Pipe {
 public:
  Pipe() { EXPECT_EQ(::pipe2(fds_, O_CLOEXEC), 0) << std::strerror(errno); }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  ~Pipe() { close_both(); }
  void close_both() {
    for (int& fd : fds_)
      if (fd >= 0) ::close(std::exchange(fd, -1));
  }
  void send(char c = 'x') { ASSERT_EQ(::write(fds_[1], &c, 1), 1) << std::strerror(errno); }
  void send_line(const std::string& s) {
    std::string l = s + "\n";
    ASSERT_EQ(::write(fds_[1], l.data(), l.size()), static_cast<ssize_t>(l.size()));
  }
  // The byte, or 0 at EOF (the other side died).
  char receive() {
    char c = 0;
    ssize_t n;
    do n = ::read(fds_[0], &c, 1);
    while (n == -1 && errno == EINTR);
    return n == 1 ? c : 0;
  }
  std::string receive_line() {
    std::string s;
    for (char c; (c = receive()) != 0 && c != '\n';) s.push_back(c);
    return s;
  }

 private:
  int fds_[2] = {-1, -1};
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

}  // namespace shmtensor::testing::manager_test
