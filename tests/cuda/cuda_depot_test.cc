// fds once per segment for device memory (docs/cuda.md, "On the wire"; docs/transport.md,
// "fds once per segment"): a device arena segment's two fds (its memfd and its allocation's)
// travel in the first message that names it on a channel, which deposits them there; every
// later message names the segment by uid alone, and a receiver that does not map it imports
// it from the depot, with the checks of an import from a message. Across exec'd processes on
// the fake driver, and as gpu.* on a GPU (cuda_test.cc).
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_fixture.h"
#include "cuda/device_memory.h"
#include "cuda/driver.h"
#include "memory/arena.h"
#include "memory/segment.h"
#include "os/shm.h"
#include "os/unique_fd.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/queue_core.h"
#include "shmtensor/queue.h"
#include "shmtensor/sharing_strategy.h"
#include "support/strategy_test.h"
#include "wire/frame.h"
#include "wire/wire.h"

namespace cuda_test {

using shmtensor::Connection;
using shmtensor::CudaError;
using shmtensor::Device;
using shmtensor::Process;
using shmtensor::Queue;
using shmtensor::SharingStrategy;
using shmtensor::Tensor;
using shmtensor::internal::FdCounts;
using ::testing::HasSubstr;

// Messages of one tensor each, all on one device arena segment (8 float32: 64-byte blocks).
constexpr int kCount = 200;
constexpr int kElements = 8;

// `n` tensors on cuda:0; tensor i holds first + i, first + i + 1, ... .
std::vector<Tensor> device_tensors(int n, int first = 0) {
  std::vector<Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(iota(kElements, static_cast<float>(first + i)).cuda());
  return out;
}

FdCounts counts(Queue<Tensor>& q) { return shmtensor::internal::QueueAccess::core(q).fd_counts(); }
FdCounts counts(const Connection& c) { return shmtensor::internal::ConnectionAccess::fd_counts(c); }
long imports() { return static_cast<long>(shmtensor::internal::cuda::import_count()); }

// The device segments each message names: its tensors' one, and its sender's fence's
// (docs/cuda.md, "Ordering") where the device orders messages by fences. Each is
// deposited, imported and counted alike.
unsigned per_message() {
  return shmtensor::internal::cuda::Driver::get().ready(0).stream_mem_ops ? 2u : 1u;
}
long k() { return static_cast<long>(per_message()); }

// A received tensor that must hold value, value + 1, ... on cuda:0 is overwritten with
// -1 - value, for its sender to see.
void check_and_negate(Tensor& t, int value) {
  if (!t.is_cuda() || t.device() != Device::cuda(0)) throw std::runtime_error("not on cuda:0");
  const Tensor host = t.cpu();
  for (int k = 0; k < kElements; ++k)
    if (host.data_ptr<float>()[k] != static_cast<float>(value + k))
      throw std::runtime_error("tensor " + std::to_string(value) + ": wrong value at " +
                               std::to_string(k));
  t.fill_(-1.0 - value);
}

// The sender's view of check_and_negate: every tensor i of `sent` reads -1 - (first + i).
void expect_negated(const std::vector<Tensor>& sent, int first = 0) {
  for (std::size_t i = 0; i < sent.size(); ++i) {
    const Tensor host = sent[i].cpu();
    const float want = -1.0f - static_cast<float>(first + static_cast<int>(i));
    EXPECT_EQ(host.data_ptr<float>()[0], want) << "tensor " << i;
    EXPECT_EQ(host.data_ptr<float>()[kElements - 1], want) << "tensor " << i;
  }
}

// A sender's counts after `messages` messages naming one device segment (and its fence's):
// each one's two fds in the first message, left out of every later one.
void expect_fds_once(const FdCounts& c, int messages) {
  EXPECT_EQ(c.sent, 2u * per_message())
      << "the memfd and the allocation's fd, in the first message only";
  EXPECT_EQ(c.omitted, 2u * per_message() * static_cast<unsigned>(messages - 1));
}

// Waits for `p`, which must exit with 0.
void expect_clean_exit(Process& p) {
  p.join();
  EXPECT_EQ(p.exitcode(), 0) << p.error();
}

// ---- children (exec'd) -----------------------------------------------------------------

// Receives `count` tensors (the first holding `first`), negates each and sends it back;
// then reports its imports and the fds its `out` sent and left out.
void negate_and_return(Queue<Tensor> in, Queue<Tensor> out, Queue<long> report, int count,
                       SharingStrategy strategy) {
  shmtensor::set_sharing_strategy(strategy);
  for (int i = 0; i < count; ++i) {
    Tensor t = in.get();
    check_and_negate(t, i);
    out.put(t);
  }
  const FdCounts c = counts(out);
  report.put(imports());
  report.put(static_cast<long>(c.sent));
  report.put(static_cast<long>(c.omitted));
}

// negate_and_return over a Connection whose end arrives on `ends`; the report goes back on
// the connection.
void negate_and_return_over(Queue<Connection> ends, int count, SharingStrategy strategy) {
  shmtensor::set_sharing_strategy(strategy);
  Connection c = ends.get();
  for (int i = 0; i < count; ++i) {
    Tensor t = c.recv<Tensor>();
    check_and_negate(t, i);
    c.send(t);
  }
  const FdCounts n = counts(c);
  c.send(std::vector<long>{imports(), static_cast<long>(n.sent), static_cast<long>(n.omitted)});
}

// Receives `count` tensors (the first holding `first`) and negates them; reports its imports.
void negate(Queue<Tensor> in, Queue<long> report, int count, int first) {
  for (int i = 0; i < count; ++i) {
    Tensor t = in.get();
    check_and_negate(t, first + i);
  }
  report.put(imports());
}

// negate over a Connection whose end arrives on `ends`.
void negate_over(Queue<Connection> ends, Queue<long> report, int count, int first) {
  Connection c = ends.get();
  for (int i = 0; i < count; ++i) {
    Tensor t = c.recv<Tensor>();
    check_and_negate(t, first + i);
  }
  report.put(imports());
}

// Holds `count` tensors, says so, and waits for a tensor that never comes.
void hold(Queue<Tensor> in, Queue<long> ack, int count) {
  std::vector<Tensor> kept;
  for (int i = 0; i < count; ++i) kept.push_back(in.get());
  ack.put(count);
  (void)in.get();
}

// Forwards `count` tensors; then reports its imports and the fds its `out` sent and left out.
void forward_all(Queue<Tensor> in, Queue<Tensor> out, Queue<long> report, int count) {
  for (int i = 0; i < count; ++i) out.put(in.get());
  const FdCounts c = counts(out);
  report.put(imports());
  report.put(static_cast<long>(c.sent));
  report.put(static_cast<long>(c.omitted));
}

// Tries to receive `count` tensors; reports how many were a CudaError naming the driver's
// out of memory.
void count_out_of_memory(Queue<Tensor> in, Queue<long> report, int count) {
  long errors = 0;
  for (int i = 0; i < count; ++i) {
    try {
      (void)in.get();
    } catch (const CudaError& e) {
      errors += std::string(e.what()).find("out of memory") != std::string::npos;
    }
  }
  report.put(errors);
}

// ---- under both sharing strategies ---------------------------------------------------

// A device segment is an entry of strategy 2 whatever the sharing strategy; each test runs
// under both, in the parent and in its children.
class CudaDepotTest : public CudaTest, public ::testing::WithParamInterface<SharingStrategy> {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    saved_ = shmtensor::get_sharing_strategy();
    shmtensor::set_sharing_strategy(GetParam());
    shmtensor::empty_cache();  // the tensors below start a device arena segment of their own
  }
  void TearDown() override {
    if (!IsSkipped()) shmtensor::set_sharing_strategy(saved_);
    CudaTest::TearDown();
  }

 private:
  SharingStrategy saved_{};
};

INSTANTIATE_TEST_SUITE_P(Strategies, CudaDepotTest, shmtensor::testing::kAllStrategies,
                         shmtensor::testing::strategy_name);

TEST_P(CudaDepotTest, AQueueCarriesADeviceSegmentsFdsOnce) {
  Queue<Tensor> to_child, from_child;
  Queue<long> report;
  Process p = exec_process(Process(negate_and_return, to_child, from_child, report, kCount,
                                   GetParam()));
  const std::vector<Tensor> sent = device_tensors(kCount);
  ASSERT_EQ(shmtensor::internal::arena_stats().segments, 1u) << "one device arena segment";
  for (const Tensor& t : sent) to_child.put(t);
  for (int i = 0; i < kCount; ++i)
    EXPECT_TRUE(from_child.get().storage().is_same(sent[static_cast<std::size_t>(i)].storage()));
  EXPECT_EQ(report.get(), k()) << "the consumer imported the segment once";
  EXPECT_EQ(report.get(), 2 * k()) << "the consumer sent the segment's two fds back once";
  EXPECT_EQ(report.get(), 2 * k() * (kCount - 1));
  expect_fds_once(counts(to_child), kCount);
  expect_clean_exit(p);
  expect_negated(sent);
}

TEST_P(CudaDepotTest, AConnectionCarriesADeviceSegmentsFdsOnce) {
  auto [mine, theirs] = shmtensor::pipe();
  Queue<Connection> ends;
  Process p = exec_process(Process(negate_and_return_over, ends, kCount, GetParam()));
  ends.put(theirs);
  theirs = Connection();
  const std::vector<Tensor> sent = device_tensors(kCount);
  ASSERT_EQ(shmtensor::internal::arena_stats().segments, 1u) << "one device arena segment";
  for (const Tensor& t : sent) mine.send(t);
  for (int i = 0; i < kCount; ++i)
    EXPECT_TRUE(mine.recv<Tensor>().storage().is_same(sent[static_cast<std::size_t>(i)].storage()));
  EXPECT_EQ(mine.recv<std::vector<long>>(), (std::vector<long>{k(), 2 * k(), 2 * k() * (kCount - 1)}))
      << "the consumer's imports, and the fds it sent back and left out";
  expect_fds_once(counts(mine), kCount);
  expect_clean_exit(p);
  expect_negated(sent);
}

// A consumer that takes the first message (with the fds) and exits; a second one, which no
// message with fds reaches, maps the segment from the channel's depot: one import.
// What the second consumer of sent[1..] comes to: it imported the segment once (from the
// depot: no message it got carried fds), its writes are seen, and the sender sent the fds
// once.
void expect_second_consumer(Queue<long>& report, Process& second, const std::vector<Tensor>& sent,
                            const FdCounts& sender) {
  EXPECT_EQ(report.get(), k()) << "imported once, from the depot";
  expect_clean_exit(second);
  expect_fds_once(sender, static_cast<int>(sent.size()));
  expect_negated(sent);
}

TEST_P(CudaDepotTest, AReceiverThatGotNoFdsImportsTheSegmentFromTheQueuesDepot) {
  Queue<Tensor> q;
  Queue<long> report;
  const std::vector<Tensor> sent = device_tensors(kCount);
  q.put(sent[0]);
  Process first = exec_process(Process(negate, q, report, 1, 0));
  EXPECT_EQ(report.get(), k());
  expect_clean_exit(first);
  Process second = exec_process(Process(negate, q, report, kCount - 1, 1));
  for (int i = 1; i < kCount; ++i) q.put(sent[static_cast<std::size_t>(i)]);
  expect_second_consumer(report, second, sent, counts(q));
}

TEST_P(CudaDepotTest, AReceiverThatGotNoFdsImportsTheSegmentFromTheConnectionsDepot) {
  auto [mine, theirs] = shmtensor::pipe();
  Queue<Connection> ends;
  Queue<long> report;
  const std::vector<Tensor> sent = device_tensors(kCount);
  mine.send(sent[0]);
  Process first = exec_process(Process(negate_over, ends, report, 1, 0));
  ends.put(theirs);
  EXPECT_EQ(report.get(), k());
  expect_clean_exit(first);
  Process second = exec_process(Process(negate_over, ends, report, kCount - 1, 1));
  ends.put(theirs);
  theirs = Connection();
  for (int i = 1; i < kCount; ++i) mine.send(sent[static_cast<std::size_t>(i)]);
  expect_second_consumer(report, second, sent, counts(mine));
}

// ---- processes killed, tensors forwarded, imports refused ---------------------------

// A consumer SIGKILLed holding 10 blocks: the producer takes them back; the next consumer
// imports the segment from the depot; then every device segment goes back.
TEST_F(CudaTest, AfterAConsumerHoldingDepositedBlocksIsKilledTheNextImportsFromTheDepot) {
  shmtensor::empty_cache();
  Queue<Tensor> q;
  Queue<long> ack, report;
  {
    Process holder = exec_process(Process(hold, q, ack, 10));
    {
      const std::vector<Tensor> held = device_tensors(10);
      for (const Tensor& t : held) q.put(t);
      EXPECT_EQ(ack.get(), 10);
    }
    EXPECT_EQ(shmtensor::internal::arena_stats().blocks_held, 10u)
        << "only the consumer holds them";
    holder.kill();
    holder.join();
    EXPECT_EQ(holder.exitcode(), -SIGKILL);
  }
  std::vector<Tensor> sent = device_tensors(5, 100);
  EXPECT_EQ(shmtensor::internal::arena_stats().segments, 1u) << "the same device arena segment";
  Process taker = exec_process(Process(negate, q, report, 5, 100));
  for (const Tensor& t : sent) q.put(t);
  EXPECT_EQ(report.get(), k()) << "imported once, from the depot";
  expect_clean_exit(taker);
  expect_negated(sent, 100);
  expect_fds_once(counts(q), 15);
  sent.clear();
  shmtensor::empty_cache();  // takes back the dead consumer's holds, returns the segment
  EXPECT_EQ(shmtensor::internal::arena_stats().blocks_held, 0u);
  EXPECT_EQ(shmtensor::internal::arena_stats().segments, 0u);
}

// Producer -> forwarder -> consumer: each hop carries the segment's fds once, and each
// receiver imports it once; the consumer's writes reach the producer.
TEST_F(CudaTest, AForwardedDeviceSegmentsFdsTravelOncePerHop) {
  shmtensor::empty_cache();
  Queue<Tensor> a, b;
  Queue<long> forwarded, report;
  Process forwarder = exec_process(Process(forward_all, a, b, forwarded, kCount));
  Process consumer = exec_process(Process(negate, b, report, kCount, 0));
  const std::vector<Tensor> sent = device_tensors(kCount);
  for (const Tensor& t : sent) a.put(t);
  EXPECT_EQ(report.get(), k()) << "the consumer imported the segment once";
  EXPECT_EQ(forwarded.get(), k()) << "the forwarder imported the segment once";
  EXPECT_EQ(forwarded.get(), 2 * k()) << "and sent its two fds on once";
  EXPECT_EQ(forwarded.get(), 2 * k() * (kCount - 1));
  expect_fds_once(counts(a), kCount);
  expect_clean_exit(forwarder);
  expect_clean_exit(consumer);
  expect_negated(sent);
}

// A receiver that cannot import the deposited segment (its driver is out of memory) gets a
// CudaError for each message naming it, and each message's count goes back.
TEST_F(CudaTest, AnImportFromTheDepotTheReceiverCannotAffordIsACudaErrorAndTheBlocksComeBack) {
  if (real_driver()) GTEST_SKIP() << "makes the fake driver's imports fail";
  shmtensor::empty_cache();
  Queue<Tensor> q;
  Queue<long> report;
  std::vector<Tensor> sent = device_tensors(3);
  q.put(sent[0]);
  Process first = exec_process(Process(negate, q, report, 1, 0));
  EXPECT_EQ(report.get(), k());
  expect_clean_exit(first);
  setenv("SHMTENSOR_FAKE_CUDA_IMPORT_OUT_OF_MEMORY", "1", 1);
  Process second = exec_process(Process(count_out_of_memory, q, report, 2));
  unsetenv("SHMTENSOR_FAKE_CUDA_IMPORT_OUT_OF_MEMORY");
  q.put(sent[1]);
  q.put(sent[2]);
  EXPECT_EQ(report.get(), 2) << "a CudaError naming out of memory for each message";
  expect_clean_exit(second);
  expect_fds_once(counts(q), 3);  // the two the second consumer refused named the depot's
  sent.clear();
  shmtensor::empty_cache();
  EXPECT_EQ(shmtensor::internal::arena_stats().blocks_held, 0u) << "the messages' counts came back";
  EXPECT_EQ(shmtensor::internal::arena_stats().segments, 0u);
}

// ---- hostile depots ------------------------------------------------------------------

using shmtensor::internal::FetchedSegment;
using shmtensor::internal::Segment;
using shmtensor::internal::SegmentEntry;
using shmtensor::internal::SegmentFetcher;
using shmtensor::internal::SegmentKind;
using shmtensor::internal::UniqueFd;

// A transport's depot that holds what a test puts there: a segment mapped here, or two fds
// (copies of them are fetched), for a device entry named without its fds.
struct TestDepot {
  std::shared_ptr<Segment> mapped;
  int meta = -1, memory = -1;
  bool asked_device = false;
  std::shared_ptr<Segment> kept;  // what the parse gave the transport to keep

  static FetchedSegment fetch(void* self, std::uint64_t /*uid*/, bool device) {
    auto& d = *static_cast<TestDepot*>(self);
    d.asked_device = device;
    if (d.mapped) return {d.mapped, {}, {}};
    if (d.meta < 0) return {};
    return {nullptr, shmtensor::internal::dup_cloexec(d.meta),
            shmtensor::internal::dup_cloexec(d.memory)};
  }
  static void keep(void* self, const std::shared_ptr<Segment>& seg) noexcept {
    static_cast<TestDepot*>(self)->kept = seg;
  }
};

// What parsing a frame that names `named` without its fds comes to, through `depot` (none:
// a transport without a depot). `size`: the entry's total_size, when not the segment's.
std::string parse_omitted(const Segment& named, TestDepot* depot, std::uint64_t size = 0) {
  std::vector<std::byte> frame = device_entry_frame(named, shmtensor::internal::kFdOmitted, 0);
  if (size != 0) {
    SegmentEntry e;
    std::memcpy(&e, frame.data() + sizeof(shmtensor::internal::FrameHeader), sizeof e);
    e.total_size = size;
    std::memcpy(frame.data() + sizeof(shmtensor::internal::FrameHeader), &e, sizeof e);
  }
  const SegmentFetcher fetcher{TestDepot::fetch, depot, TestDepot::keep};
  return protocol_error_text([&] {
    (void)shmtensor::internal::parse_frame(frame, {}, nullptr, depot ? &fetcher : nullptr);
  });
}

TEST_F(CudaTest, ADeviceSegmentFromADepotIsCheckedAsOneThatCameInAMessage) {
  auto seg = Segment::create_device(0, 64, 4, SegmentKind::kDeviceArena);
  EXPECT_THAT(parse_omitted(*seg, nullptr),
              HasSubstr("a device segment sent without its fds, on a transport that has no depot"));
  TestDepot empty;
  EXPECT_THAT(parse_omitted(*seg, &empty),
              HasSubstr("is not in its queue's or connection's depot"));
  EXPECT_TRUE(empty.asked_device);
  // Its own fds: imported (the checks of an import pass), then given to the transport to
  // keep; the import is this process's segment.
  TestDepot good{nullptr, seg->fd(), seg->device_fd()};
  const long before = imports();
  EXPECT_EQ(parse_omitted(*seg, &good), "(no ProtocolError)");
  EXPECT_EQ(imports() - before, 1);
  EXPECT_EQ(good.kept, seg);
  EXPECT_THAT(parse_omitted(*seg, &good, seg->mapped_size() + 4096),
              HasSubstr("device segment size disagrees with its fd"));
  // Not an allocation; a host segment's memfd; an allocation smaller than the blocks.
  UniqueFd plain = shmtensor::internal::create_sealed_memfd(std::size_t{2} << 20);
  TestDepot forged{nullptr, seg->fd(), plain.get()};
  EXPECT_THAT(parse_omitted(*seg, &forged), HasSubstr("does not take as an allocation"));
  auto host = Segment::create(SharingStrategy::kFileDescriptor, 64, 4, SegmentKind::kArena);
  TestDepot host_memfd{nullptr, host->fd(), seg->device_fd()};
  EXPECT_THAT(parse_omitted(*host, &host_memfd),
              HasSubstr("a device segment entry names a host segment"));
  auto big = Segment::create_device(0, granularity(), 2, SegmentKind::kDeviceArena);
  TestDepot smaller{nullptr, big->fd(), seg->device_fd()};
  EXPECT_THAT(parse_omitted(*big, &smaller), HasSubstr("cannot be mapped"));
  if (shmtensor::cuda::device_count() > 1) {
    auto other = Segment::create_device(1, 64, 4, SegmentKind::kDeviceArena);
    TestDepot elsewhere{nullptr, seg->fd(), other->device_fd()};
    EXPECT_THAT(parse_omitted(*seg, &elsewhere),
                HasSubstr("does not live on the device its segment names"));
  }
  // A dedicated segment is never deposited.
  auto dedicated = Segment::create_device(0, granularity(), 1, SegmentKind::kDeviceDedicated);
  TestDepot of_one_tensor{nullptr, dedicated->fd(), dedicated->device_fd()};
  EXPECT_THAT(parse_omitted(*dedicated, &of_one_tensor),
              HasSubstr("a depot holds a device segment that is not an arena's"));
  // Mapped here, as a host segment.
  TestDepot mapped_host{host, -1, -1};
  EXPECT_THAT(parse_omitted(*host, &mapped_host),
              HasSubstr("device segment sent without its fds disagrees with its mapping"));
  EXPECT_EQ(forged.kept, nullptr);
  EXPECT_EQ(of_one_tensor.kept, nullptr);
}

}  // namespace cuda_test
