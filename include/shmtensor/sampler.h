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
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

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
std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed);
// The seed of one epoch's shuffle, derived from the loader's base seed.
std::uint64_t epoch_seed(std::uint64_t base_seed, std::int64_t epoch) noexcept;

}  // namespace shmtensor
