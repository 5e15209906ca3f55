// The DataLoader scenario: a map-style dataset whose samples are --tensors-per-sample
// uint8 tensors of --bytes each, loaded by --workers worker processes in batches of
// --batch-size; the consumer (this process) drops each batch, or with --keep keeps every
// one (the workload that exhausts torch's fds or mappings). The clock runs from begin()
// (worker start included) to the last batch.
#include "bench_dataloader.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "shmtensor/data_loader.h"

namespace shmtensor::tool {
namespace {

struct Synthetic {
  std::int64_t samples;
  int tensors;
  std::int64_t bytes;
  std::int64_t size() const { return samples; }
  std::vector<Tensor> get(std::int64_t i) const {
    std::vector<Tensor> out;
    out.reserve(static_cast<std::size_t>(tensors));
    for (int k = 0; k < tensors; ++k)
      out.push_back(Tensor::full({bytes}, static_cast<double>((i + k) % 256), DType::kUInt8));
    return out;
  }
};

std::int64_t count_fds() {
  std::int64_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

std::int64_t count_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::int64_t n = 0;
  for (std::string line; std::getline(maps, line);) ++n;
  return n;
}

}  // namespace

void print_dataloader_header() {
  std::printf("%-10s %-16s %7s %9s %7s %8s %5s %4s %10s %12s %6s %6s\n", "scenario", "strategy",
              "workers", "samples", "tensors", "bytes", "batch", "keep", "completed",
              "samples/s", "fds", "maps");
}

void run_dataloader_bench(const DataLoaderBenchOptions& o, const std::string& strategy) {
  DataLoader loader(Synthetic{o.samples, o.tensors_per_sample,
                              static_cast<std::int64_t>(std::max<std::size_t>(o.bytes, 1))},
                    {.batch_size = o.batch_size, .num_workers = o.workers, .prefetch_factor = o.prefetch});
  std::vector<std::vector<Tensor>> kept;
  if (o.keep) kept.reserve(static_cast<std::size_t>(loader.size()));
  std::int64_t completed = 0;
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  try {
    for (auto& batch : loader) {
      completed += batch.empty() ? 0 : batch.front().size(0);
      if (o.keep) kept.push_back(std::move(batch));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double rate = secs > 0 ? static_cast<double>(completed) / secs : 0;
  const std::int64_t fds = count_fds(), maps = count_mappings();
  if (o.json) {
    std::string escaped;
    for (char c : error) {
      if (c == '"' || c == '\\') escaped += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
    }
    std::printf(
        "{\"scenario\":\"dataloader\",\"strategy\":\"%s\",\"workers\":%d,\"samples\":%lld,"
        "\"tensors_per_sample\":%d,\"bytes\":%zu,\"batch_size\":%lld,\"prefetch\":%d,"
        "\"keep\":%s,\"completed\":%lld,\"samples_per_s\":%.1f,\"consumer_fds\":%lld,"
        "\"consumer_mappings\":%lld,\"error\":\"%s\"}\n",
        strategy.c_str(), o.workers, static_cast<long long>(o.samples), o.tensors_per_sample,
        o.bytes, static_cast<long long>(o.batch_size), o.prefetch, o.keep ? "true" : "false",
        static_cast<long long>(completed), rate, static_cast<long long>(fds),
        static_cast<long long>(maps), escaped.c_str());
  } else {
    std::printf("%-10s %-16s %7d %9lld %7d %8zu %5lld %4s %10lld %12.0f %6lld %6lld  %s\n",
                "dataloader", strategy.c_str(), o.workers, static_cast<long long>(o.samples),
                o.tensors_per_sample, o.bytes, static_cast<long long>(o.batch_size),
                o.keep ? "yes" : "no", static_cast<long long>(completed), rate,
                static_cast<long long>(fds), static_cast<long long>(maps), error.substr(0, 60).c_str());
  }
  std::fflush(stdout);
}

}  // namespace shmtensor::tool
