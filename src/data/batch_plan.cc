// Which indices each batch of an epoch holds: samplers, the seeded shuffle, drop_last.
// Runs in the main process only; workers get the indices in their tasks.
#include <random>
#include <stdexcept>
#include <string>

#include "shmtensor/data_loader.h"

namespace shmtensor {

namespace {
std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed) {
  if (n < 0) throw std::invalid_argument("random_permutation: n must be >= 0");
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::uint64_t state = seed;
  for (std::int64_t i = n - 1; i > 0; --i) {
    // Rejection sampling: an unbiased j in [0, i] (a plain modulo would favour small j).
    const auto bound = static_cast<std::uint64_t>(i) + 1;
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % bound);
    std::uint64_t r;
    do r = splitmix64(state);
    while (r >= limit);
    std::swap(order[static_cast<std::size_t>(i)], order[r % bound]);
  }
  return order;
}

std::uint64_t epoch_seed(std::uint64_t base_seed, std::int64_t epoch) noexcept {
  std::uint64_t state = base_seed ^ (static_cast<std::uint64_t>(epoch) * 0xd1b54a32d192ed03ULL);
  return splitmix64(state);
}

namespace internal {

namespace {
void check_index(std::int64_t index, std::int64_t size) {
  if (index < 0 || index >= size)
    throw std::out_of_range("DataLoader: sampler index " + std::to_string(index) +
                            " is out of range for a dataset of size " + std::to_string(size));
}
}  // namespace

BatchPlan::BatchPlan(std::int64_t dataset_size, const PlanOptions& o, std::int64_t epoch)
    : batch_size_(o.batch_size) {
  if (o.batch_sampler) {
    batches_ = o.batch_sampler.batches(epoch);
    for (const auto& b : batches_)
      for (std::int64_t i : b) check_index(i, dataset_size);
    count_ = static_cast<std::int64_t>(batches_.size());
    return;
  }
  if (o.sampler) {
    order_ = o.sampler.indices(epoch);
    for (std::int64_t i : order_) check_index(i, dataset_size);
  } else if (o.shuffle) {
    order_ = random_permutation(dataset_size, epoch_seed(o.seed, epoch));
  } else {
    order_.resize(static_cast<std::size_t>(dataset_size));
    for (std::int64_t i = 0; i < dataset_size; ++i) order_[static_cast<std::size_t>(i)] = i;
  }
  const auto n = static_cast<std::int64_t>(order_.size());
  count_ = o.drop_last ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

void BatchPlan::batch(std::int64_t k, std::vector<std::int64_t>& out) const {
  if (!batches_.empty() || order_.empty()) {
    out = batches_.at(static_cast<std::size_t>(k));
    return;
  }
  const auto begin = static_cast<std::size_t>(k * batch_size_);
  const std::size_t end = std::min(order_.size(), begin + static_cast<std::size_t>(batch_size_));
  out.assign(order_.begin() + static_cast<std::ptrdiff_t>(begin),
             order_.begin() + static_cast<std::ptrdiff_t>(end));
}

std::int64_t BatchPlan::count(std::int64_t dataset_size, const PlanOptions& o, std::int64_t epoch) {
  if (o.batch_sampler) return static_cast<std::int64_t>(o.batch_sampler.batches(epoch).size());
  const std::int64_t n =
      o.sampler ? static_cast<std::int64_t>(o.sampler.indices(epoch).size()) : dataset_size;
  return o.drop_last ? n / o.batch_size : (n + o.batch_size - 1) / o.batch_size;
}

void validate_options(const PlanOptions& p, int num_workers, int prefetch_factor,
                      bool persistent_workers, Timeout timeout, bool iterable) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("DataLoader: " + what); };
  if (p.batch_size < 1) fail("batch_size must be at least 1, got " + std::to_string(p.batch_size));
  if (num_workers < 0) fail("num_workers option should be non-negative, got " + std::to_string(num_workers));
  if (prefetch_factor < 1)
    fail("prefetch_factor must be at least 1, got " + std::to_string(prefetch_factor));
  if (timeout && timeout->count() < 0) fail("timeout option should be non-negative");
  if (persistent_workers && num_workers == 0) fail("persistent_workers option needs num_workers > 0");
  if (p.sampler && p.shuffle) fail("sampler option is mutually exclusive with shuffle");
  if (p.batch_sampler && (p.batch_size != 1 || p.shuffle || p.sampler || p.drop_last))
    fail("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last");
  if (iterable && (p.shuffle || p.sampler || p.batch_sampler))
    fail("an iterable-style dataset has no indices: shuffle, sampler and batch_sampler do not apply");
}

std::uint64_t random_seed() {
  try {
    std::random_device device;
    return (static_cast<std::uint64_t>(device()) << 32) ^ device();
  } catch (const std::exception& e) {
    // The system has no entropy source for us: a failure of the environment, so an Error.
    throw Error(std::string("DataLoader: no random base seed (std::random_device: ") +
                e.what() + "); set DataLoaderOptions::seed");
  }
}

}  // namespace internal
}  // namespace shmtensor
