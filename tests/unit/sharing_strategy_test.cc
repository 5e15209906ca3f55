// Sharing strategies (names, run-time switching, what each makes in the kernel) and the
// checks a receiver applies to a segment before using it (header validation, attach_fd).
#include "shmtensor/sharing_strategy.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <regex>
#include <stdexcept>
#include <string>

#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/storage.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

using internal::Segment;
using internal::SegmentHeader;

class SharingStrategyTest : public testing::StrategyRestoringTest {};

TEST_F(SharingStrategyTest, DefaultIsFileDescriptor) {
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileDescriptor);
}

TEST_F(SharingStrategyTest, NamesAreTorchs) {
  EXPECT_EQ(to_string(SharingStrategy::kFileDescriptor), "file_descriptor");
  EXPECT_EQ(to_string(SharingStrategy::kFileSystem), "file_system");
  EXPECT_EQ(get_all_sharing_strategies(),
            (std::vector<SharingStrategy>{SharingStrategy::kFileDescriptor,
                                          SharingStrategy::kFileSystem}));
}

TEST_F(SharingStrategyTest, SetByNameAndByValue) {
  set_sharing_strategy("file_system");
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileSystem);
  set_sharing_strategy("file_descriptor");
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileDescriptor);
  set_sharing_strategy(SharingStrategy::kFileSystem);
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileSystem);
  set_sharing_strategy(SharingStrategy::kFileDescriptor);
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileDescriptor);
}

TEST_F(SharingStrategyTest, InvalidNamesAreRejectedNamingTheValidOnes) {
  set_sharing_strategy("file_system");
  for (const char* bad : {"", "file-system", "FILE_SYSTEM", "file_system ", "filesystem",
                          "file_descriptors", "cuda"}) {
    SCOPED_TRACE(bad);
    try {
      set_sharing_strategy(std::string_view(bad));
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const std::invalid_argument& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("\"file_descriptor\""), std::string::npos) << what;
      EXPECT_NE(what.find("\"file_system\""), std::string::npos) << what;
      EXPECT_NE(what.find("\"" + std::string(bad) + "\""), std::string::npos) << what;
    }
    // A rejected name changes nothing.
    EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileSystem);
  }
  EXPECT_ERROR(set_sharing_strategy(static_cast<SharingStrategy>(7)), std::invalid_argument,
               "invalid sharing strategy value 7: valid values are "
               "SharingStrategy::kFileDescriptor (0, \"file_descriptor\") and "
               "SharingStrategy::kFileSystem (1, \"file_system\")");
  EXPECT_ERROR(set_sharing_strategy(static_cast<SharingStrategy>(-1)), std::invalid_argument,
               "invalid sharing strategy value -1: valid values are");
  EXPECT_EQ(get_sharing_strategy(), SharingStrategy::kFileSystem);
}

TEST_F(SharingStrategyTest, SwitchesAtRunTime) {
  set_sharing_strategy("file_system");
  Storage named = Storage::allocate(4096).share_memory_();
  set_sharing_strategy("file_descriptor");
  Storage memfd = Storage::allocate(4096).share_memory_();
  set_sharing_strategy("file_system");
  Storage named2 = Storage::allocate_shared(4096);

  EXPECT_EQ(named.sharing_strategy(), SharingStrategy::kFileSystem);
  EXPECT_EQ(memfd.sharing_strategy(), SharingStrategy::kFileDescriptor);
  EXPECT_EQ(named2.sharing_strategy(), SharingStrategy::kFileSystem);

  const auto& n = internal::StorageAccess::impl(named)->segment();
  const auto& m = internal::StorageAccess::impl(memfd)->segment();
  EXPECT_FALSE(n->name().empty());
  EXPECT_EQ(n->fd(), -1);  // file_system keeps no fd: the name travels
  EXPECT_TRUE(m->name().empty());
  EXPECT_GE(m->fd(), 0);
  // One arena per strategy: both file_system storages live in one segment, in two blocks.
  EXPECT_EQ(n, internal::StorageAccess::impl(named2)->segment());
  EXPECT_NE(internal::StorageAccess::impl(named)->offset(),
            internal::StorageAccess::impl(named2)->offset());
  EXPECT_NE(n, m);

  // Every storage keeps working whatever the current strategy is.
  std::memset(named.data(), 1, 4096);
  std::memset(memfd.data(), 2, 4096);
  std::memset(named2.data(), 3, 4096);
  EXPECT_EQ(static_cast<unsigned char*>(named.data())[4095], 1);
  EXPECT_EQ(static_cast<unsigned char*>(memfd.data())[4095], 2);
}

TEST_F(SharingStrategyTest, FileSystemSegmentsAreNamedExclusiveAndReserved) {
  set_sharing_strategy("file_system");
  Storage a = Storage::allocate_shared(1 << 20);
  Storage b = Storage::allocate_shared(1);
  const std::string& name = internal::StorageAccess::impl(a)->segment()->name();
  const std::regex pattern("/shmtensor_" + std::to_string(::getpid()) + "_[0-9a-f]{16}_([0-9]+)");
  std::smatch ma, mb;
  ASSERT_TRUE(std::regex_match(name, ma, pattern)) << name;
  const std::string& name_b = internal::StorageAccess::impl(b)->segment()->name();
  ASSERT_TRUE(std::regex_match(name_b, mb, pattern)) << name_b;
  EXPECT_EQ(name.substr(0, name.rfind('_')), name_b.substr(0, name_b.rfind('_')));
  EXPECT_GT(std::stoull(mb[1]), std::stoull(ma[1]));

  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &st), 0) << std::strerror(errno);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(static_cast<std::size_t>(st.st_size),
            internal::StorageAccess::impl(a)->segment()->mapped_size());
  // posix_fallocate reserved the pages up front: nothing is left to fail (SIGBUS) later.
  EXPECT_GE(static_cast<std::size_t>(st.st_blocks) * 512,
            internal::StorageAccess::impl(a)->segment()->mapped_size());
  // The creator holds the only count.
  EXPECT_EQ(internal::StorageAccess::impl(a)->segment()->header()->refcount.load(), 1);
}

TEST_F(SharingStrategyTest, FileDescriptorSegmentsAreSealedCloexecMemfds) {
  Storage s = Storage::allocate_shared(12345);
  const auto& seg = internal::StorageAccess::impl(s)->segment();
  ASSERT_GE(seg->fd(), 0);
  int seals = ::fcntl(seg->fd(), F_GET_SEALS);
  ASSERT_NE(seals, -1) << std::strerror(errno);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_EQ(seals & F_SEAL_WRITE, 0);
  EXPECT_TRUE(::fcntl(seg->fd(), F_GETFD) & FD_CLOEXEC);
  EXPECT_EQ(::ftruncate(seg->fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  struct stat st {};
  ASSERT_EQ(::fstat(seg->fd(), &st), 0);
  EXPECT_EQ(static_cast<std::size_t>(st.st_size), seg->mapped_size());
  EXPECT_GE(seg->payload_size(), 12345u);
  EXPECT_EQ(seg->payload_size() % internal::kSegmentAlignment, 0u);
  char link[256] = {};
  ASSERT_GT(
      ::readlink(("/proc/self/fd/" + std::to_string(seg->fd())).c_str(), link, sizeof link - 1), 0);
  EXPECT_EQ(std::string(link).rfind("/memfd:shmtensor", 0), 0u) << link;
}

// ---- what a receiver checks -------------------------------------------------------------

// A copy of a real header, to corrupt one field at a time.
struct HeaderCopy {
  alignas(64) unsigned char bytes[internal::kSegmentHeaderSize];
  SegmentHeader& h() { return *reinterpret_cast<SegmentHeader*>(bytes); }
};

void expect_protocol_error(const SegmentHeader& h, std::size_t mapped, std::uint64_t uid,
                           const std::string& words) {
  try {
    internal::validate_segment_header(h, mapped, uid);
    ADD_FAILURE() << "accepted a header that should fail with: " << words;
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

class SegmentValidationTest : public testing::LeakCheckedTest {};

TEST_F(SegmentValidationTest, HeaderValidationRejectsEachBadField) {
  auto seg = Segment::create(SharingStrategy::kFileDescriptor, 4096, 1, internal::SegmentKind::kDedicated);
  const std::size_t mapped = seg->mapped_size();
  const std::uint64_t uid = seg->uid();
  HeaderCopy good;
  std::memcpy(good.bytes, seg->header(), sizeof good.bytes);
  EXPECT_NO_THROW(internal::validate_segment_header(good.h(), mapped, uid));
  EXPECT_EQ(good.h().layout_version, internal::kSegmentLayoutVersion);
  EXPECT_EQ(good.h().header_size, internal::kSegmentHeaderSize);
  EXPECT_EQ(good.h().total_size, mapped);
  EXPECT_EQ(good.h().creator_pid, ::getpid());

  HeaderCopy c = good;
  c.h().magic = 0;  // a segment whose creator has not finished writing the header
  expect_protocol_error(c.h(), mapped, uid, "bad magic");
  c = good;
  c.h().magic ^= 0x100;
  expect_protocol_error(c.h(), mapped, uid, "bad magic");
  c = good;
  c.h().layout_version = internal::kSegmentLayoutVersion + 1;
  expect_protocol_error(c.h(), mapped, uid, "layout version");
  c = good;
  c.h().header_size = 64;
  expect_protocol_error(c.h(), mapped, uid, "header size");
  c = good;
  c.h().total_size = mapped * 2;  // claims more than the object has: would fault
  expect_protocol_error(c.h(), mapped, uid, "total size");
  expect_protocol_error(good.h(), mapped - 64, uid, "total size");
  c = good;
  c.h().data_offset = 0;  // blocks over the header
  expect_protocol_error(c.h(), mapped, uid, "lie outside the object");
  c = good;
  c.h().data_offset = mapped - 64;  // blocks past the end
  expect_protocol_error(c.h(), mapped, uid, "lie outside the object");
  c = good;
  c.h().words_offset = 64;  // words over the header
  expect_protocol_error(c.h(), mapped, uid, "lie outside the object");
  c = good;
  c.h().data_size = mapped;
  expect_protocol_error(c.h(), mapped, uid, "data size disagrees");
  c = good;
  c.h().block_size = 100;  // not a multiple of 64
  expect_protocol_error(c.h(), mapped, uid, "block size");
  c = good;
  c.h().block_count = 0;
  expect_protocol_error(c.h(), mapped, uid, "block size");
  c = good;
  c.h().block_count = 0x80000000u;  // bookkeeping for 2^31 blocks
  expect_protocol_error(c.h(), mapped, uid, "more than a segment of this kind has");
  c = good;
  c.h().kind = static_cast<std::uint32_t>(internal::SegmentKind::kArena);
  c.h().block_count = 2;  // the second block lies past the object
  expect_protocol_error(c.h(), mapped, uid, "data size disagrees");
  c = good;
  c.h().kind = 7;
  expect_protocol_error(c.h(), mapped, uid, "unknown kind");
  expect_protocol_error(good.h(), mapped, uid + 1, "uid");
}

// memfd named like the library's (so the leak check would see a mapping left behind).
internal::UniqueFd test_memfd(std::size_t size, bool seal) {
  int fd = ::memfd_create("shmtensor", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
  if (seal) EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return internal::UniqueFd(fd);
}

TEST_F(SegmentValidationTest, AttachFdRejectsAnUnsealedFd) {
  auto fd = test_memfd(64 * 1024, /*seal=*/false);
  try {
    Segment::attach_fd(std::move(fd), 1);
    ADD_FAILURE() << "mapped an unsealed fd";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("not sealed"), std::string::npos) << e.what();
  }
  // A shm object that cannot be sealed at all (not a memfd) is rejected the same way.
  std::string name = "/shmtensor_test_" + std::to_string(::getpid());
  int shm = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  ASSERT_GE(shm, 0) << std::strerror(errno);
  ::shm_unlink(name.c_str());
  ASSERT_EQ(::ftruncate(shm, 4096), 0);
  EXPECT_ERROR(Segment::attach_fd(internal::UniqueFd(shm), 1), ProtocolError,
               "not sealed against shrinking");
}

TEST_F(SegmentValidationTest, AttachFdRejectsAnFdSmallerThanAHeader) {
  for (std::size_t size : {std::size_t{0}, std::size_t{64}, internal::kSegmentHeaderSize - 1}) {
    SCOPED_TRACE(size);
    try {
      Segment::attach_fd(test_memfd(size, /*seal=*/true), 1);
      ADD_FAILURE() << "mapped a " << size << "-byte fd";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find("smaller than a segment header"), std::string::npos)
          << e.what();
    }
  }
}

TEST_F(SegmentValidationTest, AttachFdValidatesTheHeaderAndUnmapsOnFailure) {
  auto seg = Segment::create(SharingStrategy::kFileDescriptor, 4096, 1, internal::SegmentKind::kDedicated);
  HeaderCopy hdr;
  std::memcpy(hdr.bytes, seg->header(), sizeof hdr.bytes);
  const std::uint64_t uid = hdr.h().uid ^ 0x5a5a5a5a5a5a5a5aULL;  // not registered yet
  hdr.h().uid = uid;
  auto make = [&](const HeaderCopy& h) {
    auto fd = test_memfd(seg->mapped_size(), /*seal=*/false);
    EXPECT_EQ(::pwrite(fd.get(), h.bytes, sizeof h.bytes, 0), static_cast<ssize_t>(sizeof h.bytes));
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    return fd;
  };
  std::size_t maps = testing::shmtensor_mappings().size();

  HeaderCopy zero{};
  EXPECT_ERROR(Segment::attach_fd(make(zero), uid), ProtocolError, "bad magic");
  EXPECT_ERROR(Segment::attach_fd(make(hdr), uid + 1), ProtocolError,
               "uid does not match the message");
  HeaderCopy bad_version = hdr;
  bad_version.h().layout_version = 99;
  EXPECT_ERROR(Segment::attach_fd(make(bad_version), uid), ProtocolError, "layout version 99");
  // More blocks than any segment of that kind has: refused before anything is allocated
  // per block (the geometry is checked before the sizes, so the object need not be big).
  HeaderCopy two_dedicated = hdr;
  two_dedicated.h().block_count = 2;
  HeaderCopy huge_arena = hdr;
  huge_arena.h().kind = static_cast<std::uint32_t>(internal::SegmentKind::kArena);
  huge_arena.h().block_size = 64;
  huge_arena.h().block_count = internal::kMaxSegmentBlocks + 1;
  for (HeaderCopy* bad : {&two_dedicated, &huge_arena}) {
    try {
      Segment::attach_fd(make(*bad), uid);
      ADD_FAILURE() << "accepted " << bad->h().block_count << " blocks";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find("more than a segment of this kind has"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps);  // nothing stays mapped

  // The positive control: the same bytes with the right uid are accepted.
  auto attached = Segment::attach_fd(make(hdr), uid);
  EXPECT_EQ(attached->uid(), uid);
  EXPECT_EQ(attached->mapped_size(), seg->mapped_size());
  EXPECT_EQ(attached->strategy(), SharingStrategy::kFileDescriptor);
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps + 1);
}

}  // namespace
}  // namespace shmtensor
