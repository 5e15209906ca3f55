// Process: start/join/is_alive/exitcode/terminate/kill, daemons, both start methods, and
// what a forked child must not do (run the parent's atexit handlers, lose its stdio).
#include "shmtensor/process.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/mapping.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/queue.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace process_test {

using namespace std::chrono_literals;
using shmtensor::Process;
using shmtensor::StartMethod;
using ::testing::HasSubstr;

void sleep_for(std::chrono::milliseconds d) { std::this_thread::sleep_for(d); }

void exit_with(int code) { std::_Exit(code); }
void run_forever() {
  for (;;) sleep_for(1000ms);
}
void throw_runtime_error(std::string what) { throw std::runtime_error(what); }
void put_sum(shmtensor::Queue<long> q, long a, long b) { q.put(a + b); }
void fill_tensor(shmtensor::Tensor t, double value) { t.fill_(value); }
void say_started_then_wait(shmtensor::Queue<long> q) {
  q.put(1);
  run_forever();
}

class ProcessTest : public shmtensor::testing::LeakCheckedTest,
                    public ::testing::WithParamInterface<StartMethod> {
 protected:
  void TearDown() override {
    shmtensor::testing::expect_no_children();
    LeakCheckedTest::TearDown();
  }
  template <class... A>
  Process make(A&&... a) {
    Process p(std::forward<A>(a)...);
    p.set_start_method(GetParam());
    return p;
  }
};

std::string name_of(const ::testing::TestParamInfo<StartMethod>& info) {
  return info.param == StartMethod::kFork ? "Fork" : "Exec";
}

TEST_P(ProcessTest, ExitCode) {
  Process p = make(exit_with, 7);
  EXPECT_EQ(p.exitcode(), std::nullopt);
  EXPECT_FALSE(p.is_alive());
  p.start();
  EXPECT_TRUE(p.join());
  EXPECT_EQ(p.exitcode(), 7);
  EXPECT_FALSE(p.is_alive());
  EXPECT_EQ(p.error(), "");
}

TEST_P(ProcessTest, JoinTimeoutIsAliveAndKill) {
  Process p = make(run_forever);
  p.start();
  EXPECT_GT(p.pid(), 0);
  EXPECT_TRUE(p.is_alive());
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(p.join(100ms));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
  EXPECT_EQ(p.exitcode(), std::nullopt);
  p.kill();
  EXPECT_TRUE(p.join(10s));
  EXPECT_EQ(p.exitcode(), -SIGKILL);
  EXPECT_FALSE(p.is_alive());
  p.kill();  // no-op once ended
}

// Linux signals a child (PR_SET_PDEATHSIG) when the *thread* that started it ends: a child
// started by a thread that ends at once ends too, whichever start method, while the
// Process object lives on: SIGKILLed, or, when the thread ended before the child armed the
// signal, by exiting with 1 (docs/processes.md).
TEST_P(ProcessTest, AChildDiesWithTheThreadThatStartedIt) {
  for (int round = 0; round < 5; ++round) {
    Process p = make(run_forever);
    std::thread([&] { p.start(); }).join();
    const bool ended = p.join(10s);
    EXPECT_TRUE(ended) << "round " << round << ": the child outlived the thread that started it";
    if (!ended) {
      p.kill();
      p.join();
      continue;
    }
    EXPECT_TRUE(p.exitcode() == -SIGKILL || p.exitcode() == 1) << *p.exitcode();
  }
}

TEST_P(ProcessTest, TerminateGivesMinusSigterm) {
  Process p = make(run_forever);
  p.start();
  p.terminate();
  p.join();
  EXPECT_EQ(p.exitcode(), -SIGTERM);
}

TEST_P(ProcessTest, ExceptionIsReportedAsErrorAndExitCodeOne) {
  Process p = make(throw_runtime_error, std::string("went wrong"));
  p.start();
  p.join();
  EXPECT_EQ(p.exitcode(), 1);
  EXPECT_EQ(p.error(), "std::runtime_error: went wrong");
}

TEST_P(ProcessTest, ArgumentsReachTheChild) {
  shmtensor::Queue<long> q;
  Process p = make(put_sum, q, 40L, 2L);
  p.start();
  EXPECT_EQ(q.get(), 42);
  p.join();
  EXPECT_EQ(p.exitcode(), 0);
}

TEST_P(ProcessTest, TensorArgumentIsSharedNotCopied) {
  auto t = shmtensor::Tensor::zeros({16}, shmtensor::DType::kFloat32);
  // A fork child gets a copy-on-write copy of private memory, so for kFork the storage is
  // shared up front; for kExec sending the argument moves it into shared memory in place.
  if (GetParam() == StartMethod::kFork) t.share_memory_();
  Process p = make(fill_tensor, t, 3.5);
  p.start();
  p.join();
  ASSERT_EQ(p.exitcode(), 0) << p.error();
  EXPECT_TRUE(t.is_shared());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(t.data_ptr<float>()[i], 3.5f);
}

TEST_P(ProcessTest, DaemonIsTerminatedOnDestruction) {
  auto t0 = std::chrono::steady_clock::now();
  int pid = 0;
  {
    Process p = make(run_forever);
    p.set_daemon(true);
    p.start();
    pid = p.pid();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
  EXPECT_EQ(::kill(pid, 0), -1);  // reaped: the pid no longer names our child
}

TEST_P(ProcessTest, UsageErrors) {
  Process p = make(exit_with, 0);
  EXPECT_ERROR(p.pid(), shmtensor::Error, "Process::pid: the process was not started");
  EXPECT_ERROR(p.join(), shmtensor::Error, "Process::join: the process was not started");
  p.start();
  EXPECT_ERROR(p.start(), shmtensor::Error, "Process::start: a process can be started only once");
  EXPECT_ERROR(p.set_daemon(true), shmtensor::Error,
               "Process::set_daemon: the process was already started");
  p.join();
}

TEST_P(ProcessTest, MovedProcessKeepsTheChild) {
  Process p = make(exit_with, 5);
  p.start();
  Process q = std::move(p);
  q.join();
  EXPECT_EQ(q.exitcode(), 5);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, ProcessTest,
                         ::testing::Values(StartMethod::kFork, StartMethod::kExec), name_of);

// ---- fork-only -------------------------------------------------------------------------

class ProcessForkTest : public shmtensor::testing::LeakCheckedTest {};

int g_atexit_fd = -1;
pid_t g_test_pid = 0;
void atexit_probe() {
  if (g_atexit_fd >= 0 && ::getpid() != g_test_pid) {
    [[maybe_unused]] auto n = ::write(g_atexit_fd, "X", 1);
  }
}

TEST_F(ProcessForkTest, ChildDoesNotRunTheParentsAtexitHandlers) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  static bool registered = false;
  if (!registered) {
    std::atexit(atexit_probe);
    registered = true;
  }
  g_test_pid = ::getpid();
  g_atexit_fd = fds[1];
  Process p([] {});
  p.start();
  p.join();
  g_atexit_fd = -1;
  ::close(fds[1]);
  char c;
  EXPECT_EQ(::read(fds[0], &c, 1), 0) << "the child ran an atexit handler of the parent";
  ::close(fds[0]);
  EXPECT_EQ(p.exitcode(), 0);
}

TEST_F(ProcessForkTest, ChildFlushesItsStdio) {
  ::testing::internal::CaptureStdout();
  Process p([] {
    std::printf("unflushed output of the child");  // no newline: stays in the buffer
  });
  p.start();
  p.join();
  EXPECT_THAT(::testing::internal::GetCapturedStdout(), HasSubstr("unflushed output of the child"));
}

TEST_F(ProcessForkTest, CapturingLambdaWithState) {
  auto shared = shmtensor::internal::Mapping::map_anonymous_shared(4096);
  auto* out = reinterpret_cast<volatile int*>(shared.data());
  int base = 100;
  Process p([out, base](int k) { *out = base + k; }, 5);
  p.start();
  p.join();
  EXPECT_EQ(*out, 105);
}

TEST_F(ProcessForkTest, CapturingLambdaCannotBeExeced) {
  int base = 1;
  Process p([base] { (void)base; });
  p.set_start_method(StartMethod::kExec);
  EXPECT_ERROR(p.start(), shmtensor::Error, "cannot start this callable with StartMethod::kExec");
}

TEST_F(ProcessForkTest, NonDaemonIsWaitedForOnDestruction) {
  auto shared = shmtensor::internal::Mapping::map_anonymous_shared(4096);
  auto* done = reinterpret_cast<volatile int*>(shared.data());
  {
    Process p([done] {
      sleep_for(200ms);
      *done = 1;
    });
    p.start();
  }
  EXPECT_EQ(*done, 1);
}

// ---- exec-only -------------------------------------------------------------------------

class ProcessExecTest : public shmtensor::testing::StrategyTest {};

TEST_P(ProcessExecTest, ExecChildHoldsNoneOfTheParentsBlocksOrNames) {
  // A child started by exec drops every inherited mapping at execve: it must not have
  // taken holds of our blocks or counts of our named segments at fork, which nobody would
  // give back before it exits (our freed blocks could not be reused meanwhile).
  shmtensor::Tensor t = shmtensor::Tensor::empty_shared({16}, shmtensor::DType::kFloat32);
  const auto& seg = shmtensor::internal::StorageAccess::impl(t.storage())->segment();
  const std::uint32_t block = shmtensor::internal::StorageAccess::impl(t.storage())->block();
  const std::uint64_t word = seg->block_word(block);
  const std::int64_t refcount = seg->header()->refcount.load();
  ASSERT_NE(word, 0u);
  shmtensor::Queue<long> started;
  Process p(say_started_then_wait, started);
  p.set_start_method(StartMethod::kExec);
  p.start();
  ASSERT_EQ(started.get(), 1);  // it has exec'd and runs
  EXPECT_EQ(seg->block_word(block), word) << "the exec'd child holds our block";
  EXPECT_EQ(seg->header()->refcount.load(), refcount) << "the exec'd child counts our segment";
  p.kill();
  p.join();
}

INSTANTIATE_TEST_SUITE_P(Strategies, ProcessExecTest, shmtensor::testing::kAllStrategies,
                         shmtensor::testing::strategy_name);

// A program that cannot be started again (here: an environment string longer than the
// kernel's 128 KiB for one, E2BIG) makes start() throw the SystemError of posix_spawn,
// naming what it ran; no child is left, no fd of the start (its report pipe) stays open,
// and the Process can be started once the cause is gone.
class ProcessExecFailureTest : public shmtensor::testing::LeakCheckedTest {
 protected:
  void TearDown() override {
    ::unsetenv("SHMTENSOR_TEST_TOO_LONG");
    shmtensor::testing::expect_no_children();
    LeakCheckedTest::TearDown();
  }
};

TEST_F(ProcessExecFailureTest, AStartThatCannotExecuteThrowsSayingWhyAndLeavesNothing) {
  Process p(exit_with, 7);
  p.set_start_method(StartMethod::kExec);
  ASSERT_EQ(::setenv("SHMTENSOR_TEST_TOO_LONG", std::string(200 * 1024, 'x').c_str(), 1), 0);
  try {
    p.start();
    FAIL() << "start() did not throw";
  } catch (const shmtensor::SystemError& e) {
    EXPECT_EQ(e.error_code(), E2BIG);
    EXPECT_EQ(e.syscall(), "posix_spawn");
    EXPECT_THAT(e.what(), HasSubstr("posix_spawn(/proc/self/exe)"));
  }
  EXPECT_FALSE(p.is_alive());
  EXPECT_EQ(p.exitcode(), std::nullopt);
  ASSERT_EQ(::unsetenv("SHMTENSOR_TEST_TOO_LONG"), 0);
  p.start();
  EXPECT_TRUE(p.join(10s));
  EXPECT_EQ(p.exitcode(), 7);
}

}  // namespace process_test
