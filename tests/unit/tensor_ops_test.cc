// copy_ (dtype conversion, broadcasting, overlap), fill_, add_, to, equal.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "unit/tensor_test_util.h"

namespace shmtensor {
namespace {

using testing::doubles;
using testing::ints;
using testing::values;
using V = std::vector<std::int64_t>;

TEST(TensorCopyTest, CopyConvertsDTypes) {
  Tensor f = Tensor::from_vector<float>({1.5f, -2.7f, 300.0f, -1.0f});
  EXPECT_EQ(ints(Tensor::zeros({4}, DType::kInt32).copy_(f)), (V{1, -2, 300, -1}));
  // Float to integer truncates and saturates (NaN gives 0) instead of being undefined.
  EXPECT_EQ(ints(Tensor::zeros({4}, DType::kUInt8).copy_(f)), (V{1, 0, 255, 0}));
  Tensor nan = Tensor::from_vector<double>({std::nan(""), 1e300, -1e300});
  EXPECT_EQ(
      values<std::int64_t>(Tensor::zeros({3}, DType::kInt64).copy_(nan)),
      (V{0, std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min()}));
  // Integer to narrower integer wraps, as torch.
  Tensor i = Tensor::from_vector<std::int64_t>({-1, 256, 257});
  EXPECT_EQ(ints(Tensor::zeros({3}, DType::kUInt8).copy_(i)), (V{255, 0, 1}));
  // To bool is != 0, from bool is 0/1.
  Tensor z = Tensor::from_vector<double>({0.0, 0.5, -0.0, -3.0});
  EXPECT_EQ(values<bool>(Tensor::zeros({4}, DType::kBool).copy_(z)),
            (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(doubles(Tensor::from_vector(std::vector<bool>{true, false})),
            (std::vector<double>{1, 0}));
  // Half and BFloat16 round to nearest even.
  Tensor h =
      Tensor::zeros({3}, DType::kFloat16).copy_(Tensor::from_vector<float>({1.0f, 0.1f, 65520.0f}));
  const Half* hp = h.data_ptr<Half>();
  EXPECT_EQ(hp[0].bits, 0x3C00);
  EXPECT_EQ(hp[1].bits, 0x2E66);
  EXPECT_EQ(hp[2].bits, 0x7C00);
  Tensor b = Tensor::zeros({1}, DType::kBFloat16).copy_(h.slice(0, 1, 2));
  EXPECT_EQ(b.data_ptr<BFloat16>()[0].bits, BFloat16(static_cast<float>(hp[1])).bits);
  // Complex: real part out, imaginary 0 in.
  Tensor c = Tensor::from_vector<std::complex<double>>({{1.5, 2.0}, {-3.0, -4.0}});
  EXPECT_EQ(doubles(c), (std::vector<double>{1.5, -3.0}));
  EXPECT_EQ(values<bool>(Tensor::zeros({2}, DType::kBool)
                             .copy_(Tensor::from_vector<std::complex<float>>({{0, 1}, {0, 0}}))),
            (std::vector<bool>{true, false}));
  Tensor cf = Tensor::zeros({2}, DType::kComplex64).copy_(Tensor::arange(2));
  EXPECT_EQ(cf.data_ptr<std::complex<float>>()[1], std::complex<float>(1, 0));
  Tensor cc = Tensor::zeros({2}, DType::kComplex64).copy_(c);
  EXPECT_EQ(cc.data_ptr<std::complex<float>>()[1], std::complex<float>(-3, -4));
}

TEST(TensorCopyTest, CopyIntoStridedViewsAndFromStridedSources) {
  Tensor m = Tensor::zeros({3, 4}, DType::kInt64);
  m.select(1, 2).copy_(Tensor::from_vector<std::int32_t>({7, 8, 9}));
  EXPECT_EQ(ints(m), (V{0, 0, 7, 0, 0, 0, 8, 0, 0, 0, 9, 0}));
  Tensor src = Tensor::arange(12).view({3, 4}).transpose(0, 1);
  Tensor dst = Tensor::zeros({4, 3}, DType::kFloat32).copy_(src);
  EXPECT_EQ(doubles(dst), (std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  Tensor& r = dst.copy_(src);
  EXPECT_EQ(&r, &dst);
}

TEST(TensorCopyTest, CopyBroadcastsTheSource) {
  Tensor t = Tensor::zeros({2, 3}, DType::kInt32);
  t.copy_(Tensor::from_vector<std::int32_t>({1, 2, 3}));
  EXPECT_EQ(ints(t), (V{1, 2, 3, 1, 2, 3}));
  t.copy_(Tensor::from_vector<std::int32_t>({5, 6}, {2, 1}));
  EXPECT_EQ(ints(t), (V{5, 5, 5, 6, 6, 6}));
  t.copy_(Tensor::full({}, 4.0));
  EXPECT_EQ(ints(t), (V{4, 4, 4, 4, 4, 4}));
  EXPECT_ERROR(t.copy_(Tensor::zeros({2})), std::invalid_argument,
               "source of sizes [2] cannot be broadcast to sizes [2, 3]");
  EXPECT_ERROR(t.copy_(Tensor::zeros({3, 2})), std::invalid_argument,
               "source of sizes [3, 2] cannot be broadcast to sizes [2, 3]");
  EXPECT_ERROR(t.copy_(Tensor()), std::invalid_argument,
               "Tensor::copy_: the source tensor is undefined (a default-constructed Tensor has "
               "no elements); give a defined tensor whose sizes broadcast to [2, 3]");
  EXPECT_ERROR(Tensor().copy_(t), std::invalid_argument, "Tensor::copy_: the tensor is undefined");
  Tensor e = Tensor::zeros({0, 3});
  EXPECT_NO_THROW(e.copy_(Tensor::zeros({3})));
}

TEST(TensorCopyTest, CopyFromAnOverlappingViewOfTheSameStorage) {
  Tensor t = Tensor::arange(9).view({3, 3});
  t.copy_(t.transpose(0, 1));
  EXPECT_EQ(ints(t), (V{0, 3, 6, 1, 4, 7, 2, 5, 8}));
  Tensor x = Tensor::arange(6);
  x.slice(0, 1).copy_(x.slice(0, 0, 5));
  EXPECT_EQ(ints(x), (V{0, 0, 1, 2, 3, 4}));
}

TEST(TensorOpsTest, FillAndAdd) {
  Tensor t = Tensor::zeros({2, 3}, DType::kFloat64);
  t.transpose(0, 1)[1].fill_(2.5);
  EXPECT_EQ(doubles(t), (std::vector<double>{0, 2.5, 0, 0, 2.5, 0}));
  t.add_(1);
  EXPECT_EQ(doubles(t), (std::vector<double>{1, 3.5, 1, 1, 3.5, 1}));
  EXPECT_EQ(&t.fill_(0), &t);

  Tensor i8 = Tensor::from_vector<std::int8_t>({127, -128, 0});
  i8.add_(1);
  EXPECT_EQ(ints(i8), (V{-128, -127, 1}));  // wraps
  i8.add_(-2);
  EXPECT_EQ(ints(i8), (V{126, 127, -1}));
  EXPECT_ERROR(i8.add_(0.5), std::invalid_argument, "cannot add the non-integral value 0.5");
  EXPECT_ERROR(i8.add_(std::numeric_limits<double>::infinity()), std::invalid_argument,
               "cannot add the non-integral value inf");

  Tensor b = Tensor::from_vector(std::vector<bool>{true, false});
  b.add_(0);
  EXPECT_EQ(values<bool>(b), (std::vector<bool>{true, false}));
  b.add_(1);
  EXPECT_EQ(values<bool>(b), (std::vector<bool>{true, true}));
  b.fill_(0.0);
  EXPECT_EQ(values<bool>(b), (std::vector<bool>{false, false}));

  Tensor h = Tensor::ones({2}, DType::kFloat16);
  h.add_(0.5);
  EXPECT_EQ(h.data_ptr<Half>()[1].bits, Half(1.5f).bits);
  Tensor bf = Tensor::ones({1}, DType::kBFloat16).add_(1);
  EXPECT_EQ(bf.item<float>(), 2.0f);
  Tensor c = Tensor::ones({1}, DType::kComplex128);
  c.fill_(std::complex<double>(1, 2)).add_(1);
  EXPECT_EQ(c.item<std::complex<double>>(), std::complex<double>(2, 2));
  Tensor u = Tensor::zeros({1}, DType::kUInt8).add_(-1);
  EXPECT_EQ(u.item<int>(), 255);
  Tensor l = Tensor::full({1}, 0, DType::kInt64).add_(1e15);
  EXPECT_EQ(l.item<std::int64_t>(), 1000000000000000);
  Tensor e = Tensor::zeros({0});
  EXPECT_NO_THROW(e.fill_(1).add_(1));
}

TEST(TensorOpsTest, ToConvertsOrReturnsSelf) {
  Tensor t = Tensor::arange(3);
  Tensor same = t.to(DType::kInt64);
  EXPECT_TRUE(same.storage().is_same(t.storage()));
  Tensor f = t.to(DType::kFloat32);
  EXPECT_EQ(f.dtype(), DType::kFloat32);
  EXPECT_EQ(doubles(f), (std::vector<double>{0, 1, 2}));
}

TEST(TensorOpsTest, Equal) {
  Tensor a = Tensor::arange(6).view({2, 3});
  EXPECT_TRUE(a.equal(a));
  EXPECT_TRUE(a.equal(a.clone()));
  EXPECT_TRUE(a.transpose(0, 1).equal(a.transpose(0, 1).contiguous()));
  EXPECT_FALSE(a.equal(a.view({3, 2})));       // sizes differ
  EXPECT_FALSE(a.equal(a.to(DType::kInt32)));  // dtype differs
  Tensor b = a.clone();
  b[1][2].fill_(0);
  EXPECT_FALSE(a.equal(b));
  Tensor nan = Tensor::full({1}, std::nan(""));
  EXPECT_FALSE(nan.equal(nan));
  EXPECT_TRUE(Tensor::full({1}, -0.0).equal(Tensor::zeros({1})));
  EXPECT_TRUE(Tensor::full({1}, -0.0, DType::kFloat16).equal(Tensor::zeros({1}, DType::kFloat16)));
  EXPECT_TRUE(Tensor::zeros({0, 2}).equal(Tensor::ones({0, 2})));
  EXPECT_FALSE(Tensor::zeros({0, 2}).equal(Tensor::zeros({2, 0})));
  EXPECT_TRUE(Tensor().equal(Tensor()));
  EXPECT_FALSE(Tensor().equal(a));
  EXPECT_FALSE(a.equal(Tensor()));
}

// A Tensor is a handle: as in libtorch, a const handle still writes its bytes, and a lambda
// that captures a tensor by value can fill it.
TEST(TensorConstHandle, InPlaceOpsAndDataPtrWorkThroughAConstHandle) {
  const Tensor t = Tensor::zeros({3});
  t.fill_(2.0).add_(1.0);
  t.data_ptr<float>()[0] = 7.0f;
  const Tensor u = Tensor::zeros({3});
  u.copy_(t).share_memory_();
  EXPECT_TRUE(u.is_shared());
  auto fill = [u] { u.fill_(5.0); };
  fill();
  EXPECT_EQ(t.data_ptr<float>()[0], 7.0f);
  EXPECT_EQ(t.data_ptr<float>()[2], 3.0f);
  EXPECT_EQ(u.data_ptr<float>()[1], 5.0f);
}

TEST(TensorConstHandle, ToStringGivesAStdString) {
  std::string dtype = to_string(DType::kBFloat16);
  EXPECT_EQ(dtype, "bfloat16");
  EXPECT_EQ("strategy=" + to_string(SharingStrategy::kFileSystem), "strategy=file_system");
}

}  // namespace
}  // namespace shmtensor
