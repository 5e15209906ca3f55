// The libtorch bridge in one process (include/shmtensor/torch.h): dtypes, zero-copy both
// ways, views, lifetimes, copies of foreign tensors, moving a torch storage in place.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <complex>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "shmtensor/device.h"
#include "shmtensor/error.h"
#include "shmtensor/torch.h"
#include "support/expect_error.h"
#include "support/leak_check.h"

namespace shmtensor {
namespace {

std::vector<DType> all_dtypes() {
  std::vector<DType> out;
  for (int i = 0; i < kNumDTypes; ++i) out.push_back(static_cast<DType>(i));
  return out;
}

// 0, 1, ..., n-1 converted to dtype (exact in every dtype for n <= 12; bool: 0 then true).
Tensor shared_arange(std::int64_t n, DType dtype) {
  Tensor t = Tensor::empty_shared({n}, dtype);
  t.copy_(Tensor::arange(n, DType::kInt64));
  return t;
}
at::Tensor torch_arange(std::int64_t n, DType dtype) {
  return at::arange(n, at::kLong).to(to_torch(dtype));
}

const void* storage_data(const at::Tensor& t) { return t.storage().data(); }

class TorchBridgeTest : public testing::LeakCheckedTest {};

TEST_F(TorchBridgeTest, EveryDTypeHasATorchDTypeAndBack) {
  const std::vector<c10::ScalarType> expected = {
      at::kBool,  at::kByte,     at::kChar,  at::kShort,  at::kInt,           at::kLong,
      at::kHalf,  at::kBFloat16, at::kFloat, at::kDouble, at::kComplexFloat, at::kComplexDouble};
  for (DType d : all_dtypes()) {
    SCOPED_TRACE(to_string(d));
    EXPECT_EQ(to_torch(d), expected[static_cast<int>(d)]);
    EXPECT_EQ(dtype_from_torch(to_torch(d)), d);
    EXPECT_EQ(c10::elementSize(to_torch(d)), element_size(d));
  }
  for (c10::ScalarType lacking : {at::kComplexHalf, at::kQInt8, at::kQUInt8, at::kQInt32}) {
    try {
      (void)dtype_from_torch(lacking);
      ADD_FAILURE() << "no exception for " << c10::toString(lacking);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(c10::toString(lacking)), std::string::npos) << e.what();
    }
  }
}

TEST_F(TorchBridgeTest, ToTorchIsZeroCopyWithExactValuesForEveryDType) {
  for (DType d : all_dtypes()) {
    SCOPED_TRACE(to_string(d));
    Tensor s = shared_arange(12, d).view({3, 4});
    at::Tensor t = to_torch(s);
    EXPECT_EQ(t.scalar_type(), to_torch(d));
    EXPECT_EQ(t.device(), at::Device(at::kCPU));
    EXPECT_EQ(t.sizes().vec(), s.sizes());
    EXPECT_EQ(t.strides().vec(), s.strides());
    EXPECT_EQ(t.storage_offset(), 0);
    EXPECT_EQ(t.data_ptr(), s.raw_data());
    EXPECT_EQ(t.storage().nbytes(), s.storage().nbytes());
    EXPECT_FALSE(t.requires_grad());
    EXPECT_TRUE(at::equal(t, torch_arange(12, d).view({3, 4})));
    // Writes both ways.
    t.select(0, 2).fill_(1);
    EXPECT_TRUE(s.select(0, 2).equal(Tensor::ones({4}).to(d)));
    s.select(0, 0).fill_(0.0);
    EXPECT_TRUE(at::equal(t.select(0, 0), at::zeros({4}, to_torch(d))));
  }
}

TEST_F(TorchBridgeTest, FromTorchOfAForeignTensorCopiesIntoSharedMemoryForEveryDType) {
  for (DType d : all_dtypes()) {
    SCOPED_TRACE(to_string(d));
    at::Tensor t = torch_arange(12, d).view({3, 4});
    Tensor s = from_torch(t);
    EXPECT_TRUE(s.is_shared());
    EXPECT_EQ(s.dtype(), d);
    EXPECT_EQ(s.sizes(), (std::vector<std::int64_t>{3, 4}));
    EXPECT_NE(s.raw_data(), t.data_ptr());
    EXPECT_TRUE(s.equal(shared_arange(12, d).view({3, 4})));
    // A copy: writing one side leaves the other.
    s.fill_(0.0);
    EXPECT_TRUE(at::equal(t, torch_arange(12, d).view({3, 4})));
  }
}

TEST_F(TorchBridgeTest, FromTorchOfOursIsZeroCopyAndSharesTheStorage) {
  Tensor x = shared_arange(12, DType::kFloat32);
  Tensor back = from_torch(to_torch(x));
  EXPECT_TRUE(back.storage().is_same(x.storage()));
  EXPECT_EQ(back.raw_data(), x.raw_data());
  back.fill_(7.0);
  EXPECT_EQ(x.data_ptr<float>()[11], 7.0f);
}

TEST_F(TorchBridgeTest, ViewsKeepTheirStridesAndOffsetBothWays) {
  Tensor base = shared_arange(24, DType::kInt32).view({4, 6});
  // Non-contiguous, with an offset: columns 1, 3 of rows 1..3, transposed.
  Tensor view = base.slice(0, 1, 4).slice(1, 1, 5, 2).transpose(0, 1);
  at::Tensor t = to_torch(view);
  EXPECT_EQ(t.sizes().vec(), view.sizes());
  EXPECT_EQ(t.strides().vec(), view.strides());
  EXPECT_EQ(t.storage_offset(), view.storage_offset());
  EXPECT_EQ(t.data_ptr(), view.raw_data());
  EXPECT_TRUE(at::equal(t, at::arange(24, at::kInt).view({4, 6}).slice(0, 1, 4).slice(1, 1, 5, 2).t()));

  // A view made on the torch side comes back as a view of the same bytes.
  at::Tensor torch_view = to_torch(base).t().narrow(0, 2, 3);
  Tensor s = from_torch(torch_view);
  EXPECT_TRUE(s.storage().is_same(base.storage()));
  EXPECT_EQ(s.sizes(), torch_view.sizes().vec());
  EXPECT_EQ(s.strides(), torch_view.strides().vec());
  EXPECT_EQ(s.storage_offset(), 2);
  EXPECT_EQ(s.raw_data(), torch_view.data_ptr());

  // A foreign non-contiguous view is copied contiguous, values in order.
  at::Tensor foreign = at::arange(24, at::kInt).view({4, 6}).t().narrow(0, 1, 3);
  Tensor copy = from_torch(foreign);
  EXPECT_TRUE(copy.is_contiguous());
  EXPECT_TRUE(at::equal(to_torch(copy), foreign));
}

TEST_F(TorchBridgeTest, LazyConjugateAndNegativeBitsAreCopiedAsValues) {
  Tensor x = Tensor::empty_shared({2}, DType::kComplex64);
  x.data_ptr<std::complex<float>>()[0] = {1, 2};
  x.data_ptr<std::complex<float>>()[1] = {3, -4};
  at::Tensor conj = to_torch(x).conj();
  ASSERT_TRUE(conj.is_conj());
  Tensor c = from_torch(conj);
  EXPECT_FALSE(c.storage().is_same(x.storage()));
  EXPECT_EQ(c.data_ptr<std::complex<float>>()[0], std::complex<float>(1, -2));
  EXPECT_EQ(c.data_ptr<std::complex<float>>()[1], std::complex<float>(3, 4));
  at::Tensor neg = at::_neg_view(to_torch(x));
  ASSERT_TRUE(neg.is_neg());
  Tensor n = from_torch(neg);
  EXPECT_EQ(n.data_ptr<std::complex<float>>()[0], std::complex<float>(-1, -2));
}

TEST_F(TorchBridgeTest, WhatShmtensorCannotHoldIsAnInvalidArgument) {
  auto expect_invalid = [](const at::Tensor& t, const char* words) {
    try {
      (void)from_torch(t);
      ADD_FAILURE() << "no exception; expected: " << words;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_invalid(at::empty({2}, at::TensorOptions().device(at::kMeta)), "CPU and CUDA tensors only");
  expect_invalid(at::eye(3).to_sparse(), "strided");
  expect_invalid(at::empty({2}, at::kComplexHalf), "ComplexHalf");
  EXPECT_ERROR((void)to_torch(Tensor()), std::invalid_argument, "to_torch: an undefined Tensor");
  EXPECT_FALSE(from_torch(at::Tensor()).defined());
}

TEST_F(TorchBridgeTest, APrivateTensorMovesIntoSharedMemoryBeforeTorchSeesIt) {
  Tensor x = Tensor::full({4}, 3.0);
  ASSERT_FALSE(x.is_shared());
  at::Tensor t = to_torch(x);
  EXPECT_TRUE(x.is_shared());
  EXPECT_EQ(t.data_ptr(), x.raw_data());
  EXPECT_TRUE(at::equal(t, at::full({4}, 3.0f)));
}

TEST_F(TorchBridgeTest, EitherSideMayBeDroppedFirst) {
  Storage probe;
  {
    at::Tensor t;
    {
      Tensor x = shared_arange(6, DType::kInt64);
      probe = x.storage();
      t = to_torch(x);
      EXPECT_EQ(probe.use_count(), 3);  // probe, x, the torch DataPtr's copy
    }  // shmtensor side dropped first
    EXPECT_EQ(probe.use_count(), 2);
    EXPECT_TRUE(at::equal(t, at::arange(6, at::kLong)));
  }  // then torch's
  EXPECT_EQ(probe.use_count(), 1);

  Tensor x = shared_arange(6, DType::kInt64);
  probe = x.storage();
  {
    at::Tensor t = to_torch(x);
    EXPECT_EQ(probe.use_count(), 3);
    t.add_(1);
  }  // torch side dropped first
  EXPECT_EQ(probe.use_count(), 2);  // probe, x
  EXPECT_EQ(x.data_ptr<std::int64_t>()[5], 6);
}

TEST_F(TorchBridgeTest, TensorsOnOneStorageShareOneTorchStorageWhileOneLives) {
  Tensor x = shared_arange(12, DType::kFloat32);
  const Storage probe = x.storage();
  at::Tensor a = to_torch(x.slice(0, 0, 6));
  at::Tensor b = to_torch(x.slice(0, 6, 12));
  EXPECT_TRUE(a.storage().is_alias_of(b.storage()));
  EXPECT_EQ(a.storage().use_count(), 2u);
  EXPECT_EQ(probe.use_count(), 3);  // probe, x, one DataPtr for both
  // torch's resize cannot take the bytes out of shared memory.
  EXPECT_ERROR(a.resize_({100}), c10::Error, "Trying to resize storage that is not resizable");
  a.reset();
  b.reset();
  EXPECT_EQ(probe.use_count(), 2);
  at::Tensor c = to_torch(x);  // a new one, the old having died
  EXPECT_EQ(c.storage().use_count(), 1u);
  EXPECT_TRUE(at::equal(c, at::arange(12, at::kFloat)));
}

TEST_F(TorchBridgeTest, SharedStorageOfTellsOursFromTorchs) {
  Tensor x = shared_arange(4, DType::kUInt8);
  at::Tensor t = to_torch(x);
  auto ours = shared_storage_of(*t.storage().unsafeGetStorageImpl());
  ASSERT_TRUE(ours.has_value());
  EXPECT_TRUE(ours->is_same(x.storage()));
  EXPECT_FALSE(shared_storage_of(*at::ones({4}).storage().unsafeGetStorageImpl()).has_value());
  c10::Storage whole = to_torch(x.storage());
  EXPECT_TRUE(whole.is_alias_of(t.storage()));
  EXPECT_EQ(whole.nbytes(), 4u);
}

TEST_F(TorchBridgeTest, ShareMemoryMovesATorchStorageInPlaceAndViewsFollow) {
  at::Tensor base = at::arange(100, at::kFloat);
  at::Tensor row = base.view({10, 10}).select(0, 3);
  at::Tensor col = base.view({10, 10}).t().select(0, 4);
  c10::StorageImpl& impl = *base.storage().unsafeGetStorageImpl();
  ASSERT_TRUE(impl.resizable());
  const void* before = storage_data(base);

  std::optional<Storage> moved = share_memory_(impl);
  ASSERT_TRUE(moved.has_value());
  EXPECT_TRUE(moved->is_shared());
  EXPECT_EQ(moved->nbytes(), 400u);
  EXPECT_NE(storage_data(base), before);
  EXPECT_EQ(storage_data(base), moved->data());
  EXPECT_EQ(row.data_ptr(), static_cast<char*>(moved->data()) + 30 * 4);
  EXPECT_EQ(col.data_ptr(), static_cast<char*>(moved->data()) + 4 * 4);
  EXPECT_FALSE(impl.resizable());
  EXPECT_TRUE(at::equal(base, at::arange(100, at::kFloat)));
  EXPECT_TRUE(at::equal(col, at::arange(4, 100, 10, at::kFloat)));

  // Ours now: recognised, not moved again, and what to_torch of its Storage gives.
  EXPECT_TRUE(shared_storage_of(impl)->is_same(*moved));
  EXPECT_TRUE(share_memory_(impl)->is_same(*moved));
  EXPECT_EQ(storage_data(base), moved->data());
  EXPECT_EQ(to_torch(*moved).unsafeGetStorageImpl(), &impl);
  Tensor s = from_torch(row);
  EXPECT_TRUE(s.storage().is_same(*moved));
  s.fill_(-1.0);
  EXPECT_TRUE(at::equal(base.view({10, 10}).select(0, 3), at::full({10}, -1.0f)));
}

// A CUDA storage of torch's moves into this process's device arena in place: one copy, the
// DataPtr ours from then on (no second copy), and to_torch of that Storage is the same
// StorageImpl. One whose bytes are not its allocator's own (a DataPtr torch's CUDA IPC put
// in place: sent or received) stays as it is. On the fake driver, whose device addresses are
// host addresses: the CPU allocator's memory, labelled cuda:0, stands for torch's caching
// allocator's (CPU builds of torch make no CUDA memory, but hold a CUDA DataPtr they are
// given).
c10::intrusive_ptr<c10::StorageImpl> fake_torch_cuda_storage(const std::vector<std::int32_t>& values) {
  c10::Allocator* allocator = c10::GetAllocator(c10::kCPU);
  const std::size_t nbytes = values.size() * sizeof(std::int32_t);
  c10::DataPtr bytes = allocator->allocate(nbytes);
  std::memcpy(bytes.get(), values.data(), nbytes);
  bytes.unsafe_set_device(c10::Device(c10::kCUDA, 0));
  return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                               static_cast<std::int64_t>(nbytes),
                                               std::move(bytes), allocator, /*resizable=*/false);
}

TEST_F(TorchBridgeTest, ACudaStorageMovesIntoTheDeviceArenaOnceAndStaysThere) {
  ::setenv("SHMTENSOR_CUDA_DRIVER", "fake", 1);  // chosen at the first CUDA use, below
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  auto impl = fake_torch_cuda_storage({1, 2, 3, 4, 5, 6, 7, 8});
  const void* before = impl->data();
  std::optional<Storage> moved = share_memory_(*impl);
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(moved->device(), Device::cuda(0));
  EXPECT_TRUE(moved->is_shared());
  EXPECT_EQ(moved->nbytes(), 32u);
  EXPECT_NE(impl->data(), before);
  EXPECT_EQ(impl->data(), moved->data());
  EXPECT_EQ(impl->device(), c10::Device(c10::kCUDA, 0));
  Tensor host = Tensor::from_storage(*moved, 0, {8}, {1}, DType::kInt32).cpu();
  EXPECT_EQ(std::vector<std::int32_t>(host.data_ptr<std::int32_t>(),
                                      host.data_ptr<std::int32_t>() + 8),
            std::vector<std::int32_t>({1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_TRUE(share_memory_(*impl)->is_same(*moved));
  EXPECT_EQ(to_torch(*moved).unsafeGetStorageImpl(), impl.get());
  EXPECT_TRUE(shared_storage_of(*impl)->is_same(*moved));

  // An allocator that answers with another device's memory is refused, the storage unchanged.
  auto other = fake_torch_cuda_storage({9, 9});
  const void* others = other->data();
  EXPECT_ERROR(
      share_memory_(*other, [](std::size_t n, Device) { return Storage::allocate_shared(n); }),
      std::invalid_argument,
      "allocate(8, cuda:0) must return a shared Storage of that many bytes there");
  EXPECT_EQ(other->data(), others);

  // Bytes torch's IPC put in place (a DataPtr that is not its allocator's): left alone.
  std::vector<std::int32_t> mapped = {7, 7};
  auto received = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 8,
      c10::DataPtr(mapped.data(), c10::Device(c10::kCUDA, 0)), c10::GetAllocator(c10::kCPU), false);
  EXPECT_FALSE(share_memory_(*received).has_value());
  EXPECT_EQ(received->data(), mapped.data());
  EXPECT_FALSE(shared_storage_of(*received).has_value());
}

TEST_F(TorchBridgeTest, ShareMemoryLeavesEmptyAndUnsuitableStoragesAlone) {
  at::Tensor empty = at::empty({0});
  EXPECT_FALSE(share_memory_(*empty.storage().unsafeGetStorageImpl()).has_value());
  EXPECT_TRUE(empty.storage().resizable());

  at::Tensor meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
  EXPECT_ERROR(share_memory_(*meta.storage().unsafeGetStorageImpl()), std::invalid_argument,
               "share_memory_: a storage on meta");

  at::Tensor t = at::arange(8, at::kLong);
  c10::StorageImpl& impl = *t.storage().unsafeGetStorageImpl();
  const void* before = storage_data(t);
  EXPECT_ERROR(
      share_memory_(impl, [](std::size_t, Device) { return Storage::allocate_shared(7); }),
      std::invalid_argument, "allocate(64, cpu) must return a shared Storage of that many bytes");
  EXPECT_ERROR(share_memory_(impl, [](std::size_t n, Device) { return Storage::allocate(n); }),
               std::invalid_argument,
               "allocate(64, cpu) must return a shared Storage of that many bytes there");
  EXPECT_ERROR(share_memory_(impl,
                             [](std::size_t n, Device) -> Storage {
                               throw SharedMemoryFullError("full", n, 0);
                             }),
      SharedMemoryFullError, "full");
  EXPECT_EQ(storage_data(t), before);
  EXPECT_TRUE(impl.resizable());
  EXPECT_FALSE(shared_storage_of(impl).has_value());
  EXPECT_TRUE(at::equal(t, at::arange(8, at::kLong)));
}

TEST_F(TorchBridgeTest, ThreadsMovingOneStorageAtOnceAllGetTheOneItMovedTo) {
  for (int round = 0; round < 20; ++round) {
    at::Tensor t = at::arange(1000, at::kInt);
    c10::StorageImpl& impl = *t.storage().unsafeGetStorageImpl();
    std::vector<Storage> got(4);
    std::vector<std::thread> threads;
    for (auto& g : got) threads.emplace_back([&impl, &g] { g = *share_memory_(impl); });
    for (auto& th : threads) th.join();
    for (const Storage& g : got) EXPECT_TRUE(g.is_same(got[0]));
    EXPECT_EQ(storage_data(t), got[0].data());
    EXPECT_TRUE(at::equal(t, at::arange(1000, at::kInt)));
  }
}

TEST_F(TorchBridgeTest, AMovedStorageLivesAsLongAsEitherSide) {
  Storage probe;
  {
    at::Tensor t = at::arange(16, at::kInt);
    probe = *share_memory_(*t.storage().unsafeGetStorageImpl());
    EXPECT_EQ(probe.use_count(), 2);  // probe, the DataPtr's copy
  }
  EXPECT_EQ(probe.use_count(), 1);
  EXPECT_EQ(static_cast<std::int32_t*>(probe.data())[15], 15);
}

}  // namespace
}  // namespace shmtensor
