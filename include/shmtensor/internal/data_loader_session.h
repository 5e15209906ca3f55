// DataLoader internals that its template needs (data_loader.h): the batch plan of a
// map-style epoch, and the main process's side of the workers. Internal.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/data_worker.h"
#include "shmtensor/internal/launch.h"
#include "shmtensor/process.h"
#include "shmtensor/sampler.h"
#include "shmtensor/start_method.h"
#include "shmtensor/timeout.h"

namespace shmtensor::internal {

struct PlanOptions {
  std::int64_t batch_size = 1;
  bool shuffle = false;
  std::uint64_t seed = 0;
  bool drop_last = false;
  Sampler sampler;
  BatchSampler batch_sampler;
};

// The batches of one epoch of a map-style dataset (src/data/batch_plan.cc). Throws
// std::out_of_range for a sampler index outside [0, dataset_size).
class SHMTENSOR_API BatchPlan {
 public:
  BatchPlan(std::int64_t dataset_size, const PlanOptions& options, std::int64_t epoch);
  std::int64_t size() const noexcept { return count_; }
  void batch(std::int64_t k, std::vector<std::int64_t>& out) const;
  // size() without building the plan.
  static std::int64_t count(std::int64_t dataset_size, const PlanOptions& options,
                            std::int64_t epoch);

 private:
  std::vector<std::int64_t> order_;
  std::vector<std::vector<std::int64_t>> batches_;
  std::int64_t batch_size_ = 1;
  std::int64_t count_ = 0;
};

// Checks the options as torch does; throws std::invalid_argument.
SHMTENSOR_API void validate_options(const PlanOptions& plan, int num_workers,
                                    int prefetch_factor, bool persistent_workers,
                                    Timeout timeout, bool iterable);
SHMTENSOR_API std::uint64_t random_seed();

struct SessionOptions {
  int num_workers = 1;
  int prefetch_factor = 2;
  bool in_order = true;
  Timeout timeout;  // unset or 0: no limit
  StartMethod start_method = StartMethod::kFork;
  bool iterable = false;
  std::int64_t batch_size = 1;  // sizes the task boards' entries (longer batches: messages)
};

// The main process's side of a set of workers (src/data/loader_session.cc): starts them,
// hands out tasks, collects and orders results, watches for deaths and timeouts, stops
// them. Used by one thread.
class SHMTENSOR_API LoaderSession {
 public:
  // The launch of worker `id` whose end of its connection is `link`.
  using Launch = std::function<LaunchSpec(int id, WorkerLink link)>;
  // Decodes one batch of a reply; keep = false for a stale batch (of an abandoned epoch).
  using Decode = std::function<void(std::uint64_t id, Decoder& d, bool keep)>;
  // Fills the next batch's indices; false when the epoch has no more (map-style).
  using Source = std::function<bool(std::vector<std::int64_t>& indices)>;

  // Starts the workers; throws what Process::start throws (the others are stopped).
  LoaderSession(SessionOptions options, const Launch& launch, Decode decode);
  ~LoaderSession();  // stops the workers; never throws
  LoaderSession(const LoaderSession&) = delete;
  LoaderSession& operator=(const LoaderSession&) = delete;

  // Starts an epoch; results of tasks of an earlier one are dropped when they arrive.
  // source is empty for an iterable dataset (each task asks a worker for its next batch).
  void begin_epoch(Source source);
  // The id of the next batch to hand out (decoded by then), or nullopt at the epoch's end.
  // Throws DataLoaderWorkerError (the epoch goes on, unless it comes from worker_init_fn:
  // then broken() is true afterwards), DataLoaderWorkerDied, DataLoaderTimeout or
  // DataLoaderError for a reply that does not decode (broken() is true afterwards).
  std::optional<std::uint64_t> next();
  bool broken() const noexcept;
  std::vector<int> pids() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace shmtensor::internal
