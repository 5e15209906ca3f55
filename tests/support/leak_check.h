// Test helpers: what a process holds (fds, mappings, /dev/shm names), and a fixture that
// fails a test that leaves any of them behind.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace shmtensor::testing {

// Open fds of this process (from /proc/self/fd), excluding the one used to list them.
std::set<int> open_fds();
// Lines of /proc/self/maps that are shmtensor segments (memfd:shmtensor or /dev/shm/shmtensor_).
std::vector<std::string> shmtensor_mappings();
// Total number of mappings of this process.
std::size_t mapping_count();
// Names in /dev/shm that start with "shmtensor_".
std::set<std::string> shm_names();
// shm_names() created by process `pid` (the "<pid>" part of the name).
std::set<std::string> shm_names_of(pid_t pid);

// Forks; the child runs fn and _exit(0) on success, _exit(1) with the failure printed to
// stderr if fn throws or a gtest assertion failed in it. Returns the child's pid.
pid_t fork_child(const std::function<void()>& fn);
// waitpid; returns the exit status (or 128 + signal).
int wait_child(pid_t pid);
// The child's exit status (or 128 + signal), or -1 once `limit` passed (the child is then
// SIGKILLed and reaped): for a test of a call that must not block.
int wait_child_within(pid_t pid, std::chrono::seconds limit);
// fork_child + wait_child.
int run_in_child(const std::function<void()>& fn);
// Fails the test if a child of this process is left unreaped (a zombie) or running: for
// the TearDown of tests of the API that starts and reaps children.
void expect_no_children();

// Records fds, shmtensor mappings and /dev/shm names at SetUp and checks at TearDown that
// nothing new is left (waiting up to 2 s for names unlinked by exiting children).
class LeakCheckedTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  std::set<int> fds_;
  std::set<std::string> names_;
  std::size_t st_mappings_ = 0;
};

}  // namespace shmtensor::testing
