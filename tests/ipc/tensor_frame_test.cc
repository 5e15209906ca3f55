// One tensor alone over a Connection (docs/transport.md, "One tensor"): send<Tensor> frames a
// tensor straight into a buffer (wire.h, TensorFrame) and recv<Tensor> parses a ring slot of
// that shape without a Decoder (parse_tensor_frame). What these tests prove:
//   - TensorFrame writes the very bytes finish_frame writes for that value, and counts what
//     it counts; a frame never sent gives its counts back;
//   - every other shape (undefined, no elements, an fd that must travel, too large) is left
//     to the general path, having counted nothing; parse_tensor_frame says "not mine" for
//     frames of other shapes and changes nothing;
//   - across processes, 200 tensors of several dtypes, shapes and views arrive exact, in the
//     ring (no bytes on the socket once each file_descriptor segment was deposited);
//     try_send / try_recv take the same path;
//   - a hostile slot of that shape gets the very ProtocolError the general path gives for
//     the same bytes, the connection goes on, and every count comes back.
// Real shared memory, both sharing strategies, exact values; the fixture checks that no fd,
// mapping or /dev/shm name is left.
#include <gtest/gtest.h>
#include <sys/ioctl.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "memory/segment.h"
#include "memory/segment_header.h"
#include "memory/storage_impl.h"
#include "os/unique_fd.h"
#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/strategy_test.h"
#include "transport/announced.h"
#include "transport/ring.h"
#include "wire/frame.h"
#include "wire/wire.h"

namespace shmtensor {
namespace {

using internal::FdElision;
using internal::FrameHeader;
using internal::Segment;
using internal::TensorFrame;
using testing::fork_child;
using testing::wait_child;

class TensorFrameTest : public testing::StrategyTest {
 protected:
  bool file_descriptor() const { return GetParam() == SharingStrategy::kFileDescriptor; }
};

// A connection ring slot's room (1 KiB slots, less the slot header): the frames the fast
// path writes, and the buffer it writes them into.
constexpr std::size_t kSlotRoom = 1024 - internal::Ring::kSlotHeaderBytes;
using SlotBuffer = std::array<std::byte, kSlotRoom>;

// The transport's say whether a file_descriptor segment is in the peer's depot.
bool yes(void*, const Segment&) { return true; }
bool no(void*, const Segment&) { return false; }
constexpr FdElision kDeposited{yes, nullptr};
constexpr FdElision kNotDeposited{no, nullptr};

// ---- counts -----------------------------------------------------------------------------

// A tensor's block, kept mapped (the Segment) after the tensors on it are gone.
struct Block {
  std::shared_ptr<Segment> seg;
  std::uint32_t index = 0;
};
Block block_of(const Tensor& t) {
  const auto& impl = internal::StorageAccess::impl(t.storage());
  EXPECT_TRUE(impl->is_shared());
  return {impl->segment(), impl->block()};
}

// What a message carries counts of: its block's word (holders' bits, and one count per
// message in flight) and, for a named (file_system) segment, the name's refcount.
struct Counts {
  std::uint64_t word = 0;
  std::int64_t name_refs = 0;
  bool operator==(const Counts&) const = default;
};
std::ostream& operator<<(std::ostream& os, const Counts& c) {
  return os << "{word 0x" << std::hex << c.word << std::dec << ", name refs " << c.name_refs << "}";
}
Counts counts_of(const Block& b) {
  const bool named = b.seg->strategy() == SharingStrategy::kFileSystem;
  return {b.seg->block_word(b.index),
          named ? b.seg->header()->refcount.load(std::memory_order_acquire) : 0};
}
// `c` with the counts of `messages` more messages in flight.
Counts plus(const Block& b, Counts c, std::uint64_t messages) {
  c.word += messages * internal::kCountUnit;
  if (b.seg->strategy() == SharingStrategy::kFileSystem)
    c.name_refs += static_cast<std::int64_t>(messages);
  return c;
}

// ---- frames -----------------------------------------------------------------------------

// finish_frame's frame of `value` (with `elision` asked for each file_descriptor segment).
template <class T>
internal::OutgoingFrame general_frame(const T& value, const FdElision* elision = &kDeposited) {
  Encoder e;
  e.encode(value);
  return internal::finish_frame(std::move(e), elision);
}

// Its parts as one datagram.
std::vector<std::byte> bytes_of(const internal::OutgoingFrame& f) {
  std::vector<std::byte> out;
  for (const auto& part : f.parts()) out.insert(out.end(), part.begin(), part.end());
  return out;
}

std::vector<std::byte> bytes_of(const TensorFrame& f) {
  return {f.bytes().begin(), f.bytes().end()};
}

// A SegmentFetcher that has one segment: what a connection's depot gives a frame that names
// a file_descriptor segment without its fd (kFdOmitted).
struct OneSegment {
  std::shared_ptr<Segment> seg;
  static internal::FetchedSegment fetch(void* self, std::uint64_t uid, bool /*device*/) {
    const auto& seg = static_cast<OneSegment*>(self)->seg;
    return {seg->uid() == uid ? seg : nullptr, {}, {}};
  }
  internal::SegmentFetcher fetcher() { return {fetch, this}; }
};

// What receiving `frame` as a Tensor comes to: "accepted: <tensor>" or the ProtocolError's
// message. By the general path (parse_frame, decode, finish), by parse_tensor_frame alone,
// and by a Connection's recv<Tensor>.
std::string accepted(const Tensor& t) { return "accepted: " + t.to_string(); }

std::string by_general_path(std::span<const std::byte> frame, OneSegment& depot) {
  const internal::SegmentFetcher fetcher = depot.fetcher();
  try {
    Decoder d = internal::parse_frame(frame, {}, nullptr, &fetcher);
    const Tensor t = d.decode<Tensor>();
    d.finish();
    return accepted(t);
  } catch (const ProtocolError& e) {
    return e.what();
  }
}

std::string by_parse_tensor_frame(std::span<const std::byte> frame, OneSegment& depot) {
  const internal::SegmentFetcher fetcher = depot.fetcher();
  try {
    Tensor t;
    if (!internal::parse_tensor_frame(frame, &fetcher, t)) return "(not a one-tensor frame)";
    return accepted(t);
  } catch (const ProtocolError& e) {
    return e.what();
  }
}

std::string by_recv(Connection& c) {
  try {
    return accepted(c.recv<Tensor>());
  } catch (const ProtocolError& e) {
    return e.what();
  }
}

// ---- byte identity ----------------------------------------------------------------------

// The tensors of the byte-identity and parse tests: contiguous, a non-contiguous view with
// an offset, a 0-d scalar (offset too), 6-d, bool.
std::vector<Tensor> sample_tensors() {
  std::vector<bool> bits;
  for (int i = 0; i < 12; ++i) bits.push_back(i % 3 == 0);
  return {
      Tensor::arange(16),
      Tensor::arange(48, DType::kFloat32)
          .view({6, 8})
          .narrow(0, 1, 4)
          .narrow(1, 2, 5)
          .transpose(0, 1),
      Tensor::arange(5, DType::kFloat64).select(0, 3),
      Tensor::arange(64, DType::kInt32).view({2, 2, 2, 2, 2, 2}).permute({5, 0, 4, 1, 3, 2}),
      Tensor::from_vector(bits, {3, 4}),
  };
}

TEST_P(TensorFrameTest, FramesTheBytesFinishFrameWritesAndGivesItsCountsBackUnsent) {
  for (const Tensor& t : sample_tensors()) {
    SCOPED_TRACE(t.to_string());
    t.share_memory_();
    const Block block = block_of(t);
    const Counts before = counts_of(block);
    {
      SlotBuffer buffer;
      TensorFrame fast;
      ASSERT_TRUE(fast.frame(t, kDeposited, buffer));
      const internal::OutgoingFrame general = general_frame(t);
      EXPECT_TRUE(general.fds().empty());
      EXPECT_EQ(bytes_of(fast), bytes_of(general));
      EXPECT_EQ(fast.bytes().data(), buffer.data());
      EXPECT_EQ(counts_of(block), plus(block, before, 2)) << "each frame counts one message";
    }
    EXPECT_EQ(counts_of(block), before) << "neither was sent";
  }
}

TEST_P(TensorFrameTest, AFrameThatFitsItsBufferExactlyIsWrittenOneByteLessIsNot) {
  Tensor t = Tensor::arange(64, DType::kInt32).view({2, 2, 2, 2, 2, 2});
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  SlotBuffer buffer;
  std::size_t size = 0;
  {
    TensorFrame f;
    ASSERT_TRUE(f.frame(t, kDeposited, buffer));
    size = f.bytes().size();
  }
  const std::size_t name = file_descriptor() ? 0 : (block.seg->name().size() + 7) / 8 * 8;
  EXPECT_EQ(size, sizeof(FrameHeader) + sizeof(internal::SegmentEntry) + name +
                      sizeof(internal::StorageEntry) + sizeof(internal::EncodedTensorHead) +
                      2 * 6 * sizeof(std::int64_t));
  {
    TensorFrame f;
    EXPECT_TRUE(f.frame(t, kDeposited, std::span(buffer).first(size)));
    EXPECT_EQ(counts_of(block), plus(block, before, 1));
  }
  {
    TensorFrame f;
    EXPECT_FALSE(f.frame(t, kDeposited, std::span(buffer).first(size - 1)));
    EXPECT_TRUE(f.bytes().empty());
    EXPECT_EQ(counts_of(block), before);
  }
  EXPECT_EQ(counts_of(block), before);
}

// ---- shapes that go the general way ------------------------------------------------------

TEST_P(TensorFrameTest, UndefinedAndElementlessTensorsGoTheGeneralWayCountingNothing) {
  SlotBuffer buffer;
  {
    TensorFrame f;
    EXPECT_FALSE(f.frame(Tensor(), kDeposited, buffer));
    EXPECT_TRUE(f.bytes().empty());
  }
  {
    TensorFrame f;
    EXPECT_FALSE(f.frame(Tensor::empty({0, 3}), kDeposited, buffer));
    EXPECT_TRUE(f.bytes().empty());
  }
  // No elements, on a shared storage whose block could be counted: it is not.
  Tensor t = Tensor::arange(16);
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  {
    TensorFrame f;
    EXPECT_FALSE(f.frame(t.narrow(0, 5, 0), kDeposited, buffer));
    EXPECT_TRUE(f.bytes().empty());
    EXPECT_EQ(counts_of(block), before);
  }
  EXPECT_EQ(counts_of(block), before);
}

TEST_P(TensorFrameTest, MoreThan64DimensionsGoTheGeneralWayCountingNothing) {
  Tensor t = Tensor::arange(1).view(Dims(65, 1));
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  SlotBuffer buffer;
  {
    TensorFrame f;
    EXPECT_FALSE(f.frame(t, kDeposited, buffer));
    EXPECT_EQ(counts_of(block), before);
  }
  EXPECT_EQ(counts_of(block), before);
}

// A file_descriptor segment not in the peer's depot needs its fd in the message: the
// general way. A named segment's fd never travels: the elision is not asked.
TEST_P(TensorFrameTest, ASegmentWhoseFdMustTravelGoesTheGeneralWayCountingNothing) {
  Tensor t = Tensor::arange(16);
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  SlotBuffer buffer;
  {
    TensorFrame f;
    const bool framed = f.frame(t, kNotDeposited, buffer);
    if (file_descriptor()) {
      EXPECT_FALSE(framed);
      EXPECT_TRUE(f.bytes().empty());
      EXPECT_EQ(counts_of(block), before);
    } else {
      ASSERT_TRUE(framed);
      EXPECT_EQ(bytes_of(f), bytes_of(general_frame(t, &kNotDeposited)));
      EXPECT_EQ(counts_of(block), plus(block, before, 1));
    }
  }
  EXPECT_EQ(counts_of(block), before);
}

// frame() moves a private storage into shared memory first, as finish_frame does.
TEST_P(TensorFrameTest, APrivateTensorIsMovedIntoSharedMemoryFirst) {
  const Tensor t = Tensor::arange(16);
  ASSERT_FALSE(t.is_shared());
  SlotBuffer buffer;
  TensorFrame f;
  const bool framed = f.frame(t, kNotDeposited, buffer);
  EXPECT_TRUE(t.is_shared());
  EXPECT_EQ(framed, !file_descriptor());
  EXPECT_EQ(t.data_ptr<std::int64_t>()[15], 15);
}

// ---- parse_tensor_frame -----------------------------------------------------------------

TEST_P(TensorFrameTest, ParsesItsFrameIntoTheSameViewAndTheCountsComeBack) {
  std::vector<Tensor> samples = sample_tensors();
  for (Tensor& sample : samples) {
    SCOPED_TRACE(sample.to_string());
    Tensor t = std::move(sample);  // the one handle on its storage
    t.share_memory_();
    const Block block = block_of(t);
    const Counts before = counts_of(block);
    OneSegment depot{block.seg};
    const internal::SegmentFetcher fetcher = depot.fetcher();
    Tensor got;
    {
      SlotBuffer buffer;
      TensorFrame f;
      ASSERT_TRUE(f.frame(t, kDeposited, buffer));
      f.mark_sent();
      EXPECT_EQ(counts_of(block), plus(block, before, 1));
      ASSERT_TRUE(internal::parse_tensor_frame(f.bytes(), &fetcher, got));
    }
    EXPECT_EQ(got.raw_data(), t.raw_data());
    EXPECT_EQ(got.sizes().vec(), t.sizes().vec());
    EXPECT_EQ(got.strides().vec(), t.strides().vec());
    EXPECT_EQ(got.storage_offset(), t.storage_offset());
    EXPECT_EQ(got.dtype(), t.dtype());
    EXPECT_TRUE(got.equal(t));
    // This process holds the block already: the message's count went back at the parse.
    EXPECT_EQ(counts_of(block), before);
    got = Tensor();
    EXPECT_EQ(counts_of(block), before);
    t = Tensor();
    EXPECT_EQ(counts_of(block), (Counts{0, before.name_refs})) << "the block is free again";
  }
}

// Frames of any other shape: parse_tensor_frame says so and does nothing (the counts the
// frames carry are still in flight); the frames, never sent, give them back.
TEST_P(TensorFrameTest, FramesOfOtherShapesAreNotParsedAndChangeNothing) {
  Tensor t = Tensor::arange(16);
  Tensor u = Tensor::arange(8, DType::kFloat32);
  t.share_memory_();
  u.share_memory_();
  const Block bt = block_of(t), bu = block_of(u);
  ASSERT_TRUE(bt.seg != bu.seg || bt.index != bu.index);
  const Counts before_t = counts_of(bt), before_u = counts_of(bu);
  OneSegment depot{bt.seg};
  const internal::SegmentFetcher fetcher = depot.fetcher();
  auto not_parsed = [&](const internal::OutgoingFrame& f, std::uint64_t t_counts,
                        std::uint64_t u_counts) {
    const std::vector<std::byte> bytes = bytes_of(f);
    EXPECT_EQ(counts_of(bt), plus(bt, before_t, t_counts));
    EXPECT_EQ(counts_of(bu), plus(bu, before_u, u_counts));
    Tensor out = Tensor::arange(3);
    EXPECT_FALSE(internal::parse_tensor_frame(bytes, &fetcher, out));
    EXPECT_TRUE(out.equal(Tensor::arange(3))) << "the output is untouched";
    EXPECT_EQ(counts_of(bt), plus(bt, before_t, t_counts));
    EXPECT_EQ(counts_of(bu), plus(bu, before_u, u_counts));
  };
  {
    SCOPED_TRACE("an int64");
    not_parsed(general_frame(std::int64_t{7}), 0, 0);
  }
  {
    SCOPED_TRACE("a tuple of two tensors on two storages");
    not_parsed(general_frame(std::make_tuple(t, u)), 1, 1);
  }
  {
    SCOPED_TRACE("a tensor without elements");
    not_parsed(general_frame(Tensor::empty({0, 4})), 0, 0);
  }
  {
    SCOPED_TRACE("an undefined tensor");
    not_parsed(general_frame(Tensor()), 0, 0);
  }
  if (file_descriptor()) {
    SCOPED_TRACE("a tensor whose segment's fd travels with it");
    not_parsed(general_frame(t, nullptr), 1, 0);
  }
  EXPECT_EQ(counts_of(bt), before_t);
  EXPECT_EQ(counts_of(bu), before_u);
}

// Two views of one storage frame like one tensor up to the payload, which holds a second
// value: received as a Tensor that is the general path's error, word for word.
TEST_P(TensorFrameTest, TwoTensorsOnOneStorageGetTheGeneralPathsError) {
  Tensor t = Tensor::arange(16);
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  OneSegment depot{block.seg};
  const auto value = std::make_tuple(t, t.narrow(0, 2, 3));
  internal::OutgoingFrame general = general_frame(value);
  internal::OutgoingFrame fast = general_frame(value);
  general.sent = fast.sent = true;  // their counts are the parses' to take
  EXPECT_EQ(counts_of(block), plus(block, before, 2));
  const std::string expected = by_general_path(bytes_of(general), depot);
  EXPECT_EQ(expected, "malformed shmtensor message: 32 trailing bytes after the value");
  EXPECT_EQ(by_parse_tensor_frame(bytes_of(fast), depot), expected);
  EXPECT_EQ(counts_of(block), before);
}

// ---- across processes -------------------------------------------------------------------

int queued_bytes(int sock) {
  int n = -1;
  EXPECT_EQ(::ioctl(sock, FIONREAD, &n), 0);
  return n;
}
int socket_of(const Connection& c) { return internal::ConnectionAccess::fds(c).at(0); }

// Storages of several dtypes (a 6-d one among them), made alike in both processes.
std::vector<Tensor> storages() {
  std::vector<bool> bits;
  for (int i = 0; i < 24; ++i) bits.push_back(i % 3 != 1);
  return {
      Tensor::arange(64).view({4, 16}),
      Tensor::arange(60, DType::kFloat32).view({3, 4, 5}),
      Tensor::arange(48, DType::kUInt8).view({6, 8}),
      Tensor::arange(36, DType::kFloat64).view({6, 6}),
      Tensor::arange(35, DType::kInt16).view({7, 5}),
      Tensor::from_vector(bits, {4, 6}),
      Tensor::arange(30, DType::kInt32).view({2, 3, 5}),
      Tensor::arange(96, DType::kFloat32).view({2, 3, 2, 2, 2, 2}),
  };
}

// Message i's view of one of `s`: whole, a select, a transpose, a narrow, a stepped slice, a
// 0-d element, an expansion (stride 0), a permuted narrow.
Tensor view_for(const std::vector<Tensor>& s, int i) {
  const Tensor& base = s[static_cast<std::size_t>(i) % s.size()];
  const int round = i / static_cast<int>(s.size());
  switch (round % 8) {
    case 0:
      return base;
    case 1:
      return base.select(0, base.size(0) - 1);
    case 2:
      return base.transpose(0, -1);
    case 3:
      return base.narrow(-1, 1, base.size(-1) - 1);
    case 4:
      return base.slice(0, round % 2, Tensor::kSliceEnd, 2);
    case 5: {
      Tensor scalar = base;
      while (scalar.dim() > 0) scalar = scalar.select(0, round % scalar.size(0));
      return scalar;
    }
    case 6: {
      std::vector<std::int64_t> sizes = base.sizes().vec();
      sizes.insert(sizes.begin(), 3);
      return base.unsqueeze(0).expand(sizes);
    }
    default: {
      std::vector<std::int64_t> reversed;
      for (std::int64_t d = base.dim() - 1; d >= 0; --d) reversed.push_back(d);
      return base.permute(reversed).narrow(0, 1, 1);
    }
  }
}

TEST_P(TensorFrameTest, TwoHundredViewsArriveExactAndOnlyFirstSegmentFdsUseTheSocket) {
  auto [a, b] = pipe();
  constexpr int kViews = 200;
  // Sent by a child before the parent receives anything: every message is in the ring or
  // on the socket when the parent looks.
  const pid_t child = fork_child([&a = a, &b = b, fd = file_descriptor()] {
    b.close();
    const std::vector<Tensor> s = storages();
    for (const Tensor& t : s) a.send(t);  // each storage first (its segment's fd, if first)
    for (int i = 0; i < kViews; ++i) a.send(view_for(s, i));
    std::set<const Segment*> segments;
    for (const Tensor& t : s) segments.insert(block_of(t).seg.get());
    const auto counts = internal::ConnectionAccess::fd_counts(a);
    if (fd) {
      EXPECT_EQ(counts.sent, segments.size()) << "one fd per segment";
      EXPECT_EQ(counts.omitted, s.size() + kViews - segments.size());
    } else {
      EXPECT_EQ(counts.sent + counts.omitted, 0u);
    }
  });
  a.close();
  ASSERT_EQ(wait_child(child), 0);
  const std::vector<Tensor> s = storages();
  if (file_descriptor())
    EXPECT_GT(queued_bytes(socket_of(b)), 0) << "the first message's fd";
  else
    EXPECT_EQ(queued_bytes(socket_of(b)), 0);
  auto expect_same = [](const Tensor& got, const Tensor& want) {
    EXPECT_EQ(got.dtype(), want.dtype());
    EXPECT_EQ(got.sizes().vec(), want.sizes().vec());
    EXPECT_EQ(got.strides().vec(), want.strides().vec());
    EXPECT_EQ(got.storage_offset(), want.storage_offset());
    EXPECT_TRUE(got.equal(want)) << got.to_string() << "\n" << want.to_string();
  };
  std::vector<Tensor> received;  // keeps every storage mapped: the later views reuse them
  for (const Tensor& want : s) {
    received.push_back(b.recv<Tensor>());
    expect_same(received.back(), want);
  }
  EXPECT_EQ(queued_bytes(socket_of(b)), 0) << "every later message travelled in the ring";
  for (int i = 0; i < kViews; ++i) {
    SCOPED_TRACE("view " + std::to_string(i));
    const Tensor got = b.recv<Tensor>();
    expect_same(got, view_for(s, i));
    EXPECT_EQ(got.storage().data(),
              received[static_cast<std::size_t>(i) % s.size()].storage().data())
        << "a view of the storage received first";
    EXPECT_EQ(queued_bytes(socket_of(b)), 0);
  }
  EXPECT_ERROR((void)b.recv<Tensor>(), ConnectionClosed, "the peer closed the connection");
}

// try_recv<Tensor> with nothing there says so; try_send fills the ring (256 slots) and then
// says no, having counted nothing; try_recv takes them all back.
TEST_P(TensorFrameTest, TrySendAndTryRecvTakeTheSamePath) {
  auto [a, b] = pipe();
  EXPECT_FALSE(b.try_recv<Tensor>().has_value());
  EXPECT_FALSE(b.try_recv<Tensor>(std::chrono::milliseconds(1)).has_value());
  Tensor t = Tensor::arange(16);
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  int sent = 0;
  while (sent < 1000 && a.try_send(t)) ++sent;
  EXPECT_EQ(sent, 256) << "one slot each (the first, with file_descriptor, its datagram's marker)";
  EXPECT_EQ(counts_of(block), plus(block, before, 256)) << "the refused one counted nothing";
  EXPECT_FALSE(a.try_send(t));
  EXPECT_EQ(counts_of(block), plus(block, before, 256));
  for (int i = 0; i < sent; ++i) {
    const std::optional<Tensor> got = b.try_recv<Tensor>();
    ASSERT_TRUE(got.has_value()) << i;
    EXPECT_EQ(got->raw_data(), t.raw_data());
    EXPECT_TRUE(got->equal(t));
  }
  EXPECT_FALSE(b.try_recv<Tensor>().has_value());
  EXPECT_EQ(counts_of(block), before);
  // Room again.
  EXPECT_TRUE(a.try_send(t.narrow(0, 3, 4)));
  EXPECT_TRUE(b.try_recv<Tensor>().value().equal(Tensor::arange(16).narrow(0, 3, 4)));
  EXPECT_EQ(counts_of(block), before);
}

// A connection over an adopted socket has no ring: send<Tensor>, try_send, recv<Tensor> and
// try_recv go the general way, with the same results and counts.
TEST_P(TensorFrameTest, OnAnAdoptedSocketATensorGoesTheGeneralWay) {
  auto [a, b] = internal::ConnectionAccess::socket_pair();
  Tensor t = Tensor::arange(16);
  t.share_memory_();
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  EXPECT_FALSE(b.try_recv<Tensor>().has_value());
  a.send(t);
  ASSERT_TRUE(a.try_send(t.narrow(0, 4, 8)));
  EXPECT_EQ(counts_of(block), plus(block, before, 2));
  const Tensor got = b.recv<Tensor>();
  EXPECT_EQ(got.raw_data(), t.raw_data());
  EXPECT_TRUE(got.equal(t));
  const std::optional<Tensor> view = b.try_recv<Tensor>(std::chrono::seconds(10));
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->storage_offset(), 4);
  EXPECT_TRUE(view->equal(Tensor::arange(16).narrow(0, 4, 8)));
  EXPECT_FALSE(b.try_recv<Tensor>().has_value());
  EXPECT_EQ(counts_of(block), before);
}

// ---- hostile slots ----------------------------------------------------------------------

// One change to a genuine frame of a 1-d int64 tensor of 16 elements: header (32 bytes),
// segment entry (and name), storage entry, then the tensor's head (16 bytes), size, stride.
struct Mutation {
  const char* what;
  void (*apply)(std::vector<std::byte>& frame);
  // Part of the error the general path gives (so that the change hits the check it means).
  const char* says;
  // Refused after the storage was adopted (the frame's counts taken). Otherwise before:
  // such a frame is not marked sent, its counts go back at once.
  bool adopted = true;
  // Still of the one-tensor shape (header, tables' bounds): parse_tensor_frame parses it.
  // Otherwise it says "not mine" and the general path refuses it.
  bool one_tensor = true;
};

constexpr std::size_t kTensorBytes = sizeof(internal::EncodedTensorHead) + 2 * 8;
std::size_t head_at(const std::vector<std::byte>& frame) { return frame.size() - kTensorBytes; }
template <class T>
void put(std::vector<std::byte>& frame, std::size_t at, T value) {
  std::memcpy(frame.data() + at, &value, sizeof value);
}
void fix_body_size(std::vector<std::byte>& frame) {
  put<std::uint64_t>(frame, offsetof(FrameHeader, body_size), frame.size() - sizeof(FrameHeader));
}
constexpr std::size_t kDtype = offsetof(internal::EncodedTensorHead, dtype);
constexpr std::size_t kNdim = offsetof(internal::EncodedTensorHead, ndim);
constexpr std::size_t kDevice = offsetof(internal::EncodedTensorHead, device);
constexpr std::size_t kStorageIndex = offsetof(internal::EncodedTensorHead, storage_index);
constexpr std::size_t kSize = sizeof(internal::EncodedTensorHead);

const Mutation kMutations[] = {
    {"dtype 12", [](auto& f) { put<std::uint8_t>(f, head_at(f) + kDtype, 12); },
     "unknown dtype 12"},
    {"ndim 65", [](auto& f) { put<std::uint8_t>(f, head_at(f) + kNdim, 65); },
     "tensor with 65 dimensions"},
    {"ndim 65, the body grown to the slot's room",
     [](auto& f) {
       put<std::uint8_t>(f, head_at(f) + kNdim, 65);
       f.resize(kSlotRoom);
       fix_body_size(f);
     },
     "tensor with 65 dimensions"},
    {"ndim 65, eight bytes appended, the body size not adjusted",
     [](auto& f) {
       put<std::uint8_t>(f, head_at(f) + kNdim, 65);
       f.resize(f.size() + 8);
     },
     "body size disagrees with the datagram", false, false},
    {"defined byte 2", [](auto& f) { put<std::uint8_t>(f, head_at(f), 2); },
     "invalid bool byte in message"},
    {"defined byte 0", [](auto& f) { put<std::uint8_t>(f, head_at(f), 0); },
     "31 trailing bytes after the value"},
    {"device byte 2", [](auto& f) { put<std::uint8_t>(f, head_at(f) + kDevice, 2); },
     "unknown device 2"},
    {"storage_index 1", [](auto& f) { put<std::uint32_t>(f, head_at(f) + kStorageIndex, 1); },
     "storage index out of range"},
    {"storage_index kEmptyTensor",
     [](auto& f) { put(f, head_at(f) + kStorageIndex, internal::kEmptyTensor); },
     "tensor without storage has elements"},
    {"size -1", [](auto& f) { put<std::int64_t>(f, head_at(f) + kSize, -1); },
     "negative tensor size"},
    {"size 17", [](auto& f) { put<std::int64_t>(f, head_at(f) + kSize, 17); },
     "tensor outside its storage: "},
    {"one trailing byte, the body size adjusted",
     [](auto& f) {
       f.push_back(std::byte{0});
       fix_body_size(f);
     },
     "1 trailing bytes after the value"},
    {"storage entry's nbytes 0",
     [](auto& f) {
       put<std::uint64_t>(
           f,
           head_at(f) - sizeof(internal::StorageEntry) + offsetof(internal::StorageEntry, nbytes),
           0);
     },
     "storage is not a block of its segment", false},
};

// A copy of the frame of `t` with `m` applied, with counts of its own (a TensorFrame each).
std::vector<std::byte> hostile_copy(const Tensor& t, const Mutation& m) {
  SlotBuffer buffer;
  TensorFrame f;
  EXPECT_TRUE(f.frame(t, kDeposited, buffer));
  std::vector<std::byte> bytes = bytes_of(f);
  m.apply(bytes);
  EXPECT_LE(bytes.size(), kSlotRoom);
  if (m.adopted) f.mark_sent();
  return bytes;
}

void push_slot(internal::Ring& ring, std::span<const std::byte> frame) {
  ASSERT_EQ(ring.push(frame, internal::kRingMessageTag, std::nullopt), internal::Ring::Status::kOk);
}

// The end `a` sends in: a hostile peer's view of it, to write slots into.
internal::Ring out_ring_of(const Connection& a) {
  internal::Ring ring =
      internal::Ring::attach(internal::dup_cloexec(internal::ConnectionAccess::fds(a)[2]));
  EXPECT_EQ(ring.max_message(), kSlotRoom);
  return ring;
}

// What the three parses say of one mutation, compared: the general path's error is the
// reference; it is the one the mutation means; parse_tensor_frame and recv<Tensor> say
// the same, word for word.
void expect_same_outcomes(const Mutation& m, const std::string& general, const std::string& fast,
                          const std::string& received) {
  EXPECT_NE(general.find(m.says), std::string::npos) << general;
  if (m.one_tensor)
    EXPECT_EQ(fast, general) << "parse_tensor_frame disagrees with the general path";
  else
    EXPECT_EQ(fast, "(not a one-tensor frame)");
  EXPECT_EQ(received, general) << "recv<Tensor> disagrees with the general path";
}

// The receiver holds the storage (sender and receiver are one process): each parse finds
// it here and gives the message's count back at once.
TEST_P(TensorFrameTest, HostileSlotsGetTheGeneralPathsErrorsWhereTheReceiverHoldsTheStorage) {
  auto [a, b] = pipe();
  Tensor t = Tensor::arange(16);
  a.send(t);  // deposits the segment with b (file_descriptor)
  EXPECT_TRUE(b.recv<Tensor>().equal(t));
  const Block block = block_of(t);
  const Counts before = counts_of(block);
  OneSegment depot{block.seg};
  internal::Ring ring = out_ring_of(a);
  for (const Mutation& m : kMutations) {
    SCOPED_TRACE(m.what);
    const std::string general = by_general_path(hostile_copy(t, m), depot);
    const std::string fast = by_parse_tensor_frame(hostile_copy(t, m), depot);
    push_slot(ring, hostile_copy(t, m));
    const std::string received = by_recv(b);
    expect_same_outcomes(m, general, fast, received);
    a.send(t);
    EXPECT_TRUE(b.recv<Tensor>().equal(t)) << "the connection goes on";
    EXPECT_EQ(counts_of(block), before);
  }
  EXPECT_FALSE(b.poll());
}

std::string as_string(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}
std::vector<std::byte> as_bytes(const std::string& s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

// The receiver maps the segment but holds no storage of it (the sender is a child): each
// parse adopts the block afresh, and its error drops the storage, giving the counts back.
TEST_P(TensorFrameTest, HostileSlotsGetTheGeneralPathsErrorsWhereTheReceiverAdoptsTheBlock) {
  auto [a, b] = pipe();
  // The child's copies for the parent's own parses, and the parent's "next" for each round.
  auto [side_child, side_parent] = pipe();
  const pid_t child = fork_child([&a = a, &b = b, &sc = side_child, &sp = side_parent] {
    b.close();
    sp.close();
    const Tensor t = Tensor::arange(16);
    a.send(t);  // deposits the segment with the parent (file_descriptor)
    internal::Ring ring = out_ring_of(a);
    for (const Mutation& m : kMutations) {
      ASSERT_EQ(sc.recv<std::string>(), "next");
      sc.send(as_string(hostile_copy(t, m)));  // for the general path
      sc.send(as_string(hostile_copy(t, m)));  // for parse_tensor_frame
      push_slot(ring, hostile_copy(t, m));
      a.send(t);
    }
    ASSERT_EQ(sc.recv<std::string>(), "done");  // holds `t` until the parent checked
  });
  a.close();
  side_child.close();
  Block block;
  {
    const Tensor first = b.recv<Tensor>();
    ASSERT_TRUE(first.equal(Tensor::arange(16)));
    block = block_of(first);
  }
  const Counts before = counts_of(block);  // the child's hold alone
  ASSERT_GE(block.seg->slot(), 0);
  ASSERT_EQ(before.word & (std::uint64_t{1} << block.seg->slot()), 0u)
      << "this process holds no storage of the block: each parse adopts it afresh";
  OneSegment depot{block.seg};
  for (const Mutation& m : kMutations) {
    SCOPED_TRACE(m.what);
    side_parent.send(std::string("next"));
    const std::string general = by_general_path(as_bytes(side_parent.recv<std::string>()), depot);
    const std::string fast =
        by_parse_tensor_frame(as_bytes(side_parent.recv<std::string>()), depot);
    const std::string received = by_recv(b);
    expect_same_outcomes(m, general, fast, received);
    EXPECT_TRUE(b.recv<Tensor>().equal(Tensor::arange(16))) << "the connection goes on";
    EXPECT_EQ(counts_of(block), before);
  }
  side_parent.send(std::string("done"));
  EXPECT_EQ(wait_child(child), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorFrameTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
