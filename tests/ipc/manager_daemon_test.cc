// The manager daemon with real processes: it starts on first file_system use in a session
// of its own, removes the names of SIGKILLed processes while others live on, is replaced
// when killed (and the new one sweeps), is not displaced by a second daemon, drops only
// the connection that sends garbage, refuses other uids, and at its open-file limit refuses
// a new connection saying why.
#include <dirent.h>
#include <gmock/gmock.h>
#include <sys/fsuid.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include "ipc/manager_test_util.h"
#include "manager/protocol.h"
#include "manager/segments.h"
#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "os/private_dir.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/queue.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"

namespace shmtensor {
namespace {

using internal::Segment;
using testing::fork_child;
using testing::wait_child;
using namespace testing::manager_test;
namespace mgr = internal::manager;

// A raw client socket connected to the daemon's socket (no hello sent).
int raw_connect(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// recv on a raw connection: the bytes, "" at EOF, "TIMEOUT" if nothing came. A reset (the
// daemon closed with our hello unread) is reported once, before what it sent: read on.
std::string raw_recv(int fd) {
  char buf[2048];
  ssize_t n = ::recv(fd, buf, sizeof buf, 0);
  if (n < 0 && errno == ECONNRESET) n = ::recv(fd, buf, sizeof buf, 0);
  if (n < 0) return errno == EAGAIN ? "TIMEOUT" : "ERROR";
  return std::string(buf, static_cast<std::size_t>(n));
}

// In a child: creates `count` named segments, reports their names once the daemon has read
// (and journaled) their registrations, then waits for SIGKILL. A registration is one-way:
// without the sync, a test that kills the daemon right after reading the names could kill
// it before it read them, and its successor would adopt them under the documented limit
// L2 of cleanup.md (kept until the creator's process group, the test's, ends). CI's ASan
// run once failed KilledDaemonIsReplacedAndTheNewOneSweepsOrphans that way.
pid_t child_holding_segments(int count, Pipe& names, std::vector<Storage>* inherited = nullptr) {
  return fork_child([&names, count, inherited] {
    if (inherited) inherited->clear();  // not these: the test wants only the new ones held
    std::vector<Storage> keep;
    for (int i = 0; i < count; ++i) {
      keep.push_back(Storage::allocate_shared(4096 * (i + 1)));
      std::memset(keep.back().data(), i + 1, keep.back().nbytes());
    }
    mgr::sync();
    for (const auto& s : keep) names.send_line(segment_name(s));
    for (;;) ::pause();
  });
}

std::vector<std::string> receive_names(Pipe& p, int count) {
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) out.push_back(p.receive_line());
  return out;
}

TEST_F(ManagerTest, StartsOnFirstUseInASessionOfItsOwnAndExitsWhenIdle) {
  const auto loc = location();
  ASSERT_FALSE(internal::file_exists(loc.socket_path)) << "a daemon of this group runs already";
  EXPECT_EQ(mgr::connected_daemon_pid(), 0);
  pid_t daemon = 0;
  {
    Storage s = Storage::allocate_shared(4096);
    daemon = mgr::connected_daemon_pid();
    ASSERT_GT(daemon, 0);
    EXPECT_TRUE(process_lives(daemon));
    EXPECT_NE(::getsid(daemon), ::getsid(0)) << "the daemon must leave the caller's session";
    EXPECT_NE(::getpgid(daemon), ::getpgid(0)) << "and its process group (Ctrl-C)";
    EXPECT_NE(internal::read_process_status(daemon).parent, ::getpid());
    EXPECT_NE(::getsid(daemon), daemon) << "nor lead a session (it could take a terminal)";
    struct stat st {};
    ASSERT_EQ(::stat(loc.dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    EXPECT_EQ(st.st_uid, ::geteuid());
    ASSERT_EQ(::stat(loc.socket_path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(mgr::held_name_count(), 1u);
  }
  empty_cache();  // the arena gives its segment back
  EXPECT_EQ(mgr::connected_daemon_pid(), 0) << "a process holding nothing disconnects";
  // Grace 300 ms: it exits, and removes its socket.
  EXPECT_TRUE(eventually([&] { return !process_lives(daemon); })) << "daemon " << daemon;
  EXPECT_FALSE(internal::file_exists(loc.socket_path));
}

TEST_F(ManagerTest, NamesOfASigkilledChildGoWhileTheParentLivesOn) {
  Storage mine = Storage::allocate_shared(8192);
  std::memset(mine.data(), 5, mine.nbytes());
  const std::string my_name = segment_name(mine);
  Pipe names;
  pid_t child = child_holding_segments(3, names);
  auto theirs = receive_names(names, 3);
  for (const auto& n : theirs) ASSERT_TRUE(name_exists(n)) << n;
  EXPECT_EQ(refcount_of(mine), 2) << "the child got its own count at fork";

  ::kill(child, SIGKILL);
  EXPECT_EQ(wait_child(child), 128 + SIGKILL);
  for (const auto& n : theirs)
    EXPECT_TRUE(eventually([&] { return !name_exists(n); }, std::chrono::seconds(3)))
        << n << " outlived its SIGKILLed creator by 3 s";
  // Ours lives on, with the dead child's count taken back.
  mgr::sync();
  EXPECT_TRUE(name_exists(my_name));
  EXPECT_EQ(refcount_of(mine), 1);
  EXPECT_EQ(static_cast<unsigned char*>(mine.data())[8191], 5);
  mine = Storage();
  empty_cache();  // the arena gives its segment back
  EXPECT_FALSE(name_exists(my_name)) << "our drop was the last count: we unlink at once";
}

TEST_F(ManagerTest, ChildThatExitsWithoutReleasingDoesNotPinTheParentsSegment) {
  Storage s = Storage::allocate_shared(4096);
  const std::string name = segment_name(s);
  // _exit with the inherited storage alive: its count is never given back by the child.
  EXPECT_EQ(testing::run_in_child([] {}), 0);
  s = Storage();
  empty_cache();  // the arena gives its segment back
  EXPECT_TRUE(eventually([&] { return !name_exists(name); }, std::chrono::seconds(3)))
      << name << " stayed after its last live holder dropped it";
}

TEST_F(ManagerTest, ChildThatExecsDoesNotPinTheParentsSegment) {
  // exec drops the child's mappings (and the count it got at fork) without a word, and the
  // child lives on as another program.
  Storage s = Storage::allocate_shared(4096);
  const std::string name = segment_name(s);
  pid_t child =
      fork_child([] { ::execl("/bin/sleep", "sleep", "30", static_cast<char*>(nullptr)); });
  // Exec done: /proc/<pid>/comm is set after the old address space is gone.
  ASSERT_TRUE(eventually([&] {
    std::ifstream comm("/proc/" + std::to_string(child) + "/comm");
    std::string c;
    return std::getline(comm, c) && c == "sleep";
  }));
  ASSERT_FALSE(internal::process_maps_shm(child, name));
  s = Storage();
  empty_cache();  // the arena gives its segment back
  EXPECT_TRUE(eventually([&] { return !name_exists(name); }, std::chrono::seconds(3)))
      << name << " stayed while an exec'd child that does not map it lives; journal:\n"
      << internal::read_small_file(location().journal_path);
  EXPECT_TRUE(process_lives(child));
  ::kill(child, SIGKILL);
  wait_child(child);
}

TEST_F(ManagerTest, SegmentSharedWithAKilledChildIsKeptWhileTheParentMapsIt) {
  Storage s = Storage::allocate_shared(4096);
  std::memset(s.data(), 9, s.nbytes());
  const std::string name = segment_name(s);
  Pipe ready;
  pid_t child = fork_child([&] {
    static_cast<char*>(s.data())[0] = 1;
    ready.send();
    for (;;) ::pause();
  });
  ASSERT_EQ(ready.receive(), 'x');
  ::kill(child, SIGKILL);
  wait_child(child);
  mgr::sync();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  mgr::sync();
  EXPECT_TRUE(name_exists(name)) << "the daemon removed a name the parent still maps";
  EXPECT_EQ(static_cast<char*>(s.data())[0], 1);
}

TEST_F(ManagerTest, KilledDaemonIsReplacedAndTheNewOneSweepsOrphans) {
  Pipe names;
  pid_t child = child_holding_segments(2, names);
  auto theirs = receive_names(names, 2);
  // Ours is made after the fork: the child does not hold it (a count leaked while no
  // daemon runs would keep the name until its creator, this process, exits).
  Storage mine = Storage::allocate_shared(4096);
  const std::string my_name = segment_name(mine);
  const pid_t first = mgr::connected_daemon_pid();
  ASSERT_GT(first, 0);
  // The daemon first, then the holder. Whichever client notices first (this process or
  // the child, both connected) starts a new daemon, which carries on from the journal;
  // names it does not know it sweeps.
  ::kill(first, SIGKILL);
  ASSERT_TRUE(eventually([&] { return !process_lives(first); }));
  ::kill(child, SIGKILL);
  wait_child(child);

  // Our own names are re-registered with it.
  // (Large: a new segment of its own, which needs the daemon; a small one could come
  // from the arena segment of `mine`.)
  Storage more = Storage::allocate_shared(300 * 1024);
  const pid_t second = mgr::connected_daemon_pid();
  EXPECT_GT(second, 0);
  EXPECT_NE(second, first);
  mgr::sync();
  for (const auto& n : theirs)
    EXPECT_TRUE(eventually([&] { return !name_exists(n); })) << n << " survived the sweep";
  EXPECT_TRUE(name_exists(my_name));
  EXPECT_TRUE(name_exists(segment_name(more)));
  EXPECT_EQ(mgr::held_name_count(), 2u);
  mine = Storage();
  empty_cache();
  EXPECT_FALSE(name_exists(my_name));
}

TEST_F(ManagerTest, MessageInFlightSurvivesItsSendersExitAndADaemonKill) {
  Queue<Tensor> q;
  Pipe daemon_pid;
  pid_t child = fork_child([&] {
    Tensor t = Tensor::full({1024}, 3.0, DType::kFloat32);
    q.put(t);
    // The daemon has read our registration (and journaled it) before it is killed. A kill
    // in the microseconds before that is the case of cleanup.md L2: the name is then kept
    // until this job ends.
    mgr::sync();
    daemon_pid.send_line(std::to_string(mgr::connected_daemon_pid()));
  });  // drops t and exits with the message still queued
  const pid_t daemon = std::stoi(daemon_pid.receive_line());
  EXPECT_EQ(wait_child(child), 0);
  ASSERT_GT(daemon, 0);
  // Kill the daemon once it has taken the dead child's counts back, so that only the
  // message's count is left on the child's names. Killed in the middle of that (after it
  // journaled the release, before the count came off: cleanup.md L3), it would leave a
  // count that keeps the name until this job ends.
  const std::string prefix = "/shmtensor_" + std::to_string(child) + "_";
  EXPECT_TRUE(eventually([&] {
    int found = 0;
    for (const auto& seg : internal::manager::list_segments()) {
      if (seg.name.rfind(prefix, 0) != 0) continue;
      if (seg.facts.refcount != 1) return false;
      ++found;
    }
    return found > 0;
  }));
  ::kill(daemon, SIGKILL);
  ASSERT_TRUE(eventually([&] { return !process_lives(daemon); }));
  // A new daemon carries on from the killed one's journal: the sender is gone, but this
  // process (its process group) may still receive the message.
  Storage other = Storage::allocate_shared(4096);
  EXPECT_NE(mgr::connected_daemon_pid(), daemon);
  mgr::sync();
  Tensor t = q.get();
  ASSERT_EQ(t.numel(), 1024);
  EXPECT_EQ(t.data_ptr<float>()[1023], 3.0f);
}

TEST_F(ManagerTest, SecondDaemonDoesNotStealTheFirstOnesClients) {
  Storage s = Storage::allocate_shared(4096);
  const pid_t first = mgr::connected_daemon_pid();
  const auto loc = location();
  // The first candidate that exists, as the client picks it (the first one, next to the
  // library, is this test program's directory: none there).
  std::string program;
  for (const auto& p : mgr::manager_program_candidates())
    if (program.empty() && internal::file_exists(p)) program = p;
  ASSERT_FALSE(program.empty());
  pid_t second = ::fork();
  if (second == 0) {
    ::execl(program.c_str(), "shmtensor-manager", "--dir", loc.dir.c_str(), "--group",
            loc.group.c_str(), static_cast<char*>(nullptr));
    ::_exit(99);
  }
  EXPECT_EQ(wait_child(second), 3) << "a second daemon must exit with 3 (already running)";
  EXPECT_TRUE(process_lives(first));
  EXPECT_TRUE(internal::file_exists(loc.socket_path));
  // The first one still serves: a killed child's names still go.
  Storage more = Storage::allocate_shared(4096);
  EXPECT_EQ(mgr::connected_daemon_pid(), first);
  Pipe names;
  pid_t child = child_holding_segments(1, names);
  auto theirs = receive_names(names, 1);
  ::kill(child, SIGKILL);
  wait_child(child);
  EXPECT_TRUE(eventually([&] { return !name_exists(theirs[0]); }, std::chrono::seconds(3)));
}

TEST_F(ManagerTest, GarbageDropsOnlyThatConnection) {
  Storage s = Storage::allocate_shared(4096);
  const pid_t daemon = mgr::connected_daemon_pid();
  const auto loc = location();
  {
    int fd = raw_connect(loc.socket_path);
    ASSERT_GE(fd, 0);
    const char junk[] = "GET / HTTP/1.0\r\n\r\n";
    ASSERT_EQ(::send(fd, junk, sizeof junk, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof junk));
    EXPECT_EQ(raw_recv(fd), "") << "garbage must close the connection";
    ::close(fd);
  }
  {
    // A well-formed hello, then a name that tries to leave /dev/shm.
    int fd = raw_connect(loc.socket_path);
    ASSERT_GE(fd, 0);
    mgr::MessageHeader h{};
    mgr::encode_header(mgr::MessageType::kHello, 1, 0, &h);
    ASSERT_EQ(::send(fd, &h, sizeof h, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof h));
    std::string ack = raw_recv(fd);
    ASSERT_EQ(ack.size(), sizeof h);
    std::string bad(reinterpret_cast<const char*>(&h), sizeof h);
    reinterpret_cast<mgr::MessageHeader*>(bad.data())->type =
        static_cast<std::uint16_t>(mgr::MessageType::kRegisterCreated);
    bad += std::string("/shmtensor_../../etc/passwd") + '\0';
    ASSERT_EQ(::send(fd, bad.data(), bad.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bad.size()));
    EXPECT_EQ(raw_recv(fd), "");
    ::close(fd);
  }
  // The daemon and our connection are fine.
  EXPECT_TRUE(process_lives(daemon));
  Storage more = Storage::allocate_shared(4096);
  EXPECT_EQ(mgr::connected_daemon_pid(), daemon);
  mgr::sync();
  Pipe names;
  pid_t child = child_holding_segments(1, names);
  auto theirs = receive_names(names, 1);
  ::kill(child, SIGKILL);
  wait_child(child);
  EXPECT_TRUE(eventually([&] { return !name_exists(theirs[0]); }, std::chrono::seconds(3)));
}

// At its open-file limit the daemon refuses a new connection and says why, instead of
// leaving it pending (the client waited for its deadline, and the daemon's loop spun on a
// listener it could not accept from); connections that close make room again.
TEST_F(ManagerTest, AtItsOpenFileLimitTheDaemonRefusesSayingWhyAndRecovers) {
  const auto loc = location();
  Pipe started;
  // The daemon this client starts inherits its hard limit of 64 fds.
  const pid_t starter = fork_child([&] {
    const rlimit lim{64, 64};
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) std::_Exit(2);
    Storage s = Storage::allocate_shared(4096);
    mgr::sync();
    started.send_line(std::to_string(mgr::connected_daemon_pid()));
    for (;;) ::pause();
  });
  const pid_t daemon = std::stoi(started.receive_line());
  // A hello on a new connection: the daemon's reply. `strict`: a hello that cannot be sent
  // or gets no reply is a failure; else it is an empty Message (the daemon, still at its
  // limit, closed the connection before it read the hello: the caller tries again).
  auto greet = [&](int* kept, bool strict = true) -> mgr::Message {
    int fd = raw_connect(loc.socket_path);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    *kept = fd;
    mgr::MessageHeader h{};
    mgr::encode_header(mgr::MessageType::kHello, 1, 0, &h);
    const ssize_t sent = ::send(fd, &h, sizeof h, MSG_NOSIGNAL);
    if (!strict && sent != static_cast<ssize_t>(sizeof h)) return {};
    // At its limit the daemon may accept, refuse and close before the hello is sent (EPIPE):
    // its refusal is still there to read.
    if (sent != static_cast<ssize_t>(sizeof h))
      EXPECT_TRUE(errno == EPIPE || errno == ECONNRESET) << std::strerror(errno);
    const std::string reply = raw_recv(fd);
    if (reply.size() < sizeof(mgr::MessageHeader)) {
      if (strict) ADD_FAILURE() << "no reply: " << reply;
      return {};
    }
    return mgr::decode(reply.data(), reply.size());
  };
  std::vector<int> open;
  std::string refusal;
  for (int i = 0; i < 200 && refusal.empty() && !HasFailure(); ++i) {
    int fd = -1;
    const mgr::Message m = greet(&fd);
    if (m.type == mgr::MessageType::kHelloAck) {
      open.push_back(fd);
      continue;
    }
    EXPECT_EQ(m.type, mgr::MessageType::kRefused);
    refusal = m.text;
    char byte;  // closed after the refusal: the end, or a reset (our hello was not read)
    const ssize_t n = ::recv(fd, &byte, 1, 0);
    EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << n << " " << std::strerror(errno);
    ::close(fd);
  }
  EXPECT_THAT(refusal, ::testing::HasSubstr("manager is at its open-file limit (64 fds"));
  EXPECT_GT(open.size(), 20u);  // it served until its fds ran out
  EXPECT_LT(open.size(), 64u);
  // Room again once some connections close.
  for (int i = 0; i < 4; ++i) {
    ::close(open.back());
    open.pop_back();
  }
  bool served = false;
  for (int attempt = 0; attempt < 50 && !served && !HasFailure(); ++attempt) {
    int fd = -1;
    const mgr::Message m = greet(&fd, false);
    served = m.type == mgr::MessageType::kHelloAck;
    ::close(fd);
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(served);
  EXPECT_TRUE(process_lives(daemon));
  for (int fd : open) ::close(fd);
  ::kill(starter, SIGKILL);
  wait_child(starter);
}

TEST_F(ManagerTest, PeerOfAnotherUidIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
  Storage s = Storage::allocate_shared(4096);
  const auto loc = location();
  Pipe result;
  pid_t child = fork_child([&] {
    // euid 65534 (what SO_PEERCRED reports), fsuid 0 (so the 0700 directory can still be
    // entered: this tests the daemon's check, not the directory's).
    ASSERT_EQ(::setresuid(0, 65534, 0), 0) << std::strerror(errno);
    ::setfsuid(0);
    int fd = raw_connect(loc.socket_path);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    std::string reply = raw_recv(fd);
    ::close(fd);
    ASSERT_GE(reply.size(), sizeof(mgr::MessageHeader));
    mgr::Message m = mgr::decode(reply.data(), reply.size());
    result.send_line(std::to_string(static_cast<int>(m.type)) + " " + m.text);
  });
  std::string line = result.receive_line();
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(line.substr(0, line.find(' ')),
            std::to_string(static_cast<int>(mgr::MessageType::kRefused)))
      << line;
  EXPECT_NE(line.find("uid 65534"), std::string::npos) << line;
}

TEST_F(ManagerTest, ReceiverThatOpensANameIsAHolderToo) {
  // A child opens the parent's name as a receiver does (its own count, then the message's
  // count given back) and is SIGKILLed: its count is taken back, so the parent's drop
  // unlinks at once.
  Pipe message, ready;
  pid_t child = fork_child([&] {
    std::string name = message.receive_line();
    std::uint64_t uid = std::stoull(message.receive_line());
    auto opened = Segment::attach_name(name, uid);
    opened->drop_in_flight_count();  // what the decoder does once the message proved it
    ready.send();
    for (;;) ::pause();
  });
  auto seg = Segment::create(SharingStrategy::kFileSystem, 4096, 1, internal::SegmentKind::kDedicated);
  const std::string name = seg->name();
  seg->add_in_flight_count();  // the count the "message" carries
  message.send_line(name);
  message.send_line(std::to_string(seg->uid()));
  ASSERT_EQ(ready.receive(), 'x');
  EXPECT_EQ(seg->header()->refcount.load(), 2);
  ::kill(child, SIGKILL);
  wait_child(child);
  ASSERT_TRUE(eventually([&] { return seg->header()->refcount.load() == 1; }))
      << "refcount " << seg->header()->refcount.load();
  seg.reset();
  EXPECT_FALSE(name_exists(name));
}

TEST_F(ManagerTest, StartingTheDaemonLeavesTheStarterNoChild) {
  int rc = testing::run_in_child([&] {
    Storage s = Storage::allocate_shared(4096);
    const pid_t daemon = mgr::connected_daemon_pid();
    ASSERT_GT(daemon, 0);
    // The process spawn_detached started exited (the daemon is its child) and was reaped.
    int status = 0;
    errno = 0;
    EXPECT_EQ(::waitpid(-1, &status, WNOHANG), -1);
    EXPECT_EQ(errno, ECHILD);
    EXPECT_NE(internal::read_process_status(daemon).parent, ::getpid());
  });
  EXPECT_EQ(rc, 0);
}

// The starter's fd 0 closed (the notify pipe's read end takes it, and its write end goes
// to fd 3 in the process spawned), SIGCHLD ignored (that process is reaped by the kernel),
// and an fd without close-on-exec open: the daemon starts and reports, has /dev/null as
// its stdin and stdout and its log as stderr, and holds nothing of the starter's.
TEST_F(ManagerTest, TheDaemonStartsFromAStarterWithoutStdinIgnoringSigchldAndHoldsNoneOfItsFds) {
  char marker[] = "/tmp/shmtensor-leak-XXXXXX";
  const int marker_fd = ::mkstemp(marker);  // no O_CLOEXEC
  ASSERT_GE(marker_fd, 0);
  int rc = testing::run_in_child([&] {
    ::close(STDIN_FILENO);
    ::signal(SIGCHLD, SIG_IGN);
    Storage s = Storage::allocate_shared(4096);
    const pid_t daemon = mgr::connected_daemon_pid();
    ASSERT_GT(daemon, 0);
    const std::string fds = "/proc/" + std::to_string(daemon) + "/fd/";
    for (int fd = 0; fd < 3; ++fd) {
      char target[256] = {};
      ASSERT_GT(::readlink((fds + std::to_string(fd)).c_str(), target, sizeof target - 1), 0);
      // stderr: the daemon's log, which it opens there itself (manager.md, "Where it lives").
      EXPECT_EQ(target, fd == 2 ? location().log_path : "/dev/null") << "fd " << fd;
    }
    DIR* dir = ::opendir(fds.c_str());
    ASSERT_NE(dir, nullptr);
    while (dirent* e = ::readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      char target[256] = {};
      ::readlink((fds + e->d_name).c_str(), target, sizeof target - 1);
      EXPECT_STRNE(target, marker) << "the daemon holds the starter's fd " << e->d_name;
    }
    ::closedir(dir);
  });
  EXPECT_EQ(rc, 0);
  ::close(marker_fd);
  ::unlink(marker);
}

TEST_F(ManagerTest, ADaemonProgramThatCannotBeExecutedIsAnErrorSayingWhy) {
  char dir_template[] = "/tmp/shmtensor-noexec-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string program = dir + "/shmtensor-manager";
  {
    std::FILE* f = std::fopen(program.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("#!/bin/sh\nexit 0\n", f);
    std::fclose(f);
  }
  ASSERT_EQ(::chmod(program.c_str(), 0644), 0);  // no execute bit: EACCES, for root too
  int rc = testing::run_in_child([&] {
    ::setenv("SHMTENSOR_MANAGER", program.c_str(), 1);
    try {
      Storage s = Storage::allocate_shared(4096);
      ADD_FAILURE() << "created a named segment without a manager";
    } catch (const Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find(program + " (cannot execute: " + std::strerror(EACCES) + ")"),
                std::string::npos) << what;
    }
    EXPECT_TRUE(testing::shm_names_of(::getpid()).empty()) << "a name was created anyway";
    int status = 0;
    EXPECT_EQ(::waitpid(-1, &status, WNOHANG), -1) << "a child was left to reap";
  });
  EXPECT_EQ(rc, 0);
  ::unlink(program.c_str());
  ::rmdir(dir.c_str());
}

TEST_F(ManagerTest, DaemonThatCannotBeFoundIsAnErrorSayingWhereItLooked) {
  const std::string bogus = "/nonexistent/bin/shmtensor-manager";
  int rc = testing::run_in_child([&] {
    ::setenv("SHMTENSOR_MANAGER", bogus.c_str(), 1);
    try {
      Storage s = Storage::allocate_shared(4096);
      ADD_FAILURE() << "created a named segment without a manager";
    } catch (const Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("cannot start shmtensor-manager"), std::string::npos) << what;
      EXPECT_NE(what.find(bogus + " (does not exist)"), std::string::npos) << what;
      EXPECT_NE(what.find("SHMTENSOR_MANAGER"), std::string::npos) << what;
      EXPECT_NE(what.find("file_descriptor"), std::string::npos) << what;
    }
    EXPECT_TRUE(testing::shm_names_of(::getpid()).empty()) << "a name was created anyway";
    EXPECT_EQ(mgr::held_name_count(), 0u);
  });
  EXPECT_EQ(rc, 0);
}

TEST_F(ManagerTest, ThreadsCreatingAndForkingConcurrentlyLeaveNothing) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < 100; ++i) {
          Storage s = Storage::allocate_shared(4096 + 64 * t);
          static_cast<char*>(s.data())[0] = static_cast<char>(i);
          if (t == 0 && i % 10 == 0) {
            // Forks while the other threads register and release.
            if (testing::run_in_child([] {}) != 0) ++failures;
          }
        }
      } catch (const std::exception& e) {
        ++failures;
        ADD_FAILURE() << e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  empty_cache();  // the children are gone: their holds are taken back, the segments go
  EXPECT_EQ(mgr::held_name_count(), 0u);
}

}  // namespace
}  // namespace shmtensor
