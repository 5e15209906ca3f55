// Factories for every dtype, from_vector, and stack / stack_into.
#include <gtest/gtest.h>

#include <complex>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "unit/tensor_test_util.h"

namespace shmtensor {
namespace {

using testing::ints;
using testing::make;
using testing::same;
using testing::values;
using V = std::vector<std::int64_t>;

template <class T>
class TensorFactoryTest : public ::testing::Test {};
TYPED_TEST_SUITE(TensorFactoryTest, testing::AllElementTypes);

template <class T>
void expect_all(const Tensor& t, const T& expected) {
  for (const T& v : values<T>(t)) EXPECT_TRUE(same(v, expected));
}

TYPED_TEST(TensorFactoryTest, EveryFactoryForEveryDType) {
  using T = TypeParam;
  constexpr DType kDType = dtype_of_v<T>;
  Tensor e = Tensor::empty({2, 3}, kDType);
  EXPECT_EQ(e.dtype(), kDType);
  EXPECT_EQ(e.sizes(), (V{2, 3}));
  EXPECT_EQ(e.nbytes(), 6 * sizeof(T));
  EXPECT_FALSE(e.is_shared());

  expect_all<T>(Tensor::zeros({2, 3}, kDType), make<T>(0));
  expect_all<T>(Tensor::ones({4}, kDType), make<T>(1));
  expect_all<T>(Tensor::full({3, 1}, 3.0, kDType), make<T>(3));
  expect_all<T>(Tensor::zeros_like(e), make<T>(0));
  EXPECT_EQ(Tensor::empty_like(e).sizes(), e.sizes());
  EXPECT_EQ(Tensor::empty_like(e).dtype(), kDType);

  const auto a = values<T>(Tensor::arange(5, kDType));
  ASSERT_EQ(a.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(same(a[i], make<T>(i))) << i;

  Tensor v = Tensor::from_vector<T>({make<T>(1), make<T>(0), make<T>(2), make<T>(1)}, {2, 2});
  EXPECT_EQ(v.dtype(), kDType);
  EXPECT_EQ(v.sizes(), (V{2, 2}));
  const auto got = values<T>(v);
  EXPECT_TRUE(same(got[0], make<T>(1)) && same(got[1], make<T>(0)) && same(got[2], make<T>(2)) &&
              same(got[3], make<T>(1)));

  Tensor z = Tensor::zeros({0}, kDType);
  EXPECT_EQ(z.numel(), 0);
  EXPECT_TRUE(Tensor::full({0, 4}, 1.0, kDType).equal(Tensor::zeros({0, 4}, kDType)));
}

TYPED_TEST(TensorFactoryTest, SharedFactoriesForEveryDType) {
  using T = TypeParam;
  Tensor s = Tensor::zeros_shared({5}, dtype_of_v<T>);
  EXPECT_TRUE(s.is_shared());
  expect_all<T>(s, make<T>(0));
  s.fill_(1);
  expect_all<T>(s, make<T>(1));
}

TEST(TensorFactoryTest, FullConvertsTheValue) {
  EXPECT_EQ(ints(Tensor::full({2}, 2.9, DType::kInt32)), (V{2, 2}));
  EXPECT_EQ(ints(Tensor::full({2}, -2.9, DType::kInt8)), (V{-2, -2}));
  EXPECT_EQ(ints(Tensor::full({1}, 1e10, DType::kInt16)), (V{32767}));  // saturates
  EXPECT_EQ(ints(Tensor::full({1}, 0.5, DType::kBool)), (V{1}));
  EXPECT_EQ(Tensor::full({1}, 0.1, DType::kFloat16).data_ptr<Half>()[0].bits, 0x2E66);
  EXPECT_EQ(Tensor::full({1}, 1.0, DType::kBFloat16).data_ptr<BFloat16>()[0].bits, 0x3F80);
  Tensor c = Tensor::full({2}, std::complex<double>(1, -1));
  EXPECT_EQ(c.dtype(), DType::kComplex64);
  EXPECT_EQ(c.data_ptr<std::complex<float>>()[1], std::complex<float>(1, -1));
  EXPECT_EQ(Tensor::full({1}, std::complex<double>(2, 5), DType::kFloat64).item<double>(), 2.0);
}

TEST(TensorFactoryTest, BadSizesThrow) {
  EXPECT_ERROR((void)Tensor::empty({2, -1}), std::invalid_argument,
               "negative dimension -1 in sizes [2, -1]");
  EXPECT_ERROR((void)Tensor::zeros({-3}), std::invalid_argument,
               "negative dimension -3 in sizes [-3]");
  EXPECT_ERROR((void)Tensor::empty({std::int64_t{1} << 62, 4}), std::invalid_argument,
               "sizes [4611686018427387904, 4] overflow int64");
  EXPECT_ERROR((void)Tensor::arange(-1), std::invalid_argument,
               "Tensor::arange: n must be >= 0, got -1");
  EXPECT_EQ(Tensor::arange(0).numel(), 0);
}

TEST(TensorFactoryTest, FromVector) {
  Tensor t = Tensor::from_vector(std::vector<float>{1.5f, 2.5f, 3.5f});
  EXPECT_EQ(t.dtype(), DType::kFloat32);
  EXPECT_EQ(t.sizes(), (V{3}));
  EXPECT_EQ(t[2].item<float>(), 3.5f);
  Tensor b = Tensor::from_vector(std::vector<bool>{true, false, true});
  EXPECT_EQ(b.dtype(), DType::kBool);
  EXPECT_EQ(ints(b), (V{1, 0, 1}));
  Tensor m = Tensor::from_vector<std::int32_t>({1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(m.sizes(), (V{3, 2}));
  EXPECT_EQ(m[2][0].item<int>(), 5);
  EXPECT_ERROR((void)Tensor::from_vector<std::int32_t>({1, 2, 3}, {2, 2}), std::invalid_argument,
               "3 values do not fill sizes of numel 4");
  EXPECT_ERROR((void)Tensor::from_vector<std::int32_t>({1, 2}, {-1, -2}), std::invalid_argument,
               "negative dimension -1 in sizes [-1, -2]");
  Tensor e = Tensor::from_vector(std::vector<double>{});
  EXPECT_EQ(e.sizes(), (V{0}));
  // The vector is copied: the tensor owns its bytes.
  std::vector<double> src = {1, 2};
  Tensor c = Tensor::from_vector(src);
  src[0] = 9;
  EXPECT_EQ(c[0].item<double>(), 1.0);
}

TEST(TensorStackTest, StackAlongEveryDim) {
  Tensor a = Tensor::from_vector<std::int64_t>({1, 2});
  Tensor b = Tensor::from_vector<std::int64_t>({3, 4});
  Tensor c = Tensor::from_vector<std::int64_t>({5, 6});
  Tensor s0 = stack({a, b, c});
  EXPECT_EQ(s0.sizes(), (V{3, 2}));
  EXPECT_EQ(ints(s0), (V{1, 2, 3, 4, 5, 6}));
  Tensor s1 = stack({a, b, c}, 1);
  EXPECT_EQ(s1.sizes(), (V{2, 3}));
  EXPECT_EQ(ints(s1), (V{1, 3, 5, 2, 4, 6}));
  EXPECT_EQ(stack({a, b, c}, -1).sizes(), (V{2, 3}));
  EXPECT_FALSE(s0.storage().is_same(a.storage()));
  // Non-contiguous inputs and 0-d inputs.
  Tensor m = Tensor::arange(6).view({2, 3});
  EXPECT_EQ(ints(stack({m.transpose(0, 1), m.transpose(0, 1)})),
            (V{0, 3, 1, 4, 2, 5, 0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(ints(stack({a[0], b[1]})), (V{1, 4}));
  EXPECT_EQ(stack({Tensor::zeros({0, 2}), Tensor::zeros({0, 2})}).sizes(), (V{2, 0, 2}));
}

TEST(TensorStackTest, StackRejectsMismatches) {
  Tensor a = Tensor::zeros({2});
  EXPECT_ERROR((void)stack({}), std::invalid_argument,
               "stack: expects a non-empty list of tensors");
  EXPECT_ERROR((void)stack({a, Tensor::zeros({3})}), std::invalid_argument,
               "expects each tensor to be equal size, but got [2] at entry 0 and [3] at entry 1");
  EXPECT_ERROR((void)stack({a, Tensor::zeros({2}, DType::kInt32)}), std::invalid_argument,
               "expects one dtype, but got float32 at entry 0 and int32 at entry 1");
  EXPECT_ERROR((void)stack({a, Tensor()}), std::invalid_argument, "stack: tensor 1 is undefined");
  EXPECT_ERROR((void)stack({a, a}, 2), std::out_of_range,
               "Dimension out of range (expected to be in range of [-2, 1], but got 2)");
}

class TensorStackIntoTest : public testing::LeakCheckedTest {};

TEST_F(TensorStackIntoTest, StackIntoWritesAPreallocatedSharedTensor) {
  Tensor out = Tensor::empty_shared({2, 3}, DType::kFloat64);
  const void* p = out.raw_data();
  Tensor& r = stack_into({Tensor::full({3}, 1.0, DType::kInt64), Tensor::arange(3)}, out);
  EXPECT_EQ(&r, &out);
  EXPECT_EQ(out.raw_data(), p);
  EXPECT_TRUE(out.is_shared());
  EXPECT_EQ(testing::doubles(out), (std::vector<double>{1, 1, 1, 0, 1, 2}));
  Tensor col = Tensor::zeros({3, 2}, DType::kInt64);
  stack_into({Tensor::arange(3), Tensor::arange(3)}, col, 1);
  EXPECT_EQ(ints(col), (V{0, 0, 1, 1, 2, 2}));
  Tensor wrong = Tensor::zeros({3, 3});
  EXPECT_ERROR(stack_into({Tensor::arange(3), Tensor::arange(3)}, wrong), std::invalid_argument,
               "out has sizes [3, 3] but the stacked sizes are [2, 3]");
  Tensor undefined;
  EXPECT_ERROR(stack_into({Tensor::arange(3)}, undefined), std::invalid_argument,
               "out has sizes (undefined) but the stacked sizes are [1, 3]");
}

}  // namespace
}  // namespace shmtensor
