// DistributedSampler: torch's per-rank share of an epoch, and where num_replicas and rank
// come from when the caller leaves them to the launcher.
#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

#include "shmtensor/error.h"
#include "shmtensor/sampler.h"

namespace shmtensor {

namespace {

constexpr const char* kWhat = "DistributedSampler: ";

// A value and where it came from, for messages: "WORLD_SIZE='8'" or
// "DistributedSamplerOptions::num_replicas".
struct Setting {
  std::int64_t value;
  std::string source;
};

// The first variable of `names` that is set, parsed as a decimal integer. An empty or
// malformed value is an error rather than a reason to look further: a launcher that sets
// the variable means it, and silently taking another launcher's value would give two
// processes the same rank.
Setting from_environment(std::initializer_list<const char*> names, const std::string& option,
                         const std::string& meaning) {
  for (const char* name : names) {
    const char* raw = std::getenv(name);
    if (raw == nullptr) continue;
    const std::string_view text(raw);
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || end != text.data() + text.size())
      throw ConfigurationError(std::string(kWhat) + name + "='" + std::string(text) +
                               "' is not a decimal integer: set " + name + " to " + meaning +
                               ", or set DistributedSamplerOptions::" + option);
    return {value, std::string(name) + "='" + std::string(text) + "'"};
  }
  std::string list;
  for (const char* name : names) list += (list.empty() ? "" : ", ") + std::string(name);
  const std::string advice = "start the job with torchrun or mpirun, set " +
                             std::string(*names.begin()) + " to " + meaning +
                             ", or set DistributedSamplerOptions::" + option;
  throw ConfigurationError(std::string(kWhat) + option + " is not set and none of " + list +
                           " is in the environment: " + advice);
}

Setting resolve(const std::optional<std::int64_t>& given, std::initializer_list<const char*> names,
                const std::string& option, const std::string& meaning) {
  if (given) return {*given, "DistributedSamplerOptions::" + option};
  return from_environment(names, option, meaning);
}

}  // namespace

DistributedSampler::DistributedSampler(std::int64_t dataset_size, DistributedSamplerOptions o)
    : dataset_size_(dataset_size), shuffle_(o.shuffle), seed_(o.seed) {
  if (dataset_size < 0)
    throw ConfigurationError(std::string(kWhat) + "dataset_size must be >= 0, got " +
                             std::to_string(dataset_size));
  const Setting replicas =
      resolve(o.num_replicas, {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, "num_replicas",
              "the number of processes in the job");
  if (replicas.value < 1)
    throw ConfigurationError(std::string(kWhat) + "num_replicas must be at least 1, got " +
                             std::to_string(replicas.value) + " from " + replicas.source +
                             ": set it to the number of processes in the job");
  const Setting rank = resolve(o.rank, {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}, "rank",
                               "this process's number in [0, number of processes)");
  if (rank.value < 0 || rank.value >= replicas.value)
    throw ConfigurationError(std::string(kWhat) + "rank " + std::to_string(rank.value) + " from " +
                             rank.source + " is outside [0, " + std::to_string(replicas.value) +
                             ") for num_replicas " + std::to_string(replicas.value) + " from " +
                             replicas.source + ": set rank to this process's number in [0, " +
                             std::to_string(replicas.value) + ")");
  num_replicas_ = replicas.value;
  rank_ = rank.value;
  // torch: ceil((N - R) / R) with drop_last when N % R != 0, which is floor(N / R) (N / R is
  // not whole, so subtracting 1 and rounding up lands on its floor; for N < R both are 0),
  // and floor(N / R) is also ceil(N / R) when N % R == 0.
  num_samples_ = o.drop_last ? dataset_size / num_replicas_
                             : (dataset_size + num_replicas_ - 1) / num_replicas_;
}

std::vector<std::int64_t> DistributedSampler::indices(std::int64_t epoch) const {
  std::vector<std::int64_t> order;
  if (shuffle_)
    order = random_permutation(dataset_size_, seed_ + static_cast<std::uint64_t>(epoch));
  std::vector<std::int64_t> out(static_cast<std::size_t>(num_samples_));
  // torch pads the order by repeating it from its start (the whole order as often as
  // needed), so position p of the padded list is order[p % N]; rank r takes positions
  // r, r + R, ... below total_size. With drop_last every position is already below N.
  for (std::int64_t k = 0; k < num_samples_; ++k) {
    const std::int64_t p = (rank_ + k * num_replicas_) % dataset_size_;
    out[static_cast<std::size_t>(k)] = shuffle_ ? order[static_cast<std::size_t>(p)] : p;
  }
  return out;
}

}  // namespace shmtensor
