// Faults the manager must survive: SIGKILL of producers, consumers, the daemon, or all of
// them, at random moments while tensors flow over a queue (file_system strategy); and the
// daemon SIGKILLed alone, or with the producer, while a job runs that then ends by itself.
// Afterwards no /dev/shm name of the run is left (within a few seconds of the run's end),
// every value a survivor received was intact, and a new run works at once.
//
// The default run is short (about 4 s, then about 2 s per daemon-kill case).
// SHMTENSOR_STRESS_ROUNDS=500 makes each test run that many rounds.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
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
  std::atomic<int> stop{0};  // producers return when set
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

// The pid of a daemon serving `group` (0 if none runs).
pid_t find_daemon(const std::string& group) {
  auto d = daemons_of(group);
  return d.empty() ? 0 : d.front();
}

pid_t start_producer(Queue<Item> q, Stats* stats, int seed) {
  return testing::fork_child([=]() mutable {
    std::mt19937 rng(seed);
    std::vector<Tensor> keep;  // a few held at any time, so that a kill finds names held
    while (stats->stop.load() == 0) {
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

int stress_rounds(int default_rounds) {
  if (const char* r = std::getenv("SHMTENSOR_STRESS_ROUNDS")) return std::max(1, std::atoi(r));
  return default_rounds;
}

// Joins the daemon group `group` with the file_system strategy, in a process group of its
// own (the job).
struct JobSetup {
  explicit JobSetup(const std::string& group) {
    ::setpgid(0, 0);
    ::setenv("SHMTENSOR_MANAGER_GROUP", group.c_str(), 1);
    set_sharing_strategy(SharingStrategy::kFileSystem);
  }
};

// What a job process has: its setup, a queue, shared counters, and the pipe on which it
// reports the pid of every process it starts.
class Job {
 public:
  Job(const std::string& group, int pid_fd) : setup_(group), pid_fd_(pid_fd) {}
  pid_t report(pid_t pid) {
    std::string line = std::to_string(pid) + "\n";
    if (::write(pid_fd_, line.data(), line.size()) < 0) std::abort();
    return pid;
  }
  pid_t producer(int seed) { return report(start_producer(q, stats, seed)); }
  pid_t consumer() { return report(start_consumer(q, stats)); }
  // The verdict on the counters, printed with what happened.
  int verdict(const std::string& what) const {
    std::fprintf(stderr, "stress job: %s, put %lld, received %lld, bad %lld, lost %lld\n",
                 what.c_str(), static_cast<long long>(stats->put.load()),
                 static_cast<long long>(stats->received.load()),
                 static_cast<long long>(stats->bad.load()),
                 static_cast<long long>(stats->lost.load()));
    if (stats->bad.load() != 0) return 2;
    if (stats->received.load() == 0) return 3;
    // Every process of this job stays in its process group, so no name a message carries
    // is removed before it is received (docs/cleanup.md, L2 says when one can be).
    if (stats->lost.load() != 0) return 5;
    if (failures != 0) {
      std::fprintf(stderr, "stress job: %d producers/consumers failed on their own\n", failures);
      return 4;
    }
    return 0;
  }

 private:
  JobSetup setup_;
  int pid_fd_;
  internal::Mapping map_ = internal::Mapping::map_anonymous_shared(sizeof(Stats));

 public:
  Stats* stats = new (map_.data()) Stats;
  Queue<Item> q{32};
};

// Waits for a child that should end by itself; one that has not after 10 s (blocked: a
// failure) is SIGKILLed. Returns its exit status.
int wait_or_kill(pid_t pid) {
  for (int i = 0; i < 1000; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::fprintf(stderr, "stress job: pid %d did not end by itself\n", static_cast<int>(pid));
  ::kill(pid, SIGKILL);
  return testing::wait_child(pid);
}

// Producers, consumers and the daemon SIGKILLed at random while tensors flow.
int run_kill_everything_job(int rounds, const std::string& group, int pid_fd) {
  Job job(group, pid_fd);
  constexpr int kProducers = 2, kConsumers = 2;
  std::vector<pid_t> producers, consumers;
  for (int i = 0; i < kProducers; ++i) producers.push_back(job.producer(i));
  for (int i = 0; i < kConsumers; ++i) consumers.push_back(job.consumer());

  std::mt19937 rng(12345);
  int daemon_kills = 0;
  for (int round = 0; round < rounds; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 40));
    int what = static_cast<int>(rng() % 100);
    bool all = what >= 85;
    if (what < 35 || all) {
      auto& p = producers[rng() % kProducers];
      kill_and_reap(p);
      p = job.producer(round + 100);
    }
    if ((what >= 35 && what < 70) || all) {
      auto& c = consumers[rng() % kConsumers];
      kill_and_reap(c);
      c = job.consumer();
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
  return job.verdict(std::to_string(rounds) + " rounds, " + std::to_string(daemon_kills) +
                     " daemon kills");
}

enum class DaemonKill { kAlone, kWithProducer };

// Waits up to 5 s for a daemon of `group` other than `killed` to run.
bool replaced(const std::string& group, pid_t killed) {
  for (int i = 0; i < 500; ++i) {
    for (pid_t d : daemons_of(group))
      if (d != killed) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// One producer and one consumer; the daemon is SIGKILLed at random moments, alone or at
// the same moment as the producer. Only the survivors can start its replacement, and they
// must do it at once (cleanup.md G6), without waiting for a call into the library: the
// consumer, blocked in get() while no producer runs, makes none. Then the producer is
// restarted. At the end the job ends by itself: the producer stops, the queue is closed
// and drained, and every process exits.
int run_daemon_kill_job(int rounds, const std::string& group, DaemonKill mode, int pid_fd) {
  Job job(group, pid_fd);
  pid_t producer = job.producer(1);
  pid_t consumer = job.consumer();
  // From its first item on, the consumer holds names (those it keeps and its receive
  // cache), so it is connected and watches the daemon.
  for (int i = 0; i < 500 && job.stats->received.load() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::mt19937 rng(mode == DaemonKill::kAlone ? 777 : 778);
  int daemon_kills = 0;
  for (int round = 0; round < rounds; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 40));
    pid_t d = find_daemon(group);
    if (d == 0) continue;
    if (mode == DaemonKill::kWithProducer) ::kill(producer, SIGKILL);
    ::kill(d, SIGKILL);
    ++daemon_kills;
    if (mode == DaemonKill::kWithProducer && testing::wait_child(producer) != 128 + SIGKILL)
      ++failures;
    if (!replaced(group, d)) {
      std::fprintf(stderr, "stress job: no daemon 5 s after kill %d\n", daemon_kills);
      return 6;
    }
    if (mode == DaemonKill::kWithProducer) producer = job.producer(round + 100);
  }
  job.stats->stop.store(1);
  if (wait_or_kill(producer) != 0) ++failures;
  job.q.close();
  if (wait_or_kill(consumer) != 0) ++failures;
  return job.verdict(std::to_string(daemon_kills) + " daemon kills (" +
                     (mode == DaemonKill::kAlone ? "alone" : "with the producer") + ")");
}

// Runs `job` in a child (it makes its own process group: a "job"); returns its exit status
// and adds the pid of every process it started to `started`.
int run_job(const std::function<int(int pid_fd)>& job, std::set<pid_t>* started) {
  int pids[2];
  EXPECT_EQ(::pipe2(pids, O_CLOEXEC), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pids[0]);
    int rc = 1;
    try {
      rc = job(pids[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "stress job threw: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  ::close(pids[1]);
  started->insert(pid);
  int job_status = -1;
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
    if (job_status < 0 && ::waitpid(pid, &status, WNOHANG) == pid) {
      job_status = status;
      ::kill(-pid, SIGKILL);
    }
  }
  ::close(pids[0]);
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    started->insert(std::atoi(text.substr(pos, nl - pos).c_str()));
    pos = nl + 1;
  }
  return job_status < 0          ? testing::wait_child(pid)
         : WIFEXITED(job_status) ? WEXITSTATUS(job_status)
                                 : 128 + WTERMSIG(job_status);
}

// Every name any process of the job created is gone within a few seconds of its end
// (cleanup.md G3, G5: the daemon removes what the processes could not once the job's
// process group has ended). Removes what is left, for the next test.
void expect_no_name_left(const std::set<pid_t>& started) {
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
  std::fprintf(stderr, "%zu names of the job when it ended, gone after %lld ms\n", at_end,
               static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::steady_clock::now() - t0)
                                          .count()));
  for (const auto& n : leftovers()) ::shm_unlink(("/" + n).c_str());
}

// Stops the group's daemon and removes its files.
void stop_daemon(const std::string& group) {
  ::setenv("SHMTENSOR_MANAGER_GROUP", group.c_str(), 1);
  const auto loc = mgr::manager_location();
  ::unsetenv("SHMTENSOR_MANAGER_GROUP");
  if (pid_t d = find_daemon(group)) {
    ::kill(d, SIGTERM);  // it may rewrite its journal on the way out: unlink after
    EXPECT_TRUE(eventually([&] { return !process_lives(d); }));
  }
  if (std::getenv("SHMTENSOR_STRESS_KEEP_LOG") == nullptr)  // to read the daemon's log
    for (const auto& f : {loc.socket_path, loc.lock_path, loc.log_path, loc.journal_path})
      ::unlink(f.c_str());
}

constexpr const char* kJobFailures =
    "the job threw (1), saw a corrupted value (2), none (3), a process that failed (4), "
    "a message whose segment was gone (5), or no daemon after the last kill (6)";

TEST(ManagerStressTest, SigkillProducersConsumersAndTheDaemonWhileTensorsFlow) {
  const int rounds = stress_rounds(150);
  const std::string group = "stress" + std::to_string(::getpid());
  ::setenv("SHMTENSOR_MANAGER_GRACE_MS", "300", 1);

  std::set<pid_t> started;
  EXPECT_EQ(run_job([&](int fd) { return run_kill_everything_job(rounds, group, fd); }, &started),
            0)
      << kJobFailures;
  expect_no_name_left(started);

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
  ::unsetenv("SHMTENSOR_MANAGER_GROUP");
  ::unsetenv("SHMTENSOR_MANAGER_GRACE_MS");
  stop_daemon(group);
}

// The crash probe's cases (docs/cleanup.md G6): the daemon SIGKILLed while its clients
// live on, alone or together with the producer. Nothing of the job is left after it ends.
class DaemonKillStressTest : public ::testing::TestWithParam<DaemonKill> {};

TEST_P(DaemonKillStressTest, JobLeavesNoNameWhenTheDaemonIsKilledWhileItRuns) {
  const int rounds = stress_rounds(40);
  const std::string group = "stressd" + std::to_string(::getpid()) + "-" +
                            std::to_string(static_cast<int>(GetParam()));
  ::setenv("SHMTENSOR_MANAGER_GRACE_MS", "300", 1);
  std::set<pid_t> started;
  EXPECT_EQ(run_job([&](int fd) { return run_daemon_kill_job(rounds, group, GetParam(), fd); },
                    &started),
            0)
      << kJobFailures;
  expect_no_name_left(started);
  ::unsetenv("SHMTENSOR_MANAGER_GRACE_MS");
  stop_daemon(group);
}

INSTANTIATE_TEST_SUITE_P(Kills, DaemonKillStressTest,
                         ::testing::Values(DaemonKill::kAlone, DaemonKill::kWithProducer),
                         [](const auto& info) {
                           return info.param == DaemonKill::kAlone ? "Alone" : "WithProducer";
                         });

}  // namespace
}  // namespace shmtensor
