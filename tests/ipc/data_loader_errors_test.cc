// DataLoader failures: exceptions in a worker, a worker that dies (SIGKILL, SIGBUS, exit;
// killed while the main process sleeps on its ring), a stuck or stopped (SIGSTOP) worker
// past the timeout, a worker writing garbage into its reply ring, leaving an epoch early,
// invalid options. Each test checks the exact exception type and the words of its message,
// and that no fd, mapping or /dev/shm name is left behind. Nothing here depends on timing
// except the timeout tests, whose workers block far longer than the timeout.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <optional>
#include <thread>
#include <vector>
#include <typeinfo>

#include "shmtensor/internal/task_board.h"
#include "os/unique_fd.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/shmtensor.h"
#include "support/leak_check.h"
#include "transport/announced.h"
#include "transport/ring.h"

namespace shmtensor {
namespace {

class DataLoaderErrorsTest : public testing::LeakCheckedTest {};

// Sample i is i, except: throws for `bad`, blocks for `stuck` and beyond, raises a signal or
// exits for `fatal`.
struct Troubled {
  std::int64_t n = 10;
  std::int64_t bad = -1;
  std::int64_t stuck = -1;
  std::int64_t fatal = -1;
  int how = 0;  // 0: nothing; > 0: raise(how); < 0: _Exit(-how)
  SHMTENSOR_FIELDS(n, bad, stuck, fatal, how)
  std::int64_t size() const { return n; }
  std::int64_t get(std::int64_t i) const {
    if (i == bad) throw std::out_of_range("no sample " + std::to_string(i));
    if (stuck >= 0 && i >= stuck) std::this_thread::sleep_for(std::chrono::seconds(60));
    if (i == fatal) {
      if (how > 0) std::raise(how);
      std::_Exit(-how);
    }
    return i;
  }
};

TEST_F(DataLoaderErrorsTest, ExceptionInGetCarriesWorkerIndexTypeAndMessageAndTheEpochGoesOn) {
  DataLoader loader(Troubled{.bad = 7}, {.batch_size = 2, .num_workers = 2});
  auto it = loader.begin();
  EXPECT_EQ((*it)[0].item<std::int64_t>(), 0);
  for (std::int64_t b = 1; b < 3; ++b) EXPECT_EQ((*++it)[0].item<std::int64_t>(), 2 * b);
  try {
    ++it;  // batch 3 = indices 6, 7: loaded by worker 3 % 2
    FAIL() << "no exception";
  } catch (const DataLoaderWorkerError& e) {
    EXPECT_EQ(e.worker_id(), 1);
    EXPECT_EQ(e.index(), 7);
    EXPECT_EQ(e.stage(), "get");
    EXPECT_EQ(e.type_name(), "std::out_of_range");
    EXPECT_EQ(e.message(), "no sample 7");
    EXPECT_EQ(e.pid(), loader.worker_pids()[1]);
    EXPECT_EQ(std::string(e.what()), "DataLoader worker 1 (pid " + std::to_string(e.pid()) +
                                         ") raised std::out_of_range in get(7): no sample 7");
  }
  ++it;
  ASSERT_FALSE(it == loader.end());
  EXPECT_EQ((*it)[1].item<std::int64_t>(), 9);
  ++it;
  EXPECT_TRUE(it == loader.end());
}

struct Ragged {
  std::int64_t size() const { return 4; }
  Tensor get(std::int64_t i) const { return Tensor::zeros({i + 1}); }
};

void failing_init(int id) { throw std::runtime_error("cannot open shard " + std::to_string(id)); }

TEST_F(DataLoaderErrorsTest, CollateAndWorkerInitFailuresNameTheirStage) {
  DataLoader ragged(Ragged{}, {.batch_size = 2, .num_workers = 1});
  try {
    ragged.begin();
    FAIL() << "no exception";
  } catch (const DataLoaderWorkerError& e) {
    EXPECT_EQ(e.stage(), "collate_fn");
    EXPECT_EQ(e.index(), -1);
    EXPECT_EQ(e.type_name(), "std::invalid_argument");
    EXPECT_NE(std::string(e.what()).find("raised std::invalid_argument in collate_fn"),
              std::string::npos);
  }
  for (StartMethod method : {StartMethod::kFork, StartMethod::kExec}) {
    DataLoader init(Troubled{},
                    {.num_workers = 2, .worker_init_fn = &failing_init, .start_method = method});
    try {
      init.begin();
      FAIL() << "no exception";
    } catch (const DataLoaderWorkerError& e) {
      EXPECT_EQ(e.stage(), "worker_init_fn");
      EXPECT_EQ(e.type_name(), "std::runtime_error");
      EXPECT_EQ(e.message(), "cannot open shard " + std::to_string(e.worker_id()));
    }
    EXPECT_TRUE(init.worker_pids().empty());  // the others were stopped
  }
}

void worker_1_cannot_start(int id) {
  if (id == 1) throw std::runtime_error("no shard for worker 1");
}

TEST_F(DataLoaderErrorsTest, WorkerInitFailureEndsTheEpoch) {
  // Unlike an exception in get(), one in worker_init_fn leaves a worker that can load
  // nothing (batch 1 is its): the error ends the epoch and stops the workers.
  DataLoader loader(Troubled{}, {.num_workers = 2, .worker_init_fn = &worker_1_cannot_start});
  std::optional<decltype(loader.begin())> it;
  bool thrown = false;
  try {
    it.emplace(loader.begin());
    for (; !(*it == loader.end()); ++*it) {
    }
  } catch (const DataLoaderWorkerError& e) {
    thrown = true;
    EXPECT_EQ(e.worker_id(), 1);
    EXPECT_EQ(e.stage(), "worker_init_fn");
    EXPECT_EQ(e.message(), "no shard for worker 1");
  }
  ASSERT_TRUE(thrown);
  EXPECT_TRUE(loader.worker_pids().empty());
  if (it) {  // begin() returned batch 0 before the error came
    EXPECT_TRUE(*it == loader.end());
    ++*it;
    EXPECT_TRUE(*it == loader.end());
  }
  // The next epoch starts new workers, and worker 1 fails the same way.
  try {
    for (auto& batch : loader) (void)batch;
    ADD_FAILURE() << "no exception";
  } catch (const DataLoaderWorkerError& e) {
    EXPECT_EQ(e.stage(), "worker_init_fn");
  }
  EXPECT_EQ(loader.epochs(), 2);
}

// Iterates until the loader throws; the dataset guarantees that it must.
template <class Loader>
void drain(Loader& loader) {
  for (auto& batch : loader) (void)batch;
}

TEST_F(DataLoaderErrorsTest, WorkerKilledMidEpochIsReportedWithTheSignalName) {
  // Index 4 and later block, so the loader must notice the death to get anywhere.
  DataLoader loader(Troubled{.n = 8, .stuck = 4}, {.num_workers = 1});
  auto it = loader.begin();
  const int pid = loader.worker_pids().at(0);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  try {
    for (; !(it == loader.end()); ++it) {
    }
    FAIL() << "no exception";
  } catch (const DataLoaderWorkerDied& e) {
    EXPECT_EQ(e.worker_id(), 0);
    EXPECT_EQ(e.pid(), pid);
    EXPECT_EQ(e.exit_code(), -SIGKILL);
    EXPECT_EQ(e.signal_name(), "SIGKILL");
    EXPECT_NE(std::string(e.what()).find("DataLoader worker 0 (pid " + std::to_string(pid) +
                                         ") was killed by signal SIGKILL"),
              std::string::npos);
  }
  EXPECT_TRUE(loader.worker_pids().empty());
  // A new epoch starts new workers (this one stops short of the blocking index).
  int n = 0;
  for (auto& batch : loader) {
    if (++n == 3) break;
    (void)batch;
  }
  EXPECT_EQ(n, 3);
}

TEST_F(DataLoaderErrorsTest, BusErrorExplainsSharedMemoryAndExitCodesAreReported) {
  DataLoader bus(Troubled{.fatal = 3, .how = SIGBUS}, {.num_workers = 2});
  try {
    drain(bus);
    FAIL() << "no exception";
  } catch (const DataLoaderWorkerDied& e) {
    EXPECT_EQ(e.worker_id(), 1);
    EXPECT_EQ(e.signal_name(), "SIGBUS");
    const std::string what = e.what();
    EXPECT_NE(what.find("was killed by signal SIGBUS"), std::string::npos);
    EXPECT_NE(what.find("ran out of shared memory"), std::string::npos);
    EXPECT_NE(what.find("--shm-size"), std::string::npos);
  }
  DataLoader exits(Troubled{.fatal = 0, .how = -3}, {.num_workers = 1});
  try {
    drain(exits);
    FAIL() << "no exception";
  } catch (const DataLoaderWorkerDied& e) {
    EXPECT_EQ(e.exit_code(), 3);
    EXPECT_EQ(e.signal_name(), "");
    EXPECT_NE(std::string(e.what()).find("exited unexpectedly with exit code 3 while loading"),
              std::string::npos);
  }
}

TEST_F(DataLoaderErrorsTest, StuckWorkerPastTheTimeoutIsATimeoutError) {
  DataLoader loader(Troubled{.stuck = 2},
                    {.num_workers = 1, .timeout = std::chrono::milliseconds(300)});
  auto it = loader.begin();
  ++it;
  EXPECT_EQ((*it).item<std::int64_t>(), 1);
  const int pid = loader.worker_pids().at(0);
  try {
    ++it;
    FAIL() << "no exception";
  } catch (const DataLoaderTimeout& e) {
    EXPECT_EQ(std::string(e.what()),
              "DataLoader timed out after 0.3 seconds waiting for batch 2 from "
              "worker 0 (pid " +
                  std::to_string(pid) + ")");
  }
  // The stuck worker was stopped (SIGTERM) and reaped.
  EXPECT_TRUE(loader.worker_pids().empty());
  EXPECT_EQ(::kill(pid, 0), -1);
}

TEST_F(DataLoaderErrorsTest, AZeroTimeoutIsNoLimitAsInTorch) {
  // A 0 s limit would fail the first batch, which a worker just started cannot have ready.
  DataLoader loader(Troubled{.n = 4}, {.num_workers = 1, .timeout = std::chrono::seconds(0)});
  std::vector<std::int64_t> got;
  for (auto& batch : loader) got.push_back(batch.item<std::int64_t>());
  EXPECT_EQ(got, (std::vector<std::int64_t>{0, 1, 2, 3}));
}

TEST_F(DataLoaderErrorsTest, LeavingAnEpochEarlyStopsTheWorkers) {
  for (StartMethod method : {StartMethod::kFork, StartMethod::kExec}) {
    DataLoader loader(Troubled{.n = 1000},
                      {.batch_size = 3, .num_workers = 2, .start_method = method});
    std::vector<int> pids;
    int seen = 0;
    for (auto& batch : loader) {
      pids = loader.worker_pids();
      EXPECT_EQ(batch[0].item<std::int64_t>(), 3 * seen);
      if (++seen == 5) break;
    }
    EXPECT_TRUE(loader.worker_pids().empty());
    for (int pid : pids) EXPECT_EQ(::kill(pid, 0), -1) << pid;  // reaped
    // An exception thrown by the loop body does the same.
    try {
      for (auto& batch : loader)
        throw std::runtime_error(std::to_string(batch[0].item<std::int64_t>()));
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "0");
    }
    EXPECT_TRUE(loader.worker_pids().empty());
    // The loader is still usable: a whole epoch.
    std::int64_t batches = 0;
    for (auto& batch : loader) batches += batch.numel() > 0 ? 1 : 0;
    EXPECT_EQ(batches, loader.size());
  }
}

TEST_F(DataLoaderErrorsTest, DestroyingALoaderMidEpochStopsPersistentAndStuckWorkers) {
  std::vector<int> pids;
  {
    DataLoader loader(Troubled{.n = 100, .stuck = 3},
                      {.num_workers = 2, .persistent_workers = true});
    auto it = loader.begin();
    ++it;
    pids = loader.worker_pids();
    ASSERT_EQ(pids.size(), 2u);
  }
  for (int pid : pids) EXPECT_EQ(::kill(pid, 0), -1) << pid;
}

// A worker that ignores every message, kStop included, and SIGTERM: it ends only at EOF on
// its connection. flags[id]: 1 once it runs, 2 once it saw EOF.
void eof_only_worker(int id, internal::WorkerLink link, Tensor flags) {
  std::signal(SIGTERM, SIG_IGN);
  auto* flag = flags.data_ptr<std::int64_t>() + id;
  std::atomic_ref<std::int64_t>(*flag).store(1);
  for (;;) {
    try {
      (void)internal::ConnectionAccess::recv(*link.connection, std::nullopt);
    } catch (const ConnectionClosed&) {
      std::atomic_ref<std::int64_t>(*flag).store(2);
      return;
    }
  }
}

TEST_F(DataLoaderErrorsTest, ClosingTheMainProcessEndIsEndOfFileForEveryWorker) {
  // The loader's session stops its workers with kStop and then closes its ends. A forked
  // worker inherits copies of those ends (its own and the earlier workers'); unless it
  // closes them, the close is no EOF and only the signals after the grace period end it.
  for (StartMethod method : {StartMethod::kFork, StartMethod::kExec}) {
    Tensor flags = Tensor::zeros({3}, DType::kInt64);
    flags.share_memory_();
    auto flag = [&](int i) {
      return std::atomic_ref<std::int64_t>(flags.data_ptr<std::int64_t>()[i]).load();
    };
    {
      internal::SessionOptions options;
      options.num_workers = 3;
      options.start_method = method;
      internal::LoaderSession session(
          options,
          [&](int id, internal::WorkerLink link) {
            return internal::make_launch<true>(id, &eof_only_worker, link, flags);
          },
          [](std::uint64_t, Decoder&, bool) {});
      // Wait until every worker runs (an exec'd one takes a while to start).
      auto running = [&] { return flag(0) != 0 && flag(1) != 0 && flag(2) != 0; };
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!running() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ASSERT_TRUE(running()) << "the workers did not start";
    }  // stops the workers: kStop (ignored), EOF; SIGTERM (ignored); SIGKILL
    for (int i = 0; i < 3; ++i) EXPECT_EQ(flag(i), 2) << "worker " << i << " never saw EOF";
  }
}

// Sample i is i; from index `hold` on, the worker sets flag[0] to 1 and blocks.
struct Holding {
  std::int64_t n = 8;
  std::int64_t hold = 2;
  Tensor flag;
  std::int64_t size() const { return n; }
  std::int64_t get(std::int64_t i) const {
    if (i >= hold) {
      std::atomic_ref<std::int64_t>(*flag.data_ptr<std::int64_t>()).store(1);
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    return i;
  }
};

// Waits (up to 20 s) until flag[0] is 1.
bool wait_for_flag(const Tensor& flag) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::atomic_ref<std::int64_t>(*flag.data_ptr<std::int64_t>()).load() != 1) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST_F(DataLoaderErrorsTest, AWorkerKilledWhileTheMainProcessSleepsOnItsRingIsReported) {
  // The main process waits for batch 2, which the worker never makes: it spins on the ring,
  // then sleeps; the worker is killed once it blocked, and a while later (so that the main
  // process is most likely asleep by then; it is reported in either case).
  Tensor flag = Tensor::zeros({1}, DType::kInt64);
  flag.share_memory_();
  DataLoader loader(Holding{.flag = flag}, {.num_workers = 1});
  auto it = loader.begin();
  ++it;
  EXPECT_EQ((*it).item<std::int64_t>(), 1);
  const int pid = loader.worker_pids().at(0);
  std::atomic<bool> killed{false};
  std::thread killer([&] {
    if (!wait_for_flag(flag)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    killed = ::kill(pid, SIGKILL) == 0;
  });
  try {
    ++it;
    ADD_FAILURE() << "no exception";
  } catch (const DataLoaderWorkerDied& e) {
    EXPECT_EQ(e.worker_id(), 0);
    EXPECT_EQ(e.pid(), pid);
    EXPECT_EQ(e.exit_code(), -SIGKILL);
    // Tasks 2 and 3 (prefetch_factor 2) were the worker's.
    EXPECT_NE(std::string(e.what()).find("was killed by signal SIGKILL while loading 2 batches"),
              std::string::npos)
        << e.what();
  }
  killer.join();
  EXPECT_TRUE(killed.load());
  EXPECT_TRUE(loader.worker_pids().empty());
  EXPECT_EQ(::kill(pid, 0), -1);
}

TEST_F(DataLoaderErrorsTest, AStoppedWorkerPastTheTimeoutIsATimeoutErrorAndIsReaped) {
  DataLoader loader(Troubled{.n = 100},
                    {.num_workers = 1, .timeout = std::chrono::milliseconds(300)});
  auto it = loader.begin();
  EXPECT_EQ((*it).item<std::int64_t>(), 0);
  const int pid = loader.worker_pids().at(0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  // The batches it made before it stopped come out in order; then one it cannot make.
  std::int64_t next = 1;
  try {
    for (; next < 100; ++next) {
      ++it;
      ASSERT_EQ((*it).item<std::int64_t>(), next);
    }
    FAIL() << "no exception";
  } catch (const DataLoaderTimeout& e) {
    EXPECT_EQ(std::string(e.what()), "DataLoader timed out after 0.3 seconds waiting for batch " +
                                         std::to_string(next) + " from worker 0 (pid " +
                                         std::to_string(pid) + ")");
  }
  EXPECT_LE(next, 3);  // at most prefetch_factor batches were asked of it past batch 0
  // Stopped, it ignores SIGTERM; SIGKILL ends it, and it was reaped.
  EXPECT_TRUE(loader.worker_pids().empty());
  EXPECT_EQ(::kill(pid, 0), -1);
}

// Sends `message`, then reads what comes until the main process closes its end.
void send_then_wait_for_end(Connection& c, Encoder&& message) {
  internal::ConnectionAccess::send(c, std::move(message));
  for (;;) {
    try {
      (void)internal::ConnectionAccess::recv(c, std::nullopt);
    } catch (const ConnectionClosed&) {
      return;
    }
  }
}

// A one-worker session whose worker runs `worker`, in its first epoch of 4 tasks.
std::unique_ptr<internal::LoaderSession> session_of(void (*worker)(int, internal::WorkerLink),
                                                    internal::LoaderSession::Decode decode) {
  internal::SessionOptions options;
  options.num_workers = 1;
  auto session = std::make_unique<internal::LoaderSession>(
      options,
      [worker](int id, internal::WorkerLink link) {
        return internal::make_launch<true>(id, worker, link);
      },
      std::move(decode));
  session->begin_epoch([k = 0](std::vector<std::int64_t>& indices) mutable {
    indices = {k};
    return k++ < 4;
  });
  return session;
}

// What the DataLoaderError (that type exactly) that session.next() throws says.
std::string next_error(internal::LoaderSession& session) {
  try {
    (void)session.next();
  } catch (const DataLoaderError& e) {
    EXPECT_EQ(typeid(e), typeid(DataLoaderError));
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return {};
}

// A worker whose first reply (a worker speaks first: its task board) is a ring slot that
// is not a frame, then a message.
void junk_worker(int, internal::WorkerLink link) {
  Connection& c = *link.connection;
  const std::vector<int> fds = internal::ConnectionAccess::fds(c);
  internal::Ring ring = internal::Ring::attach(internal::dup_cloexec(fds[2]));  // replies
  const std::byte junk[12] = {std::byte{0xde}, std::byte{0xad}};
  (void)ring.push(junk, internal::kRingMessageTag, std::nullopt);
  // A raw push signals nobody who sleeps in poll(); a message sent after it does, and the
  // slot before it is taken first.
  Encoder e;
  e.encode(std::uint64_t{1});
  send_then_wait_for_end(c, std::move(e));
}

TEST_F(DataLoaderErrorsTest, AWorkerThatWritesGarbageIntoItsRingBreaksTheSession) {
  int decoded = 0;
  const auto owned = session_of(&junk_worker, [&](std::uint64_t, Decoder&, bool) { ++decoded; });
  internal::LoaderSession& session = *owned;
  const int pid = session.pids().at(0);
  const std::string what = next_error(session);
  EXPECT_NE(what.find("DataLoader worker 0 (pid " + std::to_string(pid) +
                      ") sent a reply that could not be decoded"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("shorter than a frame header"), std::string::npos) << what;
  EXPECT_EQ(decoded, 0);
  EXPECT_TRUE(session.broken());
  EXPECT_THROW((void)session.next(), DataLoaderError);
}

// A worker's first reply: `board` as its task board. Then reads until the end.
void reply_with_board(internal::WorkerLink link, const Tensor& board) {
  Encoder e;
  e.encode(std::uint64_t{0});
  e.encode(internal::EntryKind::kBoard);
  e.encode(board);
  e.encode(std::uint64_t{0});
  e.encode(internal::EntryKind::kDone);
  send_then_wait_for_end(*link.connection, std::move(e));
}

// A worker whose first reply is a task board far smaller than the loader's shape.
void small_board_worker(int, internal::WorkerLink link) {
  reply_with_board(link, Tensor::zeros({2}, DType::kInt64).share_memory_());
}

TEST_F(DataLoaderErrorsTest, AWorkerWhoseTaskBoardIsTooSmallBreaksTheSession) {
  // The main process writes tasks on the board the worker sent: one smaller than the
  // shape it expects (2 slots of 16 indices: 64 + 2 × 144 bytes) is refused, not written.
  const auto owned = session_of(&small_board_worker, [](std::uint64_t, Decoder&, bool) {});
  internal::LoaderSession& session = *owned;
  const int pid = session.pids().at(0);
  EXPECT_EQ(next_error(session),
            "DataLoader worker 0 (pid " + std::to_string(pid) +
                ") sent a reply that could not be decoded: shmtensor::ProtocolError: the task "
                "board is not a 1-d int64 host tensor of 352 bytes or more");
  EXPECT_TRUE(session.broken());
}

// Workers whose first reply carries a segment of each strategy: a file_descriptor one's fd
// travels with the message; a file_system one is opened by name in the main process.
void fd_board_worker(int, internal::WorkerLink link) {
  set_sharing_strategy(SharingStrategy::kFileDescriptor);
  reply_with_board(link, Tensor::zeros({64}, DType::kInt64).share_memory_());
}
void named_board_worker(int, internal::WorkerLink link) {
  set_sharing_strategy(SharingStrategy::kFileSystem);
  reply_with_board(link, Tensor::zeros({64}, DType::kInt64).share_memory_());
}

// What next() of a session of `worker` says when this process's fd table is full but for
// the one fd next()'s wait makes (the connection's epoll fd, made at the first wait). Run
// in a child: it lowers its fd limit.
void expect_reply_lost_at_the_fd_limit(void (*worker)(int, internal::WorkerLink),
                                       const std::string& cause) {
  const int status = testing::run_in_child([&] {
    const auto owned = session_of(worker, [](std::uint64_t, Decoder&, bool) {});
    internal::LoaderSession& session = *owned;
    const int pid = session.pids().at(0);
    // The limit one above the highest fd: fd `highest + 1` is the one left free.
    const int highest = *testing::open_fds().rbegin();
    rlimit lim{static_cast<rlim_t>(highest + 2), static_cast<rlim_t>(highest + 2)};
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
    std::vector<int> filler;
    for (int d; (d = ::dup(highest)) >= 0;) filler.push_back(d);
    ASSERT_EQ(errno, EMFILE);
    ASSERT_FALSE(filler.empty());
    ::close(filler.back());
    filler.pop_back();
    const std::string what = next_error(session);
    for (int d : filler) ::close(d);
    EXPECT_EQ(what.rfind("DataLoader worker 0 (pid " + std::to_string(pid) +
                             ")'s reply could not be received whole: ",
                         0),
              0u)
        << what;
    EXPECT_NE(what.find(cause), std::string::npos) << what;
    EXPECT_NE(what.find("ulimit -n"), std::string::npos) << what;
    EXPECT_EQ(what.find("could not be decoded"), std::string::npos) << what;
    EXPECT_EQ(what.find("exited"), std::string::npos) << what;
    EXPECT_TRUE(session.broken());
  });
  EXPECT_EQ(status, 0);
}

TEST_F(DataLoaderErrorsTest, AReplyLostAtTheFdLimitIsNotBlamedOnTheWorker) {
#if defined(__SANITIZE_ADDRESS__)
  // As HostileFramesTest.ReceiverAtItsFdLimitGetsCtruncErrorNamingUlimit: UBSan's vptr
  // check needs free fds.
  GTEST_SKIP() << "UBSan's vptr check needs free fds; runs in the plain and TSan builds";
#endif
  // The reply is lost and the session broken, but the error says why, not that the worker
  // sent something that could not be decoded, or died.
  expect_reply_lost_at_the_fd_limit(&fd_board_worker, "MSG_CTRUNC");
  expect_reply_lost_at_the_fd_limit(&named_board_worker, "Too many open files");
}

// A worker whose board always says it sleeps and which never reads its connection, but
// answers every task off its board (its answer: the task's id). Ends when its parent does.
void sleepless_board_worker(int, internal::WorkerLink link) {
  Connection& c = *link.connection;
  const internal::TaskBoardShape shape = internal::task_board_shape(2, 1, false);
  Tensor board = Tensor::zeros({static_cast<std::int64_t>(
                                   internal::TaskBoardMemory::bytes(shape) / 8)},
                               DType::kInt64)
                     .share_memory_();
  auto* base = reinterpret_cast<std::byte*>(board.data_ptr<std::int64_t>());
  auto* h = reinterpret_cast<internal::TaskBoardHeader*>(base);
  h->magic = internal::kTaskBoardMagic;
  h->version = internal::kTaskBoardVersion;
  h->slots = shape.slots;
  h->index_words = shape.index_words;
  h->asleep.store(1);
  Encoder first;
  first.encode(std::uint64_t{0});
  first.encode(internal::EntryKind::kBoard);
  first.encode(board);
  first.encode(std::uint64_t{0});
  first.encode(internal::EntryKind::kDone);
  internal::ConnectionAccess::send(c, std::move(first));
  const std::size_t entry_bytes = sizeof(internal::TaskEntry) + shape.index_words * 8;
  const pid_t parent = ::getppid();
  for (std::uint64_t taken = 0; ::getppid() == parent;) {
    h->asleep.store(1);
    if (h->published.load() == taken) {
      std::this_thread::yield();
      continue;
    }
    const auto* entry = reinterpret_cast<const internal::TaskEntry*>(
        base + sizeof(internal::TaskBoardHeader) + (taken++ % shape.slots) * entry_bytes);
    Encoder e;
    e.encode(entry->id);
    e.encode(internal::EntryKind::kBatch);
    e.encode(static_cast<std::int64_t>(entry->id));
    e.encode(std::uint64_t{0});
    e.encode(internal::EntryKind::kDone);
    internal::ConnectionAccess::send(c, std::move(e));
  }
}

TEST_F(DataLoaderErrorsTest, AWorkerThatSaysItSleepsButNeverReadsDoesNotBlockTheMainProcess) {
  // Every publish finds `asleep` set and sends a kWake the worker never reads: more than
  // its connection holds. The main process blocked in that send before it went by try_send.
  constexpr int kTasks = 20000;
  const pid_t main_process = testing::fork_child([] {
    int got = 0;
    {
      internal::SessionOptions options;
      options.num_workers = 1;
      internal::LoaderSession session(
          options,
          [](int id, internal::WorkerLink link) {
            return internal::make_launch<true>(id, &sleepless_board_worker, link);
          },
          [](std::uint64_t id, Decoder& d, bool) {
            if (d.decode<std::int64_t>() != static_cast<std::int64_t>(id)) std::_Exit(3);
          });
      session.begin_epoch([k = 0](std::vector<std::int64_t>& indices) mutable {
        indices = {k};
        return k++ < kTasks;
      });
      while (session.next()) ++got;
    }
    std::_Exit(got == kTasks ? 0 : 2);
  });
  EXPECT_EQ(testing::wait_child_within(main_process, std::chrono::seconds(60)), 0)
      << "-1: the main process blocked sending a wake";
}

auto capturing_collate(int k) {
  return [k](std::vector<std::int64_t> s) { return static_cast<std::int64_t>(s.size()) + k; };
}

TEST_F(DataLoaderErrorsTest, InvalidOptionsAreRejectedUpFront) {
  auto message = [](auto&& make) {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_EQ(message([] { DataLoader l(Troubled{}, {.batch_size = 0}); }),
            "DataLoader: batch_size must be at least 1, got 0");
  EXPECT_EQ(message([] { DataLoader l(Troubled{}, {.num_workers = -1}); }),
            "DataLoader: num_workers option should be non-negative, got -1");
  EXPECT_EQ(message([] { DataLoader l(Troubled{}, {.persistent_workers = true}); }),
            "DataLoader: persistent_workers option needs num_workers > 0");
  EXPECT_EQ(message([] {
              DataLoader l(Troubled{}, {.shuffle = true, .sampler = std::vector<std::int64_t>{1}});
            }),
            "DataLoader: sampler option is mutually exclusive with shuffle");
  EXPECT_EQ(message([] {
              DataLoader l(Troubled{},
                           {.batch_size = 2, .batch_sampler = BatchSampler::Batches{{1}}});
            }),
            "DataLoader: batch_sampler option is mutually exclusive with batch_size, shuffle, "
            "sampler, and drop_last");
  const std::string exec = message([] {
    DataLoader l(Troubled{}, DataLoaderOptions{.num_workers = 1,
                                               .start_method = StartMethod::kExec,
                                               .collate_fn = capturing_collate(1)});
  });
  EXPECT_NE(exec.find("collate_fn must be a plain function or a captureless lambda"),
            std::string::npos);
  const std::string init = message([] {
    int k = 0;
    DataLoader l(Troubled{}, {.num_workers = 1,
                              .worker_init_fn = [k](int) { (void)k; },
                              .start_method = StartMethod::kExec});
  });
  EXPECT_NE(init.find("worker_init_fn must hold a plain function pointer"), std::string::npos);
}

}  // namespace
}  // namespace shmtensor
