// The os layer's calls that the layers above it use instead of system calls of their own
// (docs/architecture.md, "os"): eventfds, epoll sets, peeks at a socket's queued datagrams,
// the library's own threads, CPU affinity, private futexes, the coarse clock, file kinds,
// paths, shared libraries, and the fork generation the fork handlers keep.
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "os/clock.h"
#include "os/epoll.h"
#include "os/event_fd.h"
#include "os/futex.h"
#include "os/poll.h"
#include "os/private_dir.h"
#include "os/proc.h"
#include "os/shared_library.h"
#include "os/shm.h"
#include "os/socket.h"
#include "os/thread.h"
#include "os/unique_fd.h"
#include "shmtensor/error.h"
#include "support/expect_error.h"
#include "support/leak_check.h"

namespace shmtensor::internal {
namespace {

using testing::run_in_child;

class OsSeamTest : public testing::LeakCheckedTest {};

std::span<const std::byte> bytes_of(const char* s) {
  return {reinterpret_cast<const std::byte*>(s), std::strlen(s)};
}

bool send_text(int sock, const char* text, std::span<const int> fds = {}) {
  const std::span<const std::byte> parts[1] = {bytes_of(text)};
  return send_message(sock, parts, fds);
}

TEST_F(OsSeamTest, AnEventFdIsReadableFromItsSignalUntilItIsDrained) {
  UniqueFd fd = make_event_fd();
  const int fds[1] = {fd.get()};
  EXPECT_TRUE(wait_readable(fds, std::chrono::nanoseconds(0)).empty());
  signal_event_fd(fd.get());
  signal_event_fd(fd.get());
  EXPECT_EQ(wait_readable(fds, std::chrono::nanoseconds(0)).size(), 1u);
  drain_event_fd(fd.get());
  EXPECT_TRUE(wait_readable(fds, std::chrono::nanoseconds(0)).empty());
  EXPECT_EQ(fd_target(fd.get()), "anon_inode:[eventfd]");
  EXPECT_NE(::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, 0);
  EXPECT_TRUE(try_make_event_fd().valid());
}

TEST_F(OsSeamTest, MakeEventFdAtTheFdLimitThrowsSystemErrorWithItsContextAndAdvice) {
  EXPECT_EQ(run_in_child([] {
              // What the test reads of the error, in one place: UBSan's vptr check opens a
              // pipe the first time it meets a (dynamic type, static type) pair, so each read
              // below is made once on a SystemError thrown before the fd limit is lowered.
              struct Seen {
                int code;
                std::string call;
                std::string what;
              };
              const auto seen = [](const auto& make) -> std::optional<Seen> {
                try {
                  make();
                } catch (const SystemError& e) {
                  return Seen{e.error_code(), e.syscall(), e.what()};
                }
                return std::nullopt;
              };
              ASSERT_TRUE(seen([] { throw SystemError(EMFILE, "eventfd", "warm-up"); }));
              const rlimit none{0, 0};
              ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &none), 0);
              const std::optional<Seen> e = seen(
                  [] { (void)make_event_fd("a queue's readiness fd", "raise `ulimit -n`"); });
              ASSERT_TRUE(e.has_value()) << "no error";
              EXPECT_EQ(e->code, EMFILE);
              EXPECT_EQ(e->call, "eventfd");
              EXPECT_EQ(e->what, "eventfd(a queue's readiness fd): " +
                                     std::string(std::strerror(EMFILE)) + " — raise `ulimit -n`");
              EXPECT_FALSE(try_make_event_fd().valid());
              EXPECT_FALSE(try_make_epoll().valid());
            }),
            0);
}

TEST_F(OsSeamTest, RequireEventFdRefusesAnotherKindOfFdAndABlockingEventFd) {
  UniqueFd good = make_event_fd();
  require_event_fd(good.get(), "queue readiness");
  auto [a, b] = seqpacket_pair();
  EXPECT_ERROR(require_event_fd(a.get(), "queue readiness"), ProtocolError,
               "received queue readiness fd is not an eventfd");
  UniqueFd blocking(::eventfd(0, EFD_CLOEXEC));
  ASSERT_TRUE(blocking.valid());
  EXPECT_ERROR(require_event_fd(blocking.get(), "connection readiness"), ProtocolError,
               "received connection readiness eventfd is not non-blocking");
}

TEST_F(OsSeamTest, AnEpollSetReportsTheDataOfEachReadyFd) {
  UniqueFd ep = make_epoll("a test's epoll set");
  UniqueFd ready = make_event_fd();
  UniqueFd quiet = make_event_fd();
  add_to_epoll(ep.get(), ready.get(), kEpollIn, 7, "a test");
  ASSERT_TRUE(try_add_to_epoll(ep.get(), quiet.get(), kEpollIn, 8));
  signal_event_fd(ready.get());
  std::uint64_t data[4] = {};
  ASSERT_EQ(wait_epoll(ep.get(), data), 1);
  EXPECT_EQ(data[0], 7u);
  remove_from_epoll(ep.get(), ready.get());
  remove_from_epoll(ep.get(), ready.get());  // not in the set any more: ignored
  signal_event_fd(quiet.get());
  ASSERT_EQ(wait_epoll(ep.get(), data), 1);
  EXPECT_EQ(data[0], 8u);
}

TEST_F(OsSeamTest, AnEpollSetReportsASocketsHangUpOnceWhenOneShot) {
  UniqueFd ep = make_epoll("a test's epoll set");
  auto [a, b] = seqpacket_pair();
  add_to_epoll(ep.get(), a.get(), kEpollReadHangup | kEpollOneShot, 42, "a test");
  EXPECT_FALSE(hung_up_now(a.get()));
  b.reset();
  std::uint64_t data[1] = {};
  ASSERT_EQ(wait_epoll(ep.get(), data), 1);
  EXPECT_EQ(data[0], 42u);
  EXPECT_TRUE(hung_up_now(a.get()));
}

TEST_F(OsSeamTest, AddingAnFdEpollRefusesThrowsSystemErrorNamingEpollCtl) {
  UniqueFd ep = make_epoll("a test's epoll set");
  try {
    add_to_epoll(ep.get(), -1, kEpollIn, 1, "a test's fd");
    ADD_FAILURE() << "no error";
  } catch (const SystemError& e) {
    EXPECT_EQ(e.error_code(), EBADF);
    EXPECT_EQ(e.syscall(), "epoll_ctl");
    EXPECT_EQ(std::string(e.what()), "epoll_ctl(a test's fd): " + std::string(std::strerror(EBADF)));
  }
  errno = 0;
  EXPECT_FALSE(try_add_to_epoll(ep.get(), -1, kEpollIn, 1));
  EXPECT_EQ(errno, EBADF);
}

TEST_F(OsSeamTest, PeekingAtADatagramsHeadTakesNothing) {
  auto [a, b] = seqpacket_pair();
  char head[4] = {};
  auto head_bytes = std::as_writable_bytes(std::span(head));
  EXPECT_EQ(peek_datagram_head(b.get(), head_bytes, "a test"), std::nullopt);
  ASSERT_TRUE(send_text(a.get(), "0123456789"));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(peek_datagram_head(b.get(), head_bytes, "a test"), std::optional<std::size_t>(4));
    EXPECT_EQ(std::string(head, 4), "0123");
  }
  std::byte buf[64];
  Received r = receive_message(b.get(), buf);
  EXPECT_EQ(r.size, 10u);
  ASSERT_TRUE(send_text(a.get(), ""));  // an empty datagram: 0 bytes, still queued
  EXPECT_EQ(peek_datagram_head(b.get(), head_bytes, "a test"), std::optional<std::size_t>(0));
  EXPECT_EQ(receive_message(b.get(), buf).size, 0u);
  EXPECT_EQ(peek_datagram_head(b.get(), head_bytes, "a test"), std::nullopt);
  UniqueFd not_a_socket = make_event_fd();
  EXPECT_ERROR((void)peek_datagram_head(not_a_socket.get(), head_bytes, "a test's socket"),
               SystemError, "recv(a test's socket)");
}

TEST_F(OsSeamTest, PeekingAtAMessageOwnsCopiesOfItsFdsAndLeavesItQueued) {
  auto [a, b] = seqpacket_pair();
  UniqueFd passed = make_event_fd();
  const int fds[1] = {passed.get()};
  ASSERT_TRUE(send_text(a.get(), "0123456789", fds));
  char head[8] = {};
  std::optional<Peeked> p =
      peek_message(b.get(), std::as_writable_bytes(std::span(head)), "a test");
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->size, 10u);  // the whole length, though 8 bytes were copied
  EXPECT_EQ(std::string(head, 8), "01234567");
  EXPECT_FALSE(p->fds_cut);
  ASSERT_EQ(p->fds.size(), 1u);
  EXPECT_NE(p->fds[0].get(), passed.get());
  EXPECT_EQ(fd_target(p->fds[0].get()), "anon_inode:[eventfd]");
  EXPECT_NE(::fcntl(p->fds[0].get(), F_GETFD) & FD_CLOEXEC, 0);
  std::byte buf[64];
  Received r = receive_message(b.get(), buf);
  EXPECT_EQ(r.size, 10u);
  EXPECT_EQ(r.fds.size(), 1u);
  EXPECT_EQ(peek_message(b.get(), std::as_writable_bytes(std::span(head)), "a test"),
            std::nullopt);
}

TEST_F(OsSeamTest, APeekOffsetStartsAPeekAtTheDatagramThere) {
  if (!peek_offset_works()) GTEST_SKIP() << "this kernel does not peek at an offset";
  auto [a, b] = seqpacket_pair();
  ASSERT_TRUE(send_text(a.get(), "abc"));
  ASSERT_TRUE(send_text(a.get(), "defgh"));
  char head[8] = {};
  auto head_bytes = std::as_writable_bytes(std::span(head));
  set_peek_offset(b.get(), 3, "a test");
  std::optional<Peeked> p = peek_message(b.get(), head_bytes, "a test");
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(std::string(head, p->size), "defgh");
  clear_peek_offset(b.get());
  p = peek_message(b.get(), head_bytes, "a test");
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(std::string(head, p->size), "abc");
  UniqueFd not_a_socket = make_event_fd();
  EXPECT_ERROR(set_peek_offset(not_a_socket.get(), 0, "a depot"), SystemError,
               "setsockopt(SO_PEEK_OFF)(a depot)");
}

struct ThreadSeen {
  bool int_blocked = false;
  bool term_blocked = false;
  char name[16] = {};
};

void* look_around(void* arg) {
  auto* seen = static_cast<ThreadSeen*>(arg);
  sigset_t mask;
  ::pthread_sigmask(SIG_SETMASK, nullptr, &mask);
  seen->int_blocked = sigismember(&mask, SIGINT) == 1;
  seen->term_blocked = sigismember(&mask, SIGTERM) == 1;
  ::pthread_getname_np(::pthread_self(), seen->name, sizeof seen->name);
  return nullptr;
}

TEST_F(OsSeamTest, AStartedThreadBlocksEverySignalAndHasItsName) {
  sigset_t before, after;
  ::pthread_sigmask(SIG_SETMASK, nullptr, &before);
  ThreadSeen seen;
  ThreadHandle handle;
  ASSERT_TRUE(start_thread(look_around, &seen, 64 * 1024, "shmtensor-test", &handle));
  join_thread(handle);
  EXPECT_TRUE(seen.int_blocked);
  EXPECT_TRUE(seen.term_blocked);
  EXPECT_STREQ(seen.name, "shmtensor-test");
  ::pthread_sigmask(SIG_SETMASK, nullptr, &after);
  EXPECT_EQ(sigismember(&after, SIGINT), sigismember(&before, SIGINT));
}

TEST_F(OsSeamTest, AThreadPinnedToOneCpuMayNotRunOnSeveral) {
  EXPECT_EQ(run_in_child([] {
              cpu_set_t one;
              CPU_ZERO(&one);
              ASSERT_EQ(::sched_getaffinity(0, sizeof one, &one), 0);
              const bool several = CPU_COUNT(&one) > 1;
              EXPECT_EQ(may_run_on_several_cpus(), several);
              for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
                if (!CPU_ISSET(cpu, &one)) continue;
                CPU_ZERO(&one);
                CPU_SET(cpu, &one);
                break;
              }
              ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
              EXPECT_FALSE(may_run_on_several_cpus());
            }),
            0);
}

TEST_F(OsSeamTest, APrivateFutexWakesItsSleeper) {
  std::atomic<std::uint32_t> word{0};
  futex_wait_private(&word, 1);  // not 1: returns at once
  std::thread sleeper([&] {
    while (word.load() == 0) futex_wait_private(&word, 0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  word.store(1);
  futex_wake_private(&word, 1);
  sleeper.join();
  EXPECT_EQ(word.load(), 1u);
}

TEST_F(OsSeamTest, TheCoarseClockFollowsTheMonotonicClockToATick) {
  const auto fine = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  const std::int64_t first = coarse_monotonic_ns();
  const std::int64_t now = fine();
  EXPECT_LE(first, now);
  EXPECT_GT(first, now - 100'000'000);  // a tick is a few ms
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_GT(coarse_monotonic_ns(), first);
}

TEST_F(OsSeamTest, FileKindTellsSocketsPipesFilesAndDirectoriesApart) {
  auto [a, b] = seqpacket_pair();
  EXPECT_EQ(file_kind(a.get()), FileKind::kSocket);
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  EXPECT_EQ(file_kind(r.get()), FileKind::kFifo);
  UniqueFd file = create_sealed_memfd(64);
  EXPECT_EQ(file_kind(file.get()), FileKind::kRegular);
  UniqueFd dir(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  EXPECT_EQ(file_kind(dir.get()), FileKind::kDirectory);
  UniqueFd event = make_event_fd();
  EXPECT_EQ(file_kind(event.get()), FileKind::kOther);
  EXPECT_EQ(file_kind(-1), FileKind::kUnknown);
}

TEST_F(OsSeamTest, PathsResolveAndFdsAreFoundByWhatTheyLinkTo) {
  char dir[] = "/tmp/shmtensor_os_seam_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string real = real_path(dir);
  ASSERT_FALSE(real.empty());
  EXPECT_EQ(real_path(std::string(dir) + "/../" + (std::strrchr(dir, '/') + 1)), real);
  EXPECT_EQ(real_path(std::string(dir) + "/missing"), "");
  const std::string file = real + "/linked";
  {
    UniqueFd fd(::open(file.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
    ASSERT_TRUE(fd.valid());
    EXPECT_TRUE(has_fd_linking_to(file));
  }
  EXPECT_FALSE(has_fd_linking_to(file));
  EXPECT_TRUE(remove_file(file));
  EXPECT_EQ(::rmdir(dir), 0);
}

TEST_F(OsSeamTest, ALoadedLibraryGivesItsSymbolsAndAMissingOneItsReason) {
  std::string why;
  void* libc = load_library("libc.so.6", &why);
  ASSERT_NE(libc, nullptr) << why;
  EXPECT_NE(library_symbol(libc, "getpid"), nullptr);
  EXPECT_EQ(library_symbol(libc, "shmtensor_no_such_symbol"), nullptr);
  EXPECT_EQ(load_library("libshmtensor_no_such_library.so", &why), nullptr);
  EXPECT_NE(why.find("libshmtensor_no_such_library.so"), std::string::npos) << why;
}

TEST_F(OsSeamTest, AForkedChildCountsOneGenerationMore) {
  const std::uint32_t parent = fork_generation();
  EXPECT_EQ(run_in_child([parent] {
              EXPECT_EQ(fork_generation(), parent + 1);
              EXPECT_EQ(run_in_child([parent] { EXPECT_EQ(fork_generation(), parent + 2); }), 0);
            }),
            0);
  EXPECT_EQ(fork_generation(), parent);
}

}  // namespace
}  // namespace shmtensor::internal
