// CUDA tensors without a GPU: the fake driver (SHMTENSOR_CUDA_DRIVER=fake, two devices)
// runs the real protocol paths (device arenas, export, import, the wire's device entries,
// holder slots) across real processes. Every child is exec'd (CUDA does not survive fork);
// one test checks that a forked child is refused.
//
// With SHMTENSOR_CUDA_TEST_REAL=1 the driver is not faked: CTest runs the same program so
// a second time, as the `gpu.*` tests (label gpu), which skip with the reason on a machine
// without CUDA and run on a GPU (docs/cuda.md lists what they check). Tests that need two
// devices skip with one.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cuda/cuda_fixture.h"
#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "cuda/probe.h"
#include "manager/report.h"
#include "memory/arena.h"
#include "memory/fence.h"
#include "memory/registry.h"
#include "memory/segment.h"
#include "os/shm.h"
#include "shmtensor/connection.h"
#include "shmtensor/device.h"
#include "shmtensor/process.h"
#include "shmtensor/queue.h"
#include "shmtensor/spawn.h"
#include "shmtensor/start_method.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "wire/frame.h"
#include "wire/wire.h"

namespace cuda_test {

using shmtensor::CudaError;
using shmtensor::Device;
using shmtensor::DType;
using shmtensor::Process;
using shmtensor::Queue;
using shmtensor::StartMethod;
using shmtensor::Tensor;
using ::testing::HasSubstr;

std::size_t device_free_bytes() {
  const auto& d = shmtensor::internal::cuda::Driver::get();
  shmtensor::internal::cuda::CurrentDevice current(d, 0);
  std::size_t free = 0, total = 0;
  d.check(d.api().cuMemGetInfo(&free, &total), "cuMemGetInfo");
  return free;
}

// ---- without a driver ----------------------------------------------------------------

// Runs this binary again with `env` added and only `test` selected; returns its exit code.
int run_self(const std::string& test, const std::vector<std::string>& env) {
  pid_t pid = fork();
  if (pid == 0) {
    unsetenv("SHMTENSOR_CUDA_DRIVER");
    for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
    std::string filter = "--gtest_filter=" + test;
    execl("/proc/self/exe", "cuda_tests", filter.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(CudaWithoutDriver, IsUnavailableWithTheReasonAndDeviceTensorsThrow) {
  ASSERT_EQ(run_self("CudaWithoutDriverChild.*",
                     {"SHMTENSOR_CUDA_LIBRARY=/nonexistent/libcuda.so.1",
                      "SHMTENSOR_CUDA_CHILD=1", "SHMTENSOR_CUDA_TEST_REAL=1"}),
            0);
}

TEST(CudaWithoutDriverChild, Checks) {
  if (std::getenv("SHMTENSOR_CUDA_CHILD") == nullptr) GTEST_SKIP() << "run by the test above";
  EXPECT_FALSE(shmtensor::cuda::is_available());
  EXPECT_EQ(shmtensor::cuda::device_count(), 0);
  EXPECT_THAT(shmtensor::cuda::unavailable_reason(), HasSubstr("/nonexistent/libcuda.so.1"));
  try {
    (void)Tensor::empty({2}, DType::kFloat32, Device::cuda());
    ADD_FAILURE() << "no CudaError";
  } catch (const CudaError& e) {
    EXPECT_THAT(e.what(), HasSubstr("CUDA is not available: cannot load the CUDA driver"));
  }
  // CPU tensors are untouched by all this.
  EXPECT_TRUE(iota(3).cpu().equal(iota(3)));
}

TEST(CudaWithoutDriver, ADeviceThatRefusesExportIsRefusedAtFirstUseWithTheReason) {
  ASSERT_EQ(run_self("CudaRefusedExportChild.*",
                     {"SHMTENSOR_CUDA_DRIVER=fake", "SHMTENSOR_FAKE_CUDA_REFUSE_EXPORT=1",
                      "SHMTENSOR_CUDA_CHILD=1", "SHMTENSOR_CUDA_TEST_REAL=1"}),
            0);
}

TEST(CudaRefusedExportChild, Checks) {
  if (std::getenv("SHMTENSOR_CUDA_CHILD") == nullptr) GTEST_SKIP() << "run by the test above";
  EXPECT_TRUE(shmtensor::cuda::is_available());
  try {
    (void)Tensor::empty({2}, DType::kFloat32, Device::cuda());
    ADD_FAILURE() << "no CudaError";
  } catch (const CudaError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot share memory between processes: a trial export "
                                    "failed (cuMemExportToShareableHandle: operation not "
                                    "supported"));
  }
}

// ---- one process ---------------------------------------------------------------------

TEST_F(CudaTest, DevicesHaveUuidsAndSupportFdExport) {
  const auto& d = shmtensor::internal::cuda::Driver::get();
  if (!real_driver()) ASSERT_EQ(d.device_count(), 2);
  for (int i = 0; i < d.device_count(); ++i) {
    EXPECT_TRUE(d.device(i).vmm);
    EXPECT_TRUE(d.device(i).posix_fd);
    EXPECT_EQ(d.ordinal_of(d.device(i).uuid), i);
    for (int j = 0; j < i; ++j)
      EXPECT_NE(shmtensor::internal::cuda::uuid_string(d.device(i).uuid),
                shmtensor::internal::cuda::uuid_string(d.device(j).uuid));
  }
}

TEST_F(CudaTest, DoctorReportsTheDriverEachDeviceAndATrialExport) {
  auto checks = shmtensor::internal::manager::cuda_checks(shmtensor::internal::cuda::probe_cuda());
  if (real_driver()) {
    // What docs/cuda.md records for the GPU the tests ran on.
    std::cout << shmtensor::internal::manager::format_checks(checks);
    ASSERT_EQ(checks.size(), 1u + static_cast<std::size_t>(shmtensor::cuda::device_count()));
    for (const auto& c : checks) {
      EXPECT_EQ(c.verdict, "ok") << c.what << ": " << c.value;
      if (c.what != "CUDA driver") EXPECT_THAT(c.value, HasSubstr("trial export: ok"));
    }
    return;
  }
  ASSERT_EQ(checks.size(), 3u);
  EXPECT_EQ(checks[0].what, "CUDA driver");
  EXPECT_EQ(checks[0].value, "fake driver (SHMTENSOR_CUDA_DRIVER=fake), CUDA 12.0");
  EXPECT_EQ(checks[1].what, "cuda:0 shmtensor fake CUDA device 0");
  EXPECT_EQ(checks[1].value,
            shmtensor::internal::cuda::uuid_string(
                shmtensor::internal::cuda::Driver::get().device(0).uuid) +
                ", VMM yes, POSIX fd export yes, granularity 2.0 MiB, trial export: ok");
  EXPECT_EQ(checks[1].verdict, "ok");
  EXPECT_EQ(checks[2].verdict, "ok");
  shmtensor::internal::cuda::CudaProbe none;
  none.why = "cannot load the CUDA driver libcuda.so.1";
  auto unavailable = shmtensor::internal::manager::cuda_checks(none);
  ASSERT_EQ(unavailable.size(), 1u);
  EXPECT_EQ(unavailable[0].verdict, "n/a");
  EXPECT_EQ(unavailable[0].value, "not available: cannot load the CUDA driver libcuda.so.1");
}

TEST_F(CudaTest, CopiesBetweenHostAndDeviceKeepValues) {
  Tensor h = iota(12).view({3, 4});
  Tensor g = h.cuda();
  EXPECT_EQ(g.device(), Device::cuda(0));
  EXPECT_TRUE(g.is_cuda());
  EXPECT_TRUE(g.is_shared());
  EXPECT_NE(g.raw_data(), h.raw_data());
  EXPECT_TRUE(g.cpu().equal(h));
  EXPECT_FALSE(g.cpu().is_cuda());
  // Non-contiguous both ways, across devices, with a dtype conversion.
  EXPECT_TRUE(g.transpose(0, 1).cpu().equal(h.transpose(0, 1).contiguous()));
  Tensor g1 = g.transpose(0, 1).to(Device::cuda(other_device()));
  EXPECT_EQ(g1.device(), Device::cuda(other_device()));
  EXPECT_TRUE(g1.cpu().equal(h.transpose(0, 1).contiguous()));
  Tensor d = Tensor::zeros({4, 3}, DType::kFloat64, Device::cuda(other_device()));
  d.copy_(g.transpose(0, 1));
  EXPECT_TRUE(d.cpu().equal(h.transpose(0, 1).to(DType::kFloat64)));
  // Writing a strided view of a device tensor leaves the elements between untouched.
  Tensor z = Tensor::zeros({3, 4}, DType::kFloat32, Device::cuda());
  z.select(1, 2).copy_(Tensor::from_vector<float>({7, 8, 9}));
  EXPECT_TRUE(z.cpu().equal(Tensor::from_vector<float>({0, 0, 7, 0, 0, 0, 8, 0, 0, 0, 9, 0}, {3, 4})));
  // Element operations go through host copies.
  z.fill_(2.0);
  z.add_(1.5);
  EXPECT_EQ(z[1][3].item<float>(), 3.5f);
  EXPECT_TRUE(z.equal(z.clone()));
  EXPECT_EQ(z.clone().device(), Device::cuda(0));
  EXPECT_FALSE(z.equal(z.cpu())) << "devices differ";
  EXPECT_EQ(Tensor::from_vector<float>({1, 2}).cuda().to_string(),
            "tensor([1., 2.], device='cuda:0', dtype=float32)");
  EXPECT_TRUE(shmtensor::stack({g, g}).cpu().equal(shmtensor::stack({h, h})));
}

TEST_F(CudaTest, TheCallersCurrentContextIsRestored) {
  const auto& d = shmtensor::internal::cuda::Driver::get();
  const auto& api = d.api();
  shmtensor::internal::cuda::CUcontext current = nullptr;
  ASSERT_EQ(api.cuCtxSetCurrent(nullptr), 0);
  Tensor t = iota(8).cuda(0);
  t.add_(1.0);
  ASSERT_EQ(api.cuCtxGetCurrent(&current), 0);
  EXPECT_EQ(current, nullptr) << "no context of ours left current";
  const auto other = d.ready(other_device()).context;
  ASSERT_EQ(api.cuCtxSetCurrent(other), 0);
  EXPECT_EQ(t.cpu()[7].item<float>(), 8.0f);
  t = Tensor();
  ASSERT_EQ(api.cuCtxGetCurrent(&current), 0);
  EXPECT_EQ(current, other) << "the caller's context is current again";
  ASSERT_EQ(api.cuCtxSetCurrent(nullptr), 0);
}

TEST_F(CudaTest, ADeviceAllocationsFdIsCloseOnExec) {
  auto seg = shmtensor::internal::Segment::create_device(0, 64, 4,
                                                         shmtensor::internal::SegmentKind::kDeviceArena);
  const int flags = fcntl(seg->device_fd(), F_GETFD);
  ASSERT_GE(flags, 0);
  EXPECT_TRUE(flags & FD_CLOEXEC);
  if (real_driver()) {
    // DeviceMemory::import takes a refused fd that is a file, pipe, socket or directory
    // for the message's fault: the driver's own must be none of those (driver 580's is
    // /dev/nvidiactl, a character device). Printed for docs/cuda.md.
    struct stat st {};
    ASSERT_EQ(fstat(seg->device_fd(), &st), 0);
    EXPECT_FALSE(S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
                 S_ISDIR(st.st_mode));
    char link[256] = {};
    const std::string path = "/proc/self/fd/" + std::to_string(seg->device_fd());
    (void)!readlink(path.c_str(), link, sizeof link - 1);
    std::cout << "an exported allocation's fd: " << link << ", st_mode 0" << std::oct
              << st.st_mode << std::dec << "\n";
  }
}

TEST_F(CudaTest, ADeviceThisProcessDoesNotSeeIsAnInvalidArgument) {
  const int n = shmtensor::cuda::device_count();
  EXPECT_ERROR((void)Tensor::empty({2}, DType::kFloat32, Device::cuda(n)), std::invalid_argument,
               "cuda:" + std::to_string(n) + ": this process sees");
  EXPECT_ERROR((void)iota(2).cuda(n + 3), std::invalid_argument,
               "cuda:" + std::to_string(n + 3) + ": this process sees");
}

TEST_F(CudaTest, HundredThousandSmallTensorsShareAFewAllocations) {
  const int fds_before = static_cast<int>(shmtensor::testing::open_fds().size());
  std::vector<Tensor> kept;
  kept.reserve(100000);
  for (int i = 0; i < 100000; ++i) kept.push_back(Tensor::empty({10}, DType::kFloat32, Device::cuda()));
  const auto stats = shmtensor::internal::arena_stats();
  EXPECT_LE(stats.segments, 8u) << "device segments for 100,000 tensors of 40 bytes";
  EXPECT_EQ(stats.blocks_held, 100000u);
  EXPECT_GE(stats.bytes, stats.segments * granularity()) << "device memory, not the memfds";
  EXPECT_LE(static_cast<int>(shmtensor::testing::open_fds().size()) - fds_before, 16);
  kept.clear();
  shmtensor::empty_cache();
  EXPECT_EQ(shmtensor::internal::arena_stats().segments, 0u);
}

// ---- across processes ----------------------------------------------------------------

// Gets tensors, checks their device and values, doubles them in place, sends them back,
// then reports how many allocations this process imported.
void double_and_return(Queue<Tensor> in, Queue<Tensor> out, Queue<long> imports, int count) {
  for (int i = 0; i < count; ++i) {
    Tensor t = in.get();
    if (!t.is_cuda() || t.device() != Device::cuda(0)) throw std::runtime_error("not on cuda:0");
    if (t[0].item<float>() != static_cast<float>(i)) throw std::runtime_error("wrong value");
    t.copy_(t.cpu().add_(static_cast<double>(i)));  // t + i: i + i at element 0
    out.put(t);
  }
  imports.put(static_cast<long>(shmtensor::internal::cuda::import_count()));
}

TEST_F(CudaTest, RoundTripKeepsIdentityAndWritesAreSeenBothWays) {
  Queue<Tensor> to_child, from_child;
  Queue<long> imports;
  constexpr int kCount = 200;
  Process p = exec_process(Process(double_and_return, to_child, from_child, imports, kCount));
  std::vector<Tensor> sent;
  for (int i = 0; i < kCount; ++i) {
    sent.push_back(iota(10, static_cast<float>(i)).cuda());
    to_child.put(sent.back());
  }
  for (int i = 0; i < kCount; ++i) {
    Tensor back = from_child.get();
    EXPECT_TRUE(back.storage().is_same(sent[static_cast<std::size_t>(i)].storage()))
        << "the tensor came back as the very storage it left as";
    EXPECT_EQ(back.raw_data(), sent[static_cast<std::size_t>(i)].raw_data());
    EXPECT_EQ(sent[static_cast<std::size_t>(i)][0].item<float>(), 2.0f * i);
  }
  // And one for this process's fence (docs/cuda.md, "Ordering").
  const long fence = shmtensor::internal::cuda::Driver::get().ready(0).stream_mem_ops ? 1 : 0;
  EXPECT_EQ(imports.get(), 1 + fence) << "200 tensors of one device segment: one import";
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

void produce_and_exit(Queue<Tensor> out, int kind) {
  out.put(iota(100000, 1.0f).cuda(kind));
}

void produce_and_wait(Queue<Tensor> out, Queue<long> fenced, Queue<long> done) {
  out.put(iota(1000, 5.0f).cuda());
  // The fence of the put written before the test kills this process: a sender killed while
  // its fence write is still queued leaves the receiver's stream waiting for good
  // (docs/cuda.md, "Ordering"; the fake driver runs queued work on a thread of the process,
  // which a loaded machine may not have run by the kill).
  shmtensor::cuda::complete_fences();
  fenced.put(1);
  (void)done.get();  // never comes: the test kills this process
}

TEST_F(CudaTest, ConsumerKeepsTheDataWhenTheProducerExitsOrIsKilled) {
  {
    Queue<Tensor> q;
    Process p = exec_process(Process(produce_and_exit, q, other_device()));
    p.join();
    ASSERT_EQ(p.exitcode(), 0) << p.error();
    Tensor t = q.get();  // received after the producer exited
    EXPECT_EQ(t.device(), Device::cuda(other_device()));
    EXPECT_TRUE(t.cpu().equal(iota(100000, 1.0f)));
  }
  {
    Queue<Tensor> q;
    Queue<long> fenced, never;
    Process p = exec_process(Process(produce_and_wait, q, fenced, never));
    Tensor t = q.get();
    EXPECT_EQ(fenced.get(), 1);
    p.kill();
    p.join();
    EXPECT_EQ(p.exitcode(), -SIGKILL);
    EXPECT_TRUE(t.cpu().equal(iota(1000, 5.0f)));
    t.fill_(3.0);
    EXPECT_EQ(t[999].item<float>(), 3.0f);
  }
}

void hold_forever(Queue<Tensor> in, Queue<long> ack) {
  Tensor t = in.get();
  ack.put(static_cast<long>(t.numel()));
  (void)in.get();  // never comes
}

TEST_F(CudaTest, ABlockHeldByAKilledConsumerIsReclaimed) {
  auto& driver = shmtensor::internal::cuda::Driver::get();
  (void)driver;
  // 200 rounds on a GPU (issue 15's check), 20 on the fake driver.
  const int rounds = real_driver() ? 200 : 20;
  for (int round = 0; round < rounds; ++round) {
    Queue<Tensor> q;
    Queue<long> ack;
    Process p = exec_process(Process(hold_forever, q, ack));
    {
      Tensor t = iota(64).cuda();
      q.put(t);
      EXPECT_EQ(ack.get(), 64);
    }
    // Only the consumer holds the block now.
    EXPECT_EQ(shmtensor::internal::arena_stats().blocks_held, 1u);
    p.kill();
    p.join();
    shmtensor::empty_cache();  // takes back the dead consumer's hold, returns the segment
    EXPECT_EQ(shmtensor::internal::arena_stats().blocks_held, 0u);
    EXPECT_EQ(shmtensor::internal::arena_stats().segments, 0u);
  }
}

void keep_and_count_imports(Queue<Tensor> in, Queue<long> out, long count) {
  std::vector<Tensor> kept;
  for (long i = 0; i < count; ++i) kept.push_back(in.get());
  out.put(static_cast<long>(shmtensor::internal::cuda::import_count()));
}

TEST_F(CudaTest, ImportsEqualTheChunksOfManySmallTensors) {
  // 100,000 tensors of 40 bytes (64-byte blocks): 6.4 MB, several device segments.
  constexpr long kCount = 100000;
  std::vector<Tensor> sent;
  for (long i = 0; i < kCount; ++i) sent.push_back(Tensor::zeros({10}, DType::kFloat32, Device::cuda()));
  const auto chunks = static_cast<long>(shmtensor::internal::arena_stats().segments);
  ASSERT_GT(chunks, 1);
  ASSERT_LE(chunks, 8);
  Queue<Tensor> q;
  Queue<long> imports;
  Process p = exec_process(Process(keep_and_count_imports, q, imports, kCount));
  for (const auto& t : sent) q.put(t);
  // And one for the producer's fence (docs/cuda.md, "Ordering"), which every message names.
  const long fence = shmtensor::internal::cuda::Driver::get().ready(0).stream_mem_ops ? 1 : 0;
  EXPECT_EQ(imports.get(), chunks + fence)
      << kCount << " tensors in " << chunks << " device segments";
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

// Receives a first tensor and says it is ready (-1), then receives a tensor and counts its
// elements that are not `value`.
void count_not_equal(Queue<Tensor> in, Queue<long> out, long value) {
  (void)in.get();
  out.put(-1);
  Tensor host = in.get().cpu();
  const auto* v = host.data_ptr<std::int32_t>();
  long wrong = 0;
  for (std::int64_t i = 0; i < host.numel(); ++i) wrong += v[i] != value;
  out.put(wrong);
}

TEST_F(CudaTest, AConsumerSeesTheFinalValuesOfWorkQueuedWithoutAHostSync) {
  const auto& d = shmtensor::internal::cuda::Driver::get();
  // 256 MiB of int32 on a GPU (long enough to be running when the message goes); 4 MiB on
  // the fake driver, whose queued fills each take a millisecond.
  const std::int64_t n = real_driver() ? std::int64_t{64} << 20 : std::int64_t{1} << 20;
  Tensor t = Tensor::empty({n}, DType::kInt32, Device::cuda());
  shmtensor::internal::cuda::CurrentDevice current(d, 0);
  shmtensor::internal::cuda::CUstream stream = nullptr;
  Queue<Tensor> q;
  Queue<long> wrong;
  Process p = exec_process(Process(count_not_equal, q, wrong, 32L));
  // A first message: the sender's fence is made (zeroed, and the device synchronized), the
  // consumer is ready and reads the next message as soon as it comes.
  q.put(Tensor::zeros({1}, DType::kInt32, Device::cuda()));
  ASSERT_EQ(wrong.get(), -1);
  // A blocking stream: the legacy default stream, where the sender's fence is written,
  // waits for its work (docs/cuda.md, "Ordering").
  d.check(d.api().cuStreamCreate(&stream, 0), "cuStreamCreate");
  // 32 passes over the tensor on a stream that nothing waits for; the last writes 32.
  for (unsigned v = 1; v <= 32; ++v)
    d.check(d.api().cuMemsetD32Async(reinterpret_cast<shmtensor::internal::cuda::CUdeviceptr>(
                                         t.raw_data()),
                                     v, static_cast<std::size_t>(n), stream),
            "cuMemsetD32Async");
  const auto synchronized = shmtensor::internal::cuda::fake_synchronize_count();
  q.put(t);  // at once: the message's fence is written once the passes are done
  if (!real_driver())
    EXPECT_EQ(shmtensor::internal::cuda::fake_synchronize_count(), synchronized)
        << "the sender does not wait for the device";
  EXPECT_EQ(wrong.get(), 0);
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
  d.check(d.api().cuStreamDestroy(stream), "cuStreamDestroy");
}

// Queues 32 passes over a tensor on a blocking stream, sends it and returns at once: the
// child's exit (_exit, which runs no atexit handler) must first complete the fence write it
// queued, which a GPU (and the fake driver) drops with a dead process's queued work. The
// stream is not destroyed: destroying one waits for its work.
void fill_send_and_exit(Queue<Tensor> out) {
  const auto& d = shmtensor::internal::cuda::Driver::get();
  const std::int64_t n = std::int64_t{1} << 18;
  Tensor t = Tensor::zeros({n}, DType::kInt32, Device::cuda());
  shmtensor::internal::cuda::CurrentDevice current(d, 0);
  shmtensor::internal::cuda::CUstream stream = nullptr;
  d.check(d.api().cuStreamCreate(&stream, 0), "cuStreamCreate");
  for (unsigned v = 1; v <= 32; ++v)
    d.check(d.api().cuMemsetD32Async(
                reinterpret_cast<shmtensor::internal::cuda::CUdeviceptr>(t.raw_data()), v,
                static_cast<std::size_t>(n), stream),
            "cuMemsetD32Async");
  out.put(t);
}

TEST_F(CudaTest, AProducerThatExitsRightAfterSendingCompletesItsFenceFirst) {
  Queue<Tensor> q;
  Process p = exec_process(Process(fill_send_and_exit, q));
  p.join();
  ASSERT_EQ(p.exitcode(), 0) << p.error();
  Tensor host = q.get().cpu();  // would wait for good on a fence that was never written
  long wrong = 0;
  for (std::int64_t i = 0; i < host.numel(); ++i) wrong += host.data_ptr<std::int32_t>()[i] != 32;
  EXPECT_EQ(wrong, 0);
}

TEST_F(CudaTest, DeviceMemoryReturnsToItsBaselineAfterProducerExitAndConsumerKill) {
  if (!real_driver()) GTEST_SKIP() << "the fake driver does not account device memory";
  shmtensor::empty_cache();
  const std::size_t baseline = device_free_bytes();
  {
    Queue<Tensor> q;
    Process p = exec_process(Process(produce_and_exit, q, 0));
    p.join();
    ASSERT_EQ(p.exitcode(), 0) << p.error();
    EXPECT_TRUE(q.get().cpu().equal(iota(100000, 1.0f)));
  }
  {
    Queue<Tensor> q;
    Queue<long> ack;
    Process p = exec_process(Process(hold_forever, q, ack));
    q.put(Tensor::zeros({std::int64_t{16} << 20}, DType::kFloat32, Device::cuda()));  // 64 MiB
    EXPECT_EQ(ack.get(), std::int64_t{16} << 20);
    p.kill();
    p.join();
  }
  shmtensor::empty_cache();
  // The children's contexts go with them, a moment after they are reaped.
  std::size_t now = device_free_bytes();
  for (int i = 0; i < 100 && now < baseline; ++i) {
    usleep(50000);
    now = device_free_bytes();
  }
  EXPECT_GE(now, baseline) << "device memory not back: " << (baseline - now) << " bytes short";
}

void echo(Queue<Tensor> in, Queue<Tensor> out, int count) {
  for (int i = 0; i < count; ++i) out.put(in.get());
}

// Round trips of a 64 MiB tensor to another process and back (zero copy), ordered by
// fences and then by synchronizing the device (SHMTENSOR_CUDA_ORDERING=synchronize, in
// both processes), against one cuMemcpyDtoD of the same bytes waited for: medians printed,
// not asserted (docs/cuda.md, "On a GPU").
TEST_F(CudaTest, ThroughputAgainstADeviceToDeviceCopy) {
  if (!real_driver()) GTEST_SKIP() << "figures of the fake driver mean nothing";
  constexpr int kRounds = 20;
  const std::int64_t n = std::int64_t{16} << 20;  // 64 MiB of float32
  Tensor a = Tensor::zeros({n}, DType::kFloat32, Device::cuda());
  Tensor b = Tensor::zeros({n}, DType::kFloat32, Device::cuda());
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> copy_us;
  for (int i = 0; i < kRounds; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    b.copy_(a);
    shmtensor::internal::cuda::synchronize(0);
    copy_us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  for (const char* ordering : {"fences", "synchronize"}) {
    if (std::string(ordering) == "synchronize") setenv("SHMTENSOR_CUDA_ORDERING", "synchronize", 1);
    Queue<Tensor> to, from;
    Process p = exec_process(Process(echo, to, from, kRounds));
    std::vector<double> trip_us;
    for (int i = 0; i < kRounds; ++i) {
      b.copy_(a);  // device work queued before each send, as a producer's kernel would be
      auto t0 = std::chrono::steady_clock::now();
      to.put(a);
      Tensor back = from.get();
      trip_us.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      ASSERT_TRUE(back.storage().is_same(a.storage()));
    }
    p.join();
    unsetenv("SHMTENSOR_CUDA_ORDERING");
    EXPECT_EQ(p.exitcode(), 0) << p.error();
    std::cout << "64 MiB CUDA tensor, median of " << kRounds << ", ordered by " << ordering
              << ": round trip to another process " << median(trip_us)
              << " us (zero copy); one cuMemcpyDtoD of 64 MiB, waited for: " << median(copy_us)
              << " us\n";
  }
}

// Over a Connection (its end received through a Queue): receives a tensor, reports the
// fence waits its receipt queued and the device synchronizations its release caused (the
// fake driver counts both), then the synchronizations of dropping a tensor of its own.
void release_and_count(Queue<shmtensor::Connection> connections) {
  using shmtensor::internal::cuda::fake_fence_waits;
  using shmtensor::internal::cuda::fake_synchronize_count;
  shmtensor::Connection c = connections.get();
  const auto waits = fake_fence_waits();
  auto v = c.recv<std::vector<Tensor>>();  // a tensor and a view of it
  const auto received_waits = fake_fence_waits() - waits;
  if (v.at(0)[5].item<float>() != 5.0f || v.at(1).item<float>() != 3.0f)
    throw std::runtime_error("wrong value");
  const auto before = fake_synchronize_count();
  v.clear();
  const auto after_received = fake_synchronize_count();
  (void)Tensor::zeros({8}, DType::kFloat32, Device::cuda());
  const auto after_own = fake_synchronize_count();
  c.send(std::vector<long>{static_cast<long>(received_waits),
                           static_cast<long>(after_received - before),
                           static_cast<long>(after_own - after_received)});
}

TEST_F(CudaTest, ASenderQueuesAFenceAndAReceiverWaitsForItOnItsStream) {
  if (real_driver()) GTEST_SKIP() << "counts the fake driver's calls";
  using shmtensor::internal::cuda::fake_fence_writes;
  using shmtensor::internal::cuda::fake_synchronize_count;
  auto [mine, theirs] = shmtensor::pipe();
  Queue<shmtensor::Connection> connections;
  Process p = exec_process(Process(release_and_count, connections));
  connections.put(theirs);  // the child's end travels as an fd
  theirs = shmtensor::Connection();
  Tensor a = iota(16).cuda();
  // The first signal makes this process's fence: zeroed, and the device synchronized once.
  const auto before_fence = fake_synchronize_count();
  ASSERT_TRUE(shmtensor::internal::signal_fence(0).has_value());
  EXPECT_EQ(fake_synchronize_count() - before_fence, 1u);
  const auto synchronized = fake_synchronize_count();
  const auto written = fake_fence_writes();
  mine.send(std::vector<Tensor>{a, a[3]});  // one device: one fence
  EXPECT_EQ(fake_fence_writes() - written, 1u) << "one fence per device the message carries";
  EXPECT_EQ(fake_synchronize_count() - synchronized, 0u) << "the sender does not wait";
  EXPECT_EQ(mine.recv<std::vector<long>>(), (std::vector<long>{1, 1, 0}))
      << "the receiver queues one wait; a received block's release waits for the device, a "
         "block of one's own does not";
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

// The sum of a float32 tensor's elements, read on the host.
double sum_of(const Tensor& t) {
  Tensor host = t.cpu().contiguous();
  double sum = 0;
  for (std::int64_t i = 0; i < host.numel(); ++i) sum += host.data_ptr<float>()[i];
  return sum;
}

void receive_vector_and_sum(Queue<std::vector<Tensor>> in, Queue<double> out) {
  double sum = 0;
  for (const Tensor& t : in.get()) sum += sum_of(t);
  out.put(sum);
}

TEST_F(CudaTest, AMessageOnTwoDevicesCarriesAFenceForEach) {
  if (real_driver() && shmtensor::cuda::device_count() < 2) GTEST_SKIP() << "one device";
  using shmtensor::internal::cuda::fake_fence_writes;
  Queue<std::vector<Tensor>> q;
  Queue<double> sums;
  Process p = exec_process(Process(receive_vector_and_sum, q, sums));
  const auto written = fake_fence_writes();
  q.put(std::vector<Tensor>{iota(10).cuda(0), iota(10, 100.0f).cuda(1), iota(10).cuda(0)});
  if (!real_driver()) EXPECT_EQ(fake_fence_writes() - written, 2u);
  EXPECT_EQ(sums.get(), 45.0 + 1045.0 + 45.0);
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

void receive_and_sum(Queue<Tensor> in, Queue<double> out) {
  out.put(sum_of(in.get()));
}

// SHMTENSOR_CUDA_ORDERING=synchronize, or a device without 64-bit stream memory
// operations (checked in a child, as the driver reads the attribute when it loads): the
// sender synchronizes the device and the message carries no fence.
void expect_a_synchronize_and_no_fence() {
  using shmtensor::internal::cuda::fake_fence_writes;
  using shmtensor::internal::cuda::fake_synchronize_count;
  Queue<Tensor> q;
  Queue<double> sums;
  Process p = exec_process(Process(receive_and_sum, q, sums));
  Tensor t = iota(100).cuda();
  const auto synchronized = fake_synchronize_count();
  const auto written = fake_fence_writes();
  q.put(t);
  EXPECT_EQ(fake_synchronize_count() - synchronized, 1u);
  EXPECT_EQ(fake_fence_writes() - written, 0u);
  EXPECT_EQ(sums.get(), 4950.0);
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

TEST_F(CudaTest, WithoutStreamMemoryOperationsTheSenderSynchronizes) {
  if (real_driver()) GTEST_SKIP() << "counts the fake driver's calls";
  setenv("SHMTENSOR_CUDA_ORDERING", "synchronize", 1);
  expect_a_synchronize_and_no_fence();
  unsetenv("SHMTENSOR_CUDA_ORDERING");
  EXPECT_EQ(run_self("CudaWithoutStreamMemOpsChild.Checks",
                     {"SHMTENSOR_CUDA_DRIVER=fake", "SHMTENSOR_FAKE_CUDA_NO_STREAM_MEM_OPS=1"}),
            0);
}

TEST(CudaWithoutStreamMemOpsChild, Checks) {
  if (std::getenv("SHMTENSOR_FAKE_CUDA_NO_STREAM_MEM_OPS") == nullptr)
    GTEST_SKIP() << "run by WithoutStreamMemoryOperationsTheSenderSynchronizes";
  EXPECT_FALSE(shmtensor::internal::cuda::Driver::get().device(0).stream_mem_ops);
  expect_a_synchronize_and_no_fence();
}

void fill_argument(Tensor t, double value) { t.fill_(value); }

void fill_rank(int rank, Tensor t) { t[rank].fill_(static_cast<double>(rank)); }

TEST_F(CudaTest, ATensorArgumentOfAnExecProcessOrSpawnIsShared) {
  Tensor t = Tensor::zeros({32}, DType::kFloat32, Device::cuda(other_device()));
  Process p = exec_process(Process(fill_argument, t, 2.5));
  p.join();
  ASSERT_EQ(p.exitcode(), 0) << p.error();
  EXPECT_EQ(t[31].item<float>(), 2.5f);
  shmtensor::SpawnOptions options;
  options.start_method = StartMethod::kExec;
  shmtensor::spawn(fill_rank, 2, options, t);
  EXPECT_EQ(t[0].item<float>(), 0.0f);
  EXPECT_EQ(t[1].item<float>(), 1.0f);
  EXPECT_EQ(t[2].item<float>(), 2.5f);
}

void use_first_device_only(Queue<long> out) {
  Tensor t = iota(4).cuda(0);
  out.put(static_cast<long>(shmtensor::internal::cuda::fake_context_retains()));
}

TEST_F(CudaTest, AProcessRetainsAContextOnlyOnTheDevicesItUses) {
  if (real_driver()) GTEST_SKIP() << "counts the fake driver's context retains";
  Queue<long> out;
  Process p = exec_process(Process(use_first_device_only, out));
  EXPECT_EQ(out.get(), 1) << "two devices, one used: one primary context";
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

void receive_expecting_cuda_error(Queue<Tensor> in, Queue<long> out) {
  try {
    (void)in.get();
    out.put(0);
  } catch (const CudaError& e) {
    out.put(std::string(e.what()).find("out of memory") != std::string::npos ? 1 : 2);
  }
}

TEST_F(CudaTest, AnImportTheReceiverCannotAffordIsACudaErrorAndTheBlockComesBack) {
  if (real_driver()) GTEST_SKIP() << "makes the fake driver's imports fail";
  Queue<Tensor> q;
  Queue<long> out;
  setenv("SHMTENSOR_FAKE_CUDA_IMPORT_OUT_OF_MEMORY", "1", 1);
  Process p = exec_process(Process(receive_expecting_cuda_error, q, out));
  unsetenv("SHMTENSOR_FAKE_CUDA_IMPORT_OUT_OF_MEMORY");
  {
    Tensor t = iota(16).cuda();
    q.put(t);
    EXPECT_EQ(out.get(), 1) << "CudaError naming the driver's out of memory";
  }
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
  shmtensor::empty_cache();
  EXPECT_EQ(shmtensor::internal::arena_stats().blocks_held, 0u) << "the message's count came back";
}

void forward(Queue<Tensor> in, Queue<Tensor> out) { out.put(in.get()); }

void write_and_ack(Queue<Tensor> in, Queue<long> ack) {
  Tensor t = in.get();
  t.fill_(42.0);
  ack.put(static_cast<long>(t.device().index()));
}

TEST_F(CudaTest, AReceivedTensorCanBeForwarded) {
  Queue<Tensor> a, b;
  Queue<long> ack;
  Process first = exec_process(Process(forward, a, b));
  Process second = exec_process(Process(write_and_ack, b, ack));
  Tensor t = Tensor::zeros({256}, DType::kFloat32, Device::cuda(other_device()));
  a.put(t);
  EXPECT_EQ(ack.get(), other_device());
  EXPECT_EQ(t[255].item<float>(), 42.0f);
  first.join();
  second.join();
  EXPECT_EQ(first.exitcode(), 0) << first.error();
  EXPECT_EQ(second.exitcode(), 0) << second.error();
}

void report_device(Queue<Tensor> in, Queue<long> out) {
  Tensor t = in.get();
  out.put(t.device().index());
  out.put(static_cast<long>(t[3].item<float>()));
  try {
    (void)in.get();  // a tensor of a device this process does not see
    out.put(-100);
  } catch (const CudaError& e) {
    out.put(std::string(e.what()).find("does not see") != std::string::npos ? -1 : -2);
  }
}

TEST_F(CudaTest, DevicesAreMatchedByUuidNotIndex) {
  if (shmtensor::cuda::device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  Queue<Tensor> q;
  Queue<long> out;
  // The child sees only the second device, as its cuda:0.
  setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  Process p = exec_process(Process(report_device, q, out));
  unsetenv("CUDA_VISIBLE_DEVICES");
  q.put(iota(8).cuda(1));
  EXPECT_EQ(out.get(), 0) << "our cuda:1 is the child's cuda:0";
  EXPECT_EQ(out.get(), 3);
  q.put(iota(8).cuda(0));
  EXPECT_EQ(out.get(), -1);
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

TEST_F(CudaTest, AForkedChildCannotUseCuda) {
  Tensor t = iota(4).cuda();
  Queue<Tensor> q;
  int rc = shmtensor::testing::run_in_child([&t, &q] {
    try {
      (void)Tensor::empty({2}, DType::kFloat32, Device::cuda());
      _exit(3);
    } catch (const CudaError& e) {
      if (std::string(e.what()).find("exec start method") == std::string::npos) _exit(4);
    }
    try {
      q.put(t);  // sending waits for the device: refused
      _exit(5);
    } catch (const CudaError&) {
    }
    t = Tensor();  // the inherited hold goes back through the host metadata
    shmtensor::empty_cache();
  });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(t[3].item<float>(), 3.0f) << "the parent still can";
}

// ---- hostile input -------------------------------------------------------------------

using shmtensor::ProtocolError;
using shmtensor::internal::Segment;
using shmtensor::internal::SegmentKind;
using shmtensor::internal::UniqueFd;

TEST_F(CudaTest, TheReceiveCacheKeepsAtMostAGibibyteOfDeviceMemory) {
  if (real_driver() && device_free_bytes() < (std::size_t{4} << 30))
    GTEST_SKIP() << "allocates 1.8 GiB of device memory, and less than 4 GiB is free";
  using shmtensor::internal::Registry;
  // Three 600 MiB device segments "received" in turn: only the newest fits in 1 GiB.
  std::vector<std::weak_ptr<Segment>> cached;
  for (int i = 0; i < 3; ++i) {
    auto seg = Segment::create_device(0, std::size_t{600} << 20, 1, SegmentKind::kDeviceDedicated);
    Registry::instance().remember_received_segment(seg);
    cached.push_back(seg);
  }
  EXPECT_TRUE(cached[0].expired());
  EXPECT_TRUE(cached[1].expired());
  EXPECT_FALSE(cached[2].expired());
  Registry::instance().forget_cached_segments();
  EXPECT_TRUE(cached[2].expired());
}

TEST_F(CudaTest, DeviceSegmentsRefuseWhatIsNotTheirs) {
  auto seg = Segment::create_device(0, 64, 4, SegmentKind::kDeviceArena);
  auto dup = [](int fd) { return shmtensor::internal::dup_cloexec(fd); };
  // Any memfd is not a device allocation.
  UniqueFd plain = shmtensor::internal::create_sealed_memfd(std::size_t{2} << 20);
  EXPECT_THAT(protocol_error_text([&] {
                (void)Segment::attach_device(dup(seg->fd()), dup(plain.get()), seg->uid());
              }),
              HasSubstr("does not take as an allocation"));
  // A device segment's memfd is not a host segment, and a host one not a device one.
  EXPECT_THAT(protocol_error_text([&] { (void)Segment::attach_fd(dup(seg->fd()), seg->uid()); }),
              HasSubstr("a host segment entry names a device segment"));
  auto host = Segment::create(shmtensor::SharingStrategy::kFileDescriptor, 64, 4, SegmentKind::kArena);
  EXPECT_THAT(protocol_error_text([&] {
                (void)Segment::attach_device(dup(host->fd()), dup(seg->device_fd()), host->uid());
              }),
              HasSubstr("a device segment entry names a host segment"));
  // An allocation of another device, or smaller than the segment's blocks.
  if (shmtensor::cuda::device_count() > 1) {
    auto other = Segment::create_device(1, 64, 4, SegmentKind::kDeviceArena);
    EXPECT_THAT(protocol_error_text([&] {
                  (void)Segment::attach_device(dup(seg->fd()), dup(other->device_fd()), seg->uid());
                }),
                HasSubstr("does not live on the device its segment names"));
  }
  auto big = Segment::create_device(0, 2 * granularity(), 1, SegmentKind::kDeviceDedicated);
  EXPECT_THAT(protocol_error_text([&] {
                (void)Segment::attach_device(dup(big->fd()), dup(seg->device_fd()), big->uid());
              }),
              HasSubstr("cannot be mapped"));
}

TEST_F(CudaTest, TamperedDeviceHeadersAreRefused) {
  auto seg = Segment::create_device(0, 64, 4, SegmentKind::kDeviceArena);
  auto dup = [](int fd) { return shmtensor::internal::dup_cloexec(fd); };
  auto* h = seg->header();
  auto attach = [&] { (void)Segment::attach_device(dup(seg->fd()), dup(seg->device_fd()), seg->uid()); };
  const auto count = h->block_count;
  h->block_count = 1000;  // more words than the object holds
  h->data_size = h->block_size * 1000;
  EXPECT_THAT(protocol_error_text(attach), HasSubstr("slots, words or blocks lie outside the object"));
  h->block_count = count;
  h->data_size = h->block_size * count;
  const auto kind = h->kind;
  h->kind = static_cast<std::uint32_t>(SegmentKind::kDeviceDedicated);  // 4 blocks
  EXPECT_THAT(protocol_error_text(attach), HasSubstr("more than a segment of this kind has"));
  h->kind = kind;
  const auto block_size = h->block_size;
  h->block_size = std::uint64_t{1} << 39;  // 2 TiB of device blocks
  h->data_size = h->block_size * h->block_count;
  EXPECT_THAT(protocol_error_text(attach), HasSubstr("device blocks of"));
  h->block_size = block_size;
  h->data_size = block_size * count;
  // Restored, it attaches: to the segment this process already has.
  EXPECT_NO_THROW(attach());
}

// A frame of one segment entry (the fds given) and the fence table `fences`.
std::vector<std::byte> fence_frame(const Segment& seg, std::uint32_t count,
                                   const std::vector<shmtensor::internal::FenceEntry>& fences) {
  using namespace shmtensor::internal;
  SegmentEntry e = {};
  e.uid = seg.uid();
  e.total_size = seg.mapped_size();
  e.strategy = seg.is_device() ? 2 : 0;
  e.fd_index = 0;
  const std::uint32_t head[2] = {count, 0};
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.flags = kFlagFences;
  h.segment_count = 1;
  h.fd_count = seg.is_device() ? 2 : 1;
  h.body_size = sizeof e + sizeof head + fences.size() * sizeof(FenceEntry);
  std::vector<std::byte> datagram(sizeof h + h.body_size);
  std::byte* p = datagram.data();
  for (auto [from, n] : {std::pair<const void*, std::size_t>{&h, sizeof h}, {&e, sizeof e},
                         {head, sizeof head}}) {
    std::memcpy(p, from, n);
    p += n;
  }
  if (!fences.empty()) std::memcpy(p, fences.data(), fences.size() * sizeof(FenceEntry));
  return datagram;
}

TEST_F(CudaTest, MalformedFenceEntriesAreProtocolErrorsAndQueueNoWait) {
  using namespace shmtensor::internal;
  auto seg = Segment::create_device(0, 64, 4, SegmentKind::kDeviceArena);
  auto host = Segment::create(shmtensor::SharingStrategy::kFileDescriptor, 64, 4, SegmentKind::kArena);
  auto parse = [&](const Segment& s, std::uint32_t count, std::vector<FenceEntry> fences) {
    std::vector<UniqueFd> fds;
    fds.push_back(dup_cloexec(s.fd()));
    if (s.is_device()) fds.push_back(dup_cloexec(s.device_fd()));
    return protocol_error_text(
        [&] { (void)parse_frame(fence_frame(s, count, fences), std::move(fds)); });
  };
  const auto waits = cuda::fake_fence_waits();
  EXPECT_THAT(parse(*seg, 1, {{1, 0, 0, 1}}), HasSubstr("fence refers to a missing segment"));
  EXPECT_THAT(parse(*host, 1, {{0, 0, 0, 1}}), HasSubstr("fence lies in a host segment"));
  for (std::uint64_t offset : {std::uint64_t{4}, std::uint64_t{256 - 8 + 8}, ~std::uint64_t{7}})
    EXPECT_THAT(parse(*seg, 1, {{0, 0, offset, 1}}), HasSubstr("fence lies outside"))
        << offset;
  EXPECT_THAT(parse(*seg, 1, {{0, 1, 0, 1}}), HasSubstr("fence lies outside"));
  EXPECT_THAT(parse(*seg, 0, {}), HasSubstr("bad fence count"));
  EXPECT_THAT(parse(*seg, kMaxFences + 1, {}), HasSubstr("bad fence count"));
  EXPECT_THAT(parse(*seg, 2, {{0, 0, 0, 1}}), HasSubstr("past the end of the body"));
  if (!real_driver()) EXPECT_EQ(cuda::fake_fence_waits(), waits) << "a refused message queues no wait";
  // The last 8 bytes of the blocks are a fence: the message parses and queues its wait
  // (for 0, which the zeroed bytes hold).
  cuda::fill_device(0, reinterpret_cast<cuda::CUdeviceptr>(seg->payload() + 256 - 8), 0, 8);
  std::vector<UniqueFd> fds;
  fds.push_back(dup_cloexec(seg->fd()));
  fds.push_back(dup_cloexec(seg->device_fd()));
  EXPECT_NO_THROW((void)parse_frame(fence_frame(*seg, 1, {{0, 0, 256 - 8, 0}}), std::move(fds)));
  if (!real_driver()) EXPECT_EQ(cuda::fake_fence_waits(), waits + 1);
}

TEST_F(CudaTest, MalformedDeviceEntriesAreProtocolErrors) {
  using namespace shmtensor::internal;
  auto seg = Segment::create_device(0, 64, 4, SegmentKind::kDeviceArena);
  auto parse = [](const std::vector<std::byte>& datagram, std::vector<UniqueFd> fds) {
    return protocol_error_text([&] { (void)parse_frame(datagram, std::move(fds)); });
  };
  // Lacking one or both fds.
  for (std::uint32_t attached : {0u, 1u}) {
    std::vector<UniqueFd> fds;
    if (attached == 1) fds.push_back(dup_cloexec(seg->fd()));
    EXPECT_THAT(parse(device_entry_frame(*seg, 0, attached), std::move(fds)),
                HasSubstr("device segment fd index out of range"));
  }
  // An index near INT32_MAX, or negative.
  for (std::int32_t index : {std::numeric_limits<std::int32_t>::max(), -1}) {
    std::vector<UniqueFd> fds;
    fds.push_back(dup_cloexec(seg->fd()));
    fds.push_back(dup_cloexec(seg->device_fd()));
    EXPECT_THAT(parse(device_entry_frame(*seg, index, 2), std::move(fds)),
                HasSubstr("device segment fd index out of range"));
  }
  // Naming a host segment this process has mapped.
  auto host = Segment::create(shmtensor::SharingStrategy::kFileDescriptor, 64, 4, SegmentKind::kArena);
  std::vector<UniqueFd> fds;
  fds.push_back(dup_cloexec(host->fd()));
  fds.push_back(dup_cloexec(seg->device_fd()));
  EXPECT_THAT(parse(device_entry_frame(*host, 0, 2), std::move(fds)),
              HasSubstr("device segment disagrees with its mapping"));
}

}  // namespace cuda_test
