// torch's test_multiprocessing_spawn.py, for both start methods. Child functions are plain
// functions (templates where torch passes an argument) so that the exec start method, which
// re-executes this binary, can run them too.
#include "shmtensor/spawn.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "os/mapping.h"
#include "shmtensor/queue.h"
#include "shmtensor/start_method.h"
#include "support/expect_error.h"
#include "support/leak_check.h"

namespace spawn_test {

using namespace std::chrono_literals;
using shmtensor::ProcessExitedException;
using shmtensor::ProcessRaisedException;
using shmtensor::SpawnOptions;
using shmtensor::StartMethod;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

struct ValueError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void sleep_for(std::chrono::milliseconds d) { std::this_thread::sleep_for(d); }

void no_core_dump() {
  rlimit none{0, 0};
  ::setrlimit(RLIMIT_CORE, &none);
}

// ---- child functions ---------------------------------------------------------------------

void success_func(int) {}

void success_single_arg_func(int i, shmtensor::Queue<int> q) { q.put(i); }

void exception_single_func(int i, int arg) {
  if (i == arg) throw ValueError("legitimate exception from process " + std::to_string(i));
  sleep_for(1000ms);
}

void exception_all_func(int i) {
  std::mt19937 rng(static_cast<unsigned>(::getpid()));
  sleep_for(std::chrono::milliseconds(rng() % 100));
  throw ValueError("legitimate exception from process " + std::to_string(i));
}

void terminate_signal_func(int i) {
  if (i == 0) {
    no_core_dump();
    ::raise(SIGABRT);
  }
  sleep_for(1000ms);
}

void terminate_exit_func(int i, int arg) {
  if (i == 0) std::_Exit(arg);
  sleep_for(1500ms);
}

void success_first_then_exception_func(int i) {
  if (i == 0) return;
  sleep_for(100ms);
  throw ValueError("legitimate exception");
}

void fail_now_or_sleep_a_minute(int i) {
  if (i == 0) throw ValueError("fast");
  sleep_for(60000ms);
}

void infinite_task(int) {
  for (;;) sleep_for(1000ms);
}

void throws_std_type(int i) {
  if (i == 1) throw std::invalid_argument("bad argument in process 1");
}

void throws_non_std(int) { throw 42; }

// ---- helpers -----------------------------------------------------------------------------

// The state letter of /proc/<pid>/stat, or 0 when the process is gone.
char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  auto p = line.rfind(')');
  return p == std::string::npos || p + 2 >= line.size() ? 0 : line[p + 2];
}

bool process_dead(pid_t pid) {
  char s = process_state(pid);
  return s == 0 || s == 'Z' || s == 'X';
}

class SpawnTest : public shmtensor::testing::LeakCheckedTest,
                  public ::testing::WithParamInterface<StartMethod> {
 protected:
  void TearDown() override {
    shmtensor::testing::expect_no_children();
    LeakCheckedTest::TearDown();
  }
  StartMethod method() const { return GetParam(); }
  SpawnOptions options(bool join = true) const {
    return SpawnOptions{.join = join, .daemon = false, .start_method = method()};
  }
};

std::string name_of(const ::testing::TestParamInfo<StartMethod>& info) {
  return info.param == StartMethod::kFork ? "Fork" : "Exec";
}

// ---- torch's tests -----------------------------------------------------------------------

TEST_P(SpawnTest, Success) {
  shmtensor::start_processes(method(), success_func, 2);
  auto ctx = shmtensor::spawn(success_func, 2, options());
  EXPECT_TRUE(ctx.join());
}

TEST_P(SpawnTest, SuccessNonBlocking) {
  auto ctx = shmtensor::spawn(success_func, 2, options(/*join=*/false));
  ctx.join();
  ctx.join();
  EXPECT_TRUE(ctx.join());
  EXPECT_TRUE(ctx.join());
}

TEST_P(SpawnTest, RepeatedJoinWithTimeoutEventuallyTrue) {
  auto ctx = shmtensor::spawn(exception_single_func, 2, options(/*join=*/false), -1);
  EXPECT_FALSE(ctx.join(0s));  // both sleep 1 s
  EXPECT_FALSE(ctx.join(50ms));
  int calls = 0;
  while (!ctx.join(100ms)) ++calls;
  EXPECT_GE(calls, 3);
  EXPECT_TRUE(ctx.join(0s));
}

TEST_P(SpawnTest, ExceptionSingle) {
  for (int i = 0; i < 2; ++i) {
    try {
      shmtensor::spawn(exception_single_func, 2, options(), i);
      ADD_FAILURE() << "no exception for process " << i;
    } catch (const ProcessRaisedException& e) {
      std::string expected = "legitimate exception from process " + std::to_string(i);
      EXPECT_THAT(e.what(), HasSubstr("\n\n-- Process " + std::to_string(i) +
                                      " terminated with the following error:\n"));
      EXPECT_THAT(e.what(), EndsWith("ValueError: " + expected));
      EXPECT_THAT(e.what(), HasSubstr("\nspawn_test::ValueError: " + expected));
      EXPECT_EQ(e.error_index(), i);
      EXPECT_GT(e.pid(), 0);
    }
  }
}

TEST_P(SpawnTest, ExceptionAll) {
  try {
    shmtensor::spawn(exception_all_func, 2, options());
    ADD_FAILURE() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_THAT(e.what(),
                MatchesRegex("(.|\n)*\nspawn_test::ValueError: legitimate exception from process "
                             "(0|1)"));
    EXPECT_THAT(e.what(), EndsWith("process " + std::to_string(e.error_index())));
  }
}

TEST_P(SpawnTest, TerminateSignal) {
  try {
    shmtensor::spawn(terminate_signal_func, 2, options());
    ADD_FAILURE() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_STREQ(e.what(), "process 0 terminated with signal SIGABRT");
    EXPECT_EQ(e.error_index(), 0);
    EXPECT_EQ(e.exit_code(), -SIGABRT);
    EXPECT_EQ(e.signal_name(), "SIGABRT");
  }
}

TEST_P(SpawnTest, TerminateExitTerminatesTheOthersWithAWarning) {
  auto ctx = shmtensor::spawn(terminate_exit_func, 2, options(/*join=*/false), 123);
  auto pids = ctx.pids();
  ASSERT_EQ(pids.size(), 2u);
  ::testing::internal::CaptureStderr();
  try {
    while (!ctx.join()) {
    }
    ADD_FAILURE() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_STREQ(e.what(), "process 0 terminated with exit code 123");
    EXPECT_EQ(e.exit_code(), 123);
    EXPECT_EQ(e.signal_name(), "");
    EXPECT_EQ(e.pid(), pids[0]);
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err,
              HasSubstr("Terminating process " + std::to_string(pids[1]) + " via signal SIGTERM"));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("via signal SIGKILL")));
  EXPECT_EQ(ctx.processes()[1].exitcode(), -SIGTERM);
  for (auto& p : ctx.processes()) EXPECT_FALSE(p.is_alive());
}

TEST_P(SpawnTest, FailureOfAChildReapedThroughProcessesIsStillThrownByJoin) {
  auto ctx = shmtensor::spawn(terminate_exit_func, 2, options(/*join=*/false), 7);
  // The caller reaps child 0 itself, through processes(), before join() sees it end.
  shmtensor::Process& first = ctx.processes()[0];
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!first.exitcode() && std::chrono::steady_clock::now() < deadline) sleep_for(5ms);
  ASSERT_EQ(first.exitcode(), 7);
  EXPECT_FALSE(first.is_alive());
  ::testing::internal::CaptureStderr();
  try {
    ctx.join();
    ADD_FAILURE() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_STREQ(e.what(), "process 0 terminated with exit code 7");
    EXPECT_EQ(e.error_index(), 0);
    EXPECT_EQ(e.exit_code(), 7);
  }
  ::testing::internal::GetCapturedStderr();
  for (auto& p : ctx.processes()) EXPECT_FALSE(p.is_alive());
  EXPECT_TRUE(ctx.join());  // the failure is thrown once; every child has ended
}

TEST_P(SpawnTest, TerminateExitWithGracePeriodLetsTheOthersFinish) {
  auto ctx = shmtensor::spawn(terminate_exit_func, 2, options(/*join=*/false), 123);
  ::testing::internal::CaptureStderr();
  try {
    while (!ctx.join(std::nullopt, /*grace_period=*/20s)) {
    }
    ADD_FAILURE() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_STREQ(e.what(), "process 0 terminated with exit code 123");
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, ::testing::Not(HasSubstr("Terminating process")));
  EXPECT_EQ(ctx.processes()[1].exitcode(), 0);
  for (auto& p : ctx.processes()) EXPECT_FALSE(p.is_alive());
}

TEST_P(SpawnTest, SigkillAfterTheGracePeriod) {
  // Children that ignore SIGTERM are killed once the grace period has passed.
  auto ignore_term = +[](int i) {
    ::signal(SIGTERM, SIG_IGN);
    if (i == 0) {
      sleep_for(200ms);
      std::_Exit(3);
    }
    for (;;) sleep_for(1000ms);
  };
  auto ctx = shmtensor::spawn(ignore_term, 2, options(/*join=*/false));
  auto pids = ctx.pids();
  ::testing::internal::CaptureStderr();
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_ERROR(ctx.join(std::nullopt, 300ms), ProcessExitedException,
               "process 0 terminated with exit code 3");
  auto elapsed = std::chrono::steady_clock::now() - t0;
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err,
              HasSubstr("Terminating process " + std::to_string(pids[1]) + " via signal SIGTERM"));
  EXPECT_THAT(err,
              HasSubstr("Terminating process " + std::to_string(pids[1]) + " via signal SIGKILL"));
  EXPECT_EQ(ctx.processes()[1].exitcode(), -SIGKILL);
  EXPECT_LT(elapsed, 10s);
}

TEST_P(SpawnTest, FailureIsReportedWithoutWaitingForTheOthers) {
  // Child 0 fails at once; child 1 would sleep for a minute. join() reports the failure
  // when child 0 ends (each child is watched through its pidfd) and terminates child 1,
  // rather than waiting for it: it returns well within the minute.
  auto ctx = shmtensor::spawn(fail_now_or_sleep_a_minute, 2, options(/*join=*/false));
  const auto pids = ctx.pids();
  ::testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ctx.join();
    ADD_FAILURE() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(e.error_index(), 0);
    EXPECT_THAT(e.what(), EndsWith("spawn_test::ValueError: fast"));
  }
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_LT(elapsed, 20s) << "join() waited for the sleeping child";
  EXPECT_THAT(err,
              HasSubstr("Terminating process " + std::to_string(pids[1]) + " via signal SIGTERM"));
  EXPECT_EQ(ctx.processes()[1].exitcode(), -SIGTERM);
}

TEST_P(SpawnTest, SuccessFirstThenException) {
  try {
    shmtensor::spawn(success_first_then_exception_func, 3, options());
    ADD_FAILURE() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_THAT(e.what(), EndsWith("ValueError: legitimate exception"));
    EXPECT_NE(e.error_index(), 0);
  }
}

TEST_P(SpawnTest, SignalFromOutsideRaisesProcessExited) {
  auto ctx = shmtensor::spawn(infinite_task, 1, options(/*join=*/false));
  for (int pid : ctx.pids()) ::kill(pid, SIGTERM);
  try {
    ctx.join();
    ADD_FAILURE() << "no exception";
  } catch (const ProcessExitedException& e) {
    EXPECT_STREQ(e.what(), "process 0 terminated with signal SIGTERM");
    EXPECT_EQ(e.exit_code(), -SIGTERM);
  }
}

TEST_P(SpawnTest, ExceptionTypeNameIsDemangled) {
  try {
    shmtensor::spawn(throws_std_type, 2, options());
    ADD_FAILURE() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_THAT(e.what(), EndsWith("\nstd::invalid_argument: bad argument in process 1"));
    EXPECT_EQ(e.error_index(), 1);
  }
}

TEST_P(SpawnTest, NonStdExceptionIsReportedByType) {
  try {
    shmtensor::spawn(throws_non_std, 1, options());
    ADD_FAILURE() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_THAT(e.what(), HasSubstr("\nint: "));
  }
}

TEST_P(SpawnTest, CaptureLessLambda) {
  auto lambda = [](int i) {
    if (i == 1) throw std::out_of_range("from a lambda in process 1");
  };
  try {
    shmtensor::spawn(lambda, 2, options());
    ADD_FAILURE() << "no exception";
  } catch (const ProcessRaisedException& e) {
    EXPECT_THAT(e.what(), EndsWith("std::out_of_range: from a lambda in process 1"));
  }
}

// Parent death: a child spawns a grandchild, then the child is SIGKILLed; the grandchild
// (PR_SET_PDEATHSIG: set by a forked child, or by an exec child in init()) dies within
// seconds. torch's _test_nested.
TEST_P(SpawnTest, ChildrenDieWithTheirParent) {
  auto shared = shmtensor::internal::Mapping::map_anonymous_shared(4096);
  auto* grandchild_pid = reinterpret_cast<volatile int*>(shared.data());
  *grandchild_pid = 0;
  const StartMethod m = method();
  pid_t middle = shmtensor::testing::fork_child([&] {
    auto ctx = shmtensor::spawn(infinite_task, 1,
                                SpawnOptions{.join = false, .daemon = false, .start_method = m});
    *grandchild_pid = ctx.pids()[0];
    for (;;) sleep_for(1000ms);
  });
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (*grandchild_pid == 0 && std::chrono::steady_clock::now() < deadline) sleep_for(10ms);
  const pid_t gc = *grandchild_pid;
  ASSERT_GT(gc, 0) << "the middle process never started its child";
  EXPECT_FALSE(process_dead(gc));
  ::kill(middle, SIGKILL);
  EXPECT_EQ(shmtensor::testing::wait_child(middle), 128 + SIGKILL);
  while (!process_dead(gc) && std::chrono::steady_clock::now() < deadline) sleep_for(10ms);
  EXPECT_TRUE(process_dead(gc)) << "grandchild " << gc << " outlived its parent";
}

TEST_P(SpawnTest, FirstArgumentIsTheIndex) {
  shmtensor::Queue<int> q;
  shmtensor::spawn(success_single_arg_func, 2, options(), q);
  std::vector<int> got{q.get(), q.get()};
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int>{0, 1}));
}

INSTANTIATE_TEST_SUITE_P(StartMethods, SpawnTest,
                         ::testing::Values(StartMethod::kFork, StartMethod::kExec), name_of);

// ---- fork-only and API details ------------------------------------------------------------

class SpawnForkTest : public shmtensor::testing::LeakCheckedTest {
 protected:
  void TearDown() override {
    shmtensor::testing::expect_no_children();
    LeakCheckedTest::TearDown();
  }
};

TEST_F(SpawnForkTest, ArgumentsAreCopiedIntoEachChild) {
  auto shared = shmtensor::internal::Mapping::map_anonymous_shared(4096);
  auto* out = reinterpret_cast<volatile int*>(shared.data());
  std::string word = "abc";
  shmtensor::spawn(
      [out](int i, const std::string& w, int k) { out[i] = static_cast<int>(w.size()) * k + i; }, 3,
      {}, word, 10);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i], 30 + i);
}

TEST_F(SpawnForkTest, CapturingLambdaCannotUseExec) {
  int captured = 1;
  try {
    shmtensor::spawn([captured](int) { (void)captured; }, 1, {.start_method = StartMethod::kExec});
    ADD_FAILURE() << "no exception";
  } catch (const shmtensor::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("plain function or a captureless lambda"));
  }
}

TEST_F(SpawnForkTest, ExecChildWithoutInitCannotStartChildren) {
  // A re-executed program that never calls init() runs main again; when it then starts a
  // child it must report that to its parent and exit instead of re-executing without end.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::testing::internal::CaptureStderr();
  pid_t pid = shmtensor::testing::fork_child([&] {
    ::close(fds[0]);
    std::string value =
        "2:0:" + std::to_string(fds[1]) + ":-1:0:0:::" + std::to_string(::getppid()) + ":" +
        std::to_string(::getppid());
    ::setenv("SHMTENSOR_EXEC_CHILD", value.c_str(), 1);
    ASSERT_TRUE(shmtensor::is_exec_child());
    shmtensor::spawn(success_func, 1);
    ADD_FAILURE() << "spawn returned";
  });
  ::close(fds[1]);
  std::string report;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) report.append(buf, n);
  ::close(fds[0]);
  EXPECT_EQ(shmtensor::testing::wait_child(pid), 1);
  EXPECT_THAT(report, HasSubstr("shmtensor::init(argc, argv) was not called"));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("was not called"));
}

TEST_F(SpawnForkTest, NprocsMustBePositive) {
  EXPECT_ERROR(shmtensor::spawn(success_func, 0), shmtensor::Error,
               "spawn: nprocs must be at least 1, got 0");
}

TEST_F(SpawnForkTest, DestroyingTheContextWaitsForTheChildren) {
  auto shared = shmtensor::internal::Mapping::map_anonymous_shared(4096);
  auto* done = reinterpret_cast<volatile int*>(shared.data());
  *done = 0;
  {
    auto ctx = shmtensor::spawn(
        [done](int) {
          sleep_for(200ms);
          *done = 1;
        },
        1, {.join = false});
  }
  EXPECT_EQ(*done, 1);
}

TEST_F(SpawnForkTest, DestroyingTheContextTerminatesDaemons) {
  auto t0 = std::chrono::steady_clock::now();
  { auto ctx = shmtensor::spawn(infinite_task, 2, {.join = false, .daemon = true}); }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
}

}  // namespace spawn_test
