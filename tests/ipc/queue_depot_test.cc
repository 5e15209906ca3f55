// fds once per segment: a Queue deposits each file_descriptor arena segment's fd once, and
// its items name the segment without an fd from then on (docs/transport.md, "fds once per
// segment"). Real forked processes; every test checks exact values, and the fixture that
// no fd, mapping or /dev/shm name is left.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <exception>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "memory/arena.h"
#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/queue.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/pipe.h"
#include "support/strategy_test.h"
#include "transport/channel.h"
#include "wire/wire.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::run_in_child;
using testing::wait_child;

class QueueDepotTest : public testing::StrategyRestoringTest {
 protected:
  void SetUp() override {
    StrategyRestoringTest::SetUp();
    set_sharing_strategy(SharingStrategy::kFileDescriptor);
  }
};

using FdCounts = internal::QueueCore::FdCounts;

FdCounts fd_counts(Queue<Tensor>& q) { return internal::QueueAccess::core(q).fd_counts(); }

Tensor item(int i) { return Tensor::full({10}, i, DType::kInt32); }

void expect_item(const Tensor& t, int i) {
  ASSERT_EQ(t.numel(), 10);
  EXPECT_EQ(t.data_ptr<std::int32_t>()[0], i);
  EXPECT_EQ(t.data_ptr<std::int32_t>()[9], i);
}

// A producer process that puts `n` items: the first carries its segment's fd, which the
// queue deposits; the producer takes that one back itself when `take_first`, so that the
// only process that ever received the fd is the producer. Sends its fd counts on `report`
// and exits.
pid_t produce(Queue<Tensor>& q, int n, bool take_first, Connection& report) {
  return fork_child([&q, n, take_first, &report] {
    if (take_first) {
      q.put(item(-1));
      expect_item(q.get(), -1);
    }
    for (int i = 0; i < n; ++i) q.put(item(i));
    const FdCounts c = fd_counts(q);
    report.send(std::pair<std::uint64_t, std::uint64_t>{c.sent, c.omitted});
  });
}

// produce() into a queue with room for every item, and wait until the producer exited:
// its fd counts.
FdCounts produce_then_exit(Queue<Tensor>& q, int n, bool take_first) {
  auto [report_in, report_out] = pipe();
  pid_t producer = produce(q, n, take_first, report_out);
  auto [sent, omitted] = report_in.recv<std::pair<std::uint64_t, std::uint64_t>>();
  EXPECT_EQ(wait_child(producer), 0);
  return {sent, omitted};
}

TEST_F(QueueDepotTest, OneProducerSendsEachSegmentsFdOnce) {
  constexpr int kItems = 3000;
  Queue<Tensor> q(256);
  auto [report_in, report_out] = pipe();
  pid_t producer = produce(q, kItems, /*take_first=*/false, report_out);
  for (int i = 0; i < kItems; ++i) expect_item(q.get(), i);
  auto [sent, omitted] = report_in.recv<std::pair<std::uint64_t, std::uint64_t>>();
  EXPECT_EQ(wait_child(producer), 0);
  // One segment of 40-byte blocks holds them all (at most 256 are in flight): its fd went
  // with the first item, every other item named it without one.
  EXPECT_EQ(sent, 1u);
  EXPECT_EQ(omitted, static_cast<std::uint64_t>(kItems) - 1);
  EXPECT_FALSE(q.try_get().has_value());
}

TEST_F(QueueDepotTest, AProcessThatJoinsLaterMapsDepositedSegmentsAfterTheProducerExited) {
  // The consumer exists before the queue and before the producer's segment: it can map
  // that segment only from the queue's depot.
  auto [to_consumer, from_parent] = pipe();
  pid_t consumer = fork_child([&from_parent = from_parent] {
    auto q = from_parent.recv<Queue<Tensor>>();
    for (int i = 0; i < 50; ++i) expect_item(q.get(), i);
    EXPECT_FALSE(q.try_get().has_value());
  });
  {
    Queue<Tensor> q;
    // The producer is gone before anyone else looks at its segment.
    const FdCounts c = produce_then_exit(q, 50, /*take_first=*/true);
    EXPECT_EQ(c.sent, 1u);  // the item it took back itself
    EXPECT_EQ(c.omitted, 50u);
    to_consumer.send(q);
  }
  EXPECT_EQ(wait_child(consumer), 0);
}

TEST_F(QueueDepotTest, AForkedChildOfAHolderThatNeverMappedTheSegmentFetchesIt) {
  Queue<Tensor> q;
  (void)produce_then_exit(q, 20, /*take_first=*/true);
  EXPECT_EQ(run_in_child([&q] {
              for (int i = 0; i < 10; ++i) expect_item(q.get(), i);
            }),
            0);
  for (int i = 10; i < 20; ++i) expect_item(q.get(), i);  // this process fetches it too
}

// Items nobody took, whose fds were left out, are dropped by the last holder through the
// depot: their blocks' counts go back to the producer's arena.
TEST_F(QueueDepotTest, TheLastHolderDrainsItemsWithoutFdsAndTheirBlocksComeBack) {
  std::optional<Queue<Tensor>> q(std::in_place);
  testing::Pipe put_done, dropped;
  pid_t producer = fork_child([&] {
    q->put(item(-1));
    expect_item(q->get(), -1);
    for (int i = 0; i < 100; ++i) q->put(item(i));
    EXPECT_EQ(fd_counts(*q).omitted, 100u);
    q.reset();  // our handle is gone; the parent still holds the queue
    empty_cache();
    EXPECT_GT(internal::arena_stats().segments, 0u);  // the 100 items' counts hold it
    put_done.send();
    ASSERT_EQ(dropped.receive(), 'x');
    empty_cache();
    EXPECT_EQ(internal::arena_stats().segments, 0u);
  });
  ASSERT_EQ(put_done.receive(), 'x');
  q.reset();  // the last holder: drains the 100 items, mapping the segment from the depot
  dropped.send();
  EXPECT_EQ(wait_child(producer), 0);
}

// Consumers SIGKILLed at random instants around their first get, which looks in the
// depot (under its robust lock, moving the socket's shared peek offset): the next process
// still finds the segment there. Each child takes at most one item; the parent takes the
// rest, each exact and in order.
TEST_F(QueueDepotTest, ConsumersKilledWhileTheyLookInTheDepotLeaveItUsable) {
  constexpr int kItems = 200, kKills = 40;
  Queue<Tensor> q;
  (void)produce_then_exit(q, kItems, /*take_first=*/true);
  std::mt19937 rng(12345);
  for (int k = 0; k < kKills; ++k) {
    pid_t consumer = fork_child([&q] {
      (void)q.get();
      ::pause();
    });
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    ::kill(consumer, SIGKILL);
    EXPECT_EQ(wait_child(consumer), 128 + SIGKILL);
  }
  int received = 0, last = -1;
  while (std::optional<Tensor> t = q.try_get(std::chrono::milliseconds(200))) {
    const int i = t->data_ptr<std::int32_t>()[0];
    EXPECT_GT(i, last);
    EXPECT_EQ(t->data_ptr<std::int32_t>()[9], i);
    last = i;
    ++received;
  }
  EXPECT_GE(received, kItems - kKills);
  EXPECT_EQ(last, kItems - 1);
}

// The depot holds 32 segments: items of a 33rd and later arena segments carry their fds
// as before, and arrive all the same.
TEST_F(QueueDepotTest, PastThirtyTwoSegmentsItemsCarryTheirFds) {
  EXPECT_EQ(run_in_child([] {  // our own arena: its segments are this test's alone
              Queue<Tensor> q;
              std::vector<Tensor> tensors;  // one per arena segment (size class)
              std::set<std::uint64_t> uids;
              for (std::size_t bytes = 64; uids.size() < 40 && bytes <= (1u << 16);
                   bytes = bytes < 1024 ? bytes + 64 : bytes + bytes / 4) {
                Tensor t = Tensor::full({static_cast<std::int64_t>(bytes)},
                                        static_cast<int>(tensors.size()), DType::kUInt8);
                t.share_memory_();
                const auto& seg = internal::StorageAccess::impl(t.storage())->segment();
                if (seg->kind() != internal::SegmentKind::kArena || !uids.insert(seg->uid()).second)
                  continue;
                tensors.push_back(t);
              }
              ASSERT_GE(tensors.size(), 33u);
              const std::uint64_t extra = tensors.size() - 32;
              for (int round = 0; round < 2; ++round)
                for (const Tensor& t : tensors) q.put(t);
              const FdCounts c = fd_counts(q);
              EXPECT_EQ(c.omitted, 32u);             // the second item of each deposited one
              EXPECT_EQ(c.sent, 32u + 2u * extra);   // and every item of the others
              for (int round = 0; round < 2; ++round)
                for (std::size_t i = 0; i < tensors.size(); ++i) {
                  Tensor got = q.get();
                  ASSERT_EQ(got.numel(), tensors[i].numel());
                  EXPECT_EQ(got.data_ptr<std::uint8_t>()[got.numel() - 1], i);
                }
            }),
            0);
}

// At its fd limit a process cannot take a segment's fd from the depot: that item is a
// ProtocolError that says so, and the next get, with room for an fd, works.
TEST_F(QueueDepotTest, AConsumerAtItsFdLimitGetsAClearErrorThenGoesOn) {
  Queue<Tensor> q;
  (void)produce_then_exit(q, 5, /*take_first=*/true);
  EXPECT_EQ(run_in_child([&q] {
              rlimit saved{};
              ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
              // Room for no new fd: the highest open one is the limit's last.
              int highest = 0;
              for (int fd : testing::open_fds()) highest = std::max(highest, fd);
              rlimit low = saved;
              low.rlim_cur = static_cast<rlim_t>(highest + 1);
              ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
              std::vector<internal::UniqueFd> holes;  // and the free numbers below it taken
              for (internal::UniqueFd fd(::dup(0)); fd.valid(); fd.reset(::dup(0)))
                holes.push_back(std::move(fd));
              ASSERT_EQ(errno, EMFILE);
              std::exception_ptr error;
              try {
                (void)q.get();
              } catch (...) {
                error = std::current_exception();
              }
              // Looked at with fds to spare: UBSan's vptr check opens a pipe, and at the
              // limit takes any exception for an invalid object.
              holes.clear();
              ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
              ASSERT_TRUE(error) << "an item whose segment could not be mapped was decoded";
              try {
                std::rethrow_exception(error);
              } catch (const ProtocolError& e) {
                EXPECT_NE(std::string(e.what()).find("open-file limit"), std::string::npos)
                    << e.what();
              } catch (const std::exception& e) {
                ADD_FAILURE() << "not a ProtocolError: " << e.what();
              }
              for (int i = 1; i < 5; ++i) expect_item(q.get(), i);
            }),
            0);
}

// A frame that names a file_descriptor segment without its fd is refused by a transport
// that has no depot (a Connection), whether or not the receiver maps the segment.
TEST_F(QueueDepotTest, ASegmentNamedWithoutItsFdIsRefusedByAConnection) {
  // The refused message keeps its block's count (docs/transport.md): the sender is a child,
  // whose arena goes with it.
  EXPECT_EQ(run_in_child([] {
              auto [a, b] = internal::ConnectionAccess::socket_pair();  // frames sent by hand
              testing::Pipe go;
              pid_t receiver = fork_child([&b = b, &go] {  // maps nothing of the sender's
                ASSERT_EQ(go.receive(), 'x');
                try {
                  (void)b.recv<Tensor>();
                  ADD_FAILURE() << "a Connection decoded a segment it does not map";
                } catch (const ProtocolError& e) {
                  EXPECT_NE(std::string(e.what()).find("on a transport that has no depot"),
                            std::string::npos)
                      << e.what();
                }
                EXPECT_EQ(b.recv<std::int64_t>(), 7);  // the connection goes on
              });
              Tensor t = item(3);
              Encoder e;
              e.encode(t);
              const internal::FdElision always{
                  [](void*, const internal::Segment&) { return true; }, nullptr};
              internal::OutgoingFrame frame = internal::finish_frame(std::move(e), &always);
              EXPECT_TRUE(frame.fds().empty());
              go.send();
              ASSERT_TRUE(internal::send_frame(a.native_handle(), frame, std::nullopt));
              a.send(std::int64_t{7});
              EXPECT_EQ(wait_child(receiver), 0);
              // Mapped here (our own segment), it is refused all the same.
              Encoder again;
              again.encode(t);
              internal::OutgoingFrame mapped = internal::finish_frame(std::move(again), &always);
              ASSERT_TRUE(internal::send_frame(b.native_handle(), mapped, std::nullopt));
              EXPECT_ERROR((void)a.recv<Tensor>(), ProtocolError,
                           "on a transport that has no depot");
              b.send(std::int64_t{8});
              EXPECT_EQ(a.recv<std::int64_t>(), 8);
            }),
            0);
}

}  // namespace
}  // namespace shmtensor
