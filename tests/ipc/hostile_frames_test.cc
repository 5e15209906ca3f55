// Every byte and fd from a peer is untrusted: hostile frames sent over a raw socket must
// give a precise ProtocolError, leak nothing, and leave the connection usable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "memory/segment.h"
#include "memory/storage_impl.h"
#include "shmtensor/storage.h"
#include "os/socket.h"
#include "shmtensor/connection.h"
#include "support/leak_check.h"
#include "wire/frame.h"

namespace shmtensor {
namespace {

using internal::FrameHeader;
using internal::SegmentEntry;
using internal::StorageEntry;

class HostileFramesTest : public testing::LeakCheckedTest {
 protected:
  void SetUp() override {
    LeakCheckedTest::SetUp();
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    raw_ = sv[0];
    conn_ = Connection::adopt(sv[1]);
  }
  void TearDown() override {
    ::close(raw_);
    conn_.close();
    LeakCheckedTest::TearDown();
  }
  void send_raw(const std::vector<std::byte>& bytes, std::vector<int> fds = {}) {
    std::span<const std::byte> part(bytes);
    internal::send_message(raw_, std::span(&part, 1), fds);
  }
  static FrameHeader header(std::size_t body, std::uint32_t segs = 0, std::uint32_t stors = 0,
                            std::uint32_t fds = 0) {
    FrameHeader h{};
    h.magic = internal::kFrameMagic;
    h.version = internal::kWireVersion;
    h.body_size = body;
    h.segment_count = segs;
    h.storage_count = stors;
    h.fd_count = fds;
    return h;
  }
  template <class... Parts>
  static std::vector<std::byte> bytes(const Parts&... parts) {
    std::vector<std::byte> out;
    (append(out, parts), ...);
    return out;
  }
  template <class T>
  static void append(std::vector<std::byte>& out, const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof v);
  }
  // After each hostile frame, a good one still arrives.
  void expect_still_usable() {
    auto [a, b] = pipe();  // unused; make sure nothing else is disturbed
    (void)a;
    (void)b;
    std::vector<std::byte> good = bytes(header(8), std::int64_t{77});
    send_raw(good);
    EXPECT_EQ(conn_.recv<std::int64_t>(), 77);
  }
  void expect_protocol_error(const std::string& words) {
    try {
      conn_.recv<std::int64_t>();
      ADD_FAILURE() << "no error for a hostile frame (expected: " << words << ")";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    expect_still_usable();
  }
  int raw_ = -1;
  Connection conn_;
};

TEST_F(HostileFramesTest, TruncatedFrame) {
  send_raw(std::vector<std::byte>(10));
  expect_protocol_error("shorter than a frame header");
}

TEST_F(HostileFramesTest, WrongMagicAndVersion) {
  FrameHeader h = header(0);
  h.magic = 0xdeadbeef;
  send_raw(bytes(h));
  expect_protocol_error("bad magic");
  h = header(0);
  h.version = 99;
  send_raw(bytes(h));
  expect_protocol_error("wire version 99");
}

TEST_F(HostileFramesTest, BodySizeDisagreesWithDatagram) {
  send_raw(bytes(header(1000), std::int64_t{1}));
  expect_protocol_error("body size disagrees");
}

TEST_F(HostileFramesTest, LengthThatOverflows) {
  // A std::string whose length prefix claims 2^63 bytes.
  send_raw(bytes(header(8), std::uint64_t{1} << 63));
  try {
    conn_.recv<std::string>();
    ADD_FAILURE() << "accepted a hostile length";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the message"), std::string::npos);
  }
  expect_still_usable();
}

TEST_F(HostileFramesTest, TrailingBytes) {
  send_raw(bytes(header(16), std::int64_t{1}, std::int64_t{2}));
  expect_protocol_error("trailing bytes");
}

TEST_F(HostileFramesTest, StorageOutsideItsSegment) {
  auto seg = internal::Segment::create(SharingStrategy::kFileDescriptor, 256, 4,
                                       internal::SegmentKind::kArena);
  SegmentEntry se{};
  se.uid = seg->uid() ^ 1;  // a segment this process has not mapped
  se.total_size = seg->mapped_size();
  se.fd_index = 0;
  StorageEntry st{0, 0, 256, 300};  // block 1, but 300 > 256 bytes
  send_raw(bytes(header(sizeof se + sizeof st, 1, 1, 1), se, st), {seg->fd()});
  expect_protocol_error("uid does not match");
  se.uid = seg->uid();  // mapped already: reused, but the storage is not a block
  send_raw(bytes(header(sizeof se + sizeof st, 1, 1, 1), se, st), {seg->fd()});
  expect_protocol_error("storage is not a block of its segment");
  st = StorageEntry{0, 0, 100, 16};  // inside, but not at a block's start
  send_raw(bytes(header(sizeof se + sizeof st, 1, 1, 1), se, st), {seg->fd()});
  expect_protocol_error("storage is not a block of its segment");
  st = StorageEntry{0, 0, 4 * 256, 16};  // past the last block
  send_raw(bytes(header(sizeof se + sizeof st, 1, 1, 1), se, st), {seg->fd()});
  expect_protocol_error("storage is not a block of its segment");
}

TEST_F(HostileFramesTest, BlockWithoutAMessageCountIsRefusedAndItsHolderUntouched) {
  // A real storage of ours, then frames that name its block without the count a sender
  // adds (a forged or replayed reference): refused, and our hold stays as it was.
  Storage mine = Storage::allocate_shared(200);
  std::memset(mine.data(), 7, 200);
  const auto& impl = mine.impl();
  const auto& seg = impl->segment();
  const std::uint64_t word = seg->block_word(impl->block());
  SegmentEntry se{};
  se.uid = seg->uid();
  se.total_size = seg->mapped_size();
  se.fd_index = 0;
  StorageEntry st{0, 0, impl->offset(), 200};
  send_raw(bytes(header(sizeof se + sizeof st, 1, 1, 1), se, st), {seg->fd()});
  expect_protocol_error("carries no message count");
  EXPECT_EQ(seg->block_word(impl->block()), word);
  // A block of the same segment that nobody holds (free): refused the same way.
  const std::uint32_t other = impl->block() + 1;
  ASSERT_LT(other, seg->block_count());
  ASSERT_EQ(seg->block_word(other), 0u);
  st.offset = std::uint64_t{other} * seg->block_size();
  send_raw(bytes(header(sizeof se + sizeof st, 1, 1, 1), se, st), {seg->fd()});
  expect_protocol_error("carries no message count");
  EXPECT_EQ(seg->block_word(other), 0u);
  EXPECT_EQ(static_cast<unsigned char*>(mine.data())[199], 7);
}

TEST_F(HostileFramesTest, UnsealedOrTooSmallFd) {
  int fd = ::memfd_create("hostile", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  SegmentEntry se{};
  se.uid = 12345;
  se.total_size = 4096;
  se.fd_index = 0;
  send_raw(bytes(header(sizeof se, 1, 0, 1), se), {fd});
  expect_protocol_error("not sealed");
  ::close(fd);
  fd = ::memfd_create("hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(::ftruncate(fd, 16), 0);
  ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  send_raw(bytes(header(sizeof se, 1, 0, 1), se), {fd});
  expect_protocol_error("smaller than a segment header");
  ::close(fd);
}

TEST_F(HostileFramesTest, FdCountMismatchClosesTheFds) {
  int fd = ::memfd_create("extra", MFD_CLOEXEC);
  send_raw(bytes(header(8), std::int64_t{5}), {fd});
  ::close(fd);
  expect_protocol_error("header announces 0 fds but 1 arrived");
}

TEST_F(HostileFramesTest, NamesThatAreNotOurs) {
  SegmentEntry se{};
  se.uid = 1;
  se.total_size = 4096;
  se.strategy = 1;
  se.fd_index = -1;
  std::string name = "/etc/passwd";
  se.name_length = static_cast<std::uint16_t>(name.size());
  std::vector<std::byte> body = bytes(se);
  for (char c : name) body.push_back(static_cast<std::byte>(c));
  body.resize(sizeof se + 16);
  std::vector<std::byte> frame = bytes(header(body.size(), 1));
  frame.insert(frame.end(), body.begin(), body.end());
  send_raw(frame);
  expect_protocol_error("invalid segment name");
}

TEST_F(HostileFramesTest, ReceiverAtItsFdLimitGetsCtruncErrorNamingUlimit) {
#if defined(__SANITIZE_ADDRESS__)
  // As LimitsTest.OutOfFdsIsASystemErrorWithAdvice: our ASan build is ASan+UBSan, and
  // UBSan's vptr check probes memory through a pipe, so at the fd limit a cache miss on any
  // virtual call (the ProtocolError being thrown included) is reported as an invalid object.
  // Whether it misses depends on the address layout: this passed locally and failed in CI.
  GTEST_SKIP() << "UBSan's vptr check needs free fds; runs in the plain and TSan builds";
#endif
  // A child lowers its fd limit so that the fds of an incoming message cannot be installed.
  int status = testing::run_in_child([&] {
    auto seg = internal::Segment::create(SharingStrategy::kFileDescriptor, 64, 1, internal::SegmentKind::kDedicated);
    auto fds_now = testing::open_fds();
    rlimit lim{static_cast<rlim_t>(*fds_now.rbegin() + 1), static_cast<rlim_t>(*fds_now.rbegin() + 1)};
    // Fill every free slot below the limit.
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
    // dup() an fd we own (CI runs with stdin closed, so fd 0 may not exist) until the
    // table is full: no slot may be left for the incoming fd.
    std::vector<int> filler;
    for (;;) {
      int d = ::dup(raw_);
      if (d < 0) {
        ASSERT_EQ(errno, EMFILE);
        break;
      }
      filler.push_back(d);
    }
    SegmentEntry se{};
    se.uid = seg->uid();
    se.total_size = seg->mapped_size();
    se.fd_index = 0;
    send_raw(bytes(header(sizeof se, 1, 0, 1), se), {seg->fd()});
    try {
      conn_.recv<std::int64_t>();
      for (int d : filler) ::close(d);
      filler.clear();
      std::string table;
      for (int fd : testing::open_fds()) table += " " + std::to_string(fd);
      ADD_FAILURE() << "no MSG_CTRUNC error; limit " << lim.rlim_cur << ", fds:" << table;
    } catch (const ProtocolError& e) {
      for (int d : filler) ::close(d);
      filler.clear();
      std::string what = e.what();
      EXPECT_NE(what.find("ulimit -n"), std::string::npos) << what;
      EXPECT_NE(what.find("file_system"), std::string::npos) << what;
    }
    for (int d : filler) ::close(d);
  });
  EXPECT_EQ(status, 0);
}

}  // namespace
}  // namespace shmtensor
