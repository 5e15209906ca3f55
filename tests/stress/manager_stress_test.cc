// Faults the manager must survive: SIGKILL of producers, consumers, the daemon, or all of
// them, at random moments while tensors flow over a queue (file_system strategy).
// Afterwards no /dev/shm name of the run is left (within a few seconds of the run's end),
// every value a survivor received was intact, and a new run works at once.
//
// The default run is a short loop (about 4 s). SHMTENSOR_STRESS_ROUNDS=500 makes it long.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ipc/manager_test_util.h"
#include "os/mapping.h"
#include "os/private_dir.h"
#include "shmtensor/queue.h"
#include "shmtensor/tensor.h"

namespace shmtensor {
namespace {

using namespace testing::manager_test;
namespace mgr = internal::manager;

struct Stats {
  std::atomic<std::int64_t> put{0};
  std::atomic<std::int64_t> received{0};
  std::atomic<std::int64_t> bad{0};   // a received value that was not intact
  std::atomic<std::int64_t> lost{0};  // a message whose segment was gone (see docs/cleanup.md)
  std::atomic<std::int64_t> next_id{0};
};

constexpr std::int64_t kElems = 1024;
using Item = std::pair<std::int64_t, Tensor>;

float value_of(std::int64_t id) { return static_cast<float>(id % 1000003); }

bool intact(std::int64_t id, Tensor& t) {
  if (t.numel() != kElems) return false;
  const float* p = t.data_ptr<float>();
  for (std::int64_t i = 0; i < kElems; ++i)
    if (p[i] != value_of(id)) return false;
  return true;
}

// The pid of the daemon serving `group`, from /proc/*/cmdline (0 if none runs). Not an
// ifstream read through istreambuf_iterator: a process that exits between the open and the
// read makes read() fail with ESRCH, which libstdc++'s filebuf throws as ios_base::failure
// ("basic_filebuf::underflow error reading the file: No such process"); that ended a
// `make asan` run's job early. read_small_file returns "" then.
pid_t find_daemon(const std::string& group) {
  pid_t found = 0;
  DIR* d = ::opendir("/proc");
  while (dirent* e = ::readdir(d)) {
    pid_t pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::string cmd = internal::read_small_file("/proc/" + std::string(e->d_name) + "/cmdline");
    if (cmd.find("shmtensor-manager") != std::string::npos &&
        cmd.find(std::string("--group") + '\0' + group + '\0') != std::string::npos &&
        process_lives(pid)) {
      found = pid;
      break;
    }
  }
  ::closedir(d);
  return found;
}

pid_t start_producer(Queue<Item> q, Stats* stats, int seed) {
  return testing::fork_child([=]() mutable {
    std::mt19937 rng(seed);
    std::vector<Tensor> keep;  // a few held at any time, so that a kill finds names held
    for (;;) {
      std::int64_t id = stats->next_id.fetch_add(1);
      Tensor t = Tensor::full({kElems}, value_of(id), DType::kFloat32);
      q.put({id, t});
      stats->put.fetch_add(1);
      keep.push_back(t);
      if (keep.size() > 4) keep.erase(keep.begin() + static_cast<long>(rng() % keep.size()));
    }
  });
}

pid_t start_consumer(Queue<Item> q, Stats* stats) {
  return testing::fork_child([=]() mutable {
    std::vector<Item> keep;
    for (;;) {
      Item item;
      try {
        item = q.get();
      } catch (const QueueClosed&) {
        return;
      } catch (const Error& e) {
        stats->lost.fetch_add(1);
        if (std::getenv("SHMTENSOR_STRESS_KEEP_LOG") != nullptr)
          std::fprintf(stderr, "lost: %s\n", e.what());
        continue;
      }
      stats->received.fetch_add(1);
      if (!intact(item.first, item.second)) stats->bad.fetch_add(1);
      keep.push_back(std::move(item));
      if (keep.size() > 4) {
        // Still intact when dropped: nobody unlinked and reused it under us.
        if (!intact(keep.front().first, keep.front().second)) stats->bad.fetch_add(1);
        keep.erase(keep.begin());
      }
    }
  });
}

// Kills and reaps; counts a process that had ended by itself (it threw: a failure).
int failures = 0;
void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  if (testing::wait_child(pid) != 128 + SIGKILL) ++failures;
}

// The whole run, in a process group of its own (it is a "job"): returns its exit status.
// Reports the pid of every process it started on `pids` (one line each).
int run_job(int rounds, const std::string& group, int pid_fd) {
  ::setpgid(0, 0);
  ::setenv("SHMTENSOR_MANAGER_GROUP", group.c_str(), 1);
  set_sharing_strategy(SharingStrategy::kFileSystem);
  auto report_pid = [&](pid_t pid) {
    std::string line = std::to_string(pid) + "\n";
    if (::write(pid_fd, line.data(), line.size()) < 0) std::abort();
  };
  auto map = internal::Mapping::map_anonymous_shared(sizeof(Stats));
  auto* stats = new (map.data()) Stats;
  Queue<Item> q(32);
  constexpr int kProducers = 2, kConsumers = 2;
  std::vector<pid_t> producers, consumers;
  for (int i = 0; i < kProducers; ++i) producers.push_back(start_producer(q, stats, i));
  for (int i = 0; i < kConsumers; ++i) consumers.push_back(start_consumer(q, stats));
  for (pid_t p : producers) report_pid(p);
  for (pid_t p : consumers) report_pid(p);

  std::mt19937 rng(12345);
  int daemon_kills = 0;
  for (int round = 0; round < rounds; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 40));
    int what = static_cast<int>(rng() % 100);
    bool all = what >= 85;
    if (what < 35 || all) {
      auto& p = producers[rng() % kProducers];
      kill_and_reap(p);
      p = start_producer(q, stats, round + 100);
      report_pid(p);
    }
    if ((what >= 35 && what < 70) || all) {
      auto& c = consumers[rng() % kConsumers];
      kill_and_reap(c);
      c = start_consumer(q, stats);
      report_pid(c);
    }
    if ((what >= 70 && what < 85) || all) {
      if (pid_t d = find_daemon(group)) {
        ::kill(d, SIGKILL);
        ++daemon_kills;
      }
    }
  }
  // Let the survivors run a moment, then end everything.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (pid_t p : producers) kill_and_reap(p);
  for (pid_t c : consumers) kill_and_reap(c);
  std::fprintf(stderr,
               "stress job: %d rounds, %d daemon kills, put %lld, received %lld, bad %lld, "
               "lost %lld\n",
               rounds, daemon_kills, static_cast<long long>(stats->put.load()),
               static_cast<long long>(stats->received.load()),
               static_cast<long long>(stats->bad.load()),
               static_cast<long long>(stats->lost.load()));
  if (stats->bad.load() != 0) return 2;
  if (stats->received.load() == 0) return 3;
  // Every process of this job stays in its process group, so no name a message carries is
  // removed before it is received (docs/cleanup.md, L2 says when one can be).
  if (stats->lost.load() != 0) return 5;
  if (failures != 0) {
    std::fprintf(stderr, "stress job: %d producers/consumers failed on their own\n", failures);
    return 4;
  }
  return 0;
}

TEST(ManagerStressTest, SigkillProducersConsumersAndTheDaemonWhileTensorsFlow) {
  int rounds = 150;
  if (const char* r = std::getenv("SHMTENSOR_STRESS_ROUNDS")) rounds = std::atoi(r);
  const std::string group = "stress" + std::to_string(::getpid());
  ::setenv("SHMTENSOR_MANAGER_GRACE_MS", "300", 1);

  int pids[2];
  ASSERT_EQ(::pipe2(pids, O_CLOEXEC), 0);
  pid_t job = ::fork();
  if (job == 0) {
    ::close(pids[0]);
    int rc = 1;
    try {
      rc = run_job(rounds, group, pids[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "stress job threw: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  ::close(pids[1]);
  std::set<pid_t> started{job};
  int job_status = -1;
  {
    // Read the pids until EOF. Every producer and consumer inherits the write end (fork
    // keeps O_CLOEXEC fds), so a job that ends without killing them (it threw, or a
    // sanitizer aborted it) would leave them running and this read waiting for ever: once
    // the job has exited, SIGKILL what is left of its process group.
    std::string text;
    char buf[4096];
    for (;;) {
      pollfd p{pids[0], POLLIN, 0};
      int ready = ::poll(&p, 1, 100);
      if (ready > 0) {
        ssize_t n = ::read(pids[0], buf, sizeof buf);
        if (n == 0) break;
        if (n > 0) text.append(buf, static_cast<std::size_t>(n));
        if (n < 0 && errno != EINTR) break;
      }
      int status = 0;
      if (job_status < 0 && ::waitpid(job, &status, WNOHANG) == job) {
        job_status = status;
        ::kill(-job, SIGKILL);
      }
    }
    ::close(pids[0]);
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t nl = text.find('\n', pos);
      started.insert(std::atoi(text.substr(pos, nl - pos).c_str()));
      pos = nl + 1;
    }
  }
  const int job_rc = job_status < 0          ? testing::wait_child(job)
                     : WIFEXITED(job_status) ? WEXITSTATUS(job_status)
                                             : 128 + WTERMSIG(job_status);
  EXPECT_EQ(job_rc, 0)
      << "the job threw (1), saw a corrupted value (2), none (3), a process that failed (4), "
         "or a message whose segment was gone (5)";

  // Every name any process of the job created is gone within a few seconds.
  auto leftovers = [&] {
    std::vector<std::string> out;
    for (const auto& n : testing::shm_names())
      if (started.count(static_cast<pid_t>(std::atoi(n.c_str() + 10)))) out.push_back(n);
    return out;
  };
  const std::size_t at_end = leftovers().size();
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(eventually([&] { return leftovers().empty(); }, std::chrono::seconds(5)))
      << leftovers().size() << " names left, e.g. " << leftovers().front();
  std::fprintf(stderr, "%zu names of killed processes when the job ended, gone after %lld ms\n",
               at_end,
               static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::steady_clock::now() - t0)
                                          .count()));
  for (const auto& n : leftovers()) ::shm_unlink(("/" + n).c_str());

  // And a new run works at once (it may have to start a new daemon).
  ::setenv("SHMTENSOR_MANAGER_GROUP", group.c_str(), 1);
  set_sharing_strategy(SharingStrategy::kFileSystem);
  {
    Queue<Item> q;
    pid_t child = testing::fork_child([&] { q.put({7, Tensor::full({kElems}, value_of(7))}); });
    Item got = q.get();
    EXPECT_EQ(got.first, 7);
    EXPECT_TRUE(intact(got.first, got.second));
    EXPECT_EQ(testing::wait_child(child), 0);
    // The child's segment is in our receive cache (cleanup.md L7): give it back, and let
    // the daemon remove the name of the dead child before we stop the daemon, or the name
    // outlives the test.
    got = Item();
    empty_cache();
    EXPECT_TRUE(eventually([&] { return testing::shm_names_of(child).empty(); }))
        << "the new run's child left a name";
  }
  set_sharing_strategy(SharingStrategy::kFileDescriptor);
  const auto loc = mgr::manager_location();
  ::unsetenv("SHMTENSOR_MANAGER_GROUP");
  ::unsetenv("SHMTENSOR_MANAGER_GRACE_MS");
  if (pid_t d = find_daemon(group)) {
    ::kill(d, SIGTERM);  // it may rewrite its journal on the way out: unlink after
    EXPECT_TRUE(eventually([&] { return !process_lives(d); }));
  }
  if (std::getenv("SHMTENSOR_STRESS_KEEP_LOG") == nullptr)  // to read the daemon's log
    for (const auto& f : {loc.socket_path, loc.lock_path, loc.log_path, loc.journal_path})
      ::unlink(f.c_str());
}

}  // namespace
}  // namespace shmtensor
