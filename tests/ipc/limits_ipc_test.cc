// Limits of the machine, hit for real in a child process: a tiny /dev/shm (in a private
// mount namespace), the open-file limit, an impossible mapping. Each must be a clear
// exception that says what to do, with nothing left behind — never a SIGBUS.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/inotify.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <string>
#include <vector>

#include "memory/arena.h"
#include "os/limits.h"
#include "os/shm.h"
#include "shmtensor/error.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/queue.h"
#include "shmtensor/storage.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

constexpr int kSkipExit = 77;
constexpr std::size_t kMiB = 1 << 20;

bool contains(const std::string& text, const std::string& words) {
  return text.find(words) != std::string::npos;
}

// Entries of /dev/shm (as this process's mount namespace sees it), "." and ".." excluded.
std::vector<std::string> dev_shm_entries() {
  std::vector<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
        out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

class LimitsTest : public testing::StrategyRestoringTest {
 protected:
  // Runs fn in a forked child. The child may call skip(reason): the parent then skips the
  // test with that reason.
  void run_or_skip(const std::function<void()>& fn) {
    ASSERT_EQ(::pipe2(reason_pipe_, O_CLOEXEC), 0);
    int rc = testing::run_in_child(fn);
    ::close(reason_pipe_[1]);
    char buf[512] = {};
    ssize_t n = ::read(reason_pipe_[0], buf, sizeof buf - 1);
    ::close(reason_pipe_[0]);
    if (rc == kSkipExit) GTEST_SKIP() << std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
    EXPECT_EQ(rc, 0) << "the child failed; its messages are above";
  }
  [[noreturn]] void skip(const std::string& reason) {
    ssize_t ignored = ::write(reason_pipe_[1], reason.data(), reason.size());
    (void)ignored;
    ::_exit(kSkipExit);
  }

  // In a run_or_skip child: a private mount namespace (on the first call) with a tmpfs of
  // `options` on /dev/shm. Skips the test without CAP_SYS_ADMIN; false after another
  // failure (already reported).
  bool mount_dev_shm(const char* options) {
    auto fail_or_skip = [&](const char* what) {
      int err = errno;
      std::string reason = std::string(what) + ": " + std::strerror(err) +
                           " (needs CAP_SYS_ADMIN, e.g. root outside an unprivileged container)";
      if (err == EPERM || err == EACCES) skip(reason);
      ADD_FAILURE() << reason;
      return false;
    };
    if (!private_ns_) {
      if (::unshare(CLONE_NEWNS) != 0) return fail_or_skip("unshare(CLONE_NEWNS)");
      // Private propagation: the tmpfs below must not appear in the parent's namespace.
      if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
        return fail_or_skip("mount(MS_REC|MS_PRIVATE)");
      private_ns_ = true;
    }
    if (::mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, options) != 0)
      return fail_or_skip("mount tmpfs on /dev/shm");
    return true;
  }

 private:
  bool private_ns_ = false;
  int reason_pipe_[2] = {-1, -1};
};

// A private mount namespace with a 1 MiB tmpfs on /dev/shm, as in a container started
// with a small --shm-size.
TEST_F(LimitsTest, TinyDevShmIsAClearErrorNotASigbus) {
  run_or_skip([&] {
    if (!mount_dev_shm("size=1m,mode=1777")) return;
    ASSERT_TRUE(dev_shm_entries().empty());

    set_sharing_strategy("file_system");
    {
      // The control: what fits, works (the arena's segment shrinks to what fits), and is
      // unlinked once the arena gives it back.
      Storage small = Storage::allocate_shared(256 * 1024);
      std::memset(small.data(), 1, small.nbytes());
      EXPECT_EQ(dev_shm_entries().size(), 1u);
    }
    empty_cache();
    EXPECT_TRUE(dev_shm_entries().empty());

    try {
      Storage big = Storage::allocate_shared(4 * kMiB);
      std::memset(big.data(), 1, big.nbytes());  // would be the SIGBUS without fallocate
      ADD_FAILURE() << "4 MiB fit in a 1 MiB /dev/shm";
    } catch (const SharedMemoryFullError& e) {
      const std::string what = e.what();
      EXPECT_GE(e.requested(), 4 * kMiB);
      // The payload plus one page for the header, holder slots and block word.
      EXPECT_LE(e.requested(), 4 * kMiB + 4096);
      EXPECT_EQ(e.available(), 1 * kMiB);
      EXPECT_TRUE(contains(what, "4.0 MiB")) << what;
      EXPECT_TRUE(contains(what, std::to_string(e.requested()))) << what;
      EXPECT_TRUE(contains(what, "1.0 MiB free")) << what;
      EXPECT_TRUE(contains(what, "--shm-size")) << what;
      EXPECT_TRUE(contains(what, "file_descriptor")) << what;
    }
    // share_memory_ fails the same way and leaves the storage private and intact.
    Storage priv = Storage::allocate(4 * kMiB);
    std::memset(priv.data(), 9, priv.nbytes());
    void* before = priv.data();
    EXPECT_ERROR(priv.share_memory_(), SharedMemoryFullError,
                 "/dev/shm is too small for a file_system segment");
    EXPECT_FALSE(priv.is_shared());
    EXPECT_EQ(priv.data(), before);
    EXPECT_EQ(static_cast<unsigned char*>(priv.data())[4 * kMiB - 1], 9);
    EXPECT_TRUE(dev_shm_entries().empty()) << "a failed allocation left a name behind";

    // memfd segments do not live in /dev/shm: the same 4 MiB works with file_descriptor.
    set_sharing_strategy("file_descriptor");
    Storage big = Storage::allocate_shared(4 * kMiB);
    std::memset(big.data(), 3, big.nbytes());  // touch every page
    EXPECT_EQ(static_cast<unsigned char*>(big.data())[4 * kMiB - 1], 3);
    priv.share_memory_();
    EXPECT_TRUE(priv.is_shared());
    EXPECT_EQ(static_cast<unsigned char*>(priv.data())[4 * kMiB - 1], 9);
    EXPECT_TRUE(dev_shm_entries().empty());
  });
}

TEST_F(LimitsTest, OutOfFdsIsASystemErrorWithAdvice) {
#if defined(__SANITIZE_ADDRESS__)
  // Our ASan build is ASan+UBSan. UBSan's vptr check probes memory through a pipe
  // (sanitizer_common's IsAccessibleMemoryRange in GCC 12), so at the fd limit it reports
  // every virtual object as invalid, the SystemError being thrown included. The plain and
  // TSan builds run this test.
  GTEST_SKIP() << "UBSan's vptr check needs free fds; runs in the plain and TSan builds";
#endif
  run_or_skip([&] {
    rlimit rl{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
    rl.rlim_cur = 64;
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &rl), 0) << std::strerror(errno);
    std::vector<int> filler;
    for (;;) {
      int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        ASSERT_EQ(errno, EMFILE);
        break;
      }
      filler.push_back(fd);
      ASSERT_LT(filler.size(), 100u);
    }

    try {
      Storage s = Storage::allocate_shared(4096);
      ADD_FAILURE() << "allocated a memfd segment with no fd left";
    } catch (const SystemError& e) {
      EXPECT_EQ(e.error_code(), EMFILE);
      EXPECT_EQ(e.syscall(), "memfd_create");
      EXPECT_TRUE(contains(e.what(), "memfd_create(")) << e.what();
      EXPECT_TRUE(contains(e.what(), "ulimit -n")) << e.what();
    }
    Storage priv = Storage::allocate(4096);
    std::memset(priv.data(), 5, 4096);
    EXPECT_ERROR(priv.share_memory_(), SystemError, "this process is at its open-file limit");
    EXPECT_FALSE(priv.is_shared());
    EXPECT_EQ(static_cast<unsigned char*>(priv.data())[4095], 5);

    // file_system needs an fd for a moment too (shm_open); nothing is left behind.
    set_sharing_strategy("file_system");
    try {
      Storage s = Storage::allocate_shared(4096);
      ADD_FAILURE() << "allocated a named segment with no fd left";
    } catch (const SystemError& e) {
      EXPECT_EQ(e.error_code(), EMFILE);
      EXPECT_TRUE(contains(e.what(), "ulimit -n")) << e.what();
    }
    EXPECT_TRUE(testing::shm_names_of(::getpid()).empty());

    // Once fds are free again, everything works.
    for (int fd : filler) ::close(fd);
    set_sharing_strategy("file_descriptor");
    priv.share_memory_();
    EXPECT_TRUE(priv.is_shared());
    EXPECT_EQ(static_cast<unsigned char*>(priv.data())[4095], 5);
  });
}

// A size no address space can map: ftruncate of the memfd succeeds (it is sparse), mmap
// fails. The error carries ENOMEM and the advice, and the memfd is closed again.
// The manager daemon raises its own soft open-file limit to the hard one at start: it holds
// the fds of every named channel and kept pickle of the user.
TEST_F(LimitsTest, RaiseOpenFilesLimitTakesTheSoftLimitToTheHardOne) {
  run_or_skip([&] {
    rlimit rl{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max <= 64) skip("the hard open-file limit is 64");
    rl.rlim_cur = 64;
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &rl), 0) << std::strerror(errno);
    const std::uint64_t now = internal::raise_open_files_limit();
    rlimit after{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &after), 0);
    EXPECT_EQ(after.rlim_cur, rl.rlim_max);
    EXPECT_EQ(now, rl.rlim_max == RLIM_INFINITY ? UINT64_MAX
                                                 : static_cast<std::uint64_t>(rl.rlim_max));
  });
}

TEST_F(LimitsTest, UnmappableSizeIsASystemError) {
  const std::size_t huge = std::size_t{1} << 48;  // 256 TiB > the x86-64/arm64 user space
  try {
    Storage s = Storage::allocate_shared(huge);
    ADD_FAILURE() << "mapped 256 TiB";
  } catch (const SystemError& e) {
    EXPECT_EQ(e.error_code(), ENOMEM);
    EXPECT_EQ(e.syscall(), "mmap");
    EXPECT_TRUE(contains(e.what(), "vm.max_map_count")) << e.what();
  }
  // file_system reserves the space first: the same size is a full /dev/shm.
  set_sharing_strategy("file_system");
  EXPECT_ERROR((void)Storage::allocate_shared(huge), SharedMemoryFullError,
               "/dev/shm is too small for a file_system segment");
}

// The sizes in these messages, exact, without iostreams or the locale (src/os/shm.cc).
TEST(HumanBytes, RoundsToTheNearestTenthOfTheLargestUnitUpToTiB) {
  using internal::human_bytes;
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(1023), "1023 B");
  EXPECT_EQ(human_bytes(1024), "1.0 KiB");
  EXPECT_EQ(human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(human_bytes(std::uint64_t{4} << 20), "4.0 MiB");
  EXPECT_EQ(human_bytes((std::uint64_t{1} << 20) - 1), "1024.0 KiB");
  EXPECT_EQ(human_bytes(std::uint64_t{129} << 30), "129.0 GiB");
  EXPECT_EQ(human_bytes(std::uint64_t{1} << 50), "1024.0 TiB");
  EXPECT_EQ(human_bytes(~std::uint64_t{0}), "16777216.0 TiB");
}

// More than a limited /dev/shm has free is refused before a name is made: posix_fallocate
// would take every free page of the tmpfs (RAM) before failing, pressing the whole machine
// for memory (on a GPU machine with 128 GiB of /dev/shm, the process died of it). In a
// private mount namespace with an 8 MiB tmpfs on /dev/shm, an inotify watch sees that no
// name is created for 16 MiB; then, on a tmpfs with no limit (size=0, which reports 0
// blocks), the same 16 MiB work.
TEST_F(LimitsTest, MoreThanDevShmHasFreeIsRefusedBeforeANameIsMade) {
  run_or_skip([&] {
    if (!mount_dev_shm("size=8m,mode=1777")) return;
    set_sharing_strategy("file_system");
    const int watch = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    ASSERT_GE(watch, 0);
    ASSERT_GE(inotify_add_watch(watch, "/dev/shm", IN_CREATE), 0);
    try {
      Storage s = Storage::allocate_shared(16 * kMiB);
      ADD_FAILURE() << "16 MiB fit in an 8 MiB /dev/shm";
    } catch (const SharedMemoryFullError& e) {
      // The segment's size: the tensor's bytes and the segment's header (a page here).
      EXPECT_GE(e.requested(), 16 * kMiB);
      EXPECT_LE(e.requested(), 16 * kMiB + 65536);
      EXPECT_EQ(e.available(), 8 * kMiB);
      EXPECT_TRUE(contains(e.what(), "16.0 MiB")) << e.what();
      EXPECT_TRUE(contains(e.what(), "8.0 MiB free of 8.0 MiB")) << e.what();
    }
    alignas(inotify_event) char buf[4096];
    EXPECT_LT(::read(watch, buf, sizeof buf), 0) << "a name was created in /dev/shm";
    EXPECT_EQ(errno, EAGAIN);
    ::close(watch);

    // size=0: no limit, statvfs reports 0 blocks free; not a reason to refuse.
    if (!mount_dev_shm("size=0,mode=1777")) return;
    {
      Storage s = Storage::allocate_shared(16 * kMiB);
      std::memset(s.data(), 1, s.nbytes());
      EXPECT_EQ(dev_shm_entries().size(), 1u);
    }
    empty_cache();
    EXPECT_TRUE(dev_shm_entries().empty());
  });
}

// In a limited /dev/shm, a file_system allocation that does not fit first gives back the
// segments this process keeps unused. 16 MiB tmpfs: three freed 1 MiB storages stay cached
// (/dev/shm is at most a quarter full), and take the room a 13 MiB storage needs.
TEST_F(LimitsTest, AFullDevShmFirstTakesBackTheSegmentsThisProcessKeeps) {
  run_or_skip([&] {
    if (!mount_dev_shm("size=16m,mode=1777")) return;
    set_sharing_strategy("file_system");
    {
      std::vector<Storage> three;
      for (int i = 0; i < 3; ++i) three.push_back(Storage::allocate_shared(1 * kMiB));
    }
    EXPECT_EQ(dev_shm_entries().size(), 3u);
    EXPECT_EQ(internal::arena_stats().segments, 3u);
    Storage big = Storage::allocate_shared(13 * kMiB);
    std::memset(big.data(), 5, big.nbytes());
    EXPECT_EQ(static_cast<unsigned char*>(big.data())[13 * kMiB - 1], 5);
    EXPECT_EQ(dev_shm_entries().size(), 1u);
    EXPECT_EQ(internal::arena_stats().segments, 1u);
  });
}

// A forked child holds the block of a dedicated segment until told; the parent drops its
// own storage first (the block is handed over). Returns the child's exit status and leaves
// the arena's segment count after the hand-over in *segments_after.
int hand_over_to_a_child(std::size_t nbytes, std::size_t* segments_after) {
  Storage s = Storage::allocate_shared(nbytes);
  std::memset(s.data(), 7, s.nbytes());
  int go[2];
  if (::pipe2(go, O_CLOEXEC) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(go[1]);
    char c = 0;
    const bool told = ::read(go[0], &c, 1) == 1;
    const bool intact = static_cast<unsigned char*>(s.data())[nbytes - 1] == 7;
    s = Storage();
    empty_cache();  // the references to its parent's segments that the child inherited
    ::_exit(told && intact ? 0 : 1);
  }
  ::close(go[0]);
  s = Storage();
  *segments_after = internal::arena_stats().segments;
  ssize_t ignored = ::write(go[1], "x", 1);
  (void)ignored;
  ::close(go[1]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A dedicated file_system segment whose block its creator no longer holds is kept for
// reuse only while /dev/shm is at most a quarter full; past that the arena gives it up and
// its name goes with its last holder. 16 MiB tmpfs: 2 MiB is kept, 6 MiB is not.
TEST_F(LimitsTest, AHandedOverSegmentIsKeptOnlyWhileDevShmIsAtMostAQuarterFull) {
  run_or_skip([&] {
    if (!mount_dev_shm("size=16m,mode=1777")) return;
    set_sharing_strategy("file_system");
    std::size_t segments = 99;
    EXPECT_EQ(hand_over_to_a_child(2 * kMiB, &segments), 0);
    EXPECT_EQ(segments, 1u);
    EXPECT_EQ(dev_shm_entries().size(), 1u);  // kept, free again
    empty_cache();
    EXPECT_TRUE(dev_shm_entries().empty());

    EXPECT_EQ(hand_over_to_a_child(6 * kMiB, &segments), 0);
    EXPECT_EQ(segments, 0u);
    EXPECT_EQ(internal::arena_stats().segments, 0u);
    EXPECT_TRUE(dev_shm_entries().empty()) << "the child's exit did not take the name";
  });
}

// /dev/shm is full of a block another process holds: the allocation does not wait for it
// (the holder may be waiting for this very block, as a consumer keeping one batch while it
// waits for the next): it takes a memfd segment, which /dev/shm's size does not limit, and
// that block travels by fd in this file_system process's message; nothing more is named in
// /dev/shm. 16 MiB tmpfs, 10 MiB held by the parent until the child's tensor arrived, 10 MiB
// asked for by a child; writes are seen both ways.
TEST_F(LimitsTest, AFullDevShmGivesWhatOthersHoldTheRoomForAMemfdSegment) {
  run_or_skip([&] {
    if (!mount_dev_shm("size=16m,mode=1777")) return;
    set_sharing_strategy("file_system");
    Storage held = Storage::allocate_shared(10 * kMiB);
    std::memset(held.data(), 1, held.nbytes());
    ASSERT_EQ(dev_shm_entries().size(), 1u);
    Queue<Tensor> to_parent;
    Queue<int> to_child;
    const pid_t pid = ::fork();
    if (pid == 0) {
      held = Storage();  // the child's inherited hold: only the parent's remains
      try {
        Tensor mine = Tensor::empty_shared({static_cast<std::int64_t>(10 * kMiB)}, DType::kUInt8);
        std::memset(mine.data_ptr<std::uint8_t>(), 3, 10 * kMiB);
        const bool memfd = mine.storage().sharing_strategy() == SharingStrategy::kFileDescriptor;
        const bool one_name = dev_shm_entries().size() == 1;
        to_parent.put(mine);
        (void)to_child.get();  // the parent wrote its mark
        const bool seen = mine.data_ptr<std::uint8_t>()[10 * kMiB - 1] == 9;
        ::_exit(memfd && one_name && seen ? 0 : 10 + memfd * 4 + one_name * 2 + seen);
      } catch (const SharedMemoryFullError&) {
        ::_exit(2);
      }
    }
    Tensor got = to_parent.get();
    ASSERT_EQ(got.numel(), static_cast<std::int64_t>(10 * kMiB));
    const std::uint8_t* bytes = got.data_ptr<std::uint8_t>();
    EXPECT_EQ(bytes[0], 3);
    EXPECT_EQ(bytes[10 * kMiB - 1], 3);
    EXPECT_EQ(got.storage().sharing_strategy(), SharingStrategy::kFileDescriptor);
    got.data_ptr<std::uint8_t>()[10 * kMiB - 1] = 9;
    to_child.put(1);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << "2: SharedMemoryFullError; 1x: 10 + 4 if its segment was a memfd, + 2 if /dev/shm "
           "held one name, + 1 if it saw the parent's write";
    got = Tensor();
    held = Storage();
    empty_cache();
    EXPECT_TRUE(dev_shm_entries().empty());
  });
}

// A segment larger than /dev/shm itself is refused at once, memfd or not: the caller asked
// for more than the machine's shared memory was sized for.
TEST_F(LimitsTest, ASegmentLargerThanDevShmIsRefusedEvenWhenItIsFull) {
  run_or_skip([&] {
    if (!mount_dev_shm("size=16m,mode=1777")) return;
    set_sharing_strategy("file_system");
    Storage held = Storage::allocate_shared(10 * kMiB);
    try {
      (void)Storage::allocate_shared(32 * kMiB);
      ADD_FAILURE() << "32 MiB fit in a 16 MiB /dev/shm";
    } catch (const SharedMemoryFullError& e) {
      EXPECT_TRUE(contains(e.what(), "/dev/shm is too small")) << e.what();
    }
    EXPECT_EQ(dev_shm_entries().size(), 1u);
  });
}

}  // namespace
}  // namespace shmtensor
