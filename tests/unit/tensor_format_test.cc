// to_string follows torch's repr (expected strings were taken from PyTorch, with the dtype
// suffix that we always print).
#include <gtest/gtest.h>

#include <complex>
#include <cstdint>
#include <sstream>
#include <string>

#include "shmtensor/tensor.h"

namespace shmtensor {
namespace {

TEST(TensorFormatTest, SmallTensors) {
  EXPECT_EQ(Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2}).to_string(),
            "tensor([[1., 2.],\n        [3., 4.]], dtype=float32)");
  EXPECT_EQ(Tensor::arange(4).to_string(), "tensor([0, 1, 2, 3], dtype=int64)");
  EXPECT_EQ(Tensor::from_vector<std::int32_t>({-5, 10, 200}).to_string(),
            "tensor([ -5,  10, 200], dtype=int32)");
  EXPECT_EQ(Tensor::from_vector<float>({1.5f, -2.25f}).to_string(),
            "tensor([ 1.5000, -2.2500], dtype=float32)");
  EXPECT_EQ(Tensor::from_vector(std::vector<bool>{true, false}).to_string(),
            "tensor([ True, False], dtype=bool)");
  EXPECT_EQ(Tensor::full({}, 3.0, DType::kFloat64).to_string(), "tensor(3., dtype=float64)");
  EXPECT_EQ(Tensor::from_vector<double>({1e-5, 1.0}).to_string(),
            "tensor([1.0000e-05, 1.0000e+00], dtype=float64)");
  EXPECT_EQ(Tensor::from_vector<double>({0.0, std::nan(""), -INFINITY}).to_string(),
            "tensor([  0.,  nan, -inf], dtype=float64)");
  EXPECT_EQ(Tensor::from_vector<std::complex<float>>({{1, 2}, {3, -4}}).to_string(),
            "tensor([1.+2.j, 3.-4.j], dtype=complex64)");
  EXPECT_EQ(Tensor::full({2}, 0.5, DType::kFloat16).to_string(),
            "tensor([0.5000, 0.5000], dtype=float16)");
}

TEST(TensorFormatTest, NestedAndStrided) {
  EXPECT_EQ(Tensor::arange(8).view({2, 2, 2}).to_string(),
            "tensor([[[0, 1],\n"
            "         [2, 3]],\n"
            "\n"
            "        [[4, 5],\n"
            "         [6, 7]]], dtype=int64)");
  EXPECT_EQ(Tensor::arange(4).view({2, 2}).transpose(0, 1).to_string(),
            "tensor([[0, 2],\n        [1, 3]], dtype=int64)");
}

TEST(TensorFormatTest, EmptyAndUndefined) {
  EXPECT_EQ(Tensor::zeros({0}).to_string(), "tensor([], dtype=float32)");
  EXPECT_EQ(Tensor::zeros({2, 0, 3}, DType::kInt8).to_string(),
            "tensor([], size=(2, 0, 3), dtype=int8)");
  EXPECT_EQ(Tensor().to_string(), "tensor(undefined)");
}

TEST(TensorFormatTest, LongRowsWrapAt80Columns) {
  EXPECT_EQ(Tensor::arange(30, DType::kFloat32).to_string(),
            "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n"
            "        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n"
            "        28., 29.], dtype=float32)");
}

TEST(TensorFormatTest, BigTensorsAreSummarised) {
  EXPECT_EQ(Tensor::arange(2000).to_string(),
            "tensor([   0,    1,    2,  ..., 1997, 1998, 1999], dtype=int64)");
  EXPECT_EQ(Tensor::arange(10000).view({100, 100}).to_string(),
            "tensor([[   0,    1,    2,  ...,   97,   98,   99],\n"
            "        [ 100,  101,  102,  ...,  197,  198,  199],\n"
            "        [ 200,  201,  202,  ...,  297,  298,  299],\n"
            "        ...,\n"
            "        [9700, 9701, 9702,  ..., 9797, 9798, 9799],\n"
            "        [9800, 9801, 9802,  ..., 9897, 9898, 9899],\n"
            "        [9900, 9901, 9902,  ..., 9997, 9998, 9999]], dtype=int64)");
}

TEST(TensorFormatTest, StreamOperator) {
  std::ostringstream os;
  os << Tensor::arange(2);
  EXPECT_EQ(os.str(), "tensor([0, 1], dtype=int64)");
}

}  // namespace
}  // namespace shmtensor
