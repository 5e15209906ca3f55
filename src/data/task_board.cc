// A DataLoader worker's task board (task_board.h): the worker makes it, the main process
// writes tasks on it.
#include "data/task_board.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "memory/storage_impl.h"
#include "shmtensor/error.h"
#include "shmtensor/internal/storage_access.h"

namespace shmtensor::internal {

namespace {
constexpr std::size_t entry_bytes(std::uint32_t index_words) noexcept {
  return sizeof(TaskEntry) + std::size_t{index_words} * sizeof(std::int64_t);
}
}  // namespace

TaskBoardShape task_board_shape(int prefetch_factor, std::int64_t batch_size, bool iterable) noexcept {
  return {static_cast<std::uint32_t>(std::max(prefetch_factor, 1)),
          iterable ? 0U
                   : static_cast<std::uint32_t>(std::clamp<std::int64_t>(batch_size, 16, kMaxEntryIndices))};
}

std::size_t TaskBoardMemory::bytes(TaskBoardShape shape) noexcept {
  return sizeof(TaskBoardHeader) + std::size_t{shape.slots} * entry_bytes(shape.index_words);
}

TaskEntry* TaskBoardMemory::entry(std::uint64_t pos) const noexcept {
  return reinterpret_cast<TaskEntry*>(reinterpret_cast<std::byte*>(header) + sizeof(TaskBoardHeader) +
                                      (pos % shape.slots) * entry_bytes(shape.index_words));
}

TaskBoardWriter::TaskBoardWriter(Tensor memory, TaskBoardShape shape) : board_{std::move(memory), nullptr, shape} {
  const Tensor& m = board_.memory;
  const std::size_t bytes = TaskBoardMemory::bytes(shape);
  if (m.is_cuda() || m.dtype() != DType::kInt64 || m.dim() != 1 || !m.is_contiguous() ||
      m.nbytes() < bytes)
    throw ProtocolError("the task board is not a 1-d int64 host tensor of " +
                        std::to_string(bytes) + " bytes or more");
  void* at = board_.memory.raw_data();
  if (reinterpret_cast<std::uintptr_t>(at) % alignof(TaskBoardHeader) != 0)
    throw ProtocolError("the task board is not aligned");
  board_.header = static_cast<TaskBoardHeader*>(at);
}

bool TaskBoardWriter::post(std::uint64_t id, bool reset, std::span<const std::int64_t> indices) noexcept {
  TaskEntry* e = board_.entry(posted_++);
  const bool fits = indices.size() <= board_.shape.index_words;
  e->id = id;
  e->flags = (reset ? kEntryReset : 0) | (fits ? 0 : kEntryInMessage);
  e->count = fits ? static_cast<std::uint32_t>(indices.size()) : 0;
  if (fits && !indices.empty()) std::memcpy(e + 1, indices.data(), indices.size_bytes());
  return fits;
}

bool TaskBoardWriter::publish() noexcept {
  TaskBoardHeader* h = board_.header;
  h->published.store(posted_, std::memory_order_seq_cst);
  // A plain look first: the exchange (a locked write) only when the worker sleeps.
  return h->asleep.load(std::memory_order_seq_cst) != 0 &&
         h->asleep.exchange(0, std::memory_order_seq_cst) != 0;
}

TaskBoardReader::TaskBoardReader(TaskBoardShape shape) {
  const std::size_t bytes = TaskBoardMemory::bytes(shape);
  board_.shape = shape;
  // A memfd whatever the process's strategy: no /dev/shm space (file_system fallocates a
  // whole arena segment there) and no name for the manager to track.
  const auto words = static_cast<std::int64_t>((bytes + sizeof(std::int64_t) - 1) / sizeof(std::int64_t));
  Storage storage = StorageAccess::make(allocate_shared_storage(
      static_cast<std::size_t>(words) * sizeof(std::int64_t), SharingStrategy::kFileDescriptor));
  board_.memory = Tensor::from_storage(std::move(storage), 0, {words}, {1}, DType::kInt64);
  void* at = board_.memory.raw_data();
  std::memset(at, 0, bytes);
  board_.header = new (at) TaskBoardHeader{kTaskBoardMagic, kTaskBoardVersion, shape.slots,
                                           shape.index_words, {0}, {0}, 0, {}};
}

TaskBoardReader::Taken TaskBoardReader::take(std::vector<std::int64_t>& indices) {
  const TaskEntry* e = board_.entry(taken_++);
  const TaskEntry entry = *e;
  if (entry.count > board_.shape.index_words || (entry.flags & ~(kEntryReset | kEntryInMessage)) != 0)
    throw ProtocolError("DataLoader worker: a task board entry of " + std::to_string(entry.count) +
                        " indices, flags " + std::to_string(entry.flags));
  const auto* first = reinterpret_cast<const std::int64_t*>(e + 1);
  indices.assign(first, first + entry.count);
  return {entry.id, (entry.flags & kEntryReset) != 0, (entry.flags & kEntryInMessage) != 0};
}

bool TaskBoardReader::about_to_sleep() noexcept {
  TaskBoardHeader* h = board_.header;
  h->asleep.store(1, std::memory_order_seq_cst);
  if (h->published.load(std::memory_order_seq_cst) > taken_) {
    h->asleep.store(0, std::memory_order_relaxed);
    return true;
  }
  return false;
}

}  // namespace shmtensor::internal
