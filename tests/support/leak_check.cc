#include "leak_check.h"

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>

#include "shmtensor/internal/fd_keeper.h"
#include "shmtensor/storage.h"

namespace shmtensor::testing {

std::set<int> open_fds() {
  std::set<int> fds;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return fds;
  int self = ::dirfd(d);
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    int fd = std::atoi(e->d_name);
    if (fd != self) fds.insert(fd);
  }
  ::closedir(d);
  return fds;
}

std::vector<std::string> shmtensor_mappings() {
  std::vector<std::string> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("memfd:shmtensor") != std::string::npos ||
        line.find("/dev/shm/shmtensor_") != std::string::npos)
      out.push_back(line);
  }
  return out;
}

std::size_t mapping_count() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::size_t n = 0;
  while (std::getline(maps, line)) ++n;
  return n;
}

std::set<std::string> shm_names() {
  std::set<std::string> names;
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind("shmtensor_", 0) == 0) names.insert(n);
  }
  ::closedir(d);
  return names;
}

std::set<std::string> shm_names_of(pid_t pid) {
  std::set<std::string> out;
  std::string prefix = "shmtensor_" + std::to_string(pid) + "_";
  for (auto& n : shm_names())
    if (n.rfind(prefix, 0) == 0) out.insert(n);
  return out;
}

namespace {
// Processes this test process forked: their names count as ours in the leak check, names
// of unrelated processes (other test binaries under ctest -j) do not.
std::set<pid_t>& our_pids() {
  static std::set<pid_t> pids;
  return pids;
}
bool is_ours(const std::string& name) {
  // "shmtensor_<pid>_..."
  pid_t pid = static_cast<pid_t>(std::atoi(name.c_str() + 10));
  return pid == ::getpid() || our_pids().count(pid) > 0;
}
}  // namespace

pid_t fork_child(const std::function<void()>& fn) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid > 0) our_pids().insert(pid);
  if (pid == 0) {
    int code = 0;
    try {
      fn();
      if (::testing::Test::HasFailure()) code = 1;
    } catch (const std::exception& e) {
      std::cerr << "child " << ::getpid() << " threw: " << e.what() << std::endl;
      code = 1;
    } catch (...) {
      std::cerr << "child " << ::getpid() << " threw a non-std exception" << std::endl;
      code = 1;
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  return pid;
}

int wait_child(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) == -1 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

int wait_child_within(pid_t pid, std::chrono::seconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (std::chrono::steady_clock::now() >= give_up) {
      ::kill(pid, SIGKILL);
      (void)wait_child(pid);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int run_in_child(const std::function<void()>& fn) { return wait_child(fork_child(fn)); }

void expect_no_children() {
  int status = 0;
  pid_t pid = ::waitpid(-1, &status, WNOHANG);
  EXPECT_EQ(pid, -1) << "a child process was left behind (pid " << pid << ")";
  EXPECT_EQ(errno, ECHILD);
}

void LeakCheckedTest::SetUp() {
  shmtensor::empty_cache();
  fds_ = open_fds();
  names_ = shm_names();
  st_mappings_ = shmtensor_mappings().size();
}

void LeakCheckedTest::TearDown() {
  // What the arena keeps for reuse is not a leak; what empty_cache() cannot return is.
  shmtensor::empty_cache();
  // Names of exited children may take a moment to go (the manager sweeps them).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::set<std::string> extra;
  for (;;) {
    extra.clear();
    for (auto& n : shm_names())
      if (!names_.count(n) && is_ours(n)) extra.insert(n);
    if (extra.empty() || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& n : extra) ADD_FAILURE() << "leaked /dev/shm name: " << n;
  // The process's connection for kept fds lives as long as the process (fd_keeper.h).
  const int keeper = shmtensor::internal::fd_keeper_connection();
  for (int fd : open_fds()) {
    if (!fds_.count(fd) && fd != keeper) {
      char path[64], target[512] = {};
      std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
      ssize_t n = ::readlink(path, target, sizeof target - 1);
      (void)n;
      ADD_FAILURE() << "leaked fd " << fd << " -> " << target;
    }
  }
  auto maps = shmtensor_mappings();
  if (maps.size() > st_mappings_) {
    for (auto& m : maps) ADD_FAILURE() << "shmtensor mapping left: " << m;
  }
}

}  // namespace shmtensor::testing
