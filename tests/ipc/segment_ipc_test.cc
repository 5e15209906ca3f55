// Shared segments across real processes: writes are seen both ways, named segments live
// exactly as long as some process holds them (fork handlers in registry.cc), and no fd the
// library creates or receives survives exec.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/socket.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/queue.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"
#include "support/leak_check.h"
#include "support/pipe.h"
#include "support/strategy_test.h"
#include "transport/channel.h"
#include "transport/hangup_watch.h"
#include "wire/wire.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::Pipe;
using testing::wait_child;

bool name_exists(const std::string& name) {
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

std::int64_t refcount_of(const Storage& s) {
  return internal::StorageAccess::impl(s)->segment()->header()->refcount.load();
}

class SegmentIpcTest : public testing::StrategyTest {};

// Values written after the fork, in turns, by each side: only shared pages can carry them.
TEST_P(SegmentIpcTest, WritesAreSeenBothWays) {
  constexpr int kRounds = 50;
  constexpr std::size_t kInts = 1 << 16;
  Storage moved = Storage::allocate(kInts * sizeof(std::int32_t));  // share_memory_ path
  std::memset(moved.data(), 0, moved.nbytes());
  moved.share_memory_();
  Storage direct = Storage::allocate_shared(kInts * sizeof(std::int32_t));  // no-copy path
  std::memset(direct.data(), 0, direct.nbytes());

  Pipe to_child, to_parent;
  pid_t pid = fork_child([&] {
    for (int r = 1; r <= kRounds; ++r) {
      ASSERT_EQ(to_child.receive(), 'x');
      auto* m = static_cast<std::int32_t*>(moved.data());
      auto* d = static_cast<std::int32_t*>(direct.data());
      for (std::size_t i = 0; i < kInts; i += 1000) {
        ASSERT_EQ(m[i], 2 * r - 1) << "round " << r << " index " << i;
        ASSERT_EQ(d[i], -(2 * r - 1));
      }
      for (std::size_t i = 0; i < kInts; i += 1000) {
        m[i] = 2 * r;
        d[i] = -2 * r;
      }
      to_parent.send();
    }
    // A forked child holds a count of every named segment it inherited: give it back.
    moved = Storage();
    direct = Storage();
  });
  for (int r = 1; r <= kRounds; ++r) {
    auto* m = static_cast<std::int32_t*>(moved.data());
    auto* d = static_cast<std::int32_t*>(direct.data());
    for (std::size_t i = 0; i < kInts; i += 1000) {
      m[i] = 2 * r - 1;
      d[i] = -(2 * r - 1);
    }
    to_child.send();
    ASSERT_EQ(to_parent.receive(), 'x') << "child died in round " << r;
    for (std::size_t i = 0; i < kInts; i += 1000) {
      ASSERT_EQ(m[i], 2 * r);
      ASSERT_EQ(d[i], -2 * r);
    }
  }
  EXPECT_EQ(wait_child(pid), 0);
}

// The control that shows the test above can fail: private bytes are copied on fork.
TEST_P(SegmentIpcTest, PrivateStorageIsNotShared) {
  Storage priv = Storage::allocate(4096);
  std::memset(priv.data(), 1, 4096);
  EXPECT_EQ(testing::run_in_child([&] { std::memset(priv.data(), 2, 4096); }), 0);
  EXPECT_EQ(static_cast<unsigned char*>(priv.data())[100], 1);

  Storage shared = Storage::allocate(4096);
  std::memset(shared.data(), 1, 4096);
  shared.share_memory_();
  EXPECT_EQ(testing::run_in_child([&] {
              std::memset(shared.data(), 2, 4096);
              shared = Storage();
            }),
            0);
  EXPECT_EQ(static_cast<unsigned char*>(shared.data())[100], 2);
}

// A segment a child creates after the fork is its own arena's: eight storages share one
// segment, and once they are dropped empty_cache() there frees it.
TEST_P(SegmentIpcTest, ChildCreatesAndDropsItsOwnSegments) {
  EXPECT_EQ(testing::run_in_child([&] {
              std::vector<Storage> v;
              for (int i = 0; i < 8; ++i) v.push_back(Storage::allocate_shared(10000));
              for (auto& st : v)
                EXPECT_EQ(internal::StorageAccess::impl(st)->segment(),
                          internal::StorageAccess::impl(v[0])->segment());
              if (GetParam() == SharingStrategy::kFileSystem)
                EXPECT_EQ(testing::shm_names_of(::getpid()).size(), 1u);
              EXPECT_EQ(testing::shmtensor_mappings().size(), 1u);
              v.clear();
              empty_cache();
              EXPECT_TRUE(testing::shm_names_of(::getpid()).empty());
              EXPECT_TRUE(testing::shmtensor_mappings().empty());
            }),
            0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, SegmentIpcTest, testing::kAllStrategies,
                         testing::strategy_name);

// ---- named segment lifetime across fork -------------------------------------------------

class NamedLifetimeTest : public testing::StrategyRestoringTest {
 protected:
  void SetUp() override {
    StrategyRestoringTest::SetUp();
    set_sharing_strategy(SharingStrategy::kFileSystem);
  }
};

// A named segment goes when its creator's arena gives it back (empty_cache(), or the
// creator's exit), which it does only once no process holds a block in it. Counts in the
// header: one per mapping process, so a forked child gets its own.
TEST_F(NamedLifetimeTest, CreatorKeepsTheSegmentWhileAChildHoldsItsBlock) {
  Storage s = Storage::allocate_shared(1 << 20);
  const std::string name = internal::StorageAccess::impl(s)->segment()->name();
  ASSERT_TRUE(name_exists(name));
  EXPECT_EQ(refcount_of(s), 1);

  Pipe ready, dropped, child_done;
  pid_t pid = fork_child([&] {
    ready.send();
    ASSERT_EQ(dropped.receive(), 'x');
    EXPECT_TRUE(name_exists(name));
    static_cast<char*>(s.data())[0] = 42;
    s = Storage();
    empty_cache();
    child_done.send();
  });
  ASSERT_EQ(ready.receive(), 'x');
  EXPECT_EQ(refcount_of(s), 2);  // the child got its own count at fork
  auto seg = internal::StorageAccess::impl(s)->segment();
  const std::uint32_t block = internal::StorageAccess::impl(s)->block();
  s = Storage();
  empty_cache();
  EXPECT_NE(seg->block_word(block), 0u) << "the child's hold is gone";
  EXPECT_TRUE(name_exists(name)) << "unlinked while the child still holds a block";
  seg.reset();
  dropped.send();
  ASSERT_EQ(child_done.receive(), 'x');
  EXPECT_EQ(wait_child(pid), 0);
  empty_cache();  // no block is held now: the segment goes, and with our count its name
  EXPECT_FALSE(name_exists(name));
}

TEST_F(NamedLifetimeTest, ChildDropsFirstParentUnlinks) {
  Storage s = Storage::allocate(1 << 20);
  std::memset(s.data(), 7, s.nbytes());
  s.share_memory_();
  const std::string name = internal::StorageAccess::impl(s)->segment()->name();
  pid_t pid = fork_child([&] {
    EXPECT_EQ(refcount_of(s), 2);
    s = Storage();
    empty_cache();
    EXPECT_TRUE(name_exists(name)) << "the child unlinked a name the parent holds";
  });
  EXPECT_EQ(wait_child(pid), 0);
  EXPECT_TRUE(name_exists(name));
  EXPECT_EQ(refcount_of(s), 1);
  EXPECT_EQ(static_cast<unsigned char*>(s.data())[12345], 7);
  s = Storage();
  empty_cache();
  EXPECT_FALSE(name_exists(name));
}

// Several children and a grandchild, dropping in an order unrelated to the fork order:
// the creator's arena keeps the segment until the last of them dropped its block.
TEST_F(NamedLifetimeTest, ManyHoldersLastOneFreesTheSegment) {
  Storage s = Storage::allocate_shared(4096);
  const std::string name = internal::StorageAccess::impl(s)->segment()->name();
  constexpr int kChildren = 4;
  std::vector<Pipe> go(kChildren);
  Pipe ready, done;
  std::vector<pid_t> pids;
  for (int i = 0; i < kChildren; ++i) {
    pids.push_back(fork_child([&, i] {
      ready.send();  // the fork handlers have run in this child: its count is taken
      pid_t grandchild = -1;
      if (i == 0) {
        // Fork handlers run in a forked child's own forks too.
        grandchild = fork_child([&] {
          ready.send();
          ASSERT_EQ(go[0].receive(), 'x');
          s = Storage();
          empty_cache();  // and the segments inherited from the parent's arena
          done.send();
        });
      }
      ASSERT_EQ(go[i].receive(), 'x');
      s = Storage();
      empty_cache();
      done.send();
      if (grandchild > 0) EXPECT_EQ(wait_child(grandchild), 0);
    }));
  }
  // Parent + 4 children + 1 grandchild, each counted once it said so (a sanitizer's fork can
  // take seconds on a loaded machine: no polling deadline).
  for (int i = 0; i < kChildren + 1; ++i) ASSERT_EQ(ready.receive(), 'x') << "holder " << i;
  EXPECT_EQ(refcount_of(s), 1 + kChildren + 1);
  auto seg = internal::StorageAccess::impl(s)->segment();
  const std::uint32_t block = internal::StorageAccess::impl(s)->block();
  s = Storage();  // the parent first
  for (int i = kChildren - 1; i >= 0; --i) {
    empty_cache();
    EXPECT_TRUE(name_exists(name)) << "gone before child " << i << " dropped it";
    EXPECT_NE(seg->block_word(block), 0u);
    go[i].send();
    if (i == 0) go[0].send();  // child 0 and the grandchild both read go[0]
    ASSERT_EQ(done.receive(), 'x');
    if (i == 0) ASSERT_EQ(done.receive(), 'x');
  }
  EXPECT_EQ(seg->block_word(block), 0u) << "every holder dropped it";
  seg.reset();
  for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), 0);
  empty_cache();
  EXPECT_FALSE(name_exists(name));
}

// ---- close-on-exec ----------------------------------------------------------------------

// Runs `ls -l /proc/self/fd` in an exec'd child and returns what it printed: the fds that
// survived exec, with their targets.
//
// posix_spawn, not fork+exec: glibc's posix_spawn runs no pthread_atfork handlers, so the
// library does not give the child a count of each file_system segment. A fork+exec'd
// child would get those counts and never give them back (exec drops the mappings without
// running destructors): the names would stay until the manager daemon sweeps them (see
// docs/shm_layout.md, "Known gaps"). Close-on-exec is a property of execve either way.
std::string fds_after_exec() {
  int out[2];
  EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  const char* argv[] = {"/bin/ls", "-l", "/proc/self/fd", nullptr};
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, const_cast<char* const*>(argv), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  EXPECT_EQ(rc, 0) << std::strerror(rc);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof buf)) > 0 || (n == -1 && errno == EINTR))
    if (n > 0) text.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  if (rc == 0) EXPECT_EQ(wait_child(pid), 0) << text;
  return text;
}

// The lines of `ls -l /proc/self/fd` whose fd is a shmtensor segment (a memfd, or a
// /dev/shm name), by their targets only: a path that merely contains "shmtensor" (a
// checkout in a directory of that name, whose build log ctest passes down) is not one.
std::vector<std::string> shmtensor_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.find(" -> /memfd:shmtensor") != std::string::npos ||
        line.find(" -> /dev/shm/shmtensor_") != std::string::npos)
      lines.push_back(line);
  return lines;
}

class CloseOnExecTest : public testing::StrategyRestoringTest {};

// fd numbers listed by `ls -l /proc/self/fd`, except ls's own handle on that directory.
std::set<int> listed_fds(const std::string& text) {
  std::set<int> fds;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto arrow = line.find(" -> ");
    if (arrow == std::string::npos) continue;
    std::string target = line.substr(arrow + 4);
    if (target.rfind("/proc/", 0) == 0 && target.size() > 3 &&
        target.compare(target.size() - 3, 3, "/fd") == 0)
      continue;
    auto space = line.rfind(' ', arrow - 1);
    fds.insert(std::stoi(line.substr(space + 1, arrow - space - 1)));
  }
  return fds;
}

TEST_F(CloseOnExecTest, EveryLibraryFdIsCloseOnExec) {
  // fds this process had before the library made any; those without FD_CLOEXEC (stdio,
  // whatever ctest passed down) are the only ones an exec'd child may inherit.
  const std::set<int> before = testing::open_fds();
  std::set<int> may_inherit;
  for (int fd : before)
    if (!(::fcntl(fd, F_GETFD) & FD_CLOEXEC)) may_inherit.insert(fd);

  std::vector<Storage> keep;
  for (SharingStrategy strategy : get_all_sharing_strategies()) {
    set_sharing_strategy(strategy);
    keep.push_back(Storage::allocate_shared(4096));
    keep.push_back(Storage::allocate(4096).share_memory_());
  }
  set_sharing_strategy(SharingStrategy::kFileDescriptor);
  int memfd = internal::StorageAccess::impl(keep[0])->segment()->fd();
  ASSERT_GE(memfd, 0);

  // Every fd the library opened here (memfds; a manager daemon's socket, if any) is
  // FD_CLOEXEC...
  for (int fd : testing::open_fds()) {
    if (before.count(fd)) continue;
    char target[256] = {};
    (void)::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1);
    EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC) << "fd " << fd << " -> " << target;
  }

  // ... and a real exec proves it. The control: an fd made inheritable on purpose must show
  // up in the child, or the check proves nothing.
  int inheritable = ::fcntl(memfd, F_DUPFD, 200);
  ASSERT_GE(inheritable, 0);
  std::string listing = fds_after_exec();
  auto lines = shmtensor_lines(listing);
  ASSERT_EQ(lines.size(), 1u) << listing;
  EXPECT_NE(lines[0].find(" " + std::to_string(inheritable) + " -> /memfd:shmtensor"),
            std::string::npos)
      << listing;
  EXPECT_TRUE(listed_fds(listing).count(inheritable)) << listing;
  ::close(inheritable);

  listing = fds_after_exec();
  EXPECT_TRUE(shmtensor_lines(listing).empty()) << listing;
  EXPECT_EQ(listing.find("/dev/shm/"), std::string::npos) << listing;
  for (int fd : listed_fds(listing))
    EXPECT_TRUE(may_inherit.count(fd) || fd == STDOUT_FILENO) << "fd " << fd << " survived exec:\n"
                                                              << listing;
  // The library's own fds are still open here, unaffected.
  EXPECT_TRUE(::fcntl(memfd, F_GETFD) & FD_CLOEXEC);
}

// What each fd opened since `known` points to ("socket:[123]", "/memfd:shmtensor (deleted)").
std::map<int, std::string> fds_opened_since(const std::set<int>& known) {
  std::map<int, std::string> out;
  for (int fd : testing::open_fds()) {
    if (known.count(fd)) continue;
    char target[256] = {};
    (void)::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1);
    out[fd] = target;
  }
  return out;
}

// The transport's fds: the sockets, rings and eventfds of pipe() and of a Queue, a queue's
// control memfd, a connection's epoll fd (native_handle), fds received through a Connection
// (MSG_CMSG_CLOEXEC: a Connection, a Queue, a segment memfd from another process) and a
// message blob on both sides.
TEST_F(CloseOnExecTest, TransportFdsAreCloseOnExec) {
  const std::set<int> before = testing::open_fds();
  std::set<int> may_inherit;
  for (int fd : before)
    if (!(::fcntl(fd, F_GETFD) & FD_CLOEXEC)) may_inherit.insert(fd);

  // Each step's new fds, checked to be what the step makes.
  struct Made {
    std::string what;
    std::map<int, std::string> fds;
  };
  std::vector<Made> made;
  std::set<int> known = before;
  auto record = [&](const std::string& what, int sockets, int memfds, int eventfds = 0,
                    int epolls = 0) {
    auto fds = fds_opened_since(known);
    int s = 0, m = 0, e = 0, p = 0;
    std::string all;
    for (const auto& [fd, target] : fds) {
      known.insert(fd);
      s += target.rfind("socket:[", 0) == 0;
      m += target.rfind("/memfd:shmtensor", 0) == 0;
      e += target == "anon_inode:[eventfd]";
      p += target == "anon_inode:[eventpoll]";
      all += " " + std::to_string(fd) + " -> " + target + ";";
    }
    EXPECT_EQ(s, sockets) << what << ":" << all;
    EXPECT_EQ(m, memfds) << what << ":" << all;
    EXPECT_EQ(e, eventfds) << what << ":" << all;
    EXPECT_EQ(p, epolls) << what << ":" << all;
    EXPECT_EQ(static_cast<int>(fds.size()), sockets + memfds + eventfds + epolls)
        << what << ":" << all;
    made.push_back({what, std::move(fds)});
  };

  auto [a, b] = pipe();
  record("pipe()", 4, 4, 4);  // per end: its socket, depot socket, two rings, two eventfds
  (void)b.native_handle();
  record("native_handle()", 0, 0, 0, 1);
  // The hang-up watch's thread (transport/hangup_watch.h): its epoll set and the eventfd
  // that stops it, made with the first watch (here, so that a receive below that sleeps
  // adds its watch to this thread and the counts stay exact).
  const std::uint64_t watch = internal::watch_hangup(
      internal::ConnectionAccess::fds(a).at(0), [](void*) {}, nullptr);
  ASSERT_NE(watch, 0u);
  record("hang-up watch", 0, 0, 1, 1);
  Queue<std::int64_t> q;
  record("Queue", 2, 2, 1);  // its sockets, control block, message ring, readiness eventfd
  auto [c, d] = pipe();
  record("pipe() to be sent", 4, 4, 4);

  a.send(c);
  Connection received_connection = b.recv<Connection>();
  record("received Connection", 2, 2, 2);
  a.send(q);
  auto received_queue = b.recv<Queue<std::int64_t>>();
  record("received Queue", 2, 2, 1);
  // A segment this process does not map yet: made and sent by a child.
  pid_t pid = fork_child([&] {
    Tensor t = Tensor::arange(64);
    a.send(t);
  });
  Tensor from_child = b.recv<Tensor>();
  EXPECT_EQ(wait_child(pid), 0);
  ASSERT_EQ(from_child.numel(), 64);
  EXPECT_EQ(from_child.data_ptr<std::int64_t>()[63], 63) << "not the child's tensor";
  record("received segment memfd", 0, 1);

  // A body over 64 KiB travels in a blob: the sender's is open until the frame is sent,
  // the receiver's from recvmsg until it is mapped. Both held here across the exec.
  std::vector<float> large(20000, 1.0f);
  Encoder e;
  e.encode(large);
  internal::OutgoingFrame frame = internal::finish_frame(std::move(e));
  ASSERT_TRUE(frame.header.flags & internal::kFlagBlob);
  record("message blob (sender)", 0, 1);
  auto [raw_a, raw_b] = internal::ConnectionAccess::socket_pair();
  record("socket_pair()", 2, 0);
  ASSERT_TRUE(internal::send_frame(raw_a.native_handle(), frame, std::nullopt));
  std::vector<std::byte> buffer(internal::kMaxInlineFrame);
  internal::Received blob = internal::receive_message(raw_b.native_handle(), buffer);
  ASSERT_EQ(blob.fds.size(), 1u);
  record("message blob (received)", 0, 1);

  for (const auto& m : made)
    for (const auto& [fd, target] : m.fds)
      EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC) << m.what << ": fd " << fd << " -> " << target;

  // The control: a socket made inheritable on purpose shows up in the child, by number and
  // by target, or the checks below prove nothing.
  const int a_socket = internal::ConnectionAccess::fds(a).at(0);
  const std::string a_target = made[0].fds.at(a_socket);
  int inheritable = ::fcntl(a_socket, F_DUPFD, 200);
  ASSERT_GE(inheritable, 0);
  std::string listing = fds_after_exec();
  EXPECT_TRUE(listed_fds(listing).count(inheritable)) << listing;
  EXPECT_NE(listing.find(" " + std::to_string(inheritable) + " -> " + a_target), std::string::npos)
      << listing;
  ::close(inheritable);

  listing = fds_after_exec();
  const std::set<int> listed = listed_fds(listing);
  for (const auto& m : made) {
    for (const auto& [fd, target] : m.fds) {
      EXPECT_FALSE(listed.count(fd)) << m.what << ": fd " << fd << " survived exec:\n" << listing;
      EXPECT_EQ(listing.find(" -> " + target), std::string::npos)
          << m.what << ": " << target << " survived exec:\n"
          << listing;
    }
  }
  for (int fd : listed)
    EXPECT_TRUE(may_inherit.count(fd) || fd == STDOUT_FILENO) << "fd " << fd << " survived exec:\n"
                                                              << listing;
  internal::unwatch_hangup(watch);  // before a's socket closes
}

}  // namespace
}  // namespace shmtensor
