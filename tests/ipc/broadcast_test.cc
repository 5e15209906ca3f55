// Broadcast<T> (include/shmtensor/broadcast.h) between real processes, under both sharing
// strategies: every reader gets every message in order, one block for all the readers
// (writes seen both ways), a slow reader named by put's timeout, a SIGKILLed reader's place
// freed and its messages' holds given back, a SIGKILLed writer, the parts a registry of
// names keeps, and a peer that writes the control block.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include "manager_test_util.h"
#include "memory/arena.h"
#include "os/mapping.h"
#include "shmtensor/broadcast.h"
#include "shmtensor/connection.h"
#include "shmtensor/storage.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/pipe.h"
#include "support/strategy_test.h"
#include "transport/broadcast_control.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::Pipe;
using testing::run_in_child;
using testing::wait_child;

class BroadcastTest : public testing::StrategyTest {};

// Segments of this process's arena in which some block is still held.
std::size_t held_arena_segments() {
  empty_cache();
  return internal::arena_stats().segments;
}

// The broadcast's control block, mapped as a peer would map it.
internal::Mapping map_control(Broadcast<std::int64_t>& b) {
  return internal::Mapping::map_shared(internal::BroadcastAccess::core(b).control_fd(),
                                       sizeof(internal::BroadcastControl), "test");
}

std::int32_t first(const Tensor& t) { return t.data_ptr<std::int32_t>()[0]; }

TEST_P(BroadcastTest, EveryReaderGetsEveryMessageInOrder) {
  constexpr int kReaders = 3;
  constexpr int kMessages = 200;  // many times the depth: the writer waits for the readers
  Broadcast<Tensor> b(kReaders, 4);
  std::vector<pid_t> children;
  for (int r = 0; r < kReaders; ++r) {
    children.push_back(fork_child([&b, r] {
      auto reader = b.reader(r);
      for (int k = 0; k < kMessages; ++k) {
        Tensor t = reader.get();
        ASSERT_EQ(t.numel(), 64);
        ASSERT_EQ(first(t), k);
        ASSERT_EQ(t.data_ptr<std::int32_t>()[63], k * 2 + r * 0);
      }
      EXPECT_FALSE(reader.try_get(std::chrono::milliseconds(10)).has_value());
    }));
  }
  for (int k = 0; k < kMessages; ++k) {
    Tensor t = Tensor::full({64}, k, DType::kInt32);
    t.data_ptr<std::int32_t>()[63] = k * 2;
    b.put(t);
  }
  for (pid_t c : children) EXPECT_EQ(wait_child(c), 0);
}

TEST_P(BroadcastTest, OneBlockForAllReadersAndWritesSeenBothWays) {
  constexpr int kReaders = 3;
  Broadcast<Tensor> b(kReaders);
  Tensor t = Tensor::zeros({8}, DType::kInt32);
  Pipe done, go;
  std::vector<pid_t> children;
  for (int r = 0; r < kReaders; ++r) {
    children.push_back(fork_child([&, r] {
      Tensor x = b.reader(r).get();
      x.data_ptr<std::int32_t>()[r] = 10 + r;  // seen by the writer and the other readers
      done.send();
      ASSERT_EQ(go.receive(), 'x');
      for (int i = 0; i < kReaders; ++i) EXPECT_EQ(x.data_ptr<std::int32_t>()[i], 10 + i);
      EXPECT_EQ(x.data_ptr<std::int32_t>()[7], 77);  // the writer's write after the put
    }));
  }
  b.put(t);
  for (int r = 0; r < kReaders; ++r) ASSERT_EQ(done.receive(), 'x');
  for (int r = 0; r < kReaders; ++r) EXPECT_EQ(t.data_ptr<std::int32_t>()[r], 10 + r);
  t.data_ptr<std::int32_t>()[7] = 77;
  for (int r = 0; r < kReaders; ++r) go.send();
  for (pid_t c : children) EXPECT_EQ(wait_child(c), 0);
}

TEST_P(BroadcastTest, ASlowReaderIsNamedByPutsTimeoutAndTheMessageWentToNone) {
  Broadcast<std::int64_t> b(2, 2);
  Pipe attached, finish, fast_done;
  pid_t fast = fork_child([&] {
    auto r = b.reader(0);
    for (std::int64_t k = 0; k < 3; ++k) EXPECT_EQ(r.get(), k);
    fast_done.send();
    ASSERT_EQ(finish.receive(), 'x');
    // The message whose put timed out came to nobody: the next one is 3.
    EXPECT_EQ(r.get(), 3);
  });
  pid_t slow = fork_child([&] {
    auto r = b.reader(1);
    EXPECT_EQ(r.get(), 0);
    attached.send();
    ASSERT_EQ(finish.receive(), 'x');
    EXPECT_EQ(r.get(), 1);
    EXPECT_EQ(r.get(), 2);
    EXPECT_EQ(r.get(), 3);
  });
  b.put(0);
  ASSERT_EQ(attached.receive(), 'x');
  b.put(1);
  b.put(2);  // reader 1 is now 2 behind: its queue is full
  ASSERT_EQ(fast_done.receive(), 'x');
  try {
    b.put(99, std::chrono::milliseconds(200));
    ADD_FAILURE() << "put() did not time out";
  } catch (const BroadcastTimeout& e) {
    EXPECT_EQ(e.reader(), 1);
    EXPECT_EQ(e.pid(), slow);
    EXPECT_EQ(e.behind(), 2u);
    EXPECT_THAT(std::string(e.what()),
                ::testing::HasSubstr("reader 1 (pid " + std::to_string(slow) +
                                     ") is 2 messages behind"));
  }
  EXPECT_EQ(b.behind(0), 0u);
  finish.send();
  finish.send();
  b.put(3);
  EXPECT_EQ(wait_child(fast), 0);
  EXPECT_EQ(wait_child(slow), 0);
}

TEST_P(BroadcastTest, ASigkilledReadersPlaceIsFreedAndItsHoldsGivenBack) {
  EXPECT_EQ(run_in_child([] {
              ASSERT_EQ(held_arena_segments(), 0u);
              {
                Broadcast<Tensor> b(2, 4);
                Pipe attached;
                pid_t victim = fork_child([&] {
                  auto r = b.reader(1);
                  EXPECT_EQ(first(r.get()), 0);
                  attached.send();
                  ::pause();
                });
                pid_t healthy = fork_child([&] {
                  auto r = b.reader(0);
                  for (int k = 0; k < 10; ++k) EXPECT_EQ(first(r.get()), k);
                });
                b.put(Tensor::full({1000}, 0, DType::kInt32));
                ASSERT_EQ(attached.receive(), 'x');
                for (int k = 1; k <= 4; ++k) b.put(Tensor::full({1000}, k, DType::kInt32));
                EXPECT_EQ(b.behind(1), 4u);
                EXPECT_EQ(b.reader_pid(1), victim);
                ::kill(victim, SIGKILL);
                EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
                // Reader 1's queue is full: this put finds it dead, drops its 4 messages
                // and from then on skips it.
                for (int k = 5; k < 10; ++k)
                  b.put(Tensor::full({1000}, k, DType::kInt32), std::chrono::seconds(30));
                EXPECT_EQ(b.behind(1), 0u);
                EXPECT_EQ(b.reader_pid(1), 0);
                EXPECT_EQ(wait_child(healthy), 0);
                // Every message was taken (reader 0) or dropped (reader 1): no block is
                // held any more but by the broadcast's own queues' nothing.
                EXPECT_EQ(held_arena_segments(), 0u);
              }
              EXPECT_EQ(held_arena_segments(), 0u);
            }),
            0);
}

TEST_P(BroadcastTest, ASigkilledWritersReadersTakeWhatWasPutThenGetQueueClosed) {
  auto [mine, theirs] = pipe();
  pid_t writer = fork_child([&, &theirs = theirs] {
    mine.close();
    Broadcast<std::int64_t> b(1);
    theirs.send(b.reader(0));
    for (std::int64_t k = 0; k < 3; ++k) b.put(k * 7);
    theirs.send(1);  // after the puts
    ::raise(SIGKILL);
  });
  theirs.close();
  auto r = mine.recv<Broadcast<std::int64_t>::Reader>();
  EXPECT_EQ(mine.recv<int>(), 1);
  EXPECT_EQ(wait_child(writer), 128 + SIGKILL);
  for (std::int64_t k = 0; k < 3; ++k) EXPECT_EQ(r.get(), k * 7);
  EXPECT_ERROR(r.get(), QueueClosed, "its writer (pid " + std::to_string(writer) + ") died");
}

TEST_P(BroadcastTest, CloseAndTheWritersLastHandleEndTheReaders) {
  Broadcast<std::int64_t> b(1);
  auto r = b.reader(0);
  b.put(5);
  b.close();
  EXPECT_EQ(r.get(), 5);
  EXPECT_ERROR(r.get(), QueueClosed, "closed");
  EXPECT_ERROR(b.put(6), QueueClosed, "closed");

  auto [mine, theirs] = pipe();
  pid_t writer = fork_child([&, &theirs = theirs] {
    mine.close();
    Broadcast<std::int64_t> w(1);
    theirs.send(w.reader(0));
    w.put(8);
  });  // the writer's handle is dropped as it returns
  theirs.close();
  auto other = mine.recv<Broadcast<std::int64_t>::Reader>();
  EXPECT_EQ(wait_child(writer), 0);
  EXPECT_EQ(other.get(), 8);
  EXPECT_ERROR(other.get(), QueueClosed, "closed");
}

TEST_P(BroadcastTest, RebuiltFromItsPartsInAnotherProcess) {
  Broadcast<Tensor> b(2);
  internal::MessageFrame parts = b.parts();
  const std::string bytes = parts.bytes();
  const std::vector<int> fds = parts.fds();
  std::vector<pid_t> children;
  for (int r = 0; r < 2; ++r) {
    children.push_back(fork_child([&, r] {
      std::vector<int> mine;
      for (int fd : fds) mine.push_back(::dup(fd));
      auto opened = Broadcast<Tensor>::from_parts(
          std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()), mine);
      EXPECT_EQ(opened.readers(), 2);
      EXPECT_ERROR(opened.put(Tensor::zeros({1})), std::logic_error, "only the process");
      auto reader = opened.reader(r);
      EXPECT_EQ(first(reader.get()), 41);
      EXPECT_EQ(first(reader.get()), 42);
    }));
  }
  b.put(Tensor::full({4}, 41, DType::kInt32));
  b.put(Tensor::full({4}, 42, DType::kInt32));
  for (pid_t c : children) EXPECT_EQ(wait_child(c), 0);
}

TEST_P(BroadcastTest, OneProcessPerReader) {
  Broadcast<std::int64_t> b(1);
  b.put(1);
  EXPECT_EQ(b.reader(0).get(), 1);  // this process is reader 0 now
  EXPECT_EQ(run_in_child([&] {
              EXPECT_ERROR(b.reader(0).get(), std::logic_error,
                           "is attached in another process (pid " +
                               std::to_string(getppid()) + ")");
            }),
            0);
  EXPECT_ERROR(Broadcast<int>(0), std::invalid_argument, "readers must be 1 to 64, not 0");
  EXPECT_ERROR(Broadcast<int>(65), std::invalid_argument, "readers must be 1 to 64, not 65");
  EXPECT_ERROR(Broadcast<int>(1, 0), std::invalid_argument, "depth must be 1 to 4096, not 0");
  EXPECT_ERROR((void)b.reader(1), std::out_of_range, "no reader 1");
}

// A peer writes the control block with values no process writes: the call that reads
// them says so, and every later call of every process says the broadcast broke.
TEST_P(BroadcastTest, AForgedReaderSlotBreaksItForEveryCaller) {
  Broadcast<std::int64_t> b(2);
  internal::Mapping map = map_control(b);
  auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
  c->reader[1].store(5, std::memory_order_seq_cst);  // a slot_owner of pid 0
  EXPECT_ERROR(b.put(1, std::chrono::seconds(1)), ProtocolError, "reader 1's slot holds 5");
  EXPECT_ERROR(b.put(2), ProtocolError, "Broadcast is broken");
  EXPECT_EQ(run_in_child([&] { EXPECT_ERROR(b.reader(0).get(), ProtocolError, "is broken"); }),
            0);
}

TEST_P(BroadcastTest, AForgedWriterWordIsSeenByAWaitingReader) {
  Broadcast<std::int64_t> b(1);
  internal::Mapping map = map_control(b);
  auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
  const std::uint64_t writer = c->writer;
  EXPECT_EQ(run_in_child([&] {
              c->writer = writer + 1;
              EXPECT_ERROR((void)b.reader(0).try_get(std::chrono::seconds(5)), ProtocolError,
                           "its writer word changed");
            }),
            0);
  EXPECT_ERROR(b.put(1), ProtocolError, "Broadcast is broken");
}

// A slot forged to "dropping" (what a process writes while it drops a dead reader's
// messages): a reader attaching there waits until its deadline, and fails after 2 s without.
TEST_P(BroadcastTest, AReaderSlotLeftDroppingCostsTheDeadlineThenFails) {
  Broadcast<std::int64_t> b(1);
  internal::Mapping map = map_control(b);
  auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
  c->reader[0].store(internal::kReaderDropping, std::memory_order_seq_cst);
  b.put(1);  // the writer skips a reader being dropped
  EXPECT_EQ(b.behind(0), 0u);
  EXPECT_EQ(b.reader(0).try_get(std::chrono::milliseconds(50)), std::nullopt);
  EXPECT_ERROR(b.reader(0).get(), ProtocolError, "reader 0's slot stayed 'dropping' for 2 s");
  EXPECT_ERROR(b.put(2), ProtocolError, "Broadcast is broken");
}

INSTANTIATE_TEST_SUITE_P(Strategies, BroadcastTest, testing::kAllStrategies,
                         testing::strategy_name);

// Named broadcasts, through a manager daemon of each test's own (its group).
class NamedBroadcastTest : public testing::manager_test::OwnManagerGroupTest {
 protected:
  NamedBroadcastTest() : OwnManagerGroupTest("nb") {}
};

TEST_P(NamedBroadcastTest, AProcessThatKnowsOnlyTheNameOpensAReader) {
  const std::string name = "nb_" + std::to_string(::getpid()) + "_" + to_string(GetParam());
  Pipe created;
  // Forked before the broadcast exists: it holds nothing of it but the name.
  pid_t child = fork_child([&] {
    ASSERT_EQ(created.receive(), 'x');
    auto b = Broadcast<Tensor>::open(name);
    EXPECT_EQ(b.readers(), 2);
    EXPECT_ERROR(b.put(Tensor::zeros({1})), std::logic_error, "only the process");
    auto r = b.reader(1);
    Tensor t = r.get();
    EXPECT_EQ(first(t), 5);
    t.data_ptr<std::int32_t>()[1] = 6;  // seen by the writer: one block
  });
  auto b = Broadcast<Tensor>::create(name, 2);
  EXPECT_ERROR(Broadcast<Tensor>::create(name, 1), NameExists, name);
  created.send();
  Tensor t = Tensor::full({3}, 5, DType::kInt32);
  b.put(t);
  EXPECT_EQ(first(b.reader(0).get()), 5);
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(t.data_ptr<std::int32_t>()[1], 6);
  // `shmtensor ls`: reader 0 is this process; reader 1's process left with its handle.
  b.put(Tensor::full({3}, 7, DType::kInt32));
  const std::string me = std::to_string(::getpid());
  const std::string out = testing::manager_test::run_tool("ls");
  EXPECT_NE(out.find("  " + name + "  broadcast  readers 0 (pid " + me +
                     ", 1 behind) 1 (none, 0 behind)  creator " + me + "\n"),
            std::string::npos)
      << out;
  const std::string json = testing::manager_test::run_tool("ls --json");
  EXPECT_NE(json.find("{\"name\": \"" + name + "\", \"kind\": \"broadcast\", \"creator_pid\": " +
                      me + ", \"readers\": [{\"index\": 0, \"pid\": " + me +
                      ", \"behind\": 1}, {\"index\": 1, \"pid\": null, \"behind\": 0}]}"),
            std::string::npos)
      << json;
  Broadcast<Tensor>::unlink(name);
  EXPECT_ERROR(Broadcast<Tensor>::open(name), NameNotFound, name);
}

// A reader's handle in flight in a message holds its queue (an in-flight count) until a
// process receives it. Opening the broadcast by name, and `shmtensor ls`, decode the
// publication, which carries no counts: they must not take that count. Here both happen
// while the handle is in flight, then the writer drops its last handle: the receiver still
// gets the message put before.
TEST_P(NamedBroadcastTest, OpeningByNameTakesNoCountOfAReaderInFlight) {
  const std::string name = "nb_flight_" + std::to_string(::getpid()) + "_" + to_string(GetParam());
  auto [out, in] = pipe();
  {
    auto b = Broadcast<std::int64_t>::create(name, 1);
    b.put(77);
    out.send(b.reader(0));
    { auto opened = Broadcast<std::int64_t>::open(name); }
    EXPECT_NE(testing::manager_test::run_tool("ls").find("  " + name + "  broadcast"),
              std::string::npos);
  }  // the writer's last handle: the broadcast is closed, its name gone
  auto r = in.recv<Broadcast<std::int64_t>::Reader>();
  EXPECT_EQ(r.get(), 77);
  EXPECT_ERROR(r.get(), QueueClosed, "closed");
}

INSTANTIATE_TEST_SUITE_P(Strategies, NamedBroadcastTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
