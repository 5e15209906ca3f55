// Views read and write through to the same storage: view, reshape, select, slice with step,
// narrow, transpose, permute, unsqueeze/squeeze, expand; and their errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "unit/tensor_test_util.h"

namespace shmtensor {
namespace {

using testing::ints;
using V = std::vector<std::int64_t>;

Tensor iota(V sizes) { return Tensor::arange(12).view(std::move(sizes)); }

TEST(TensorViewTest, ViewSharesStorageAndInfersOneSize) {
  Tensor t = Tensor::arange(12);
  Tensor v = t.view({3, 4});
  EXPECT_TRUE(v.storage().is_same(t.storage()));
  EXPECT_EQ(v.sizes(), (V{3, 4}));
  EXPECT_EQ(v.strides(), (V{4, 1}));
  EXPECT_EQ(v.view({-1, 6}).sizes(), (V{2, 6}));
  EXPECT_EQ(v.view({2, -1, 3}).sizes(), (V{2, 2, 3}));
  EXPECT_EQ(v.view({12, 1}).sizes(), (V{12, 1}));
  v.data_ptr<std::int64_t>()[5] = 100;
  EXPECT_EQ(t.data_ptr<std::int64_t>()[5], 100);
  EXPECT_ERROR((void)t.view({5, -1}), std::invalid_argument,
               "shape \'[5, -1]\' is invalid for input of size 12");
  EXPECT_ERROR((void)t.view({-1, -1}), std::invalid_argument, "only one dimension can be inferred");
  EXPECT_ERROR((void)t.view({13}), std::invalid_argument,
               "shape \'[13]\' is invalid for input of size 12");
  EXPECT_ERROR((void)t.view({-2, 6}), std::invalid_argument, "invalid shape dimension -2");
}

TEST(TensorViewTest, ViewOfIncompatibleStridesThrowsLikeTorch) {
  Tensor t = iota({3, 4}).transpose(0, 1);
  try {
    (void)t.view({12});
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "view size is not compatible with input tensor's size and stride"),
              std::string::npos)
        << e.what();
  }
  // Splitting a dimension of a non-contiguous tensor is still a view, and so is merging
  // dimensions whose strides line up.
  Tensor s = iota({3, 4}).narrow(1, 0, 3);  // sizes [3, 3], strides [4, 1]
  Tensor v = s.view({3, 3, 1});
  EXPECT_TRUE(v.storage().is_same(s.storage()));
  EXPECT_EQ(ints(v), (V{0, 1, 2, 4, 5, 6, 8, 9, 10}));
  Tensor even = iota({3, 4}).slice(1, 0, 4, 2);  // sizes [3, 2], strides [4, 2]
  EXPECT_EQ(even.view({6}).strides(), (V{2}));
  EXPECT_EQ(ints(even.view({6})), (V{0, 2, 4, 6, 8, 10}));
  EXPECT_ERROR((void)s.view({9}), std::invalid_argument,
               "view size is not compatible with input tensor\'s size and stride");
}

TEST(TensorViewTest, ReshapeViewsWhenPossibleElseCopies) {
  Tensor t = iota({3, 4});
  Tensor r = t.reshape({4, 3});
  EXPECT_TRUE(r.storage().is_same(t.storage()));
  Tensor tt = t.transpose(0, 1);
  Tensor c = tt.reshape({-1});
  EXPECT_FALSE(c.storage().is_same(t.storage()));
  EXPECT_EQ(ints(c), (V{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_EQ(tt.flatten().sizes(), (V{12}));
  EXPECT_ERROR((void)t.reshape({5}), std::invalid_argument,
               "shape \'[5]\' is invalid for input of size 12");
}

TEST(TensorViewTest, SelectAndIndexWriteThrough) {
  Tensor t = iota({3, 4});
  EXPECT_EQ(ints(t[1]), (V{4, 5, 6, 7}));
  EXPECT_EQ(ints(t[-1]), (V{8, 9, 10, 11}));
  EXPECT_EQ(ints(t.select(1, 2)), (V{2, 6, 10}));
  EXPECT_EQ(ints(t.select(-1, -1)), (V{3, 7, 11}));
  EXPECT_EQ(t[2][3].item<int>(), 11);
  EXPECT_EQ(t[2][3].dim(), 0);
  t.select(1, 0).fill_(-5);
  EXPECT_EQ(ints(t), (V{-5, 1, 2, 3, -5, 5, 6, 7, -5, 9, 10, 11}));
  EXPECT_ERROR((void)t[3], std::out_of_range,
               "index 3 out of range for tensor of size [3, 4] at dimension 0");
  EXPECT_ERROR((void)t[-4], std::out_of_range,
               "index -4 out of range for tensor of size [3, 4] at dimension 0");
  EXPECT_ERROR((void)t.select(2, 0), std::out_of_range,
               "Dimension out of range (expected to be in range of [-2, 1], but got 2)");
}

TEST(TensorViewTest, SliceClampsLikePythonAndSteps) {
  Tensor t = Tensor::arange(10);
  EXPECT_EQ(ints(t.slice(0, 1, 8, 3)), (V{1, 4, 7}));
  EXPECT_EQ(ints(t.slice(0, 1, 9, 3)), (V{1, 4, 7}));
  EXPECT_EQ(ints(t.slice(0, 1, 10, 3)), (V{1, 4, 7}));
  EXPECT_EQ(ints(t.slice(0, 0, 10, 4)), (V{0, 4, 8}));
  EXPECT_EQ(ints(t.slice(0, -3)), (V{7, 8, 9}));
  EXPECT_EQ(ints(t.slice(0, 2, -5)), (V{2, 3, 4}));
  EXPECT_EQ(ints(t.slice(0, -100, 100)), ints(t));
  EXPECT_EQ(t.slice(0, 5, 2).numel(), 0);
  EXPECT_EQ(t.slice(0, 10).numel(), 0);
  EXPECT_EQ(ints(t.slice(0, 3, 4, Tensor::kSliceEnd)), (V{3}));
  EXPECT_ERROR((void)t.slice(0, 0, 5, 0), std::invalid_argument, "slice step must be positive");
  EXPECT_ERROR((void)t.slice(0, 0, 5, -1), std::invalid_argument, "slice step must be positive");
  Tensor m = iota({3, 4});
  Tensor s = m.slice(1, 1, 4, 2);
  EXPECT_EQ(s.sizes(), (V{3, 2}));
  EXPECT_EQ(s.strides(), (V{4, 2}));
  EXPECT_EQ(s.storage_offset(), 1);
  EXPECT_FALSE(s.is_contiguous());
  s.fill_(0);
  EXPECT_EQ(ints(m), (V{0, 0, 2, 0, 4, 0, 6, 0, 8, 0, 10, 0}));
}

TEST(TensorViewTest, Narrow) {
  Tensor t = Tensor::arange(10);
  EXPECT_EQ(ints(t.narrow(0, 2, 3)), (V{2, 3, 4}));
  EXPECT_EQ(ints(t.narrow(0, -2, 2)), (V{8, 9}));
  EXPECT_EQ(t.narrow(0, 10, 0).numel(), 0);
  EXPECT_ERROR((void)t.narrow(0, 8, 3), std::out_of_range,
               "start (8) + length (3) exceeds dimension size (10)");
  EXPECT_ERROR((void)t.narrow(0, 11, 0), std::out_of_range,
               "start 11 out of range for dimension of size 10");
  EXPECT_ERROR((void)t.narrow(0, 0, -1), std::invalid_argument,
               "narrow(): length -1 is negative; from start 0 in dimension 0 of size 10 a "
               "length is 0 to 10");
  EXPECT_ERROR((void)t.narrow(-1, -3, -2), std::invalid_argument,
               "narrow(): length -2 is negative; from start 7 in dimension 0 of size 10 a "
               "length is 0 to 3");
  Tensor m = iota({3, 4});
  m.narrow(1, 1, 2).add_(100);
  EXPECT_EQ(ints(m[0]), (V{0, 101, 102, 3}));
}

TEST(TensorViewTest, TransposeAndPermute) {
  Tensor t = iota({3, 4});
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.sizes(), (V{4, 3}));
  EXPECT_EQ(tt.strides(), (V{1, 4}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(ints(tt), (V{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  tt[3][2].fill_(-1);
  EXPECT_EQ(t[2][3].item<int>(), -1);
  EXPECT_EQ(t.transpose(-1, 0).sizes(), (V{4, 3}));
  EXPECT_ERROR((void)t.transpose(0, 2), std::out_of_range,
               "Dimension out of range (expected to be in range of [-2, 1], but got 2)");

  Tensor c = Tensor::arange(24).view({2, 3, 4});
  Tensor p = c.permute({2, 0, 1});
  EXPECT_EQ(p.sizes(), (V{4, 2, 3}));
  EXPECT_EQ(p.strides(), (V{1, 12, 4}));
  EXPECT_EQ(p[1][1][2].item<int>(), c[1][2][1].item<int>());
  EXPECT_ERROR((void)c.permute({0, 1}), std::invalid_argument,
               "permute: number of dims 2 does not match tensor dim 3");
  EXPECT_ERROR((void)c.permute({0, 1, 1}), std::invalid_argument, "permute: repeated dim 1");
}

TEST(TensorViewTest, UnsqueezeSqueezeExpand) {
  Tensor t = Tensor::arange(3);
  EXPECT_EQ(t.unsqueeze(0).sizes(), (V{1, 3}));
  EXPECT_EQ(t.unsqueeze(-1).sizes(), (V{3, 1}));
  EXPECT_TRUE(t.unsqueeze(0).is_contiguous());
  EXPECT_TRUE(t.unsqueeze(1).is_contiguous());
  EXPECT_ERROR((void)t.unsqueeze(2), std::out_of_range,
               "Dimension out of range (expected to be in range of [-2, 1], but got 2)");
  Tensor u = Tensor::zeros({1, 3, 1});
  EXPECT_EQ(u.squeeze().sizes(), (V{3}));
  EXPECT_EQ(u.squeeze(0).sizes(), (V{3, 1}));
  EXPECT_EQ(u.squeeze(1).sizes(), (V{1, 3, 1}));
  EXPECT_EQ(Tensor::zeros({}).unsqueeze(0).sizes(), (V{1}));

  Tensor e = t.unsqueeze(0).expand({2, -1});
  EXPECT_EQ(e.sizes(), (V{2, 3}));
  EXPECT_EQ(e.strides(), (V{0, 1}));
  EXPECT_EQ(ints(e), (V{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(ints(t.expand({2, 3})), (V{0, 1, 2, 0, 1, 2}));
  EXPECT_ERROR((void)t.expand({4}), std::invalid_argument,
               "the expanded size of the tensor (4) must match the existing size (3)");
  EXPECT_ERROR((void)t.expand({-1, 3}), std::invalid_argument,
               "size -1 is not allowed in a leading, non-existing dimension");
}

TEST(TensorViewTest, ContiguousAndCloneAreIndependentCopies) {
  Tensor t = iota({3, 4});
  Tensor same = t.contiguous();
  EXPECT_TRUE(same.storage().is_same(t.storage()));
  Tensor tt = t.transpose(0, 1);
  Tensor c = tt.contiguous();
  EXPECT_FALSE(c.storage().is_same(t.storage()));
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_TRUE(c.equal(tt));
  c.fill_(0);
  EXPECT_EQ(t[1][1].item<int>(), 5);

  Tensor k = t.clone();
  EXPECT_FALSE(k.storage().is_same(t.storage()));
  EXPECT_EQ(ints(k), ints(t));
  k.add_(1);
  EXPECT_EQ(t[0][0].item<int>(), 0);
  EXPECT_EQ(k[0][0].item<int>(), 1);
  // A clone of a view holds only the view's elements.
  EXPECT_EQ(t[2].clone().storage().nbytes(), 4 * sizeof(std::int64_t));
}

TEST(TensorViewTest, EmptyTensorsEverywhere) {
  Tensor e = Tensor::zeros({2, 0, 3});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(e.nbytes(), 0u);
  EXPECT_TRUE(e.is_contiguous());
  EXPECT_EQ(e.view({0, 5}).sizes(), (V{0, 5}));
  EXPECT_EQ(e.view({-1, 3}).sizes(), (V{0, 3}));
  EXPECT_ERROR((void)e.view({-1, 0}), std::invalid_argument,
               "the unspecified dimension size -1 can be any value");
  EXPECT_EQ(e.reshape({3, 0}).sizes(), (V{3, 0}));
  EXPECT_EQ(e[1].sizes(), (V{0, 3}));
  EXPECT_EQ(e.slice(2, 1).sizes(), (V{2, 0, 2}));
  EXPECT_EQ(e.transpose(0, 2).sizes(), (V{3, 0, 2}));
  EXPECT_EQ(e.clone().sizes(), (V{2, 0, 3}));
  EXPECT_EQ(e.contiguous().numel(), 0);
  EXPECT_ERROR((void)e.select(1, 0), std::out_of_range,
               "index 0 out of range for tensor of size [2, 0, 3] at dimension 1");
  Tensor x = Tensor::arange(4);
  Tensor tail = x.slice(0, 4);
  EXPECT_EQ(tail.numel(), 0);
  // An empty view keeps an offset inside the storage, so it can always be sent and rebuilt.
  EXPECT_LE(tail.storage_offset() * 8, static_cast<std::int64_t>(x.storage().nbytes()));
  EXPECT_NO_THROW((void)Tensor::from_storage(tail.storage(), tail.storage_offset(), tail.sizes(),
                                             tail.strides(), tail.dtype()));
}

}  // namespace
}  // namespace shmtensor
