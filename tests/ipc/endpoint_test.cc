// Endpoint (src/transport/endpoint.h): one direction of a channel — its ring, its announced
// datagrams, its depot and its readiness fd — driven directly, without a Queue or a
// Connection around it: which frames take a slot, what a receive of each kind of slot
// returns, when the readiness fd is signalled and cleared, and a forked child's datagram
// with an fd, then a message that names the same segment from the depot.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "os/event_fd.h"
#include "os/poll.h"
#include "os/socket.h"
#include "os/unique_fd.h"
#include "shmtensor/error.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "transport/endpoint.h"
#include "transport/link_control.h"
#include "transport/ring.h"
#include "wire/wire.h"

namespace shmtensor {
namespace {

using internal::Deadline;
using internal::Endpoint;
using internal::EndpointWords;
using internal::LinkControl;
using internal::Ring;
using internal::UniqueFd;
using testing::fork_child;
using testing::wait_child;

Encoder encoded(const auto& value) {
  Encoder e;
  e.encode(value);
  return e;
}

// One direction over a ring of 8 slots of 256 bytes, its words in the ring's user area (as
// a connection's link keeps them), a socket pair for its datagrams and depot.
class EndpointTest : public testing::LeakCheckedTest {
 protected:
  void SetUp() override {
    LeakCheckedTest::SetUp();
    Ring ring = Ring::create(8, 256);
    words_ = new (ring.user_area()) LinkControl{};
    internal::init_depot(&words_->depot);
    ring_fd_ = internal::dup_cloexec(ring.fd());
    ready_ = internal::make_event_fd();
    auto [a, b] = internal::seqpacket_pair();
    send_sock_ = std::move(a);
    recv_sock_ = std::move(b);
    receiver_.emplace();
    bind(*receiver_, std::move(ring), /*sending=*/false);
  }
  void TearDown() override {
    receiver_.reset();
    ring_fd_.reset();
    ready_.reset();
    send_sock_.reset();
    recv_sock_.reset();
    LeakCheckedTest::TearDown();
  }
  // `e` over the same ring and words; as the sending side (datagrams out, deposits) or
  // the receiving one.
  void bind(Endpoint& e, Ring ring, bool sending) {
    EndpointWords w{&words_->send_lock,
                    &words_->recv_lock,
                    &words_->taken_below,
                    &words_->readiness_wanted,
                    &words_->signalling,
                    closed_,
                    nullptr,
                    nullptr};
    internal::EndpointSockets s;
    if (sending) {
      w.send_depot = &words_->depot;
      s.send = send_sock_.get();
      s.deposit = recv_sock_.get();
    } else {
      w.recv_depot = &words_->depot;
      s.recv = recv_sock_.get();
      s.peek = send_sock_.get();
    }
    e.bind(std::move(ring), internal::dup_cloexec(ready_.get()), w, s, internal::kQueueNames, 1);
  }
  Ring attach() { return Ring::attach(internal::dup_cloexec(ring_fd_.get())); }
  // A shared tensor framed on `sender` with its segment's fd, and sent as a datagram.
  static void send_datagram_of(Endpoint& sender, const Tensor& t) {
    internal::OutgoingFrame frame = sender.frame(encoded(t));
    ASSERT_EQ(frame.fds().size(), 1u);
    ASSERT_FALSE(sender.fits_slot(frame));
    ASSERT_EQ(sender.send_datagram(frame, std::nullopt), internal::AnnouncedSend::kSent);
  }
  bool readable() {
    const int fds[1] = {ready_.get()};
    return !internal::wait_readable(fds, std::chrono::nanoseconds(0)).empty();
  }
  // Pops the next slot and receives it on `receiver_`.
  std::optional<Decoder> receive_next() {
    auto buffer = internal::receive_buffer();
    Ring& ring = receiver_->ring();
    const Ring::Popped p = ring.pop(std::span(buffer.get(), ring.max_message()), Ring::kNoWait,
                                    internal::kRingMarkerTag);
    EXPECT_EQ(p.status, Ring::Status::kOk);
    if (p.status != Ring::Status::kOk) return std::nullopt;
    std::byte* data = buffer.get();
    return receiver_->receive(std::move(buffer), data, p, Deadline{});
  }

  LinkControl* words_ = nullptr;
  const std::atomic<std::uint32_t>* closed_ = nullptr;
  UniqueFd ring_fd_;
  UniqueFd ready_;
  UniqueFd send_sock_;
  UniqueFd recv_sock_;
  std::optional<Endpoint> receiver_;  // the direction's receiving side
};

TEST_F(EndpointTest, AFrameTakesASlotOnlyWithoutFdsAndWhenItFits) {
  Endpoint sender;
  bind(sender, attach(), /*sending=*/true);
  EXPECT_TRUE(sender.fits_slot(sender.frame(encoded(std::int64_t{42}))));
  EXPECT_FALSE(sender.fits_slot(sender.frame(encoded(std::string(300, 'x')))));  // > 240 B
  ASSERT_EQ(get_sharing_strategy(), SharingStrategy::kFileDescriptor);
  Tensor t = Tensor::arange(4);
  t.share_memory_();
  internal::OutgoingFrame with_fd = sender.frame(encoded(t));
  EXPECT_EQ(with_fd.fds().size(), 1u);
  EXPECT_FALSE(sender.fits_slot(with_fd));
}

TEST_F(EndpointTest, ASlotIsParsedAndASlotOfAnotherTagIsAProtocolError) {
  Endpoint sender;
  bind(sender, attach(), /*sending=*/true);
  internal::OutgoingFrame frame = sender.frame(encoded(std::int64_t{42}));
  ASSERT_EQ(sender.push(frame.parts(), Ring::kNoWait), Ring::Status::kOk);
  frame.sent = true;
  std::optional<Decoder> d = receive_next();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->decode<std::int64_t>(), 42);
  d->finish();

  const std::byte junk[8] = {};
  ASSERT_EQ(sender.ring().push(junk, 77, Ring::kNoWait), Ring::Status::kOk);
  EXPECT_ERROR((void)receive_next(), ProtocolError,
               "a slot of the queue's ring has tag 77, neither a message nor a marker");
}

TEST_F(EndpointTest, ASenderIsCountedAndSignalsOnlyWhileAReaderWantsTheFd) {
  Endpoint sender;
  bind(sender, attach(), /*sending=*/true);
  {
    const Endpoint::Signalling s(sender);
    EXPECT_EQ(words_->signalling.load(), 0u) << "nobody wants the fd: not counted";
  }
  sender.notify();
  EXPECT_FALSE(readable());

  receiver_->want();
  EXPECT_EQ(words_->readiness_wanted.load(), 1u);
  EXPECT_FALSE(readable()) << "an empty ring: want() leaves the fd clear";
  {
    Endpoint::Signalling s(sender);
    EXPECT_EQ(words_->signalling.load(), 1u);
    s.begin(sender);  // counted once however often it begins
    EXPECT_EQ(words_->signalling.load(), 1u);
    s.end();
    EXPECT_EQ(words_->signalling.load(), 0u);
  }
  EXPECT_EQ(words_->signalling.load(), 0u);
  sender.notify();
  EXPECT_TRUE(readable());
  receiver_->unwant();
  receiver_->unwant();  // never below 0
  EXPECT_EQ(words_->readiness_wanted.load(), 0u);
}

TEST_F(EndpointTest, RearmKeepsTheFdReadableWhileAMessageIsReadyAndClearsItAfter) {
  Endpoint sender;
  bind(sender, attach(), /*sending=*/true);
  receiver_->want();
  for (const std::int64_t v : {1, 2}) {
    internal::OutgoingFrame frame = sender.frame(encoded(v));
    ASSERT_EQ(sender.push(frame.parts(), Ring::kNoWait), Ring::Status::kOk);
    frame.sent = true;
    sender.notify();
  }
  std::optional<Decoder> first = receive_next();
  ASSERT_TRUE(first.has_value());
  receiver_->rearm();
  EXPECT_TRUE(readable()) << "a second message is ready";
  std::optional<Decoder> second = receive_next();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->decode<std::int64_t>(), 2);
  receiver_->rearm();
  EXPECT_FALSE(readable()) << "the ring is empty";
}

TEST_F(EndpointTest, AClosedFlagKeepsTheFdReadableOnAnEmptyRing) {
  std::atomic<std::uint32_t> closed{1};
  closed_ = &closed;
  Endpoint queue_like;
  bind(queue_like, attach(), /*sending=*/false);
  queue_like.want();
  EXPECT_TRUE(readable());
  queue_like.rearm();
  EXPECT_TRUE(readable()) << "a closed queue stays readable";
}

TEST_F(EndpointTest, AReaderThatAsksWhileAMessageIsReadyFindsTheFdReadableAtOnce) {
  Endpoint sender;
  bind(sender, attach(), /*sending=*/true);
  internal::OutgoingFrame frame = sender.frame(encoded(std::int64_t{7}));
  ASSERT_EQ(sender.push(frame.parts(), Ring::kNoWait), Ring::Status::kOk);
  frame.sent = true;
  sender.notify();
  EXPECT_FALSE(readable()) << "nobody wanted the fd when it was published";
  receiver_->want();
  EXPECT_TRUE(readable());
  std::optional<Decoder> d = receive_next();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->decode<std::int64_t>(), 7);
}

TEST_F(EndpointTest, ASegmentsFdTravelsOnceAndALaterMessageNamesItFromTheDepot) {
  ASSERT_EQ(get_sharing_strategy(), SharingStrategy::kFileDescriptor);
  // The child sends a tensor and then a view of it, and exits: the first message carries
  // the segment's fd (and deposits it), the second names the segment alone and fits a slot.
  const pid_t pid = fork_child([this] {
    Endpoint sender;
    bind(sender, attach(), /*sending=*/true);
    Tensor a = Tensor::arange(16);
    a.share_memory_();
    send_datagram_of(sender, a);
    internal::OutgoingFrame second = sender.frame(encoded(a.narrow(0, 8, 8)));
    ASSERT_TRUE(second.fds().empty()) << "the segment is in the depot: no fd";
    ASSERT_TRUE(sender.fits_slot(second));
    ASSERT_EQ(sender.push(second.parts(), Ring::kNoWait), Ring::Status::kOk);
    second.sent = true;
    EXPECT_EQ(sender.depot().counts().sent, 1u);
    EXPECT_EQ(sender.depot().counts().omitted, 1u);
  });
  ASSERT_EQ(wait_child(pid), 0);
  std::optional<Decoder> first = receive_next();
  ASSERT_TRUE(first.has_value());
  const Tensor a = first->decode<Tensor>();
  first->finish();
  std::optional<Decoder> second = receive_next();
  ASSERT_TRUE(second.has_value());
  const Tensor b = second->decode<Tensor>();
  second->finish();
  ASSERT_EQ(a.numel(), 16);
  ASSERT_EQ(b.numel(), 8);
  EXPECT_EQ(a.data_ptr<std::int64_t>()[15], 15);
  EXPECT_EQ(b.data_ptr<std::int64_t>()[7], 15);
  EXPECT_EQ(b.storage().data(), a.storage().data()) << "one storage in the receiver";
}

}  // namespace
}  // namespace shmtensor
