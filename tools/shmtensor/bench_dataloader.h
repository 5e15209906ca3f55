// `shmtensor bench dataloader`: the DataLoader scenario (bench.cc dispatches to it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shmtensor::tool {

struct DataLoaderBenchOptions {
  int workers = 1;
  std::int64_t samples = 20000;
  int tensors_per_sample = 4;
  std::size_t bytes = 40;  // per tensor
  std::int64_t batch_size = 1;
  int prefetch = 64;
  bool keep = false;  // the consumer keeps every batch
  bool json = false;
};

// Runs one measurement with the current sharing strategy and prints one line (a table row,
// or one JSON object) labelled with `strategy`.
void run_dataloader_bench(const DataLoaderBenchOptions& o, const std::string& strategy);
// The table header matching run_dataloader_bench's rows.
void print_dataloader_header();

}  // namespace shmtensor::tool
