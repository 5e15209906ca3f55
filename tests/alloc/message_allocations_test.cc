// The codec's own bookkeeping allocates nothing once a thread has sent and received a few
// messages (docs/architecture.md, "wire"): its buffers and lists live in pooled message
// states. This program replaces the global operator new to count the allocations made
// while messages go back and forth, so that a change that brings per-message allocations
// back fails here rather than only in a profile. Nothing at all allocates in these common
// cases: a decoded Tensor keeps its sizes and strides inline (dims.h), and file_descriptor
// segments are named without fds once deposited.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/queue.h"
#include "support/strategy_test.h"
#include "transport/channel.h"
#include "wire/wire.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<std::int64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// The array forms too: the library's own default would call the operator new above, but a
// sanitizer's runtime replaces them directly (Dims allocates with new[]).
void* operator new[](std::size_t n) { return ::operator new(n); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace shmtensor {
namespace {

using MessageAllocationsTest = testing::StrategyTest;

// Allocations made by `fn`, counted on every thread.
template <class Fn>
std::int64_t allocations_during(Fn&& fn) {
  g_allocations = 0;
  g_counting = true;
  fn();
  g_counting = false;
  return g_allocations.load();
}

// One process, both ends of a connection: the receiver holds the tensor's storage already,
// so a round trip allocates nothing, the decoded Tensor included. With file_descriptor too:
// the segment was deposited with the peer by the first message, so later ones carry no fd
// list (they travel in the ring).
TEST_P(MessageAllocationsTest, ARoundTripOfAHeldTensorAllocatesNothing) {
  auto [a, b] = pipe();
  Tensor t = Tensor::arange(10, DType::kFloat32);
  for (int i = 0; i < 16; ++i) {  // warm-up: pools, buffers, the registry's tables
    a.send(t);
    (void)b.recv<Tensor>();
  }
  constexpr int kRounds = 1000;
  float sum = 0;
  const std::int64_t n = allocations_during([&] {
    for (int i = 0; i < kRounds; ++i) {
      a.send(t);
      Tensor got = b.recv<Tensor>();
      sum += got.data_ptr<float>()[9];
    }
  });
  EXPECT_EQ(sum, 9.0f * kRounds);
  EXPECT_EQ(n, 0) << "allocations in " << kRounds << " round trips";
}

// Beyond six dimensions a Tensor's sizes and strides go to the heap (dims.h): exactly
// those two allocations per decoded tensor, nothing else.
TEST_P(MessageAllocationsTest, ATensorOfSevenDimsAllocatesOnlyItsSizesAndStrides) {
  auto [a, b] = pipe();
  Tensor t = Tensor::arange(2 * 3 * 2 * 2 * 1 * 2 * 2, DType::kInt32).view({2, 3, 2, 2, 1, 2, 2});
  for (int i = 0; i < 16; ++i) {
    a.send(t);
    (void)b.recv<Tensor>();
  }
  constexpr int kRounds = 500;
  std::int64_t dims = 0;
  const std::int64_t n = allocations_during([&] {
    for (int i = 0; i < kRounds; ++i) {
      a.send(t);
      dims += b.recv<Tensor>().dim();
    }
  });
  EXPECT_EQ(dims, 7 * kRounds);
  EXPECT_EQ(n, 2 * kRounds) << "sizes and strides of the decoded tensors";
}

// A tuple of tensors and numbers through a queue: the same.
TEST_P(MessageAllocationsTest, ATupleThroughAQueueAllocatesNothing) {
  using Item = std::tuple<Tensor, std::int64_t, double, Tensor>;
  Queue<Item> q;
  // Made once, outside the count: the caller's allocations (the tensors' bytes), not the
  // message's.
  Item item{Tensor::ones({4, 3}, DType::kFloat64), 0, 0.5, Tensor::zeros({7}, DType::kInt32)};
  for (int i = 0; i < 16; ++i) {
    q.put(item);
    (void)q.get();
  }
  constexpr int kRounds = 500;
  std::int64_t labels = 0;
  const std::int64_t n = allocations_during([&] {
    for (int i = 0; i < kRounds; ++i) {
      std::get<1>(item) = i;
      q.put(item);
      auto [gx, label, w, gy] = q.get();
      labels += label + static_cast<std::int64_t>(w * 2) + gy.numel() - 7 + gx.numel() - 12;
    }
  });
  EXPECT_EQ(labels, std::int64_t{kRounds} * (kRounds - 1) / 2 + kRounds);
  // No fd list with file_descriptor either: the segments were deposited with the queue by
  // the first put, and items name them without fds.
  EXPECT_EQ(n, 0) << "allocations in " << kRounds << " round trips";
  const auto fds = internal::QueueAccess::core(q).fd_counts();
  if (GetParam() == SharingStrategy::kFileDescriptor) {
    EXPECT_EQ(fds.omitted, 2u * (16 + kRounds) - fds.sent);
    EXPECT_LE(fds.sent, 2u);  // the first put's (both tensors may share one segment)
  } else {
    EXPECT_EQ(fds.sent + fds.omitted, 0u);
  }
}

// States given back on another thread than the one that took them join that thread's
// pool, and a thread that exits frees its pool: values stay exact, nothing leaks.
TEST_P(MessageAllocationsTest, MessageStatesMayEndOnAnotherThread) {
  auto [a, b] = internal::ConnectionAccess::socket_pair();  // frames sent by hand
  Tensor t = Tensor::full({5}, 3.0, DType::kFloat64);
  for (int i = 0; i < 50; ++i) {
    {
      Encoder unsent;  // an encoder that ends, unsent, on another thread
      unsent.encode(t);
      std::thread([e = std::move(unsent)]() mutable { Encoder gone = std::move(e); }).join();
    }
    Encoder e;
    e.encode(t);
    internal::OutgoingFrame frame = internal::finish_frame(std::move(e));
    std::thread([&] {
      ASSERT_TRUE(internal::send_frame(a.native_handle(), frame, std::nullopt));
      internal::OutgoingFrame gone = std::move(frame);  // ends, sent, on this thread
    }).join();
    Decoder d = internal::parse_datagram(internal::receive_datagram(b.native_handle(), std::nullopt));
    Tensor got;
    std::thread([&] {
      got = d.decode<Tensor>();
      d.finish();
      Decoder gone = std::move(d);  // ends on this thread
    }).join();
    ASSERT_EQ(got.data_ptr<double>()[4], 3.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, MessageAllocationsTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
