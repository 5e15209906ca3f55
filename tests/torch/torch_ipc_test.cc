// The libtorch bridge across processes: a torch tensor travels as a shmtensor Tensor through
// a Queue or a Connection to a forked child, which writes through torch; the parent's torch
// tensor sees the writes. Both sharing strategies. The tensors are small: torch runs no
// parallel region on them, which a forked child of a process that ran one cannot.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "shmtensor/connection.h"
#include "shmtensor/queue.h"
#include "shmtensor/torch.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::wait_child;

class TorchIpcTest : public testing::StrategyTest {};

TEST_P(TorchIpcTest, ACopiedTorchTensorTravelsThroughAQueueAndTheChildsWritesShow) {
  at::Tensor original = at::arange(12, at::kInt).view({3, 4});
  Tensor shared = from_torch(original);  // a foreign tensor: copied into shared memory
  ASSERT_TRUE(shared.is_shared());
  EXPECT_EQ(shared.storage().sharing_strategy(), GetParam());
  Queue<Tensor> q;
  auto [done, wait] = pipe();
  pid_t child = fork_child([&, &done = done] {
    at::Tensor t = to_torch(q.get());
    EXPECT_TRUE(at::equal(t, at::arange(12, at::kInt).view({3, 4})));
    t.mul_(10);
    done.send(1);
  });
  done.close();
  q.put(shared);
  EXPECT_EQ(wait.recv<int>(), 1);
  EXPECT_EQ(wait_child(child), 0);
  at::Tensor seen = to_torch(shared);
  EXPECT_TRUE(at::equal(seen, at::arange(12, at::kInt).view({3, 4}) * 10));
  EXPECT_TRUE(at::equal(original, at::arange(12, at::kInt).view({3, 4})));  // a copy
}

TEST_P(TorchIpcTest, AStorageMovedInPlaceIsWrittenByTheChildThroughAView) {
  at::Tensor base = at::zeros({4, 5}, at::kDouble);
  at::Tensor column = base.t().select(0, 2);  // a strided view made before the move
  ASSERT_TRUE(share_memory_(*base.storage().unsafeGetStorageImpl()).has_value());
  Tensor view = from_torch(column);  // zero-copy now
  ASSERT_TRUE(view.is_shared());
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    at::Tensor t = to_torch(b.recv<Tensor>());
    EXPECT_EQ(t.sizes().vec(), (std::vector<std::int64_t>{4}));
    EXPECT_EQ(t.strides().vec(), (std::vector<std::int64_t>{5}));
    t.copy_(at::arange(4, at::kDouble) + 0.5);
    b.send(1);
  });
  b.close();
  a.send(view);
  EXPECT_EQ(a.recv<int>(), 1);
  EXPECT_EQ(wait_child(child), 0);
  // The parent's own torch tensors see it: the original base and the view made before.
  EXPECT_TRUE(at::equal(column, at::arange(4, at::kDouble) + 0.5));
  EXPECT_EQ(base[3][2].item<double>(), 3.5);
  EXPECT_EQ(base.sum().item<double>(), 0.5 + 1.5 + 2.5 + 3.5);
}

INSTANTIATE_TEST_SUITE_P(Strategies, TorchIpcTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
