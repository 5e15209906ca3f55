// Connection on its rings (docs/transport.md, "Connection"): a message without fds that fits
// a slot travels in shared memory, not on the socket; one order holds for ring messages and
// datagrams; the peer's close() is seen at once and its death soon; a forked copy keeps an
// end open; native_handle() polls readable exactly while something waits; slots a hostile
// peer writes are ProtocolErrors and the connection goes on. Real processes, both strategies.
#include <dirent.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "os/unique_fd.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/pipe.h"
#include "support/strategy_test.h"
#include "transport/announced.h"
#include "transport/hangup_watch.h"
#include "transport/ring.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::wait_child;

class ConnectionRingTest : public testing::StrategyTest {};

// Bytes queued on a socket for its reader.
int queued_bytes(int sock) {
  int n = -1;
  EXPECT_EQ(::ioctl(sock, FIONREAD, &n), 0);
  return n;
}

int socket_of(const Connection& c) { return internal::ConnectionAccess::fds(c).at(0); }

bool readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) == 1;
}

// The state letter of /proc/<pid>/stat (its main thread's): 'S' while it sleeps.
char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

// Waits (up to 10 s) until `pid` sleeps: a receiver blocked in recv().
bool wait_until_asleep(pid_t pid) {
  for (int i = 0; i < 10'000; ++i) {
    if (process_state(pid) == 'S') return true;
    ::usleep(1000);
  }
  return false;
}

// Threads of this process named as the hang-up watch's thread is (other threads come and
// go: a sanitizer's own, for one).
int watch_threads() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    std::getline(comm, name);
    n += name == "shmtensor-watch";
  }
  ::closedir(d);
  return n;
}

TEST_P(ConnectionRingTest, SmallMessagesTravelInTheRingAndFdsOnTheSocketInOneOrder) {
  auto [a, b] = pipe();
  // 100 messages without fds: none of them is on the socket.
  for (std::int64_t i = 0; i < 100; ++i) a.send(i);
  EXPECT_EQ(queued_bytes(socket_of(b)), 0);
  // Tensors: with file_system, descriptors in slots; with file_descriptor each carries its
  // segment's fd, so it is a datagram (announced in the ring, to keep its place).
  Tensor t = Tensor::arange(8, DType::kInt32);
  a.send(t);
  a.send(std::int64_t{100});
  if (GetParam() == SharingStrategy::kFileDescriptor)
    EXPECT_GT(queued_bytes(socket_of(b)), 0);
  else
    EXPECT_EQ(queued_bytes(socket_of(b)), 0);
  // A value larger than a slot is a datagram too.
  std::vector<std::int64_t> large(2000, 7);
  a.send(large);
  a.send(std::int64_t{101});
  // Received in another process, in order, exact.
  const pid_t child = fork_child([&b = b] {
    for (std::int64_t i = 0; i < 100; ++i) ASSERT_EQ(b.recv<std::int64_t>(), i);
    Tensor got = b.recv<Tensor>();
    ASSERT_EQ(got.numel(), 8);
    EXPECT_EQ(got.data_ptr<std::int32_t>()[7], 7);
    got.data_ptr<std::int32_t>()[0] = 42;  // seen by the sender: the same memory
    EXPECT_EQ(b.recv<std::int64_t>(), 100);
    EXPECT_EQ(b.recv<std::vector<std::int64_t>>(), std::vector<std::int64_t>(2000, 7));
    EXPECT_EQ(b.recv<std::int64_t>(), 101);
    b.send(std::string("done"));
  });
  EXPECT_EQ(a.recv<std::string>(), "done");
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(t.data_ptr<std::int32_t>()[0], 42);
  EXPECT_EQ(queued_bytes(socket_of(b)), 0);
  EXPECT_FALSE(b.poll());
}

TEST_P(ConnectionRingTest, AReceiverBlockedInRecvSeesThePeersCloseAndGetsWhatWasSentFirst) {
  auto [a, b] = pipe();
  testing::Pipe ready;
  const pid_t child = fork_child([&a = a, &b = b, &ready] {
    a.close();  // the child holds only its end
    EXPECT_EQ(b.recv<std::int64_t>(), 1);
    ready.send();
    EXPECT_EQ(b.recv<std::int64_t>(), 2);  // sent right before the close
    EXPECT_ERROR((void)b.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
    EXPECT_ERROR((void)b.recv<std::int64_t>(), ConnectionClosed,
                 "the peer closed the connection");  // and stays so
  });
  b.close();
  a.send(std::int64_t{1});
  EXPECT_EQ(ready.receive(), 'x');
  a.send(std::int64_t{2});
  a.close();
  EXPECT_EQ(wait_child(child), 0);
}

// A peer that exits without close() (a child's _exit) bumps nothing in shared memory: a
// receive that would give up looks at the socket all the same, as recv on a bare socket
// says EOF (a pool that polls then receives with a zero timeout relies on it).
TEST_P(ConnectionRingTest, AZeroTimeoutReceiveAfterThePeerExitedSaysClosed) {
  auto [a, b] = pipe();
  const pid_t child = fork_child([&a = a, &b = b] {
    a.close();
    b.send(std::int64_t{1});
  });
  b.close();
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_TRUE(a.poll());
  EXPECT_EQ(a.try_recv<std::int64_t>(), std::optional<std::int64_t>(1));
  EXPECT_TRUE(a.poll()) << "the end waits";
  EXPECT_ERROR((void)a.try_recv<std::int64_t>(), ConnectionClosed,
               "the peer closed the connection");
}

TEST_P(ConnectionRingTest, AForkedCopyKeepsAnEndOpenUntilItsLastHolderCloses) {
  auto [a, b] = pipe();
  testing::Pipe go;
  const pid_t child = fork_child([&a = a, &b = b, &go] {
    a.close();
    EXPECT_EQ(go.receive(), 'x');
    EXPECT_EQ(b.recv<std::int64_t>(), 5);
    b.send(std::int64_t{6});
  });
  b.close();  // the child's copy of b is still open: nothing is closed for a
  a.send(std::int64_t{5});
  go.send();
  EXPECT_EQ(a.recv<std::int64_t>(), 6);
  EXPECT_EQ(wait_child(child), 0);
  // Its last holder exited: the peer is gone now.
  EXPECT_ERROR((void)a.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
  EXPECT_ERROR(a.send(std::int64_t{7}), ConnectionClosed,
               "send() on a connection whose peer has closed");
}

// Forks a peer that holds `theirs` (closing `ours` in it) until it is killed; this process
// closes `theirs`. Returns once the peer runs.
pid_t fork_peer_until_killed(Connection& ours, Connection& theirs) {
  testing::Pipe started;
  const pid_t peer = fork_child([&ours, &started] {
    ours.close();
    started.send();
    ::pause();
  });
  theirs.close();
  EXPECT_EQ(started.receive(), 'x');
  return peer;
}

TEST_P(ConnectionRingTest, APeerKilledIsNoticedByAReceiverAndABlockedSender) {
  auto [a, b] = pipe();
  const pid_t child = fork_peer_until_killed(a, b);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  EXPECT_EQ(wait_child(child), 128 + SIGKILL);
  EXPECT_ERROR((void)a.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
  // Sends: refused once the socket says so (at once here: the receive above looked).
  EXPECT_ERROR(a.send(std::int64_t{1}), ConnectionClosed,
               "send() on a connection whose peer has closed");

  // A sender blocked on a full ring whose reader dies wakes up with ConnectionClosed.
  auto [c, d] = pipe();
  const pid_t reader = fork_peer_until_killed(c, d);
  std::int64_t sent = 0;
  while (c.try_send(sent)) ++sent;
  EXPECT_EQ(sent, 256) << "one ring of 256 slots";
  const pid_t killer = fork_child([reader] {
    ::usleep(20'000);
    ASSERT_EQ(::kill(reader, SIGKILL), 0);
  });
  EXPECT_ERROR(c.send(sent), ConnectionClosed, "send() on a connection whose peer has closed");
  EXPECT_EQ(wait_child(killer), 0);
  EXPECT_EQ(wait_child(reader), 128 + SIGKILL);
}

// A receive with no deadline sleeps on the ring's futex with no time limit; the hang-up
// watch (transport/hangup_watch.h) wakes it when the peer's socket hangs up. Its thread runs
// while a watch does, and stops (its fds closed: the fixture's leak check) with the last.
TEST_P(ConnectionRingTest, AReceiverAsleepWhenItsPeerIsKilledIsWokenByTheHangUpWatch) {
  auto [a, b] = pipe();
  const pid_t peer = fork_peer_until_killed(a, b);
  const pid_t killer = fork_child([peer] {
    ASSERT_TRUE(wait_until_asleep(::getppid()));
    ASSERT_EQ(::kill(peer, SIGKILL), 0);
  });
  EXPECT_ERROR((void)a.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
  EXPECT_EQ(wait_child(killer), 0);
  EXPECT_EQ(wait_child(peer), 128 + SIGKILL);
  // The receive slept watched: the watch (fired, so later receives sleep in slices) stays
  // until the end closes.
  EXPECT_EQ(internal::hangup_watch_count(), 1u);
  EXPECT_TRUE(internal::hangup_watch_running());
  EXPECT_EQ(watch_threads(), 1);
  EXPECT_ERROR((void)a.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
  a.close();
  EXPECT_EQ(internal::hangup_watch_count(), 0u);
  EXPECT_FALSE(internal::hangup_watch_running());
  EXPECT_EQ(watch_threads(), 0);
}

// A forked child starts without its parent's watch thread and watches its own copy of an
// end when it sleeps on it.
TEST_P(ConnectionRingTest, AForkedChildWatchesItsOwnCopyOfAnEnd) {
  auto [a, b] = pipe();
  testing::Pipe go;
  const pid_t peer = fork_child([&a = a, &b = b, &go] {
    a.close();
    EXPECT_EQ(go.receive(), 'x');
    ASSERT_TRUE(wait_until_asleep(::getppid()));
    b.send(std::int64_t{1});
    ::pause();
  });
  b.close();
  go.send();
  EXPECT_EQ(a.recv<std::int64_t>(), 1);  // slept first: watched from here
  EXPECT_EQ(internal::hangup_watch_count(), 1u);
  const pid_t child = fork_child([&a = a] {
    EXPECT_FALSE(internal::hangup_watch_running());
    EXPECT_EQ(internal::hangup_watch_count(), 0u);
    EXPECT_EQ(watch_threads(), 0);
    EXPECT_ERROR((void)a.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
    EXPECT_EQ(internal::hangup_watch_count(), 1u);
  });
  ASSERT_TRUE(wait_until_asleep(child));
  ASSERT_EQ(::kill(peer, SIGKILL), 0);
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(wait_child(peer), 128 + SIGKILL);
  EXPECT_ERROR((void)a.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
}

// A thread's id, for wait_until_asleep (a thread's /proc/<tid>/stat).
pid_t thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// A receive that sleeps with no time limit is woken by every publish, not by one: a poll()
// on the same end sleeps on the same futex and takes nothing, and a wake-up it took alone
// would leave the receiver asleep for good.
TEST_P(ConnectionRingTest, APollerAsleepBesideAReceiverDoesNotTakeItsWakeUp) {
  auto [a, b] = pipe();
  std::atomic<pid_t> receiver{0}, poller{0};
  std::promise<std::int64_t> received;
  std::thread r([&b = b, &receiver, &received] {
    receiver = thread_id();
    received.set_value(b.recv<std::int64_t>());
  });
  std::thread p([&b = b, &poller] {
    poller = thread_id();
    EXPECT_TRUE(b.poll(std::chrono::seconds(30)));
  });
  while (receiver == 0 || poller == 0) std::this_thread::yield();
  ASSERT_TRUE(wait_until_asleep(receiver));
  ASSERT_TRUE(wait_until_asleep(poller));
  a.send(std::int64_t{5});
  std::future<std::int64_t> got = received.get_future();
  const bool arrived = got.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  EXPECT_TRUE(arrived) << "the receiver slept on while its message waited";
  if (!arrived) a.send(std::int64_t{5});  // let it end
  EXPECT_EQ(got.get(), 5);
  r.join();
  // The poller saw 5 before the receiver took it, or sleeps on: 6 ends its poll.
  a.send(std::int64_t{6});
  p.join();
  EXPECT_EQ(b.recv<std::int64_t>(), 6);
}

// Two processes hold the sending end; one is killed in the middle of writing a slot while
// the other's later message is published. The socket stays open (the other holds it), so
// no hang-up wakes the receiver: it must not sleep with no time limit while a claim is
// outstanding, and it gets the later message once the dead claim is found.
TEST_P(ConnectionRingTest, AWriterKilledMidSlotDoesNotStrandTheMessageBehindIt) {
  auto [a, b] = pipe();
  testing::Pipe claimed;
  const pid_t writer = fork_child([&a = a, &b = b, &claimed] {
    b.close();
    internal::Ring out =
        internal::Ring::attach(internal::dup_cloexec(internal::ConnectionAccess::fds(a).at(2)));
    ASSERT_TRUE(out.test_claim_and_abandon(false));  // a slot claimed, never finished
    claimed.send();
    ::pause();
  });
  EXPECT_EQ(claimed.receive(), 'x');
  std::atomic<pid_t> receiver{0};
  std::promise<std::int64_t> received;
  std::thread r([&b = b, &receiver, &received] {
    receiver = thread_id();
    received.set_value(b.recv<std::int64_t>());
  });
  while (receiver == 0) std::this_thread::yield();
  ASSERT_TRUE(wait_until_asleep(receiver));
  a.send(std::int64_t{7});  // behind the claim: the receiver wakes, finds it, sleeps again
  ASSERT_TRUE(wait_until_asleep(receiver));
  ASSERT_EQ(::kill(writer, SIGKILL), 0);
  EXPECT_EQ(wait_child(writer), 128 + SIGKILL);
  std::future<std::int64_t> got = received.get_future();
  const bool arrived = got.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  EXPECT_TRUE(arrived) << "the message behind a dead writer's claim never arrived";
  if (!arrived) a.send(std::int64_t{7});  // let it end
  EXPECT_EQ(got.get(), 7);
  r.join();
}

TEST_P(ConnectionRingTest, NativeHandleIsReadableExactlyWhileAMessageOrTheEndWaits) {
  auto [a, b] = pipe();
  a.send(std::int64_t{1});  // before anyone asked for the handle
  const int fd = b.native_handle();
  EXPECT_EQ(b.native_handle(), fd) << "made once";
  EXPECT_TRUE(readable(fd, 0));
  EXPECT_EQ(b.recv<std::int64_t>(), 1);
  EXPECT_FALSE(readable(fd, 0));
  // From another process, with a ring message and a datagram (a tensor with an fd, or not).
  testing::Pipe go;
  const pid_t child = fork_child([&a = a, &go] {
    EXPECT_EQ(go.receive(), 'x');
    a.send(std::int64_t{2});
    EXPECT_EQ(go.receive(), 'x');
    a.send(Tensor::ones({3}));
    EXPECT_EQ(go.receive(), 'x');
  });
  EXPECT_FALSE(readable(fd, 0));
  go.send();
  EXPECT_TRUE(readable(fd, 10'000));
  EXPECT_EQ(b.recv<std::int64_t>(), 2);
  EXPECT_FALSE(readable(fd, 0));
  go.send();
  EXPECT_TRUE(readable(fd, 10'000));
  EXPECT_EQ(b.recv<Tensor>().data_ptr<float>()[2], 1.0f);
  EXPECT_FALSE(readable(fd, 0));
  a.close();  // the child's copy is the last
  go.send();
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_TRUE(readable(fd, 10'000)) << "the peer is gone: readable, and recv says so";
  EXPECT_ERROR((void)b.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
}

// The library's own waiters (a worker group) ask for readiness only while they sleep: a
// message sent meanwhile signals, one sent while nobody waits does not (no syscall for its
// sender), and the next wait finds it all the same.
TEST_P(ConnectionRingTest, AWaitersReadinessIsSignalledOnlyWhileItWaits) {
  using internal::ConnectionAccess;
  auto [a, b] = pipe();
  a.send(std::int64_t{1});
  const int fd = ConnectionAccess::begin_wait(b);
  EXPECT_TRUE(readable(fd, 0)) << "a message was there before the wait";
  EXPECT_EQ(b.recv<std::int64_t>(), 1);
  ConnectionAccess::end_wait(b);
  a.send(std::int64_t{2});  // nobody waits: no signal
  EXPECT_FALSE(readable(fd, 0));
  EXPECT_EQ(ConnectionAccess::begin_wait(b), fd);
  EXPECT_TRUE(readable(fd, 0)) << "the wait looks at the ring";
  EXPECT_EQ(b.recv<std::int64_t>(), 2);
  ConnectionAccess::end_wait(b);
  (void)ConnectionAccess::begin_wait(b);
  EXPECT_FALSE(readable(fd, 0)) << "cleared: nothing is there";
  const pid_t child = fork_child([&a = a] { a.send(Tensor::ones({2})); });
  EXPECT_TRUE(readable(fd, 10'000)) << "signalled while we wait";
  ConnectionAccess::end_wait(b);
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(b.recv<Tensor>().data_ptr<float>()[1], 1.0f);
  a.close();
  (void)ConnectionAccess::begin_wait(b);
  EXPECT_TRUE(readable(fd, 10'000)) << "the peer is gone";
  ConnectionAccess::end_wait(b);
  EXPECT_ERROR((void)b.recv<std::int64_t>(), ConnectionClosed, "the peer closed the connection");
}

TEST_P(ConnectionRingTest, AReceivedEndIsUsableAndEndsAreRefusedWhenTheirFdsAreNot) {
  auto [a, b] = pipe();
  auto [c, d] = pipe();
  a.send(c);
  Connection got = b.recv<Connection>();
  c.close();
  const pid_t child = fork_child([&d = d] {
    EXPECT_EQ(d.recv<std::int64_t>(), 9);
    d.send(std::int64_t{10});
  });
  got.send(std::int64_t{9});
  EXPECT_EQ(got.recv<std::int64_t>(), 10);
  EXPECT_EQ(wait_child(child), 0);
  // A kind byte other than 0 (socket) or 1 (rings), and an eventfd slot holding a pipe.
  auto [raw_a, raw_b] = internal::ConnectionAccess::socket_pair();
  {
    Encoder e;
    e.write_pod<std::uint8_t>(2);
    e.write_fd(socket_of(raw_a));
    internal::ConnectionAccess::send(a, std::move(e));
  }
  EXPECT_ERROR((void)b.recv<Connection>(), ProtocolError, "a connection\'s kind byte is 2");
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  {
    const std::vector<int> fds = internal::ConnectionAccess::fds(d);
    Encoder e;
    e.write_pod<std::uint8_t>(1);
    for (int fd : {fds[0], fds[1], fds[2], fds[3], p[0], fds[5]}) e.write_fd(fd);
    internal::ConnectionAccess::send(a, std::move(e));
  }
  EXPECT_ERROR((void)b.recv<Connection>(), ProtocolError, "not an eventfd");
  ::close(p[0]);
  ::close(p[1]);
  a.send(std::int64_t{11});
  EXPECT_EQ(b.recv<std::int64_t>(), 11) << "the connection goes on";
}

// fds once per segment on a connection: with file_descriptor, a segment's fd travels in
// the first message that names it (and is deposited with the peer); later messages name it
// by uid alone and travel in the ring. A receiver that does not map it takes it from the
// depot: a forked child, a process that received the end itself, after the sender exited.
TEST_P(ConnectionRingTest, AnArenaSegmentsFdTravelsOncePerConnection) {
  auto [a, b] = pipe();
  constexpr int kMessages = 240;  // fits the ring (256 slots): nobody receives while they are sent
  // Sent by a child that exits right after: the receiver maps nothing of its own.
  const pid_t sender = fork_child([&a = a, &b = b] {
    b.close();
    for (int i = 0; i < kMessages; ++i) a.send(Tensor::full({4}, i, DType::kInt32));
    const auto counts = internal::ConnectionAccess::fd_counts(a);
    if (GetParam() == SharingStrategy::kFileDescriptor) {
      EXPECT_EQ(counts.sent, 1u) << "one arena segment, one fd";
      EXPECT_EQ(counts.omitted, kMessages - 1u);
    } else {
      EXPECT_EQ(counts.sent + counts.omitted, 0u);
    }
  });
  a.close();
  EXPECT_EQ(wait_child(sender), 0);
  // A forked child takes the first half (the first message, with the fd, among them); the
  // parent, which never mapped the segment, the rest: from the depot.
  const pid_t first_half = fork_child([&b = b] {
    for (int i = 0; i < kMessages / 2; ++i)
      ASSERT_EQ(b.recv<Tensor>().data_ptr<std::int32_t>()[3], i);
  });
  EXPECT_EQ(wait_child(first_half), 0);
  // Half the rest here; the other half in a process that receives this end in a message.
  for (int i = kMessages / 2; i < 3 * kMessages / 4; ++i)
    ASSERT_EQ(b.recv<Tensor>().data_ptr<std::int32_t>()[3], i);
  auto [c, d] = pipe();
  const pid_t joiner = fork_child([&c = c, &d = d] {
    c.close();
    Connection end = d.recv<Connection>();
    for (int i = 3 * kMessages / 4; i < kMessages; ++i)
      ASSERT_EQ(end.recv<Tensor>().data_ptr<std::int32_t>()[3], i);
    EXPECT_ERROR((void)end.recv<Tensor>(), ConnectionClosed, "the peer closed the connection");
  });
  d.close();
  c.send(b);
  b.close();
  EXPECT_EQ(wait_child(joiner), 0);
}

// When the last copy of a socket closes with datagrams in its own receive queue, the
// other end's next receive on it, a peek included, says ECONNRESET once, with everything
// the closing end sent still queued. Here both the connection's socket (a datagram the
// child never took) and, with file_descriptor, the depot socket (our deposit, which nobody
// ever takes) are reset so: nothing the child sent may be lost.
TEST_P(ConnectionRingTest, APeerExitingWithOurMessagesUnreadLosesNothingItSent) {
  auto [a, b] = pipe();
  Tensor ours = Tensor::arange(4, DType::kInt32);
  a.send(ours);  // file_descriptor: its fd is deposited at the child's depot socket
  a.send(std::vector<std::int64_t>(2000, 5));  // a datagram the child never takes
  const pid_t child = fork_child([&a = a, &b = b] {
    a.close();
    EXPECT_EQ(b.recv<Tensor>().data_ptr<std::int32_t>()[3], 3);  // (its counts come back)
    b.send(std::vector<std::int64_t>(2000, 6));
    Tensor t = Tensor::full({4}, 7, DType::kInt32);
    b.send(t);  // its segment's fd (deposited at our depot socket)
    b.send(t);  // by uid alone, with file_descriptor
  });
  b.close();
  EXPECT_EQ(wait_child(child), 0);
  // A forked copy takes the first two (and so maps the segment); we take the third, whose
  // segment we must fetch from the depot.
  const pid_t first = fork_child([&a = a] {
    EXPECT_EQ(a.recv<std::vector<std::int64_t>>(), std::vector<std::int64_t>(2000, 6));
    EXPECT_EQ(a.recv<Tensor>().data_ptr<std::int32_t>()[3], 7);
  });
  EXPECT_EQ(wait_child(first), 0);
  EXPECT_EQ(a.recv<Tensor>().data_ptr<std::int32_t>()[3], 7);
  EXPECT_ERROR((void)a.recv<Tensor>(), ConnectionClosed, "the peer closed the connection");
}

// A readiness fd left readable with nothing there (a signal that came after its message
// was taken, here written by hand) is cleared by the next receive or poll that finds
// nothing, and a claim given up (a reservation cancelled) does not count as a message.
TEST_P(ConnectionRingTest, AReadinessFdReadableForNothingIsClearedByTheNextLook) {
  auto [a, b] = pipe();
  const int fd = b.native_handle();
  const int own_ready = internal::ConnectionAccess::fds(b).at(5);
  const std::uint64_t one = 1;
  ASSERT_EQ(::write(own_ready, &one, sizeof one), 8);
  EXPECT_TRUE(readable(fd, 0));
  EXPECT_EQ(b.try_recv<std::int64_t>(), std::nullopt);
  EXPECT_FALSE(readable(fd, 0));
  ASSERT_EQ(::write(own_ready, &one, sizeof one), 8);
  EXPECT_FALSE(b.poll());
  EXPECT_FALSE(readable(fd, 0));
  // A reservation in b's ring, given up: the ring is not empty by its hints, yet nothing
  // is there.
  internal::Ring ring = internal::Ring::attach(internal::dup_cloexec(internal::ConnectionAccess::fds(a).at(2)));
  const internal::Ring::Reservation r = ring.reserve(std::nullopt);
  ASSERT_EQ(r.status, internal::Ring::Status::kOk);
  ring.cancel(r.pos);
  EXPECT_TRUE(ring.maybe_nonempty());
  EXPECT_FALSE(ring.has_ready());
  ASSERT_EQ(::write(own_ready, &one, sizeof one), 8);
  EXPECT_FALSE(b.poll());
  EXPECT_FALSE(readable(fd, 0));
  a.send(std::int64_t{3});
  EXPECT_TRUE(ring.has_ready());
  EXPECT_TRUE(readable(fd, 10'000));
  EXPECT_EQ(b.recv<std::int64_t>(), 3);
  EXPECT_FALSE(readable(fd, 0));
}

// A peer that maps the ring can write any slot: each bad one is one ProtocolError, and the
// connection goes on with the next message.
TEST_P(ConnectionRingTest, SlotsAHostilePeerWritesAreProtocolErrors) {
  auto [a, b] = pipe();
  const std::vector<int> fds = internal::ConnectionAccess::fds(a);
  internal::Ring ring = internal::Ring::attach(internal::dup_cloexec(fds[2]));  // a's out
  const std::byte junk[12] = {std::byte{0xde}, std::byte{0xad}};
  auto push = [&](std::span<const std::byte> bytes, std::uint32_t tag) {
    ASSERT_EQ(ring.push(bytes, tag, std::nullopt), internal::Ring::Status::kOk);
  };
  push(junk, internal::kRingMessageTag);  // not a frame
  a.send(std::int64_t{1});
  push(junk, 77);  // neither a message nor a marker
  a.send(std::int64_t{2});
  push({}, internal::kRingMarkerTag);  // a marker whose datagram was never sent
  a.send(std::int64_t{3});
  EXPECT_ERROR((void)b.recv<std::int64_t>(), ProtocolError, "shorter than a frame header");
  EXPECT_EQ(b.recv<std::int64_t>(), 1);
  EXPECT_ERROR((void)b.recv<std::int64_t>(), ProtocolError, "neither a message nor a marker");
  EXPECT_EQ(b.recv<std::int64_t>(), 2);
  EXPECT_ERROR((void)b.recv<std::int64_t>(), ProtocolError,
               "announces a datagram the socket does not have");
  EXPECT_EQ(b.recv<std::int64_t>(), 3);
  EXPECT_FALSE(b.poll());
}

// has_message and spin_for_message look at the rings only: what they say of ringed,
// socket-only and closed ends, across a fork.
TEST_P(ConnectionRingTest, HasMessageAndSpinForMessageSeePublishedMessagesOnly) {
  using internal::ConnectionAccess;
  using Clock = std::chrono::steady_clock;
  auto [a, b] = pipe();
  auto [c, d] = pipe();
  EXPECT_FALSE(ConnectionAccess::has_message(b));
  Connection* ends[2] = {&b, &d};
  EXPECT_EQ(ConnectionAccess::spin_for_message(ends, Clock::now() + std::chrono::milliseconds(1)),
            std::nullopt);
  const pid_t pid = fork_child([&c = c] { c.send(std::int64_t{7}); });
  ASSERT_EQ(testing::wait_child(pid), 0);
  EXPECT_FALSE(ConnectionAccess::has_message(b));
  EXPECT_TRUE(ConnectionAccess::has_message(d));
  EXPECT_EQ(ConnectionAccess::spin_for_message(ends, Clock::now() + std::chrono::seconds(10)),
            std::optional<std::size_t>(1));
  EXPECT_EQ(d.recv<std::int64_t>(), 7);
  EXPECT_FALSE(ConnectionAccess::has_message(d));
  a.send(std::int64_t{8});
  EXPECT_EQ(ConnectionAccess::spin_for_message(ends, Clock::now() + std::chrono::seconds(10)),
            std::optional<std::size_t>(0));
  EXPECT_EQ(b.recv<std::int64_t>(), 8);
  // A hang-up is no message; a closed end has none.
  c.close();
  EXPECT_FALSE(ConnectionAccess::has_message(d));
  d.close();
  EXPECT_FALSE(ConnectionAccess::has_message(d));
  // A socket-only end "has" one for has_message (only a receive can tell), and is never
  // found by the spin (poll() sees its datagrams).
  auto [s, t] = ConnectionAccess::socket_pair();
  EXPECT_TRUE(ConnectionAccess::has_message(t));
  Connection* sockets[1] = {&t};
  EXPECT_EQ(
      ConnectionAccess::spin_for_message(sockets, Clock::now() + std::chrono::milliseconds(1)),
      std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(Strategies, ConnectionRingTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
