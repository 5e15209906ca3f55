// Index orders for a DataLoader over a map-style dataset: which samples an epoch visits,
// in which order, and (with a batch sampler) how they are grouped into batches.
//
//   Sampler s = std::vector<std::int64_t>{4, 2, 0};           // the same order every epoch
//   Sampler t = [](std::int64_t epoch) { return order_for(epoch); };
//   BatchSampler b = std::vector<std::vector<std::int64_t>>{{0, 1}, {5}, {2, 3, 4}};
//
// Samplers run in the calling process only (the indices are sent to the workers), so any
// callable works with both start methods. An index outside [0, dataset size) is an error
// (std::out_of_range) when the epoch's batches are planned.
//
// For a job of several processes (one or many machines), DistributedSampler gives each
// process its own share of every epoch, as torch.utils.data.DistributedSampler does.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "shmtensor/export.h"

namespace shmtensor {

// A function of the epoch number (0, 1, ...) giving that epoch's index order; or unset.
class Sampler {
 public:
  using Fn = std::function<std::vector<std::int64_t>(std::int64_t epoch)>;
  Sampler() = default;
  Sampler(std::vector<std::int64_t> order)  // NOLINT(google-explicit-constructor): options read better
      : fn_([order = std::move(order)](std::int64_t) { return order; }) {}
  template <class F>
    requires std::is_invocable_r_v<std::vector<std::int64_t>, F&, std::int64_t>
  Sampler(F fn)  // NOLINT(google-explicit-constructor)
      : fn_(std::move(fn)) {}

  explicit operator bool() const noexcept { return static_cast<bool>(fn_); }
  std::vector<std::int64_t> indices(std::int64_t epoch) const { return fn_(epoch); }

 private:
  Fn fn_;
};

// Like Sampler, but each epoch is a list of batches, each a list of indices.
class BatchSampler {
 public:
  using Batches = std::vector<std::vector<std::int64_t>>;
  using Fn = std::function<Batches(std::int64_t epoch)>;
  BatchSampler() = default;
  BatchSampler(Batches batches)  // NOLINT(google-explicit-constructor)
      : fn_([batches = std::move(batches)](std::int64_t) { return batches; }) {}
  template <class F>
    requires std::is_invocable_r_v<Batches, F&, std::int64_t>
  BatchSampler(F fn)  // NOLINT(google-explicit-constructor)
      : fn_(std::move(fn)) {}

  explicit operator bool() const noexcept { return static_cast<bool>(fn_); }
  Batches batches(std::int64_t epoch) const { return fn_(epoch); }

 private:
  Fn fn_;
};

// A permutation of [0, n) that depends only on `seed` (the same on every platform and
// run): Fisher-Yates driven by splitmix64. shuffle=true uses
// random_permutation(n, epoch_seed(seed, epoch)).
SHMTENSOR_API std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed);
// The seed of one epoch's shuffle, derived from the loader's base seed.
SHMTENSOR_API std::uint64_t epoch_seed(std::uint64_t base_seed, std::int64_t epoch) noexcept;

struct DistributedSamplerOptions {
  // Processes in the job, and this process's number in [0, num_replicas). Unset: read from
  // the environment, the first variable that is set in this order:
  //   num_replicas: WORLD_SIZE (torchrun), OMPI_COMM_WORLD_SIZE (Open MPI's mpirun),
  //                 PMI_SIZE (MPICH / Hydra's mpiexec);
  //   rank:         RANK, OMPI_COMM_WORLD_RANK, PMI_RANK.
  std::optional<std::int64_t> num_replicas = std::nullopt;
  std::optional<std::int64_t> rank = std::nullopt;
  bool shuffle = true;
  std::uint64_t seed = 0;  // must be the same in every process of the job
  bool drop_last = false;
};

// Each process's share of a map-style dataset of dataset_size samples, with the semantics
// of torch.utils.data.DistributedSampler (torch 1.13), for num_replicas = R, rank = r,
// N = dataset_size:
//  - The epoch's order is [0, N), or with shuffle random_permutation(N, seed + epoch):
//    a function of seed + epoch only, the same in every process. (torch draws
//    torch.randperm with a generator seeded with seed + epoch; the two permutations differ,
//    so a job cannot mix torch and shmtensor processes with shuffle on.)
//  - Without drop_last: num_samples() = ceil(N / R), and the order is padded to
//    total_size() = num_samples() * R by repeating it from its start (as often as needed),
//    so total_size() - N indices are seen twice in an epoch.
//    With drop_last: num_samples() = floor(N / R) (torch writes ceil((N - R) / R) when
//    N % R != 0: the same number), and the order's tail past total_size() is dropped.
//  - indices(epoch) is every R-th index of that list from position r: num_samples() of them.
//    Over all ranks, the lists cover every index of [0, N) (without drop_last) and are
//    disjoint when N % R == 0.
// As a DataLoaderOptions::sampler (it converts to Sampler), the loader passes its own epoch
// count, so no set_epoch() is needed: every process's loader must run the same epochs.
//
// Throws ConfigurationError, naming the variable or option, its value and what to set,
// when dataset_size < 0, when num_replicas or rank is unset and no variable above holds it,
// when the first variable set is not a decimal integer (it is not skipped for a later one),
// when num_replicas < 1, or when rank is outside [0, num_replicas). The environment is read
// once, by the constructor.
//
// Copyable; const members may be called from any thread.
class SHMTENSOR_API DistributedSampler {
 public:
  explicit DistributedSampler(std::int64_t dataset_size, DistributedSamplerOptions options = {});

  std::vector<std::int64_t> indices(std::int64_t epoch) const;
  std::vector<std::int64_t> operator()(std::int64_t epoch) const { return indices(epoch); }

  std::int64_t num_samples() const noexcept { return num_samples_; }
  std::int64_t total_size() const noexcept { return num_samples_ * num_replicas_; }
  std::int64_t num_replicas() const noexcept { return num_replicas_; }
  std::int64_t rank() const noexcept { return rank_; }
  std::int64_t dataset_size() const noexcept { return dataset_size_; }

 private:
  std::int64_t dataset_size_;
  std::int64_t num_replicas_;
  std::int64_t rank_;
  std::int64_t num_samples_;
  bool shuffle_;
  std::uint64_t seed_;
};

}  // namespace shmtensor
