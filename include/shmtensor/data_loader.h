// DataLoader: batches from a dataset, loaded by worker processes into shared memory and
// handed to the calling process with zero copies, like torch.utils.data.DataLoader.
//
//   struct Images {                                   // a map-style dataset
//     std::int64_t size() const { return 50000; }
//     std::tuple<Tensor, std::int64_t> get(std::int64_t i) const { ... }
//   };
//   DataLoader loader(Images{}, {.batch_size = 64, .shuffle = true, .num_workers = 2});
//   for (int epoch = 0; epoch < 10; ++epoch)
//     for (auto& [images, labels] : loader) train(images, labels);   // [64, ...] and [64]
//
// Datasets:
//  - map-style: any type with size() and get(std::int64_t) returning a sample;
//  - iterable-style: any range (begin()/end()) of samples without get(). Each worker
//    iterates its own copy, so a dataset that should not repeat itself calls
//    get_worker_info() in begin() and takes its share (e.g. every num_workers-th item).
// A sample is anything the collate_fn accepts (collate.h); a batch anything encodable
// (codec.h).
//
// Semantics (docs/data_loader.md has the design and every message):
//  - Batches come in sampler order with in_order (results that arrive early wait), or as
//    soon as ready without it. At most prefetch_factor × num_workers batches are asked of
//    the workers and not yet handed out.
//  - num_workers = 0 loads in the calling process; exceptions then propagate unchanged.
//  - A worker's exception in get, collate_fn or an iterable dataset's iteration is thrown
//    here as DataLoaderWorkerError (worker id, index, exception type and message); the
//    epoch can go on. An exception in worker_init_fn is thrown the same way, but that
//    worker can load nothing: the epoch ends there. A worker that dies is reported at
//    once (pidfd) as DataLoaderWorkerDied with the signal's name; a wait longer than
//    `timeout` is DataLoaderTimeout; these end the epoch too. After any error that ends
//    the epoch the workers are stopped at once (persistent or not) and the next begin()
//    starts new ones.
//  - Workers start at begin(). They stop at the end of the epoch (unless
//    persistent_workers), when an iteration is left early (the iterator is destroyed), and
//    when the loader is destroyed: asked first, then SIGTERM after 1 s and SIGKILL after
//    another. They are also SIGKILLed if the thread that started them ends.
//  - begin() starts a new epoch and abandons a running one.
//
// Thread safety: one DataLoader is used by one thread at a time. Its iterators are
// invalidated by the next begin() and by the loader's destruction.
#pragma once

#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shmtensor/collate.h"
#include "shmtensor/data_loader_errors.h"
#include "shmtensor/error.h"
#include "shmtensor/export.h"
#include "shmtensor/internal/data_loader_session.h"
#include "shmtensor/internal/data_worker.h"
#include "shmtensor/process.h"
#include "shmtensor/sampler.h"
#include "shmtensor/start_method.h"
#include "shmtensor/timeout.h"

namespace shmtensor {

// Which worker this process is, in a DataLoader worker.
struct WorkerInfo {
  int id = 0;            // 0 .. num_workers - 1
  int num_workers = 0;
  std::uint64_t seed = 0;  // the loader's base seed + id
};
// The calling process's WorkerInfo in a DataLoader worker; nullopt in any other process.
// An iterable dataset calls it (in begin()) to pick its share of the data.
SHMTENSOR_API std::optional<WorkerInfo> get_worker_info();

template <class Collate = DefaultCollate>
struct DataLoaderOptions {
  std::int64_t batch_size = 1;
  bool shuffle = false;              // a new permutation every epoch (from seed and epoch)
  std::optional<std::uint64_t> seed;  // base seed; unset: a random one per loader
  Sampler sampler;                   // custom index order (not with shuffle)
  BatchSampler batch_sampler;        // custom batches (not with batch_size, shuffle,
                                     // sampler, drop_last)
  bool drop_last = false;            // drop a last batch smaller than batch_size
  int num_workers = 0;               // 0: load in the calling process
  int prefetch_factor = 2;           // batches in flight per worker
  bool persistent_workers = false;   // keep the workers from one epoch to the next
  Timeout timeout;                   // longest wait for a batch; unset or 0: no limit
  std::function<void(int worker_id)> worker_init_fn;  // runs first in each worker
  bool in_order = true;
  StartMethod start_method = StartMethod::kFork;
  Collate collate_fn{};
};

template <class Dataset, class Collate = DefaultCollate>
class DataLoader {
  static_assert(internal::kMapStyle<Dataset> || internal::kIterable<Dataset>,
                "a dataset has size() and get(std::int64_t) (map-style), or begin() and end() "
                "(iterable-style)");

 public:
  using Sample = internal::SampleOf<Dataset>;
  using Batch = internal::BatchOf<Dataset, Collate>;
  using Options = DataLoaderOptions<Collate>;
  static constexpr bool kIterable = internal::kIterable<Dataset>;

  // Moves an input iterator over the current epoch's batches. Move-only; destroying it
  // before the end abandons the epoch (non-persistent workers are stopped).
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    iterator(iterator&& o) noexcept
        : loader_(std::exchange(o.loader_, nullptr)), generation_(o.generation_) {}
    iterator& operator=(iterator&& o) noexcept {
      if (this != &o) {
        release();
        loader_ = std::exchange(o.loader_, nullptr);
        generation_ = o.generation_;
      }
      return *this;
    }
    ~iterator() { release(); }
    Batch& operator*() const { return *loader_->current_; }
    Batch* operator->() const { return &*loader_->current_; }
    iterator& operator++() {
      loader_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const noexcept {
      return loader_ == nullptr || loader_->generation_ != generation_ || !loader_->current_;
    }

   private:
    friend class DataLoader;
    iterator(DataLoader* loader, std::uint64_t generation) : loader_(loader), generation_(generation) {}
    void release() noexcept {
      if (loader_ && loader_->generation_ == generation_) loader_->finish_iteration();
      loader_ = nullptr;
    }
    DataLoader* loader_ = nullptr;
    std::uint64_t generation_ = 0;
  };

  // Checks the options (std::invalid_argument); starts nothing.
  explicit DataLoader(Dataset dataset, Options options = {})
      : dataset_(std::move(dataset)), options_(std::move(options)) {
    internal::validate_options(plan_options(), options_.num_workers, options_.prefetch_factor,
                               options_.persistent_workers, options_.timeout, kIterable);
    base_seed_ = options_.seed ? *options_.seed : internal::random_seed();
    plan_seed_ = base_seed_;
    if (options_.start_method == StartMethod::kExec && options_.num_workers > 0) check_exec();
  }
  ~DataLoader() = default;  // the session's destructor stops the workers
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Starts an epoch (starting workers unless persistent ones are running) and loads its
  // first batch: throws what iteration throws.
  iterator begin() {
    finish_iteration();
    const std::int64_t epoch = epoch_++;
    ++generation_;
    active_ = true;
    if (options_.num_workers == 0) {
      if constexpr (!kIterable) {
        plan_ = std::make_shared<internal::BatchPlan>(static_cast<std::int64_t>(dataset_.size()),
                                                      plan_options(), epoch);
        next_batch_ = 0;
      }
    } else {
      if (session_ && (session_->broken() || !options_.persistent_workers)) session_.reset();
      if (!session_) session_ = make_session();
      if constexpr (!kIterable) {
        auto plan = std::make_shared<internal::BatchPlan>(
            static_cast<std::int64_t>(dataset_.size()), plan_options(), epoch);
        session_->begin_epoch([plan, k = std::int64_t{0}](std::vector<std::int64_t>& out) mutable {
          if (k >= plan->size()) return false;
          plan->batch(k++, out);
          return true;
        });
      } else {
        session_->begin_epoch({});
      }
    }
    iterator it(this, generation_);
    advance();
    return it;
  }
  std::default_sentinel_t end() const noexcept { return {}; }

  // Batches per epoch (map-style only).
  std::int64_t size() const
    requires(!internal::kIterable<Dataset>)
  {
    return internal::BatchPlan::count(static_cast<std::int64_t>(dataset_.size()), plan_options(),
                                      epoch_);
  }
  const Dataset& dataset() const noexcept { return dataset_; }
  const Options& options() const noexcept { return options_; }
  std::uint64_t base_seed() const noexcept { return base_seed_; }
  // Epochs begun so far.
  std::int64_t epochs() const noexcept { return epoch_; }
  // The running workers' pids, by worker id (empty when none run).
  std::vector<int> worker_pids() const { return session_ ? session_->pids() : std::vector<int>{}; }

 private:
  internal::PlanOptions plan_options() const {
    return {options_.batch_size, options_.shuffle, plan_seed_, options_.drop_last,
            options_.sampler, options_.batch_sampler};
  }

  void check_exec() const {
    if constexpr (!internal::kExecDataset<Dataset>)
      throw std::invalid_argument(
          "DataLoader: the exec start method sends the dataset to each worker, so it must be "
          "encodable (SHMTENSOR_FIELDS or a Codec) or an empty class; use StartMethod::kFork");
    if constexpr (!internal::kExecCollate<Collate>)
      throw std::invalid_argument(
          "DataLoader: with the exec start method collate_fn must be a plain function or a "
          "captureless lambda (a re-executed worker cannot receive captured state)");
    if (options_.worker_init_fn && !options_.worker_init_fn.template target<void (*)(int)>())
      throw std::invalid_argument(
          "DataLoader: with the exec start method worker_init_fn must hold a plain function "
          "pointer (void (*)(int), e.g. +[](int id) {...})");
  }

  internal::WorkerConfig worker_config(int id) const {
    internal::WorkerConfig c;
    c.id = id;
    c.num_workers = options_.num_workers;
    c.base_seed = base_seed_;
    c.batch_size = options_.batch_size;
    c.drop_last = options_.drop_last;
    c.prefetch_factor = options_.prefetch_factor;
    c.iterable = kIterable;
    if (options_.start_method == StartMethod::kExec) {
      if constexpr (std::is_pointer_v<Collate>)
        c.collate_fn = internal::function_ref(reinterpret_cast<const void*>(options_.collate_fn));
      if (auto* f = options_.worker_init_fn.template target<void (*)(int)>())
        c.init_fn = internal::function_ref(reinterpret_cast<const void*>(*f));
    }
    return c;
  }

  std::unique_ptr<internal::LoaderSession> make_session() {
    internal::SessionOptions s{options_.num_workers, options_.prefetch_factor, options_.in_order,
                               options_.timeout, options_.start_method, kIterable,
                               options_.batch_size};
    auto launch = [this](int id, internal::WorkerLink link) -> internal::LaunchSpec {
      internal::WorkerConfig config = worker_config(id);
      if (options_.start_method == StartMethod::kExec) {
        if constexpr (internal::kExecDataset<Dataset> && internal::kExecCollate<Collate>) {
          return internal::make_launch<true>(id, &internal::exec_worker_main<Dataset, Collate>,
                                             link, config, internal::DatasetBox<Dataset>{dataset_});
        }
      }
      // kFork: the child is a copy of this process, so the loader's own dataset, collate_fn
      // and worker_init_fn are used in place (nothing is copied before the fork).
      return internal::make_launch<true>(id, [this, link, config](int) {
        internal::WorkerPort port(*link.connection, config);
        internal::run_worker(dataset_, options_.collate_fn, options_.worker_init_fn, port);
      });
    };
    auto decode = [this](std::uint64_t id, Decoder& d, bool keep) {
      Batch batch = d.decode<Batch>();
      if (keep) ready_.insert_or_assign(id, std::move(batch));
    };
    return std::make_unique<internal::LoaderSession>(s, launch, decode);
  }

  // Loads the next batch into current_, or leaves it empty at the end of the epoch.
  void advance() {
    current_.reset();
    if (!active_) return;
    try {
      if (options_.num_workers == 0) {
        advance_here();
      } else if (std::optional<std::uint64_t> id = session_->next()) {
        auto node = ready_.extract(*id);
        current_.emplace(std::move(node.mapped()));
      }
    } catch (...) {
      if (session_ && session_->broken()) finish_iteration();
      throw;
    }
    if (!current_) finish_iteration();
  }

  // num_workers = 0: get and collate right here.
  void advance_here() {
    std::vector<Sample> samples;
    if constexpr (!kIterable) {
      if (next_batch_ >= plan_->size()) return;
      plan_->batch(next_batch_++, indices_);
      samples.reserve(indices_.size());
      for (std::int64_t i : indices_) samples.push_back(dataset_.get(i));
    } else {
      if (!local_.it) {
        local_.it.emplace(std::begin(dataset_));
        local_.end.emplace(std::end(dataset_));
      }
      const auto n = static_cast<std::size_t>(options_.batch_size);
      while (samples.size() < n && *local_.it != *local_.end) {
        samples.push_back(Sample(**local_.it));
        ++*local_.it;
      }
      if (samples.empty() || (samples.size() < n && options_.drop_last)) return;
    }
    current_.emplace(options_.collate_fn(std::move(samples)));
  }

  // Ends the current iteration (at its end, or abandoned).
  void finish_iteration() noexcept {
    if (!active_) return;
    active_ = false;
    ready_.clear();
    plan_.reset();
    if constexpr (kIterable) {
      local_.it.reset();
      local_.end.reset();
    }
    if (session_ && (!options_.persistent_workers || session_->broken())) session_.reset();
  }

  Dataset dataset_;
  Options options_;
  std::uint64_t base_seed_ = 0;
  std::uint64_t plan_seed_ = 0;
  std::int64_t epoch_ = 0;
  std::uint64_t generation_ = 0;
  bool active_ = false;
  std::optional<Batch> current_;
  std::map<std::uint64_t, Batch> ready_;
  std::unique_ptr<internal::LoaderSession> session_;
  // num_workers = 0:
  std::shared_ptr<internal::BatchPlan> plan_;
  std::int64_t next_batch_ = 0;
  std::vector<std::int64_t> indices_;
  internal::IterationState<Dataset> local_;
};

}  // namespace shmtensor
