// Storage and share_memory_(): values survive, the pointer moves in place for every
// handle, empty storages allocate nothing, concurrent calls make exactly one segment.
#include "shmtensor/storage.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <latch>
#include <thread>
#include <vector>

#include "memory/registry.h"
#include "memory/storage_impl.h"
#include "shmtensor/internal/storage_access.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

using internal::Registry;

void fill_pattern(const Storage& s, std::uint8_t seed) {
  auto* p = static_cast<std::uint8_t*>(s.data());
  for (std::size_t i = 0; i < s.nbytes(); ++i) p[i] = static_cast<std::uint8_t>(seed + i * 7);
}

bool has_pattern(const Storage& s, std::uint8_t seed) {
  const auto* p = static_cast<const std::uint8_t*>(s.data());
  for (std::size_t i = 0; i < s.nbytes(); ++i)
    if (p[i] != static_cast<std::uint8_t>(seed + i * 7)) return false;
  return true;
}

class StorageTest : public testing::StrategyTest {};

TEST_P(StorageTest, PrivateStorageIsNotShared) {
  Storage s = Storage::allocate(100);
  ASSERT_TRUE(s.defined());
  EXPECT_EQ(s.nbytes(), 100u);
  EXPECT_NE(s.data(), nullptr);
  EXPECT_FALSE(s.is_shared());
  EXPECT_TRUE(testing::shmtensor_mappings().empty());
}

TEST_P(StorageTest, ShareMemoryKeepsValuesAndMovesThePointer) {
  for (std::size_t n : {std::size_t{1}, std::size_t{63}, std::size_t{4096}, std::size_t{1} << 20}) {
    SCOPED_TRACE(n);
    Storage s = Storage::allocate(n);
    fill_pattern(s, 3);
    void* before = s.data();
    EXPECT_FALSE(s.is_shared());

    Storage& ret = s.share_memory_();
    EXPECT_EQ(&ret, &s);
    EXPECT_TRUE(s.is_shared());
    EXPECT_EQ(s.sharing_strategy(), GetParam());
    EXPECT_NE(s.data(), before);
    EXPECT_EQ(s.nbytes(), n);
    EXPECT_TRUE(has_pattern(s, 3));
    // Tensors need at most 16-byte alignment; segments give 64.
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s.data()) % 64, 0u);
  }
}

TEST_P(StorageTest, EveryHandleFollowsTheMove) {
  Storage a = Storage::allocate(256);
  fill_pattern(a, 11);
  Storage b = a;  // another handle (as a tensor view would hold) on the same bytes
  ASSERT_TRUE(b.is_same(a));
  EXPECT_EQ(a.use_count(), 2);

  b.share_memory_();
  EXPECT_TRUE(a.is_shared());
  EXPECT_EQ(a.data(), b.data());
  EXPECT_TRUE(has_pattern(a, 11));

  // Writes through one handle are seen through the other: they are the same bytes.
  static_cast<std::uint8_t*>(a.data())[5] = 0xEE;
  EXPECT_EQ(static_cast<std::uint8_t*>(b.data())[5], 0xEE);
}

TEST_P(StorageTest, SharedStorageIsMappedOnceAndUnmappedWhenDropped) {
  std::size_t maps_before = testing::shmtensor_mappings().size();
  std::size_t segs_before = Registry::instance().segment_count();
  {
    Storage s = Storage::allocate(4096);
    s.share_memory_();
    EXPECT_EQ(testing::shmtensor_mappings().size(), maps_before + 1);
    EXPECT_EQ(Registry::instance().segment_count(), segs_before + 1);
    if (GetParam() == SharingStrategy::kFileSystem) {
      const std::string& name = internal::StorageAccess::impl(s)->segment()->name();
      ASSERT_FALSE(name.empty());
      EXPECT_TRUE(testing::shm_names().count(name.substr(1))) << name;
    }
  }
  // The arena keeps the segment for the next storage: the block is reused, nothing new is
  // mapped.
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps_before + 1);
  void* first = nullptr;
  {
    Storage s = Storage::allocate_shared(4000);
    first = s.data();
  }
  Storage again = Storage::allocate_shared(4000);
  EXPECT_EQ(again.data(), first) << "a freed block is reused by its creator";
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps_before + 1);
  again = Storage();
  // empty_cache() returns the free segment: unmapped (and, file_system, unlinked).
  shmtensor::empty_cache();
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps_before);
  EXPECT_EQ(Registry::instance().segment_count(), segs_before);
}

TEST_P(StorageTest, ShareMemoryOnSharedStorageIsANoOp) {
  Storage s = Storage::allocate(4096);
  s.share_memory_();
  fill_pattern(s, 5);
  void* data = s.data();
  auto segment = internal::StorageAccess::impl(s)->segment();
  auto fds = testing::open_fds();
  // Segment mappings only: sanitizer allocators map memory for ordinary heap allocations.
  std::size_t maps = testing::shmtensor_mappings().size();
  std::size_t segs = Registry::instance().segment_count();

  s.share_memory_();
  // Even with the other strategy selected: an already shared storage stays where it is.
  set_sharing_strategy(GetParam() == SharingStrategy::kFileDescriptor
                           ? SharingStrategy::kFileSystem
                           : SharingStrategy::kFileDescriptor);
  s.share_memory_();

  EXPECT_EQ(s.data(), data);
  EXPECT_EQ(internal::StorageAccess::impl(s)->segment(), segment);
  EXPECT_EQ(s.sharing_strategy(), GetParam());
  EXPECT_TRUE(has_pattern(s, 5));
  EXPECT_EQ(testing::open_fds(), fds);
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps);
  EXPECT_EQ(Registry::instance().segment_count(), segs);
}

TEST_P(StorageTest, AllocateSharedNeedsNoCopy) {
  Storage s = Storage::allocate_shared(8192);
  EXPECT_TRUE(s.is_shared());
  EXPECT_EQ(s.nbytes(), 8192u);
  EXPECT_EQ(s.sharing_strategy(), GetParam());
  fill_pattern(s, 9);  // the whole range is writable
  EXPECT_TRUE(has_pattern(s, 9));
  void* data = s.data();
  s.share_memory_();
  EXPECT_EQ(s.data(), data);
}

TEST_P(StorageTest, EmptyStorageSharesWithoutAllocating) {
  auto fds = testing::open_fds();
  auto names = testing::shm_names_of(::getpid());
  // Segment mappings only: sanitizer allocators map memory for ordinary heap allocations.
  std::size_t maps = testing::shmtensor_mappings().size();
  std::size_t segs = Registry::instance().segment_count();

  Storage s = Storage::allocate(0);
  EXPECT_FALSE(s.is_shared());
  EXPECT_NO_THROW(s.share_memory_());
  EXPECT_TRUE(s.is_shared());
  EXPECT_EQ(s.nbytes(), 0u);

  Storage t = Storage::allocate_shared(0);
  EXPECT_TRUE(t.is_shared());
  EXPECT_EQ(t.nbytes(), 0u);

  EXPECT_EQ(testing::open_fds(), fds);
  EXPECT_EQ(testing::shmtensor_mappings().size(), maps);
  EXPECT_EQ(Registry::instance().segment_count(), segs);
  EXPECT_EQ(testing::shm_names_of(::getpid()), names);
  EXPECT_TRUE(testing::shmtensor_mappings().empty());
}

TEST_P(StorageTest, ConcurrentShareMemoryMakesOneSegment) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 20;
  for (int round = 0; round < kRounds; ++round) {
    shmtensor::empty_cache();  // last round's segment goes: this round makes one
    std::size_t segs = Registry::instance().segment_count();
    std::size_t maps = testing::shmtensor_mappings().size();
    Storage s = Storage::allocate(std::size_t{64} * 1024);
    fill_pattern(s, static_cast<std::uint8_t>(round));

    std::latch start(kThreads);
    std::vector<void*> seen(kThreads, nullptr);
    std::vector<std::thread> threads;
    threads.reserve(kThreads);
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        Storage mine = s;  // each thread has its own handle, as tensors on it would
        start.arrive_and_wait();
        mine.share_memory_();
        seen[i] = mine.data();
      });
    }
    for (auto& t : threads) t.join();

    ASSERT_TRUE(s.is_shared());
    for (void* p : seen) EXPECT_EQ(p, s.data());
    EXPECT_EQ(Registry::instance().segment_count(), segs + 1);
    EXPECT_EQ(testing::shmtensor_mappings().size(), maps + 1);
    EXPECT_TRUE(has_pattern(s, static_cast<std::uint8_t>(round)));
  }
}

TEST_P(StorageTest, ManyStoragesEachGetTheirOwnBytes) {
  std::vector<Storage> all;
  for (int i = 0; i < 16; ++i) {
    all.push_back(Storage::allocate(1000 + i));
    fill_pattern(all.back(), static_cast<std::uint8_t>(i));
    all.back().share_memory_();
  }
  for (int i = 0; i < 16; ++i) {
    EXPECT_TRUE(has_pattern(all[i], static_cast<std::uint8_t>(i))) << i;
    for (int j = 0; j < i; ++j) EXPECT_NE(all[i].data(), all[j].data());
  }
}

// ---- Storage::from_blob: memory of another owner ----------------------------------------------

// A foreign owner's buffer and a deleter that counts its calls.
struct ForeignBuffer {
  std::vector<std::uint8_t> bytes;
  std::atomic<int> deleted{0};
  explicit ForeignBuffer(std::size_t n) : bytes(n) {}
  Storage wrap() {
    return Storage::from_blob(bytes.data(), bytes.size(), Device::cpu(),
                              [this] { deleted.fetch_add(1, std::memory_order_relaxed); });
  }
};

TEST_P(StorageTest, FromBlobAliasesTheOwnersMemoryUntilTheLastHandleGoes) {
  ForeignBuffer buf(4096);
  {
    Storage s = buf.wrap();
    EXPECT_EQ(s.data(), buf.bytes.data());
    EXPECT_EQ(s.nbytes(), 4096u);
    EXPECT_EQ(s.device(), Device::cpu());
    EXPECT_FALSE(s.is_shared());
    static_cast<std::uint8_t*>(s.data())[7] = 42;  // ours, in the owner's memory
    EXPECT_EQ(buf.bytes[7], 42);
    buf.bytes[9] = 43;  // the owner's, in ours
    EXPECT_EQ(static_cast<const std::uint8_t*>(s.data())[9], 43);
    Storage copy = s;
    Tensor view = Tensor::from_storage(s, 8, {4}, {1}, DType::kUInt8);
    s = Storage();
    copy = Storage();
    EXPECT_EQ(buf.deleted.load(), 0);  // the view holds it
    EXPECT_EQ(view[1].item<int>(), 43);
  }
  EXPECT_EQ(buf.deleted.load(), 1);
  EXPECT_TRUE(testing::shmtensor_mappings().empty());
}

TEST_P(StorageTest, FromBlobShareMemoryMovesTheBytesAndReleasesTheOwnerOnce) {
  ForeignBuffer buf(std::size_t{1} << 20);
  {
    Storage s = buf.wrap();
    fill_pattern(s, 5);
    Tensor view = Tensor::from_storage(s, 0, {16}, {1}, DType::kUInt8);
    s.share_memory_();
    EXPECT_EQ(buf.deleted.load(), 1);  // at the move, not at the end
    EXPECT_TRUE(s.is_shared() && view.is_shared());
    EXPECT_EQ(s.sharing_strategy(), GetParam());
    EXPECT_NE(s.data(), buf.bytes.data());
    EXPECT_EQ(view.raw_data(), s.data());
    EXPECT_TRUE(has_pattern(s, 5));
    std::fill(buf.bytes.begin(), buf.bytes.end(), 0);  // no longer ours
    EXPECT_TRUE(has_pattern(s, 5));
    s.share_memory_();
  }
  EXPECT_EQ(buf.deleted.load(), 1);
}

TEST_P(StorageTest, FromBlobSharedConcurrentlyReleasesOnce) {
  for (int round = 0; round < 20; ++round) {
    ForeignBuffer buf(std::size_t{64} * 1024);
    Storage s = buf.wrap();
    fill_pattern(s, static_cast<std::uint8_t>(round));
    constexpr int kThreads = 4;
    std::latch start(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&] {
        Storage mine = s;
        start.arrive_and_wait();
        mine.share_memory_();
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(buf.deleted.load(), 1);
    EXPECT_TRUE(has_pattern(s, static_cast<std::uint8_t>(round)));
  }
}

TEST_P(StorageTest, FromBlobOfNoBytesAndItsErrors) {
  int deleted = 0;
  {
    Storage empty = Storage::from_blob(nullptr, 0, Device::cpu(), [&] { ++deleted; });
    EXPECT_TRUE(empty.defined());
    EXPECT_FALSE(empty.is_shared());
    empty.share_memory_();
    EXPECT_TRUE(empty.is_shared());
    EXPECT_EQ(deleted, 1);
  }
  EXPECT_EQ(deleted, 1);
  Storage no_deleter = Storage::from_blob(&deleted, sizeof deleted, Device::cpu(), nullptr);
  no_deleter = Storage();
  EXPECT_ERROR((void)Storage::from_blob(nullptr, 8, Device::cpu(), [&] { ++deleted; }),
               std::invalid_argument, "Storage::from_blob: null data for 8 bytes");
  EXPECT_ERROR((void)Storage::from_blob(&deleted, 4, Device::cuda(-1), [&] { ++deleted; }),
               std::invalid_argument, "cuda:-1 is not a device");
  EXPECT_EQ(deleted, 1);  // not called when from_blob throws
}

INSTANTIATE_TEST_SUITE_P(Strategies, StorageTest, testing::kAllStrategies, testing::strategy_name);

TEST(StorageNullTest, DefaultConstructedStorageIsNull) {
  Storage s;
  EXPECT_FALSE(s.defined());
  EXPECT_EQ(s.data(), nullptr);
  EXPECT_EQ(s.nbytes(), 0u);
  EXPECT_FALSE(s.is_shared());
  EXPECT_NO_THROW(s.share_memory_());
  EXPECT_FALSE(s.defined());
}

}  // namespace
}  // namespace shmtensor
