// A DataLoader worker's task board: the tasks the main process gives one worker, in shared
// memory that the main process writes and the worker reads, so that a task costs neither
// side a message (docs/shm_layout.md, "A DataLoader worker's task board", is the prose
// twin of this layout). Two DataLoaders use it: the C++ one (src/data/) and the Python
// module's for torch's DataLoader (python/src/loader_iter.cc), whose workers run torch's
// own worker loop.
//
// C++ DataLoader: each worker makes its board (make_task_board: a block of its own arena,
// file_descriptor whatever the process's strategy: no /dev/shm space, no name) and sends
// it to the main process in its first reply (EntryKind::kBoard); the main process maps it
// as it maps the worker's batches (tasks it gives that worker before then wait in the main
// process). torch's DataLoader: the main process makes one board per worker and hands it to
// the worker as it starts. A task is an entry of a ring of `slots` entries: its id, flags
// and up to `index_words` sample indices (or one index that is not a batch, kEntryScalar).
// The main process writes entries, then publishes them (`published`, a count); the worker
// takes them in order and counts them in `taken`. A task whose indices do not fit an entry
// travels as a message, sent before its entry is published (the C++ DataLoader: a kTasks
// message, and its entry says kInMessage; torch's: the message names how many entries
// came before it, and `messages` counts such messages, so that the worker receives them
// before it takes a later entry). The C++ DataLoader never has more than `slots` tasks of
// a worker unanswered, so an entry is rewritten only after the worker has answered it (it
// took the entry before it answered); torch's sends a task as a message when `taken` says
// the ring is full.
//
// Waking: the worker sets `asleep` before it sleeps in its connection's (or index queue's)
// receive and looks at `published` once more; the main process, after it publishes, takes
// `asleep` back to 0 and, if it was set, sends a wake-up message. Both are sequentially
// consistent, so either the worker sees the new entry or the main process sees the flag.
// So the main process sends a message only to a worker that sleeps (or was about to).
//
// A reader checks the board's header and size against the shape it expects, as the writer
// does (ProtocolError); the main process reads nothing from the board but `asleep` and
// `taken`, and a worker that writes them misleads only itself (a wake-up for nothing, or
// its tasks sent as messages); the worker checks every entry it takes (ProtocolError).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "shmtensor/export.h"
#include "shmtensor/tensor.h"

namespace shmtensor::internal {

struct TaskBoardHeader {
  std::uint32_t magic;        // kTaskBoardMagic
  std::uint32_t version;      // kTaskBoardVersion
  std::uint32_t slots;        // entries in the ring
  std::uint32_t index_words;  // indices an entry holds
  std::atomic<std::uint64_t> published;  // entries published so far (the main process)
  std::atomic<std::uint32_t> asleep;     // 1: the worker sleeps, or is about to
  std::uint32_t reserved;
  std::atomic<std::uint64_t> messages;   // tasks sent as messages so far (torch's main process)
  std::atomic<std::uint64_t> taken;      // entries taken so far (the worker)
  std::uint64_t padding[2];
};
static_assert(std::is_standard_layout_v<TaskBoardHeader>);
static_assert(sizeof(TaskBoardHeader) == 64);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

struct TaskEntry {
  std::uint64_t id;
  std::uint32_t flags;  // kEntryReset | kEntryInMessage
  std::uint32_t count;  // indices that follow (index_words at most)
  // std::int64_t indices[index_words] follow
};
static_assert(std::is_standard_layout_v<TaskEntry>);
static_assert(sizeof(TaskEntry) == 16);

inline constexpr std::uint32_t kTaskBoardMagic = 0x42545453;  // "STTB"
inline constexpr std::uint32_t kTaskBoardVersion = 2;
inline constexpr std::uint32_t kEntryReset = 1;      // iterable: start the iteration over
inline constexpr std::uint32_t kEntryInMessage = 2;  // the task is in a kTasks message
inline constexpr std::uint32_t kEntryScalar = 4;     // one index that is not a batch (count 1)
// The indices are None (torch's IterableDataset: count Nones, or None itself with
// kEntryScalar); the entry's words are not read.
inline constexpr std::uint32_t kEntryNone = 8;
// Indices an entry holds at most; a longer batch's task travels in a message.
inline constexpr std::uint32_t kMaxEntryIndices = 512;

struct TaskBoardShape {
  std::uint32_t slots = 1;        // the loader's prefetch_factor
  std::uint32_t index_words = 0;  // the batch size, 16 to kMaxEntryIndices; 0 if iterable
};
SHMTENSOR_API TaskBoardShape task_board_shape(int prefetch_factor, std::int64_t batch_size, bool iterable) noexcept;

// A board's memory as one process sees it: the tensor, its header, and this process's own
// copy of the shape (the header's fields never steer where a process reads or writes).
struct SHMTENSOR_API TaskBoardMemory {
  Tensor memory;
  TaskBoardHeader* header = nullptr;
  TaskBoardShape shape;
  // Bytes of a board of that shape.
  static std::size_t bytes(TaskBoardShape shape) noexcept;
  // The entry of the task at position `pos` (counted from 0 over the session).
  TaskEntry* entry(std::uint64_t pos) const noexcept;
  // `memory` checked as a board of `shape`: a 1-d int64 host tensor of its bytes or more,
  // aligned, and (`check_header`) whose header names this layout and shape. ProtocolError.
  static TaskBoardMemory map(Tensor memory, TaskBoardShape shape, bool check_header);
};

// `count` new boards of that shape one after the other in one int64 tensor (board i is
// narrow(0, i * task_board_words(shape), task_board_words(shape))), in this process's arena,
// in a memfd whatever the sharing strategy, their headers written. Throws what the arena's
// allocation throws.
SHMTENSOR_API Tensor make_task_boards(TaskBoardShape shape, std::size_t count);
inline Tensor make_task_board(TaskBoardShape shape) { return make_task_boards(shape, 1); }
// The int64 words of a board of that shape.
SHMTENSOR_API std::int64_t task_board_words(TaskBoardShape shape) noexcept;

// The main process's side of one worker's board.
class SHMTENSOR_API TaskBoardWriter {
 public:
  // The board the worker sent (or this process made), checked against `shape`
  // (ProtocolError).
  TaskBoardWriter(Tensor memory, TaskBoardShape shape);
  std::uint32_t slots() const noexcept { return board_.shape.slots; }
  std::uint32_t index_words() const noexcept { return board_.shape.index_words; }
  // Entries posted so far, and tasks counted as sent in messages (announce_message).
  std::uint64_t posted() const noexcept { return posted_; }
  std::uint64_t messages() const noexcept { return messages_; }
  // Whether the worker has taken every entry but fewer than `slots` (as `taken` says), so
  // that the next post rewrites none it has not read.
  bool has_room() const noexcept {
    return posted_ - board_.header->taken.load(std::memory_order_acquire) < board_.shape.slots;
  }
  // Writes the next entry (not yet visible to the worker). False when the indices do not
  // fit: the entry says kInMessage then, and the caller sends the task in a message before
  // it publishes. `flags`: kEntryScalar (one index that is not a batch, `indices` holds
  // one), kEntryNone (`nones` indices that are None, `indices` empty).
  bool post(std::uint64_t id, bool reset, std::span<const std::int64_t> indices,
            std::uint32_t flags = 0, std::uint32_t nones = 0) noexcept;
  // Makes the entries posted so far visible. True when the worker sleeps (or was about to)
  // and must be woken with a message.
  bool publish() noexcept;
  // Counts a task sent as a message (after the message was sent). True when the worker
  // sleeps, as publish().
  bool announce_message() noexcept;

 private:
  // `asleep` taken back to 0; true when it was set.
  bool take_asleep() noexcept;

  TaskBoardMemory board_;
  std::uint64_t posted_ = 0;
  std::uint64_t messages_ = 0;
};

// The worker's side of its board.
class SHMTENSOR_API TaskBoardReader {
 public:
  // A board of that shape made here (make_task_board).
  explicit TaskBoardReader(TaskBoardShape shape);
  // A board another process made (make_task_board), checked against `shape`, its header
  // too (ProtocolError).
  TaskBoardReader(Tensor memory, TaskBoardShape shape);
  const Tensor& memory() const noexcept { return board_.memory; }
  // Whether an entry is published that this worker has not taken.
  bool ready() const noexcept {
    return board_.header->published.load(std::memory_order_acquire) > taken_;
  }
  // Entries taken so far.
  std::uint64_t taken() const noexcept { return taken_; }
  // Tasks the main process says it sent as messages so far (announce_message).
  std::uint64_t messages() const noexcept {
    return board_.header->messages.load(std::memory_order_acquire);
  }
  struct Taken {
    std::uint64_t id;
    bool reset;
    bool in_message;
    bool scalar;
    bool none;  // `count` indices that are None (`indices` left empty)
    std::uint32_t count;
  };
  // Takes the next entry (ready() must be true); its indices into `indices`.
  Taken take(std::vector<std::int64_t>& indices);
  // Before sleeping: sets `asleep`, then true if an entry came meanwhile (the flag is
  // cleared again then). After a sleep: woke().
  bool about_to_sleep() noexcept;
  void woke() noexcept { board_.header->asleep.store(0, std::memory_order_relaxed); }

 private:
  TaskBoardMemory board_;
  std::uint64_t taken_ = 0;
};

}  // namespace shmtensor::internal
