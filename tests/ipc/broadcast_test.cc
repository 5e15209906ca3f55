// Broadcast<T> (include/shmtensor/broadcast.h) between real processes, under both sharing
// strategies: every reader gets every message in order, one block for all the readers
// (writes seen both ways), a slow reader named by put's timeout, a SIGKILLed reader's place
// freed and its messages' holds given back, a SIGKILLed writer, the parts a registry of
// names keeps, and a peer that writes the control block.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sched.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "manager_test_util.h"
#include "memory/arena.h"
#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/mapping.h"
#include "shmtensor/broadcast.h"
#include "shmtensor/connection.h"
#include "shmtensor/storage.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/pipe.h"
#include "support/strategy_test.h"
#include "os/proc.h"
#include "os/shared_lock.h"
#include "shmtensor/internal/queue_core.h"
#include "shmtensor/internal/storage_access.h"
#include "transport/broadcast_control.h"
#include "transport/broadcast_state.h"
#include "transport/queue_control.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::Pipe;
using testing::run_in_child;
using testing::wait_child;
using namespace std::chrono_literals;

class BroadcastTest : public testing::StrategyTest {};

// Segments of this process's arena in which some block is still held.
std::size_t held_arena_segments() {
  empty_cache();
  return internal::arena_stats().segments;
}

// The broadcast's control block, mapped as a peer would map it.
template <class T>
internal::Mapping map_control(Broadcast<T>& b) {
  return internal::Mapping::map_shared(internal::BroadcastAccess::core(b).control_fd(),
                                       sizeof(internal::BroadcastControl), "test");
}

std::int32_t first(const Tensor& t) { return t.data_ptr<std::int32_t>()[0]; }

// A child attached as reader `r` that takes message 0 (a tensor whose first value is 0),
// says so through `attached`, then waits to be killed.
pid_t start_victim(Broadcast<Tensor>& b, int r, Pipe& attached) {
  return fork_child([&b, r, &attached] {
    auto reader = b.reader(r);
    EXPECT_EQ(first(reader.get()), 0);
    attached.send();
    ::pause();
  });
}

void put_k(Broadcast<Tensor>& b, int k) { b.put(Tensor::full({1000}, k, DType::kInt32)); }

// Puts messages 0 to 2 to a fresh Broadcast<Tensor> of 2 readers: reader 1's process takes
// message 0 and is SIGKILLed (messages 1 and 2 unread, their blocks held); reader 0's
// takes messages 0 to `healthy_to` - 1. Returns reader 0's pid; *victim_word: reader 1's
// slot while its process lived.
pid_t kill_reader_1_two_behind(Broadcast<Tensor>& b, int healthy_to, std::uint64_t* victim_word);

// A child attached as reader `r` that takes messages `from` to `to` - 1, in order.
pid_t start_reader(Broadcast<Tensor>& b, int r, int from, int to) {
  return fork_child([&b, r, from, to] {
    auto reader = b.reader(r);
    for (int k = from; k < to; ++k) EXPECT_EQ(first(reader.get()), k);
  });
}

pid_t kill_reader_1_two_behind(Broadcast<Tensor>& b, int healthy_to, std::uint64_t* victim_word) {
  internal::Mapping map = map_control(b);
  auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
  Pipe attached;
  const pid_t victim = start_victim(b, 1, attached);
  const pid_t healthy = start_reader(b, 0, 0, healthy_to);
  put_k(b, 0);
  EXPECT_EQ(attached.receive(), 'x');
  put_k(b, 1);
  put_k(b, 2);
  *victim_word = c->reader[1].load();
  EXPECT_EQ(b.reader_pid(1), victim);
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  EXPECT_EQ(b.behind(1), 2u);
  return healthy;
}

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

// Messages at a steady cadence: the reader waits for each where it is due (sleep, then a
// poll), gets every one in order, a try_get whose deadline ends before the next is due
// returns nothing, and the end of the broadcast still reaches it.
TEST_P(BroadcastTest, AReaderAtASteadyCadenceGetsEveryMessageAndKeepsItsDeadlines) {
  Broadcast<std::int64_t> b(1);
  Pipe done;
  pid_t reader = fork_child([&] {
    auto r = b.reader(0);
    for (std::int64_t k = 0; k < 30; ++k) ASSERT_EQ(r.get(), k);
    EXPECT_EQ(r.try_get(std::chrono::microseconds(300)), std::nullopt);
    done.send();
    EXPECT_EQ(r.get(), 30);
    EXPECT_ERROR(r.get(), QueueClosed, "closed");
  });
  for (std::int64_t k = 0; k < 30; ++k) {
    b.put(k);
    ::usleep(2000);
  }
  ASSERT_EQ(done.receive(), 'x');
  b.put(30);
  b.close();
  EXPECT_EQ(wait_child(reader), 0);
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
                pid_t victim = start_victim(b, 1, attached);
                pid_t healthy = start_reader(b, 0, 0, 10);
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

// A "dropping" slot naming no process (pid 0) is no value an honest process writes.
TEST_P(BroadcastTest, ADroppingSlotNamingNoProcessBreaksIt) {
  Broadcast<std::int64_t> b(1);
  internal::Mapping map = map_control(b);
  auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
  c->reader[0].store(internal::kReaderDropping, std::memory_order_seq_cst);
  EXPECT_ERROR(b.put(1), ProtocolError, "reader 0's slot holds 9223372036854775808");
  EXPECT_ERROR(b.reader(0).get(), ProtocolError, "Broadcast is broken");
}

// A process SIGKILLed while it dropped a dead reader's messages leaves the slot naming it
// as the dropper (here a child writes the word as drop_messages does, then is killed). The
// writer's next put, or a process attaching as that reader, whichever meets it first, takes
// the drop over: the messages' blocks come back, the puts go on, and a new reader gets
// every message put after it attached.
TEST_P(BroadcastTest, ADroppersDeathMidDropIsTakenOverByWhoeverMeetsItFirst) {
  for (const bool writer_first : {true, false}) {
    SCOPED_TRACE(writer_first ? "the writer meets it first" : "a reader meets it first");
    EXPECT_EQ(run_in_child([writer_first] {
                ASSERT_EQ(held_arena_segments(), 0u);
                Broadcast<Tensor> b(2, 8);
                internal::Mapping map = map_control(b);
                auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
                auto put = [&b](int k) { put_k(b, k); };
                std::uint64_t victim_word = 0;
                const pid_t healthy = kill_reader_1_two_behind(b, 8, &victim_word);
                pid_t dropper = fork_child([&] {
                  std::uint64_t expected = victim_word;
                  if (!c->reader[1].compare_exchange_strong(
                          expected, internal::reader_dropping(internal::current_slot_owner())))
                    std::_Exit(3);
                  ::raise(SIGKILL);
                });
                EXPECT_EQ(wait_child(dropper), 128 + SIGKILL);
                EXPECT_EQ(b.reader_pid(1), 0);
                EXPECT_EQ(b.behind(1), 2u);  // messages 1 and 2, their blocks held
                if (writer_first) {
                  put(3);  // takes the drop over, then skips reader 1
                  EXPECT_EQ(b.behind(1), 0u);
                  EXPECT_EQ(c->reader[1].load(), internal::kReaderLeft);
                }
                Pipe reattached;
                pid_t newcomer = fork_child([&] {
                  auto r = b.reader(1);
                  EXPECT_EQ(r.try_get(std::chrono::seconds(0)), std::nullopt);  // attaches
                  reattached.send();
                  // Message 3 was put before it attached when the writer met the slot first.
                  for (int k = writer_first ? 4 : 3; k < 8; ++k) EXPECT_EQ(first(r.get()), k);
                  EXPECT_EQ(r.try_get(std::chrono::milliseconds(10)), std::nullopt);
                });
                ASSERT_EQ(reattached.receive(), 'x');
                EXPECT_EQ(b.behind(1), 0u);
                if (!writer_first) put(3);
                for (int k = 4; k < 8; ++k) put(k);
                EXPECT_EQ(wait_child(newcomer), 0);
                EXPECT_EQ(wait_child(healthy), 0);
                // Every message was taken or dropped: no block is held.
                EXPECT_EQ(held_arena_segments(), 0u);
              }),
              0);
  }
}

// A live process dropping a slot's messages (here a child that wrote the word and stopped):
// the writer skips the reader, a reader attaching there waits until its deadline, and
// nothing breaks; once the dropper marks the slot left, a process attaches.
TEST_P(BroadcastTest, ALiveDropperIsWaitedForAndNothingBreaks) {
  Broadcast<std::int64_t> b(1);
  internal::Mapping map = map_control(b);
  auto* c = reinterpret_cast<internal::BroadcastControl*>(map.data());
  const pid_t dropper = fork_child([c] {
    c->reader[0].store(internal::reader_dropping(internal::current_slot_owner()));
    ::raise(SIGSTOP);
    c->reader[0].store(internal::kReaderLeft);
  });
  int status = 0;
  ASSERT_EQ(::waitpid(dropper, &status, WUNTRACED), dropper);
  ASSERT_TRUE(WIFSTOPPED(status));
  b.put(1);  // skips reader 0
  EXPECT_EQ(b.behind(0), 0u);
  EXPECT_EQ(b.reader(0).try_get(std::chrono::milliseconds(50)), std::nullopt);
  b.put(2);
  EXPECT_EQ(b.behind(0), 0u);
  ::kill(dropper, SIGCONT);
  EXPECT_EQ(wait_child(dropper), 0);
  EXPECT_EQ(b.reader(0).try_get(std::chrono::seconds(0)), std::nullopt);  // attaches
  b.put(3);
  EXPECT_EQ(b.reader(0).get(), 3);
}

// A reader SIGKILLed with unread messages in a queue far from full: a put 100 ms or more
// after the writer last looked at that reader finds it dead and drops its messages, whose
// blocks come back.
TEST_P(BroadcastTest, ADeadReadersMessagesAreDroppedBeforeItsQueueFills) {
  EXPECT_EQ(run_in_child([] {
              ASSERT_EQ(held_arena_segments(), 0u);
              Broadcast<Tensor> b(2, 8);
              std::uint64_t victim_word = 0;
              const pid_t healthy = kill_reader_1_two_behind(b, 4, &victim_word);
              ::usleep(150'000);  // more than kBroadcastLivenessEvery since the last look
              put_k(b, 3);
              EXPECT_EQ(b.behind(1), 0u);
              EXPECT_EQ(b.reader_pid(1), 0);
              EXPECT_EQ(wait_child(healthy), 0);
              EXPECT_EQ(held_arena_segments(), 0u);  // reader 1's 2 messages were dropped
            }),
            0);
}

// A reader among more processes (its broadcast's readers and writer) than the CPUs it may
// run on neither busy-polls nor spins before it sleeps: its spin would keep a CPU from the
// next reader being woken. With a CPU to spare it does both, as a Queue's get.
TEST_P(BroadcastTest, AReaderAmongMoreProcessesThanCpusDoesNotSpin) {
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof all, &all), 0);
  const int cpus = CPU_COUNT(&all);
  if (cpus < 2 || cpus > 32) GTEST_SKIP() << cpus << " CPUs";
  for (const int readers : {cpus - 1, cpus}) {
    Broadcast<int> b(readers, 4);
    auto r = b.reader(0);
    EXPECT_EQ(r.try_get(std::chrono::seconds(0)), std::nullopt);  // attaches here
    internal::QueueCore& q = internal::BroadcastAccess::core(b).queue(0);
    const bool spare = readers < cpus;
    EXPECT_EQ(q.busy_poll(), spare ? std::optional<std::chrono::nanoseconds>(50us)
                                   : std::optional<std::chrono::nanoseconds>(0ns))
        << readers << " readers on " << cpus << " CPUs";
    EXPECT_EQ(q.spins_before_sleep(), spare) << readers << " readers on " << cpus << " CPUs";
    b.put(7);
    EXPECT_EQ(r.get(), 7);  // and it still gets what is put
  }
}

// A queue that had room in the first step and still takes no copy (a peer names a stopped
// process in its send lock, which a large message's put takes): the other readers get the
// message, and the error names exactly who did and who did not.
TEST_P(BroadcastTest, AQueueThatTakesNoCopyIsNamedWithTheReadersThatGotIt) {
  Broadcast<std::string> b(3);
  const std::string big(8000, 'b');
  const pid_t stopped = fork_child([] { ::raise(SIGSTOP); });
  int status = 0;
  ASSERT_EQ(::waitpid(stopped, &status, WUNTRACED), stopped);
  ASSERT_TRUE(WIFSTOPPED(status));
  internal::QueueCore& q1 = internal::BroadcastAccess::core(b).queue(1);
  internal::Mapping qmap = internal::Mapping::map_shared(
      q1.shared_fds().control, sizeof(internal::QueueControl), "test");
  auto* qc = reinterpret_cast<internal::QueueControl*>(qmap.data());
  const auto who = static_cast<std::uint32_t>(stopped);
  qc->send_lock.state.store(internal::thread_lock_state(who, who));
  try {
    b.put(big + "1", std::chrono::milliseconds(50));
    ADD_FAILURE() << "put() did not time out";
  } catch (const BroadcastTimeout& e) {
    EXPECT_EQ(e.reader(), 1);
    EXPECT_EQ(e.pid(), 0);
    EXPECT_EQ(e.delivered(), (std::vector<int>{0, 2}));
    EXPECT_THAT(std::string(e.what()),
                ::testing::HasSubstr("the queue of reader 1 had room and still took no copy"));
    EXPECT_THAT(std::string(e.what()),
                ::testing::HasSubstr("the message went to readers 0 and 2, not to reader 1"));
  }
  ::kill(stopped, SIGKILL);
  EXPECT_EQ(wait_child(stopped), 128 + SIGKILL);  // its lock is taken over by the next put
  b.put(big + "2", std::chrono::seconds(5));
  for (int r = 0; r < 3; ++r) {
    auto reader = b.reader(r);
    if (r != 1) EXPECT_EQ(reader.get(), big + "1");
    EXPECT_EQ(reader.get(), big + "2");
  }
}

// A tensor over 256 KiB has a dedicated segment; the writer deposits it in each reader's
// queue's depot (file_descriptor), so its fd goes with the first message only, and every
// reader still gets every message's exact values. A Queue's puts deposit none.
TEST_P(BroadcastTest, ALargeTensorsFdGoesOncePerReader) {
  constexpr int kReaders = 2;
  constexpr int kMessages = 20;
  constexpr std::int64_t kElements = 1 << 18;  // 1 MiB of int32
  const bool fds = GetParam() == SharingStrategy::kFileDescriptor;
  Broadcast<std::tuple<std::int32_t, Tensor>> b(kReaders, kMessages);
  std::vector<pid_t> children;
  for (int r = 0; r < kReaders; ++r) {
    children.push_back(fork_child([&b, r, kElements] {
      auto reader = b.reader(r);
      for (int k = 0; k < kMessages; ++k) {
        auto [n, t] = reader.get();
        ASSERT_EQ(n, k);
        ASSERT_EQ(t.numel(), kElements);
        ASSERT_EQ(first(t), 5);
        ASSERT_EQ(t.data_ptr<std::int32_t>()[kElements - 1], 5);
      }
    }));
  }
  Tensor t = Tensor::full({kElements}, 5, DType::kInt32);
  for (int k = 0; k < kMessages; ++k) b.put({k, t});
  for (pid_t c : children) EXPECT_EQ(wait_child(c), 0);
  for (int r = 0; r < kReaders; ++r) {
    const internal::FdCounts c = internal::BroadcastAccess::core(b).queue(r).fd_counts();
    EXPECT_EQ(c.sent, fds ? 1u : 0u);
    EXPECT_EQ(c.omitted, fds ? kMessages - 1u : 0u);
  }
  Queue<Tensor> q;
  q.put(t);
  q.put(t);
  EXPECT_EQ(first(q.get()), 5);
  EXPECT_EQ(first(q.get()), 5);
  EXPECT_EQ(internal::QueueAccess::core(q).fd_counts().sent, fds ? 2u : 0u);
  EXPECT_EQ(internal::QueueAccess::core(q).fd_counts().omitted, 0u);
}

// The writer's own puts (and a reader's own gets) in one process ask the kernel for their
// pid once; a forked child of the writer, whose copy of the handle has put before, is
// still not the writer, and attaches as a reader of its own.
TEST_P(BroadcastTest, AForkedChildOfTheWriterCannotPutAfterTheWriterDid) {
  Broadcast<std::int64_t> b(2);
  b.put(1);
  auto r0 = b.reader(0);
  EXPECT_EQ(r0.get(), 1);
  const pid_t child = fork_child([&b] {
    EXPECT_ERROR(b.put(2), std::logic_error, "only the process that made the broadcast puts");
    EXPECT_ERROR(b.reader(0).try_get(), std::logic_error, "is attached in another process");
    EXPECT_EQ(b.reader(1).get(), 1);
  });
  EXPECT_EQ(wait_child(child), 0);
  b.put(3);
  EXPECT_EQ(r0.get(), 3);
  EXPECT_EQ(b.reader(1).try_get(), std::nullopt);  // put while the child was reader 1: dropped
}

// A process that never mapped a large tensor's segment gets a message that names it
// without its fd: it maps the segment from its queue's depot (its first copy of the
// segment went to a reader process before it).
TEST_P(BroadcastTest, AReaderThatNeverMappedALargeTensorFetchesItFromTheDepot) {
  constexpr std::int64_t kElements = 1 << 18;  // 1 MiB of int32
  const bool fds = GetParam() == SharingStrategy::kFileDescriptor;
  Broadcast<Tensor> b(2);
  Pipe go;
  // Forked before the tensor exists: nothing of its segment is mapped here.
  const pid_t late = fork_child([&b, &go, kElements] {
    ASSERT_EQ(go.receive(), 'x');
    Tensor t = b.reader(1).get();
    ASSERT_EQ(t.numel(), kElements);
    EXPECT_EQ(first(t), 9);
    EXPECT_EQ(t.data_ptr<std::int32_t>()[kElements - 1], 9);
  });
  Tensor x = Tensor::full({kElements}, 9, DType::kInt32);
  // Reader 1's first copy (the one with the fd) goes to a process that takes it and exits.
  const pid_t early = fork_child([&b] { EXPECT_EQ(first(b.reader(1).get()), 9); });
  b.put(x);
  EXPECT_EQ(wait_child(early), 0);
  go.send();
  // The late reader attaches (its first get) before the next put, which it then gets.
  for (int k = 0; k < 10000 && b.reader_pid(1) != late; ++k) ::usleep(1000);
  ASSERT_EQ(b.reader_pid(1), late);
  b.put(x);
  EXPECT_EQ(wait_child(late), 0);
  const internal::FdCounts c = internal::BroadcastAccess::core(b).queue(1).fd_counts();
  EXPECT_EQ(c.sent, fds ? 1u : 0u);
  EXPECT_EQ(c.omitted, fds ? 1u : 0u);
  auto r0 = b.reader(0);
  for (int k = 0; k < 2; ++k) EXPECT_EQ(first(r0.get()), 9);
}

// The writer deposits at most kBroadcastDedicatedDeposits dedicated segments per reader's
// queue: the next one carries its fd in every message.
TEST_P(BroadcastTest, DedicatedSegmentsPastTheAllowanceCarryTheirFds) {
  constexpr int kSegments = internal::kBroadcastDedicatedDeposits + 1;
  const bool fds = GetParam() == SharingStrategy::kFileDescriptor;
  Broadcast<Tensor> b(1, 2 * kSegments);
  std::vector<Tensor> tensors;  // all alive: one dedicated segment each
  for (int k = 0; k < kSegments; ++k) tensors.push_back(Tensor::full({1 << 17}, k, DType::kInt32));
  const pid_t reader = fork_child([&b] {
    auto r = b.reader(0);
    for (int round = 0; round < 2; ++round)
      for (int k = 0; k < kSegments; ++k) {
        Tensor t = r.get();
        ASSERT_EQ(first(t), k);
        ASSERT_EQ(t.data_ptr<std::int32_t>()[(1 << 17) - 1], k);
      }
  });
  for (int round = 0; round < 2; ++round)
    for (const Tensor& t : tensors) b.put(t);
  EXPECT_EQ(wait_child(reader), 0);
  const internal::FdCounts c = internal::BroadcastAccess::core(b).queue(0).fd_counts();
  // Round 1: every message carries its fd (the first of each deposited segment too);
  // round 2: the 16 deposited ones go without, the 17th with.
  EXPECT_EQ(c.sent, fds ? kSegments + 1u : 0u);
  EXPECT_EQ(c.omitted, fds ? kSegments - 1u : 0u);
}

// A peer that writes the depot table cannot make the writer deposit a dedicated segment
// past its allowance: an entry the writer did not claim itself (here one forged as a failed
// deposit of a 65 MiB tensor's segment, which the writer would "try again") is not trusted,
// and that tensor's messages keep carrying its fd; the depot holds no copy of it.
TEST_P(BroadcastTest, ADedicatedSegmentPastTheAllowanceIsNotDepositedForAForgedEntry) {
  constexpr std::int64_t kElements = (std::int64_t{65} << 20) / 4;  // over the 64 MiB allowance
  const bool fds = GetParam() == SharingStrategy::kFileDescriptor;
  Broadcast<Tensor> b(1, 4);
  auto r = b.reader(0);
  const Tensor t = Tensor::full({kElements}, 7, DType::kInt32);
  b.put(t);  // moves the storage into shared memory: its segment's uid is known from here
  EXPECT_EQ(first(r.get()), 7);
  internal::QueueCore& q = internal::BroadcastAccess::core(b).queue(0);
  internal::Mapping qmap = internal::Mapping::map_shared(
      q.shared_fds().control, sizeof(internal::QueueControl), "test");
  auto* qc = reinterpret_cast<internal::QueueControl*>(qmap.data());
  const std::uint64_t uid = internal::StorageAccess::impl(t.storage())->segment()->uid();
  int forged = -1;
  for (int i = 0; i < internal::kDepotSegments && forged < 0; ++i)
    if (qc->depot.entries[i].uid.load() == 0) forged = i;
  ASSERT_GE(forged, 0);
  constexpr std::uint64_t kFailed = 2;  // depot.cc: a deposit to be tried again
  qc->depot.entries[forged].state.store(kFailed);
  qc->depot.entries[forged].uid.store(uid);
  for (int k = 0; k < 2; ++k) {
    b.put(t);
    Tensor got = r.get();
    EXPECT_EQ(first(got), 7);
    EXPECT_EQ(got.data_ptr<std::int32_t>()[kElements - 1], 7);
  }
  EXPECT_EQ(qc->depot.entries[forged].state.load(), kFailed);  // nothing deposited for it
  const internal::FdCounts c = q.fd_counts();
  EXPECT_EQ(c.sent, fds ? 3u : 0u);
  EXPECT_EQ(c.omitted, 0u);
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
// process receives it. Opening the broadcast by name (here in another process), and
// `shmtensor ls`, decode the publication, which carries no counts: they must not take that
// count. Here both happen while the handle is in flight, then the writer drops its last
// handle: a process that receives the handle after that still gets the message put before.
TEST_P(NamedBroadcastTest, OpeningByNameTakesNoCountOfAReaderInFlight) {
  const std::string name = "nb_flight_" + std::to_string(::getpid()) + "_" + to_string(GetParam());
  auto [out, in] = pipe();
  {
    auto b = Broadcast<std::int64_t>::create(name, 1);
    b.put(77);
    out.send(b.reader(0));
    const pid_t opener = fork_child([&] {
      auto opened = Broadcast<std::int64_t>::open(name);
      std::_Exit(opened.readers() == 1 ? 0 : 1);
    });
    EXPECT_EQ(wait_child(opener), 0);
    EXPECT_NE(testing::manager_test::run_tool("ls").find("  " + name + "  broadcast"),
              std::string::npos);
  }  // the writer's last handle: the broadcast is closed, its name gone
  const pid_t receiver = fork_child([&] {
    auto r = in.recv<Broadcast<std::int64_t>::Reader>();
    if (r.get() != 77) std::_Exit(1);
    try {
      (void)r.get();
    } catch (const QueueClosed&) {
      std::_Exit(0);
    }
    std::_Exit(2);
  });
  EXPECT_EQ(wait_child(receiver), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, NamedBroadcastTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
