// Dims (include/shmtensor/dims.h): inline up to kInline values, on the heap beyond, and
// read like a std::vector<std::int64_t>.
#include "shmtensor/dims.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

#include "shmtensor/tensor.h"
#include "support/expect_error.h"

namespace shmtensor {
namespace {

using V = std::vector<std::int64_t>;

// A Dims whose values live inside the object points into it.
bool is_inline(const Dims& d) {
  const auto* self = reinterpret_cast<const char*>(&d);
  const auto* p = reinterpret_cast<const char*>(d.data());
  return p >= self && p < self + sizeof d;
}

TEST(DimsTest, UpToSixValuesStayInlineAndMoreGoToTheHeap) {
  Dims six{1, 2, 3, 4, 5, 6};
  EXPECT_TRUE(is_inline(six));
  EXPECT_EQ(six, (V{1, 2, 3, 4, 5, 6}));
  Dims seven{1, 2, 3, 4, 5, 6, 7};
  EXPECT_FALSE(is_inline(seven));
  EXPECT_EQ(seven, (V{1, 2, 3, 4, 5, 6, 7}));
  six.push_back(7);
  EXPECT_FALSE(is_inline(six));
  EXPECT_EQ(six, seven);
}

TEST(DimsTest, CopiesAndMovesKeepValuesInBothModes) {
  for (const V& values : {V{}, V{3}, V{2, 3, 4}, V{1, 2, 3, 4, 5, 6, 7, 8, 9}}) {
    const Dims original(values);
    Dims copy(original);
    EXPECT_EQ(copy, values);
    EXPECT_NE(copy.data(), original.data());
    Dims moved(std::move(copy));
    EXPECT_EQ(moved, values);
    EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(is_inline(moved), values.size() <= Dims::kInline);
    Dims assigned{9, 9};
    assigned = original;
    EXPECT_EQ(assigned, values);
    Dims move_assigned{1, 2, 3, 4, 5, 6, 7, 8};  // on the heap before
    move_assigned = std::move(moved);
    EXPECT_EQ(move_assigned, values);
    EXPECT_EQ(is_inline(move_assigned), values.size() <= Dims::kInline);
    Dims& self = assigned;
    assigned = self;
    EXPECT_EQ(assigned, values);
  }
}

TEST(DimsTest, EditsLikeAVector) {
  Dims d{1, 2, 3};
  d.insert(d.begin() + 1, 7);
  EXPECT_EQ(d, (V{1, 7, 2, 3}));
  d.erase(d.begin());
  EXPECT_EQ(d, (V{7, 2, 3}));
  d.resize(5, -1);
  EXPECT_EQ(d, (V{7, 2, 3, -1, -1}));
  d.resize(9);
  EXPECT_EQ(d, (V{7, 2, 3, -1, -1, 0, 0, 0, 0}));
  d.insert(d.end(), 4);
  EXPECT_EQ(d.back(), 4);
  EXPECT_EQ(d.front(), 7);
  d.clear();
  EXPECT_TRUE(d.empty());
  EXPECT_EQ(Dims(3, 5), (V{5, 5, 5}));
}

TEST(DimsTest, HeapAndInlineTransitionsKeepValues) {
  // Six inline, the seventh inserted in the middle: to the heap, in order.
  Dims d{1, 2, 3, 4, 5, 6};
  d.insert(d.begin() + 3, 9);
  EXPECT_FALSE(is_inline(d));
  EXPECT_EQ(d, (V{1, 2, 3, 9, 4, 5, 6}));
  // Erased on the heap down to three: still right, and copies of it are inline again.
  for (int i = 0; i < 4; ++i) d.erase(d.begin());
  EXPECT_EQ(d, (V{4, 5, 6}));
  const Dims copy(d);
  EXPECT_TRUE(is_inline(copy));
  EXPECT_EQ(copy, (V{4, 5, 6}));
  // A copy onto a heap Dims with room reuses its buffer.
  Dims big{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const std::int64_t* buffer = big.data();
  const Dims seven{1, 2, 3, 4, 5, 6, 7};
  big = seven;
  EXPECT_EQ(big.data(), buffer);
  EXPECT_EQ(big, (V{1, 2, 3, 4, 5, 6, 7}));
  // Moved onto itself: unchanged.
  Dims& self = big;
  big = std::move(self);
  EXPECT_EQ(big, (V{1, 2, 3, 4, 5, 6, 7}));
  // assign_bytes from its own values, growing (the source is freed only after the copy)
  // and in place (overlapping).
  Dims own{1, 2, 3, 4, 5, 6};
  std::int64_t twelve[12];
  for (int i = 0; i < 12; ++i) twelve[i] = i;
  own.assign_bytes(twelve, 12);
  own.assign_bytes(own.data() + 1, 11);
  EXPECT_EQ(own, (V{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
  own.assign_bytes(own.data() + 2, 2);
  EXPECT_EQ(own, (V{3, 4}));
}

TEST(DimsTest, MoreThanItCanCountIsALengthErrorAndChangesNothing) {
  Dims d{1, 2};
  EXPECT_ERROR(d.reserve(Dims::kMaxSize + 1), std::length_error, "Dims: more than 2^32 - 1 values");
  EXPECT_EQ(d, (V{1, 2}));
}

TEST(DimsTest, ConvertsToAndComparesWithVectorsAndSpans) {
  const Dims d{4, 5};
  const V v = d;
  EXPECT_EQ(v, (V{4, 5}));
  EXPECT_EQ(d.vec(), v);
  EXPECT_TRUE(v == d);
  EXPECT_FALSE(d == (V{4}));
  EXPECT_FALSE(d == (V{4, 6}));
  EXPECT_NE(d, (Dims{4, 5, 1}));
  std::span<const std::int64_t> s = d;
  EXPECT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1], 5);
}

// A tensor of more dimensions than Dims keeps inline: views, copies and equality.
TEST(DimsTest, TensorsWithManyDimensionsWork) {
  Tensor t = Tensor::arange(2 * 3 * 2 * 1 * 2 * 1 * 2 * 2).view({2, 3, 2, 1, 2, 1, 2, 2});
  EXPECT_EQ(t.dim(), 8);
  EXPECT_EQ(t.strides(), (V{48, 16, 8, 8, 4, 4, 2, 1}));
  Tensor s = t.squeeze();
  EXPECT_EQ(s.sizes(), (V{2, 3, 2, 2, 2, 2}));
  Tensor u = s.unsqueeze(0).unsqueeze(0);
  EXPECT_EQ(u.sizes(), (V{1, 1, 2, 3, 2, 2, 2, 2}));
  Tensor p = t.permute({7, 6, 5, 4, 3, 2, 1, 0});
  EXPECT_EQ(p.sizes(), (V{2, 2, 1, 2, 1, 2, 3, 2}));
  EXPECT_TRUE(p.contiguous().permute({7, 6, 5, 4, 3, 2, 1, 0}).equal(t));
  Tensor copy = t;
  EXPECT_EQ(copy.sizes(), t.sizes());
  EXPECT_EQ(t.select(1, 2).sizes(), (V{2, 2, 1, 2, 1, 2, 2}));
}

}  // namespace
}  // namespace shmtensor
