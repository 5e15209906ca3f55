// Tensor metadata, data_ptr, item, from_storage validation (including hostile values from a
// peer), share_memory_() moving every view's bytes in place, and DefaultCollate's columns.
#include "shmtensor/tensor.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "shmtensor/collate.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "unit/tensor_test_util.h"

namespace shmtensor {
namespace {

using testing::ints;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
// Wide enough that the bounds below cannot overflow.
__extension__ typedef __int128 Int128;

TEST(TensorTest, DefaultIsUndefined) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_FALSE(t.is_shared());
  EXPECT_EQ(t.to_string(), "tensor(undefined)");
  EXPECT_ERROR(t.raw_data(), std::invalid_argument, "Tensor::raw_data: the tensor is undefined");
  EXPECT_ERROR(t.data_ptr<float>(), std::invalid_argument,
               "Tensor::data_ptr: the tensor is undefined");
  EXPECT_ERROR(t.item<float>(), std::invalid_argument, "Tensor::item: the tensor is undefined");
  EXPECT_ERROR((void)t.clone(), std::invalid_argument, "Tensor::clone: the tensor is undefined");
  EXPECT_ERROR((void)t.view({1}), std::invalid_argument, "Tensor::view: the tensor is undefined");
  EXPECT_ERROR(t.share_memory_(), std::invalid_argument,
               "Tensor::share_memory_: the tensor is undefined");
}

TEST(TensorTest, Metadata) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::kInt16);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.dtype(), DType::kInt16);
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.sizes(), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(t.strides(), (std::vector<std::int64_t>{12, 4, 1}));
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_EQ(t.stride(1), 4);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_ERROR(t.size(3), std::out_of_range,
               "Dimension out of range (expected to be in range of [-3, 2], but got 3)");
  EXPECT_ERROR(t.stride(-4), std::out_of_range,
               "Dimension out of range (expected to be in range of [-3, 2], but got -4)");
  EXPECT_EQ(t.storage_offset(), 0);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.element_size(), 2u);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.storage().nbytes(), 48u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_FALSE(t.is_shared());
}

TEST(TensorTest, ZeroDimTensor) {
  Tensor t = Tensor::full({}, 7.0, DType::kInt32);
  EXPECT_EQ(t.dim(), 0);
  EXPECT_EQ(t.numel(), 1);
  EXPECT_EQ(t.nbytes(), 4u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.item<int>(), 7);
  EXPECT_ERROR(t.size(0), std::out_of_range,
               "dimension specified as 0 but tensor has no dimensions");
  EXPECT_ERROR((void)t.select(0, 0), std::out_of_range,
               "select() cannot be applied to a 0-dim tensor");
}

TEST(TensorTest, CopiesShareTheStorage) {
  Tensor a = Tensor::zeros({4});
  Tensor b = a;
  EXPECT_TRUE(b.storage().is_same(a.storage()));
  EXPECT_EQ(a.storage().use_count(), 2);  // a and b (storage() returns a reference)
  b.data_ptr<float>()[2] = 5.0f;
  EXPECT_EQ(a.data_ptr<float>()[2], 5.0f);
  // Through the const reference storage() returns, for every tensor on the storage.
  a.storage().share_memory_();
  EXPECT_TRUE(b.is_shared());
  EXPECT_EQ(b.data_ptr<float>()[2], 5.0f);
}

TEST(TensorTest, DataPtrTypeMismatchThrows) {
  Tensor t = Tensor::zeros({3}, DType::kFloat32);
  EXPECT_NO_THROW(t.data_ptr<float>());
  try {
    t.data_ptr<double>();
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("float64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("float32"), std::string::npos) << e.what();
  }
  EXPECT_ERROR(t.data_ptr<std::int32_t>(), std::invalid_argument,
               "data_ptr<int32>() called on a tensor of dtype float32");
  const Tensor& c = t;
  EXPECT_ERROR(c.data_ptr<Half>(), std::invalid_argument,
               "data_ptr<float16>() called on a tensor of dtype float32");
  EXPECT_EQ(c.data_ptr<float>(), t.raw_data());
}

TEST(TensorTest, DataPtrIncludesTheOffset) {
  Tensor t = Tensor::arange(10, DType::kInt64);
  Tensor s = t.slice(0, 3);
  EXPECT_EQ(s.storage_offset(), 3);
  EXPECT_EQ(s.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + 3);
  EXPECT_EQ(*s.data_ptr<std::int64_t>(), 3);
}

TEST(TensorTest, ItemConvertsLikeTorch) {
  EXPECT_EQ(Tensor::full({1}, 2.7).item<std::int64_t>(), 2);
  EXPECT_EQ(Tensor::full({1}, -2.7).item<int>(), -2);
  EXPECT_EQ(Tensor::full({1, 1}, 42, DType::kUInt8).item<double>(), 42.0);
  EXPECT_EQ(Tensor::full({}, 0.5, DType::kFloat16).item<float>(), 0.5f);
  EXPECT_EQ(Tensor::full({}, 3.0, DType::kBFloat16).item<Half>().bits, 0x4200);
  EXPECT_TRUE(Tensor::full({}, 0.1).item<bool>());
  EXPECT_FALSE(Tensor::full({}, 0.0, DType::kInt64).item<bool>());
  EXPECT_EQ(Tensor::full({}, 1.0, DType::kBool).item<int>(), 1);
  const auto c = Tensor::full({}, std::complex<double>(1.5, -2.0), DType::kComplex128);
  EXPECT_EQ(c.item<std::complex<double>>(), std::complex<double>(1.5, -2.0));
  EXPECT_EQ(c.item<std::complex<float>>(), std::complex<float>(1.5f, -2.0f));
  EXPECT_EQ(c.item<double>(), 1.5);  // real part
  EXPECT_EQ(Tensor::full({}, 3.0, DType::kInt16).item<std::complex<double>>(),
            std::complex<double>(3.0, 0.0));
  const std::int64_t big = std::int64_t{1} << 40;
  EXPECT_EQ(Tensor::from_vector<std::int64_t>({big + 1}).item<std::int64_t>(), big + 1);
}

TEST(TensorTest, ItemRejectsOverflowAndManyElements) {
  EXPECT_ERROR(Tensor::full({}, 300, DType::kInt32).item<std::int8_t>(), std::out_of_range,
               "value 300 cannot be converted to the requested type without overflow");
  EXPECT_ERROR(Tensor::full({}, -1, DType::kInt32).item<std::uint8_t>(), std::out_of_range,
               "value -1 cannot be converted to the requested type without overflow");
  EXPECT_ERROR(Tensor::full({}, 1e30).item<std::int64_t>(), std::out_of_range,
               "cannot be converted to the requested type without overflow");
  EXPECT_ERROR(Tensor::full({}, std::nan("")).item<int>(), std::out_of_range,
               "value nan cannot be converted to the requested type without overflow");
  EXPECT_ERROR(Tensor::full({}, 9223372036854775808.0, DType::kFloat64).item<std::int64_t>(),
               std::out_of_range, "value 9223372036854775808.000000 cannot be converted");
  EXPECT_EQ(Tensor::full({}, 255, DType::kInt32).item<std::uint8_t>(), 255);
  EXPECT_ERROR(Tensor::zeros({2}).item<float>(), std::invalid_argument,
               "a tensor with 2 elements cannot be converted to a scalar");
  EXPECT_ERROR(Tensor::zeros({0}).item<float>(), std::invalid_argument,
               "a tensor with 0 elements cannot be converted to a scalar");
}

// ---- from_storage ----------------------------------------------------------------------------

TEST(TensorFromStorageTest, MakesAViewOverTheStorage) {
  Tensor base = Tensor::arange(12, DType::kInt32);
  Tensor t = Tensor::from_storage(base.storage(), 2, {2, 3}, {4, 1}, DType::kInt32);
  EXPECT_TRUE(t.storage().is_same(base.storage()));
  EXPECT_EQ(ints(t), (std::vector<std::int64_t>{2, 3, 4, 6, 7, 8}));
  t.data_ptr<std::int32_t>()[0] = -1;
  EXPECT_EQ(base.data_ptr<std::int32_t>()[2], -1);
  // The last element exactly fills the storage; stride 0 and empty tensors are fine.
  EXPECT_NO_THROW((void)Tensor::from_storage(base.storage(), 11, {1}, {1}, DType::kInt32));
  EXPECT_NO_THROW((void)Tensor::from_storage(base.storage(), 0, {1000}, {0}, DType::kInt32));
  EXPECT_NO_THROW((void)Tensor::from_storage(base.storage(), 12, {0}, {1}, DType::kInt32));
  EXPECT_NO_THROW((void)Tensor::from_storage(base.storage(), 0, {}, {}, DType::kInt32));
  // Reinterpreting the bytes as another dtype is allowed when it fits.
  EXPECT_NO_THROW((void)Tensor::from_storage(base.storage(), 0, {6}, {1}, DType::kFloat64));
}

TEST(TensorFromStorageTest, RejectsHostileValues) {
  Storage s = Storage::allocate(48);  // 6 float64
  const auto make = [&](std::int64_t offset, std::vector<std::int64_t> sizes,
                        std::vector<std::int64_t> strides, DType dtype = DType::kFloat64) {
    return Tensor::from_storage(s, offset, std::move(sizes), std::move(strides), dtype);
  };
  EXPECT_ERROR(make(0, {7}, {1}), std::out_of_range,
               "reach beyond the storage of 48 bytes");  // one element too many
  EXPECT_ERROR(make(6, {1}, {1}), std::out_of_range,
               "reach beyond the storage of 48 bytes");  // offset at the end
  EXPECT_ERROR(make(7, {0}, {1}), std::out_of_range,
               "reach beyond the storage of 48 bytes");  // empty, but offset beyond
  EXPECT_ERROR(make(-1, {1}, {1}), std::out_of_range,
               "negative storage offset -1");  // negative offset
  EXPECT_ERROR(make(0, {2}, {6}), std::out_of_range,
               "reach beyond the storage of 48 bytes");  // stride reaches past end
  EXPECT_ERROR(make(0, {4}, {1}, DType::kComplex128), std::out_of_range,
               "of complex128 reach beyond the storage of 48 bytes");
  EXPECT_ERROR(make(0, {-1}, {1}), std::invalid_argument,
               "negative dimension -1 in sizes [-1]");  // negative size
  EXPECT_ERROR(make(0, {2, -2}, {1, 1}), std::invalid_argument,
               "negative dimension -2 in sizes [2, -2]");
  EXPECT_ERROR(make(0, {2}, {-1}), std::invalid_argument,
               "negative stride in [-1]");  // negative stride
  EXPECT_ERROR(make(0, {2}, {1, 1}), std::invalid_argument,
               "1 sizes but 2 strides");  // ranks differ
  EXPECT_ERROR(make(0, {2}, {kMax}), std::out_of_range,
               "extent overflows int64");  // last index + 1 overflows
  EXPECT_ERROR(make(0, {3}, {kMax}), std::out_of_range,
               "sizes [3] and strides [9223372036854775807] overflow int64");  // 2*kMax overflows
  EXPECT_ERROR(make(0, {2, 2}, {kMax, kMax}), std::out_of_range,
               "[9223372036854775807, 9223372036854775807] overflow int64");  // sum overflows
  EXPECT_ERROR(make(kMax, {1}, {1}), std::out_of_range,
               "extent overflows int64");  // offset + 1 overflows
  EXPECT_ERROR(make(kMax / 4, {1}, {1}), std::out_of_range,
               "reach beyond the storage of 48 bytes");  // bytes overflow
  EXPECT_ERROR(make(0, {kMax}, {0}), std::invalid_argument,
               "overflow int64 when counted in bytes");  // numel * 8 overflows
  EXPECT_ERROR(make(0, {kMax, kMax}, {0, 0}), std::invalid_argument,
               "[9223372036854775807, 9223372036854775807] overflow int64");  // numel overflows
  EXPECT_ERROR(make(0, {1}, {1}, static_cast<DType>(99)), std::invalid_argument,
               "invalid DType value 99");
  EXPECT_ERROR((void)Tensor::from_storage(Storage(), 0, {}, {}, DType::kFloat32),
               std::invalid_argument, "Tensor::from_storage: undefined storage");
  // A zero-byte storage holds only empty tensors at offset 0.
  Storage none = Storage::allocate(0);
  EXPECT_NO_THROW((void)Tensor::from_storage(none, 0, {0, 5}, {5, 1}, DType::kFloat32));
  EXPECT_ERROR((void)Tensor::from_storage(none, 0, {}, {}, DType::kFloat32), std::out_of_range,
               "reach beyond the storage of 0 bytes");
  EXPECT_ERROR((void)Tensor::from_storage(none, 1, {0}, {1}, DType::kFloat32), std::out_of_range,
               "reach beyond the storage of 0 bytes");
}

// Bytes from a peer may hold any value; a bool byte other than 0 or 1 reads as true, never as
// undefined behaviour.
TEST(TensorFromStorageTest, BoolBytesOtherThanZeroOrOneReadAsTrue) {
  Storage s = Storage::allocate(3);
  auto* bytes = static_cast<unsigned char*>(s.data());
  bytes[0] = 0;
  bytes[1] = 2;
  bytes[2] = 0xBE;
  Tensor t = Tensor::from_storage(s, 0, {3}, {1}, DType::kBool);
  EXPECT_EQ(ints(t), (std::vector<std::int64_t>{0, 1, 1}));
  EXPECT_TRUE(t[2].item<bool>());
  EXPECT_TRUE(t.equal(Tensor::from_vector(std::vector<bool>{false, true, true})));
  EXPECT_EQ(t.to_string(), "tensor([False,  True,  True], dtype=bool)");
}

// Property: whatever from_storage accepts addresses only bytes inside the storage, and every
// view made from it too.
TEST(TensorFromStorageTest, AcceptedValuesStayInBounds) {
  const std::int64_t edge[] = {
      0,        1,        2,        3,  5,
      7,        8,        63,       64, kMax,
      kMax - 1, kMax / 2, kMax / 8, -1, std::numeric_limits<std::int64_t>::min()};
  std::mt19937_64 rng(12345);
  auto pick = [&] { return edge[rng() % std::size(edge)]; };
  Storage s = Storage::allocate(64);
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const std::size_t nd = rng() % 4;
    std::vector<std::int64_t> sizes(nd);
    std::vector<std::int64_t> strides(nd);
    for (std::size_t d = 0; d < nd; ++d) {
      sizes[d] = pick();
      strides[d] = pick();
    }
    const auto dtype = static_cast<DType>(rng() % kNumDTypes);
    Tensor t;
    try {
      t = Tensor::from_storage(s, pick(), sizes, strides, dtype);
    } catch (const std::invalid_argument&) {
      continue;
    } catch (const std::out_of_range&) {
      continue;
    }
    ++accepted;
    const auto elsize = static_cast<Int128>(element_size(dtype));
    ASSERT_LE(static_cast<Int128>(t.storage_offset()) * elsize, 64);
    if (t.numel() == 0) continue;
    Int128 last = t.storage_offset();
    for (std::size_t d = 0; d < nd; ++d) last += static_cast<Int128>(sizes[d] - 1) * strides[d];
    ASSERT_LE((last + 1) * elsize, 64) << t.to_string();
    // Reading every element must stay within the storage (ASan would catch it otherwise).
    // Stride-0 dims can make numel huge; read only the small ones.
    if (t.numel() <= 4096) {
      EXPECT_NO_THROW((void)t.clone());
    }
  }
  EXPECT_GT(accepted, 100);
}

// ---- share_memory_ ---------------------------------------------------------------------------

class TensorShareTest : public testing::LeakCheckedTest {};

TEST_F(TensorShareTest, ShareMemoryKeepsValuesAndMovesEveryView) {
  Tensor t = Tensor::arange(12, DType::kFloat32).view({3, 4});
  Tensor row = t[1];
  Tensor col = t.select(1, 2);
  const void* before = t.raw_data();
  EXPECT_FALSE(t.is_shared());
  EXPECT_EQ(&t.share_memory_(), &t);
  EXPECT_TRUE(t.is_shared());
  EXPECT_TRUE(row.is_shared());
  EXPECT_TRUE(col.is_shared());
  EXPECT_NE(t.raw_data(), before);
  EXPECT_EQ(row.data_ptr<float>(), t.data_ptr<float>() + 4);
  EXPECT_EQ(testing::doubles(t), testing::doubles(Tensor::arange(12, DType::kFloat32)));
  EXPECT_EQ(testing::doubles(col), (std::vector<double>{2, 6, 10}));
  row.fill_(-1);
  EXPECT_EQ(t.data_ptr<float>()[5], -1.0f);
  // Sharing again is a no-op.
  const void* shared = t.raw_data();
  t.share_memory_();
  EXPECT_EQ(t.raw_data(), shared);
}

TEST_F(TensorShareTest, EmptySharedIsSharedFromBirth) {
  Tensor t = Tensor::empty_shared({2, 5}, DType::kInt64);
  EXPECT_TRUE(t.is_shared());
  EXPECT_TRUE(t.storage().is_shared());
  const void* p = t.raw_data();
  t.share_memory_();
  EXPECT_EQ(t.raw_data(), p);
  Tensor z = Tensor::zeros_shared({3}, DType::kComplex64);
  EXPECT_TRUE(z.is_shared());
  EXPECT_TRUE(z.equal(Tensor::zeros({3}, DType::kComplex64)));
  EXPECT_TRUE(Tensor::empty_shared({0}).is_shared());
}

TEST_F(TensorShareTest, CloneLeavesSharedMemory) {
  Tensor t = Tensor::full({4}, 2.5).share_memory_();
  Tensor c = t.clone();
  EXPECT_TRUE(t.is_shared());
  EXPECT_FALSE(c.is_shared());
  c.fill_(1);
  EXPECT_EQ(testing::doubles(t), (std::vector<double>{2.5, 2.5, 2.5, 2.5}));
}

// DefaultCollate takes position i of every sample into one column and collates it; one
// column buffer serves every position, whatever the previous position's collate did with it
// (strings are moved out, tensors stacked and left).
TEST(DefaultCollateTest, EachPositionOfVectorAndArraySamplesIsItsOwnColumn) {
  std::vector<std::vector<std::string>> words{{"a0", "b0", "c0"}, {"a1", "b1", "c1"}};
  const auto word_batch = DefaultCollate{}(std::move(words));
  EXPECT_EQ(word_batch, (std::vector<std::vector<std::string>>{
                            {"a0", "a1"}, {"b0", "b1"}, {"c0", "c1"}}));
  std::vector<std::vector<Tensor>> tensors;
  for (int s = 0; s < 3; ++s)
    tensors.push_back(
        {Tensor::full({2}, s, DType::kInt64), Tensor::full({1}, 10 + s, DType::kInt32)});
  const std::vector<Tensor> stacked = DefaultCollate{}(std::move(tensors));
  ASSERT_EQ(stacked.size(), 2u);
  EXPECT_EQ(stacked[0].sizes(), (std::vector<std::int64_t>{3, 2}));
  EXPECT_EQ(ints(stacked[0]), (std::vector<std::int64_t>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(stacked[1].dtype(), DType::kInt32);
  EXPECT_EQ(ints(stacked[1]), (std::vector<std::int64_t>{10, 11, 12}));
  std::vector<std::array<std::string, 2>> pairs{{"x0", "y0"}, {"x1", "y1"}, {"x2", "y2"}};
  const auto pair_batch = DefaultCollate{}(std::move(pairs));
  EXPECT_EQ(pair_batch[0], (std::vector<std::string>{"x0", "x1", "x2"}));
  EXPECT_EQ(pair_batch[1], (std::vector<std::string>{"y0", "y1", "y2"}));
  std::vector<std::vector<std::string>> ragged{{"a", "b"}, {"c"}};
  EXPECT_ERROR(DefaultCollate{}(std::move(ragged)), std::invalid_argument,
               "default collate: each sample's vector must have the same length (2 and 1)");
}

}  // namespace
}  // namespace shmtensor
