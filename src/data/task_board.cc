// A DataLoader worker's task board (shmtensor/internal/task_board.h): the main process
// writes tasks on it, the worker takes them.
#include "shmtensor/internal/task_board.h"

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

TaskBoardMemory TaskBoardMemory::map(Tensor memory, TaskBoardShape shape, bool check_header) {
  const std::size_t bytes = TaskBoardMemory::bytes(shape);
  if (memory.is_cuda() || memory.dtype() != DType::kInt64 || memory.dim() != 1 || !memory.is_contiguous() ||
      memory.nbytes() < bytes)
    throw ProtocolError("the task board is not a 1-d int64 host tensor of " +
                        std::to_string(bytes) + " bytes or more");
  void* at = memory.raw_data();
  if (reinterpret_cast<std::uintptr_t>(at) % alignof(TaskBoardHeader) != 0)
    throw ProtocolError("the task board is not aligned");
  auto* header = static_cast<TaskBoardHeader*>(at);
  if (check_header && (header->magic != kTaskBoardMagic || header->version != kTaskBoardVersion ||
                       header->slots != shape.slots || header->index_words != shape.index_words))
    throw ProtocolError("the task board's header is not that of a board of " +
                        std::to_string(shape.slots) + " slots of " + std::to_string(shape.index_words) +
                        " indices (layout version " + std::to_string(kTaskBoardVersion) + ")");
  return {std::move(memory), header, shape};
}

std::int64_t task_board_words(TaskBoardShape shape) noexcept {
  return static_cast<std::int64_t>((TaskBoardMemory::bytes(shape) + sizeof(std::int64_t) - 1) /
                                   sizeof(std::int64_t));
}

Tensor make_task_boards(TaskBoardShape shape, std::size_t count) {
  const std::int64_t words = task_board_words(shape);
  const std::size_t boards = std::max<std::size_t>(count, 1);
  const auto all = words * static_cast<std::int64_t>(boards);
  // A memfd whatever the process's strategy: no /dev/shm space (file_system fallocates a
  // whole arena segment there) and no name for the manager to track.
  Storage storage = StorageAccess::make(allocate_shared_storage(
      static_cast<std::size_t>(all) * sizeof(std::int64_t), SharingStrategy::kFileDescriptor));
  Tensor memory = Tensor::from_storage(std::move(storage), 0, {all}, {1}, DType::kInt64);
  auto* first = static_cast<std::int64_t*>(memory.raw_data());
  std::memset(first, 0, static_cast<std::size_t>(all) * sizeof(std::int64_t));
  for (std::size_t i = 0; i < boards; ++i)
    new (first + static_cast<std::int64_t>(i) * words) TaskBoardHeader{
        kTaskBoardMagic, kTaskBoardVersion, shape.slots, shape.index_words, {0}, {0}, 0, {0}, {0}, {}};
  return memory;
}

TaskBoardWriter::TaskBoardWriter(Tensor memory, TaskBoardShape shape)
    : board_(TaskBoardMemory::map(std::move(memory), shape, false)) {}

bool TaskBoardWriter::post(std::uint64_t id, bool reset, std::span<const std::int64_t> indices,
                           std::uint32_t flags, std::uint32_t nones) noexcept {
  TaskEntry* e = board_.entry(posted_++);
  const bool none = (flags & kEntryNone) != 0;
  const std::size_t count = none ? nones : indices.size();
  const bool fits = count <= board_.shape.index_words;
  e->id = id;
  e->flags = (reset ? kEntryReset : 0) | (fits ? flags & (kEntryScalar | kEntryNone) : kEntryInMessage);
  e->count = fits ? static_cast<std::uint32_t>(count) : 0;
  if (fits && !none && !indices.empty()) std::memcpy(e + 1, indices.data(), indices.size_bytes());
  return fits;
}

bool TaskBoardWriter::publish() noexcept {
  board_.header->published.store(posted_, std::memory_order_seq_cst);
  return take_asleep();
}

bool TaskBoardWriter::take_asleep() noexcept {
  TaskBoardHeader* h = board_.header;
  // A plain look first: the exchange (a locked write) only when the worker sleeps.
  return h->asleep.load(std::memory_order_seq_cst) != 0 &&
         h->asleep.exchange(0, std::memory_order_seq_cst) != 0;
}

bool TaskBoardWriter::announce_message() noexcept {
  board_.header->messages.store(++messages_, std::memory_order_seq_cst);
  return take_asleep();
}

TaskBoardReader::TaskBoardReader(TaskBoardShape shape) : TaskBoardReader(make_task_board(shape), shape) {}

TaskBoardReader::TaskBoardReader(Tensor memory, TaskBoardShape shape)
    : board_(TaskBoardMemory::map(std::move(memory), shape, true)) {}

TaskBoardReader::Taken TaskBoardReader::take(std::vector<std::int64_t>& indices) {
  const TaskEntry* e = board_.entry(taken_++);
  const TaskEntry entry = *e;
  if (entry.count > board_.shape.index_words ||
      (entry.flags & ~(kEntryReset | kEntryInMessage | kEntryScalar | kEntryNone)) != 0 ||
      ((entry.flags & kEntryScalar) != 0 && entry.count != 1))
    throw ProtocolError("DataLoader worker: a task board entry of " + std::to_string(entry.count) +
                        " indices, flags " + std::to_string(entry.flags));
  const bool none = (entry.flags & kEntryNone) != 0;
  const auto* first = reinterpret_cast<const std::int64_t*>(e + 1);
  indices.assign(first, first + (none ? 0 : entry.count));
  // Only once the entry is copied: `taken` lets torch's main process rewrite its slot.
  board_.header->taken.store(taken_, std::memory_order_release);
  return {entry.id,          (entry.flags & kEntryReset) != 0, (entry.flags & kEntryInMessage) != 0,
          (entry.flags & kEntryScalar) != 0, none, entry.count};
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
