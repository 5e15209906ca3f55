// Named queues (Queue<T>::create / open, docs/transport.md "Named queues"): opened by
// processes shmtensor did not start (an exec'd program that only knows the name), under
// both strategies; a taken or missing name; a SIGKILLed creator; another uid.
#include <gtest/gtest.h>
#include <sys/fsuid.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "manager_test_util.h"
#include "manager/protocol.h"
#include "memory/channel_registry.h"
#include "os/event_fd.h"
#include "os/poll.h"
#include "os/unix_socket.h"
#include "shmtensor/internal/fd_keeper.h"
#include "shmtensor/queue.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/strategy_test.h"

namespace shmtensor::testing {
namespace {

using manager_test::eventually;
using manager_test::ManagerTest;
namespace mgr = internal::manager;

// Each test its own manager group (so its own daemon), as ManagerTest does.
class NamedQueueTest : public manager_test::OwnManagerGroupTest {
 protected:
  NamedQueueTest() : OwnManagerGroupTest("nq") {}
};

pid_t exec_peer(const std::string& name, const std::string& mode) {
  return fork_child([&] {
    ::execl(SHMTENSOR_NAMED_QUEUE_PEER, SHMTENSOR_NAMED_QUEUE_PEER, name.c_str(), mode.c_str(),
            static_cast<char*>(nullptr));
    std::fprintf(stderr, "exec %s: %s\n", SHMTENSOR_NAMED_QUEUE_PEER, std::strerror(errno));
    ::_exit(127);
  });
}

bool named(const std::string& name) {
  for (const auto& c : internal::list_channels())
    if (c.name == name) return true;
  return false;
}

TEST_P(NamedQueueTest, AnExecdProgramOpensByNameAndTensorsGoBothWaysWithoutCopies) {
  const std::string name = "nq_both_" + std::to_string(::getpid());
  auto in = Queue<Tensor>::create(name + "_in");
  auto out = Queue<Tensor>::create(name + "_out", 4);
  Tensor t = Tensor::empty({5});
  for (int i = 0; i < 5; ++i) t.data_ptr<float>()[i] = static_cast<float>(i);
  in.put(t);
  pid_t peer = exec_peer(name, to_string(GetParam()));
  Tensor got = out.get();
  EXPECT_EQ(wait_child(peer), 0);  // exited: its tensor outlives it
  ASSERT_EQ(got.dtype(), DType::kInt64);
  ASSERT_EQ(got.numel(), 8);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got.data_ptr<std::int64_t>()[i], 3 * i);
  // The peer wrote the tensor we put, in place: the same memory, no copy.
  for (int i = 0; i < 5; ++i) EXPECT_EQ(t.data_ptr<float>()[i], static_cast<float>(i + 100));
  EXPECT_TRUE(in.empty());
}

TEST_P(NamedQueueTest, ASigkilledCreatorsNamesGoAndItsOpenersKeepTheQueue) {
  const std::string name = "nq_killed_" + std::to_string(::getpid());
  Pipe ready;
  pid_t creator = fork_child([&] {
    auto q = Queue<Tensor>::create(name);
    q.put(Tensor::full({3}, 7.0));
    ready.send_line("ready");
    ::pause();
  });
  ASSERT_EQ(ready.receive_line(), "ready");
  auto q = Queue<Tensor>::open(name);
  ASSERT_TRUE(named(name));
  ::kill(creator, SIGKILL);
  EXPECT_EQ(wait_child(creator), 128 + SIGKILL);
  EXPECT_TRUE(eventually([&] { return !named(name); })) << name << " outlived its creator";
  EXPECT_THROW((void)Queue<Tensor>::open(name), NameNotFound);
  // What the creator put is still there, and the queue still works for its opener.
  Tensor t = q.get();
  EXPECT_EQ(t.data_ptr<float>()[2], 7.0f);
  q.put(Tensor::full({2}, 4.0));
  EXPECT_EQ(q.get().data_ptr<float>()[1], 4.0f);
}

INSTANTIATE_TEST_SUITE_P(Strategies, NamedQueueTest, kAllStrategies, strategy_name);

TEST_F(ManagerTest, NamedQueueTakenMissingAndUnlinkedNames) {
  const std::string name = "nq_names_" + std::to_string(::getpid());
  std::optional<Queue<int>> q = Queue<int>::create(name);
  EXPECT_THROW((void)Queue<int>::create(name), NameExists);
  EXPECT_THROW((void)Queue<int>::open(name + "_missing"), NameNotFound);
  EXPECT_THROW((void)Queue<int>::create("../etc"), std::invalid_argument);
  // A program that only knows a missing name gets NameNotFound too.
  EXPECT_EQ(wait_child(exec_peer(name + "_missing", "open-missing")), 0);
  {
    auto opened = Queue<int>::open(name);
    q->put(41);
    EXPECT_EQ(opened.get(), 41);
    // Unlinked: nobody opens it any more, but the handles keep working.
    Queue<int>::unlink(name);
    EXPECT_THROW((void)Queue<int>::open(name), NameNotFound);
    EXPECT_THROW(Queue<int>::unlink(name), NameNotFound);
    opened.put(42);
    EXPECT_EQ(q->get(), 42);
  }
  // A name whose creator dropped its last handle is gone.
  auto again = Queue<int>::create(name);
  { auto copy = again; }
  EXPECT_TRUE(named(name));
  q.reset();  // the old queue, unlinked: its drop removes nothing of the new one's
  EXPECT_TRUE(named(name));
  again = Queue<int>(1);
  EXPECT_FALSE(named(name));
  EXPECT_THROW((void)Queue<int>::open(name), NameNotFound);
  // With no channel and no name left, the daemon started on demand exits on its own.
  EXPECT_TRUE(eventually([&] { return manager_test::daemons_of(group_).empty(); }));
}

TEST_F(ManagerTest, NamedQueueOfAnotherUidIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
  const std::string name = "nq_uid_" + std::to_string(::getpid());
  auto q = Queue<int>::create(name);
  const auto loc = location();
  Pipe result;
  pid_t child = fork_child([&] {
    // Another uid that points at our manager (by default it would ask its own, which
    // knows no name of ours). The manager's directory refuses it, and behind the
    // directory the manager's SO_PEERCRED check (ManagerTest.PeerOfAnotherUidIsRefused).
    ::setenv("SHMTENSOR_MANAGER_DIR", loc.dir.c_str(), 1);
    ASSERT_EQ(::setresuid(65534, 65534, 65534), 0) << std::strerror(errno);
    try {
      (void)Queue<int>::open(name);
      result.send_line("opened");
    } catch (const NameNotFound& e) {
      result.send_line(std::string("NameNotFound ") + e.what());
    } catch (const Error& e) {
      result.send_line(std::string("Error ") + e.what());
    }
  });
  std::string line = result.receive_line();
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(line.substr(0, 6), "Error ") << line;
  EXPECT_NE(line.find("belongs to uid 0, not 65534; refusing to use it"), std::string::npos)
      << line;
  EXPECT_TRUE(named(name));
}

TEST_F(ManagerTest, ShmtensorLsListsANamedQueueWithItsDepthAndEnds) {
  const std::string name = "nq_ls_" + std::to_string(::getpid());
  auto q = Queue<int>::create(name, 8);
  q.put(1);
  q.put(2);
  Pipe opened;
  Pipe done;
  pid_t opener = fork_child([&] {
    // It holds the queue twice (inherited at fork, and opened): one end.
    auto mine = Queue<int>::open(name);
    opened.send_line("opened");
    (void)done.receive_line();
  });
  ASSERT_EQ(opened.receive_line(), "opened");
  const std::string out = manager_test::run_tool("ls");
  const std::string json = manager_test::run_tool("ls --json");
  done.send_line("done");
  EXPECT_EQ(wait_child(opener), 0);
  const std::string me = std::to_string(::getpid());
  const std::string them = std::to_string(opener);
  EXPECT_NE(out.find("  " + name + "  queue  depth 2/8  creator " + me + "  ends "),
            std::string::npos)
      << out;
  const std::string line = out.substr(out.find("  " + name + "  queue"));
  const std::string ends = line.substr(line.find("ends "), line.find('\n') - line.find("ends "));
  EXPECT_TRUE(ends == "ends " + me + " " + them || ends == "ends " + them + " " + me) << ends;
  // --json: one object with the segments and the channels.
  EXPECT_EQ(json.substr(0, 14), "{\"segments\": [") << json;
  const std::string entry = "{\"name\": \"" + name + "\", \"kind\": \"queue\", \"creator_pid\": " +
                            me + ", \"depth\": 2, \"maxsize\": 8, \"ends\": [";
  const std::string head = "\"channels\": [\n " + entry;
  const auto at = json.find(head);
  ASSERT_NE(at, std::string::npos) << json;
  const auto from = at + head.size();
  const std::string json_ends = json.substr(from, json.find(']', from) - from);
  EXPECT_TRUE(json_ends == me + ", " + them || json_ends == them + ", " + me) << json_ends;
  EXPECT_EQ(json.substr(json.size() - 5), "}\n]}\n") << json;
  auto listed = internal::list_channels();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].name, name);
  EXPECT_EQ(listed[0].creator, ::getpid());
  EXPECT_EQ(listed[0].kind, static_cast<std::uint32_t>(internal::ChannelKind::kQueue));
  EXPECT_TRUE(listed[0].openers.empty());  // the opener is gone
}

TEST_F(ManagerTest, ANamedJoinableQueueCountsTheTasksOfAProcessThatOpenedIt) {
  const std::string name = "nq_join_" + std::to_string(::getpid());
  auto q = JoinableQueue<int>::create(name, 4);
  auto plain = Queue<int>::create(name + "_plain");
  EXPECT_ERROR(JoinableQueue<int>::open(name + "_plain"), std::invalid_argument,
               "\"" + name + "_plain\" is not a JoinableQueue");
  q.put(1);
  q.put(2);
  pid_t child = fork_child([&] {
    // Opens anew (not the handle inherited at fork): takes both, marks one done.
    auto mine = JoinableQueue<int>::open(name);
    if (mine.get() != 1 || mine.get() != 2) ::_exit(2);
    mine.task_done();
  });
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_FALSE(q.try_join(std::chrono::milliseconds(20)));
  q.task_done();
  EXPECT_TRUE(q.try_join(std::chrono::seconds(10)));
  EXPECT_THROW(q.task_done(), std::logic_error);
  // Queue<T>::open takes either kind; its puts are tasks of the joinable queue.
  auto as_plain = Queue<int>::open(name);
  as_plain.put(3);
  EXPECT_FALSE(q.try_join(std::chrono::milliseconds(20)));
  EXPECT_EQ(q.get(), 3);
  q.task_done();
  q.join();
}

TEST_F(ManagerTest, ANamedQueueWhoseFdsAreNotAQueuesIsAProtocolError) {
  // A process of the same user may publish anything under a name: an opener validates it
  // as it validates a queue received in a message, and keeps no fd of it.
  internal::UniqueFd e = internal::make_event_fd("test", "");
  const int one[] = {e.get()};
  (void)internal::publish_channel("nq_one_fd", internal::ChannelKind::kQueue, one, {});
  EXPECT_THROW((void)Queue<int>::open("nq_one_fd"), ProtocolError);
  const int five[] = {e.get(), e.get(), e.get(), e.get(), e.get()};
  (void)internal::publish_channel("nq_five_eventfds", internal::ChannelKind::kQueue, five, {});
  EXPECT_THROW((void)Queue<int>::open("nq_five_eventfds"), ProtocolError);
  (void)internal::publish_channel("nq_other_kind", internal::ChannelKind::kBroadcast, one, "x");
  try {
    (void)Queue<int>::open("nq_other_kind");
    ADD_FAILURE() << "opened a broadcast as a queue";
  } catch (const Error& err) {
    EXPECT_EQ(std::string(err.what()), "the channel \"nq_other_kind\" is of kind 2, not 1");
  }
  for (const char* n : {"nq_one_fd", "nq_five_eventfds", "nq_other_kind"})
    internal::unlink_channel(n);
  EXPECT_TRUE(internal::list_channels().empty());
}

TEST_F(ManagerTest, ADaemonWithoutNamedChannelsIsAnErrorThatSaysSo) {
  // An older daemon serving the group (another installation's): its hello-ack names no
  // features, and it would drop a connection that sends a channel request.
  const auto loc = location();
  internal::ensure_private_dir(loc.dir);
  internal::UniqueFd listener = internal::seqpacket_listen(loc.socket_path, 4);
  std::thread old_daemon([&] {
    const int fds[] = {listener.get()};
    (void)internal::wait_readable(fds, std::chrono::seconds(20));
    internal::UniqueFd conn = internal::accept_connection(listener.get());
    ASSERT_TRUE(conn.valid());
    const int conn_fds[] = {conn.get()};
    char buf[64];
    (void)internal::wait_readable(conn_fds, std::chrono::seconds(20));
    ASSERT_EQ(internal::recv_packet(conn.get(), buf, sizeof buf, false).size,
              static_cast<long>(sizeof(mgr::MessageHeader)));
    mgr::MessageHeader ack{};
    mgr::encode_header(mgr::MessageType::kHelloAck, 4321, 0, &ack);
    ASSERT_EQ(internal::send_packet(conn.get(), &ack, sizeof ack, false), 0);
    // Nothing more comes: the client gives up on its own (end of stream here).
    (void)internal::wait_readable(conn_fds, std::chrono::seconds(20));
    EXPECT_EQ(internal::recv_packet(conn.get(), buf, sizeof buf, false).size, 0);
  });
  try {
    (void)Queue<int>::create("nq_old_daemon");
    ADD_FAILURE() << "created a named queue with a daemon that has no named channels";
  } catch (const NameExists&) {
    ADD_FAILURE() << "NameExists";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the shmtensor-manager serving this user (pid 4321, "
                                         "group " + group_ +
                                         ") is of an older shmtensor without named channels"),
              std::string::npos)
        << e.what();
  }
  old_daemon.join();
  ::unlink(loc.socket_path.c_str());
}

}  // namespace
}  // namespace shmtensor::testing

namespace shmtensor::testing {
namespace {

using manager_test::ManagerTest;

std::string token_of(char c) { return std::string(internal::kKeptTokenBytes, c); }

// The fds and tickets of plain pickles in flight (include/shmtensor/internal/fd_keeper.h):
// kept by the manager after their sender exited, taken once.
TEST_F(ManagerTest, KeptFdsOutliveTheirSenderAndAreTakenOnce) {
  Pipe sent;
  pid_t sender = fork_child([&] {
    internal::UniqueFd e = internal::make_event_fd("test", "");
    std::uint64_t one = 7;
    ASSERT_EQ(::write(e.get(), &one, sizeof one), 8);
    internal::keep_fd_for_pickle(token_of('a'), e.get());
    internal::keep_fd_for_pickle(token_of('t'), -1);
    sent.send_line("sent");
  });
  ASSERT_EQ(sent.receive_line(), "sent");
  EXPECT_EQ(wait_child(sender), 0);  // gone before anything is taken
  int fd = -1;
  ASSERT_EQ(internal::take_fd_of_pickle(token_of('a'), &fd), internal::KeptFdKind::kFd);
  internal::UniqueFd taken(fd);
  std::uint64_t value = 0;
  EXPECT_EQ(::read(taken.get(), &value, sizeof value), 8);
  EXPECT_EQ(value, 7u);  // the sender's eventfd itself
  EXPECT_EQ(internal::take_fd_of_pickle(token_of('a'), &fd), internal::KeptFdKind::kUnknown);
  EXPECT_EQ(internal::take_fd_of_pickle(token_of('t'), &fd), internal::KeptFdKind::kTicket);
  EXPECT_EQ(internal::take_fd_of_pickle(token_of('t'), &fd), internal::KeptFdKind::kUnknown);
  EXPECT_EQ(internal::take_fd_of_pickle(token_of('n'), &fd), internal::KeptFdKind::kUnknown);
  EXPECT_THROW(internal::keep_fd_for_pickle("short", -1), std::invalid_argument);
  EXPECT_GE(internal::fd_keeper_connection(), 0);
}

}  // namespace
}  // namespace shmtensor::testing
