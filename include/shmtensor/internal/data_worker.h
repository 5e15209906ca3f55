// The worker side of a DataLoader (data_loader.h): what a worker process runs. Internal.
//
// Protocol (one duplex Connection per worker and its task board, src/data/task_board.h;
// docs/data_loader.md):
//   main -> worker  tasks are entries of the worker's task board; messages are u8 kWake (a
//                   task was published while the worker slept) | u8 kTasks, u32 n, then
//                   n × (u64 id, u8 reset, vector<i64> indices) (a task whose indices do
//                   not fit its board entry, sent before the entry is published) | u8 kStop.
//                   EOF (the main process closed its end) also means stop.
//   worker -> main  entries, each u64 id + u8 kind:
//                     kBoard <Tensor> (its task board, the first entry, id 0)
//                     | kBatch <batch> | kError/kInitError <i64 index, str stage, str text>
//                     | kEnd (an iterable worker has nothing more this epoch)
//                   closed by u64 0 + u8 kDone (a worker sends one entry per message; the
//                   main process accepts several).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/connection.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/function_ref.h"
#include "shmtensor/internal/launch.h"
#include "shmtensor/internal/worker_group.h"

namespace shmtensor {

namespace internal {

// ---- dataset and batch types ---------------------------------------------------------------

template <class D, class = void>
struct IsMapStyle : std::false_type {};
template <class D>
struct IsMapStyle<D, std::void_t<decltype(std::declval<D&>().size()),
                                 decltype(std::declval<D&>().get(std::int64_t{0}))>>
    : std::true_type {};
template <class D, class = void>
struct IsRange : std::false_type {};
template <class D>
struct IsRange<D, std::void_t<decltype(std::begin(std::declval<D&>())),
                              decltype(std::end(std::declval<D&>()))>> : std::true_type {};

template <class D>
inline constexpr bool kMapStyle = IsMapStyle<D>::value;
template <class D>
inline constexpr bool kIterable = !kMapStyle<D> && IsRange<D>::value;

template <class D, class = void>
struct SampleOfImpl {
  using type = void;
};
template <class D>
struct SampleOfImpl<D, std::enable_if_t<kMapStyle<D>>> {
  using type = std::decay_t<decltype(std::declval<D&>().get(std::int64_t{0}))>;
};
template <class D>
struct SampleOfImpl<D, std::enable_if_t<kIterable<D>>> {
  using type = std::decay_t<decltype(*std::begin(std::declval<D&>()))>;
};
template <class D>
using SampleOf = typename SampleOfImpl<D>::type;
template <class D, class C>
using BatchOf = std::decay_t<std::invoke_result_t<C&, std::vector<SampleOf<D>>>>;

// ---- worker plumbing (src/data/worker_port.cc) -----------------------------------------------

struct WorkerConfig {
  int id = 0;
  int num_workers = 0;
  std::uint64_t base_seed = 0;
  std::int64_t batch_size = 1;  // iterable datasets: the worker batches
  bool drop_last = false;
  int prefetch_factor = 2;  // with batch_size and iterable, the task board's shape
  bool iterable = false;
  FunctionRef collate_fn;  // kExec: a function-pointer collate_fn
  FunctionRef init_fn;     // kExec: worker_init_fn
  SHMTENSOR_FIELDS(id, num_workers, base_seed, batch_size, drop_last, prefetch_factor, iterable,
                   collate_fn, init_fn)
};

enum class WorkerOp : std::uint8_t { kTasks = 0, kStop = 1, kWake = 2 };
enum class EntryKind : std::uint8_t {
  kBatch = 0,
  kError = 1,
  kEnd = 2,
  kInitError = 3,
  kBoard = 4,
  kDone = 255
};

// What went wrong in a worker, as data: the index being loaded (-1 if none), the stage
// ("get", "collate_fn", "iteration", "worker_init_fn", "sending the batch") and
// "<exception type>: <what()>".
struct WorkerFailure {
  std::int64_t index = -1;
  std::string stage;
  std::string text;
};
// Describes the exception being handled (call inside a catch block).
SHMTENSOR_API WorkerFailure current_failure(std::int64_t index, const char* stage);

// The non-template part of a worker: reading tasks, sending replies.
class SHMTENSOR_API WorkerPort {
 public:
  struct Task {
    std::uint64_t id = 0;
    bool reset = false;  // iterable: start the dataset's iteration over (a new epoch)
    std::vector<std::int64_t> indices;
  };
  // Installs the WorkerInfo of this process, makes its task board and sends it to the main
  // process (the first reply). Throws what the allocation or the send throws.
  WorkerPort(Connection& connection, const WorkerConfig& config);
  ~WorkerPort();
  WorkerPort(const WorkerPort&) = delete;
  WorkerPort& operator=(const WorkerPort&) = delete;

  const WorkerConfig& config() const noexcept;
  // The next task into `task` (its vector reused), waiting for one if none is published;
  // false when told to stop or when the main process is gone. Throws ProtocolError for a
  // board entry or a message that is not the protocol's.
  bool next_task(Task& task);
  void send(Encoder&& message);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// Sends one reply entry. A batch that cannot be encoded (its memory cannot be shared) is
// replaced by that failure. One message per batch: the main process gets every batch as
// soon as it is made (holding finished batches back to send several at once is no faster,
// docs/data_loader.md, and delays a batch behind a slow one).
template <class Batch>
void send_entry(WorkerPort& port, std::uint64_t id, EntryKind kind, const Batch* batch,
                const WorkerFailure& failure) {
  Encoder e;
  try {
    e.encode(id);
    e.encode(kind);
    if (kind == EntryKind::kBatch) {
      e.encode(*batch);
    } else if (kind != EntryKind::kEnd) {
      e.encode(failure.index);
      e.encode(failure.stage);
      e.encode(failure.text);
    }
  } catch (...) {
    send_entry<Batch>(port, id, EntryKind::kError, nullptr, current_failure(-1, "sending the batch"));
    return;
  }
  e.encode(std::uint64_t{0});
  e.encode(EntryKind::kDone);
  port.send(std::move(e));
}

// ---- the worker loop --------------------------------------------------------------------------

// Where an iterable dataset's worker is in its iteration.
template <class Dataset, bool = kIterable<Dataset>>
struct IterationState {};
template <class Dataset>
struct IterationState<Dataset, true> {
  std::optional<decltype(std::begin(std::declval<Dataset&>()))> it;
  std::optional<decltype(std::end(std::declval<Dataset&>()))> end;
  bool exhausted = false;
};

// Runs in a worker until told to stop: loads each task's samples, collates them and sends
// the batch (or the failure) back. worker_init_fn failures end the worker after reporting.
template <class Dataset, class Collate>
void run_worker(Dataset& dataset, Collate& collate, const std::function<void(int)>& init_fn,
                WorkerPort& port) {
  using Sample = SampleOf<Dataset>;
  using Batch = BatchOf<Dataset, Collate>;
  auto reply = [&port](std::uint64_t id, EntryKind kind, WorkerFailure f = {}) {
    send_entry<Batch>(port, id, kind, nullptr, f);
  };
  if (init_fn) {
    try {
      init_fn(port.config().id);
    } catch (...) {
      reply(0, EntryKind::kInitError, current_failure(-1, "worker_init_fn"));
      // Exiting now could make the main process read ECONNRESET instead of this report
      // (tasks it sent would be unread): wait until it stops us.
      WorkerPort::Task ignored;
      while (port.next_task(ignored)) {
      }
      return;
    }
  }
  IterationState<Dataset> iteration;
  WorkerPort::Task next;
  const WorkerPort::Task* task = &next;
  while (port.next_task(next)) {
    std::vector<Sample> samples;
    if constexpr (kMapStyle<Dataset>) {
      samples.reserve(task->indices.size());
      std::int64_t at = -1;
      try {
        for (std::int64_t index : task->indices) {
          at = index;
          samples.push_back(dataset.get(index));
        }
      } catch (...) {
        reply(task->id, EntryKind::kError, current_failure(at, "get"));
        continue;
      }
    } else {
      const auto batch_size = static_cast<std::size_t>(port.config().batch_size);
      try {
        if (task->reset || !iteration.it) {
          iteration.it.reset();
          iteration.end.reset();
          iteration.exhausted = false;
          iteration.it.emplace(std::begin(dataset));
          iteration.end.emplace(std::end(dataset));
        }
        samples.reserve(batch_size);
        while (!iteration.exhausted && samples.size() < batch_size) {
          if (*iteration.it == *iteration.end) {
            iteration.exhausted = true;
            break;
          }
          samples.push_back(Sample(**iteration.it));
          ++*iteration.it;
        }
      } catch (...) {
        iteration.exhausted = true;  // the iterator's state is unknown: no more from it
        reply(task->id, EntryKind::kError, current_failure(-1, "iteration"));
        continue;
      }
      if (samples.empty() || (samples.size() < batch_size && port.config().drop_last)) {
        reply(task->id, EntryKind::kEnd);
        continue;
      }
    }
    std::optional<Batch> batch;
    try {
      batch.emplace(collate(std::move(samples)));
    } catch (...) {
      reply(task->id, EntryKind::kError, current_failure(-1, "collate_fn"));
      continue;
    }
    send_entry<Batch>(port, task->id, EntryKind::kBatch, &*batch, {});
  }
}

// ---- the exec start method ----------------------------------------------------------------------

// A collate_fn that a re-executed worker can rebuild: a function pointer (found again by
// module + offset) or an empty class (DefaultCollate, a captureless lambda).
template <class C>
inline constexpr bool kExecCollate =
    std::is_pointer_v<C> || (std::is_empty_v<C> && std::is_default_constructible_v<C>);
// A dataset that can be sent to a re-executed worker: encodable (codec.h, e.g.
// SHMTENSOR_FIELDS), or empty and default-constructible.
template <class D>
inline constexpr bool kExecDataset =
    HasCodec<D>::value || (std::is_empty_v<D> && std::is_default_constructible_v<D>);

template <class D>
struct DatasetBox {
  D dataset;
};

template <class Dataset, class Collate>
void exec_worker_main(int /*index*/, WorkerLink link, WorkerConfig config, DatasetBox<Dataset> box) {
  Collate collate{};
  if constexpr (std::is_pointer_v<Collate>)
    collate = reinterpret_cast<Collate>(const_cast<void*>(resolve_function(config.collate_fn)));
  std::function<void(int)> init_fn;
  if (config.init_fn.set)
    init_fn = reinterpret_cast<void (*)(int)>(const_cast<void*>(resolve_function(config.init_fn)));
  WorkerPort port(*link.connection, config);
  run_worker(box.dataset, collate, init_fn, port);
}

}  // namespace internal

template <class D>
struct Codec<internal::DatasetBox<D>> {
  static void encode(Encoder& e, const internal::DatasetBox<D>& b) {
    if constexpr (internal::HasCodec<D>::value) e.encode(b.dataset);
  }
  static internal::DatasetBox<D> decode(Decoder& d) {
    if constexpr (internal::HasCodec<D>::value) return {d.decode<D>()};
    else return {};
  }
};

}  // namespace shmtensor
