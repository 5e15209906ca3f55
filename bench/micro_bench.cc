// Micro costs inside one process (Google Benchmark): what a small tensor costs to make, to
// move into shared memory, and to send and receive over a pipe. Cross-process scenarios
// are `shmtensor bench` (docs/benchmarks.md). Run: ./build/bench/micro_bench
#include <benchmark/benchmark.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "shmtensor/broadcast.h"
#include "shmtensor/connection.h"
#include "shmtensor/tensor.h"

namespace st = shmtensor;

namespace {

void BM_TensorFull40Bytes(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(st::Tensor::full({10}, 1.0));
}
BENCHMARK(BM_TensorFull40Bytes);

// An arena block per tensor: allocation, copy in, and (when the tensor dies) the release.
void BM_ShareMemory40Bytes(benchmark::State& state) {
  st::set_sharing_strategy(state.range(0) == 0 ? st::SharingStrategy::kFileDescriptor
                                               : st::SharingStrategy::kFileSystem);
  for (auto _ : state) {
    st::Tensor t = st::Tensor::full({10}, 1.0);
    t.share_memory_();
    benchmark::DoNotOptimize(t.data_ptr<float>());
  }
  st::set_sharing_strategy(st::SharingStrategy::kFileDescriptor);
}
BENCHMARK(BM_ShareMemory40Bytes)->Arg(0)->Arg(1)->ArgName("file_system");

// One message each way through the kernel and the wire codec, both ends in this process
// (the receiver finds the storage already here: identity, no mapping).
void BM_PipeSendRecvSharedTensor(benchmark::State& state) {
  auto [a, b] = st::pipe();
  st::Tensor t =
      st::Tensor::empty_shared({static_cast<std::int64_t>(state.range(0))}, st::DType::kUInt8);
  for (auto _ : state) {
    a.send(t);
    benchmark::DoNotOptimize(b.recv<st::Tensor>());
  }
}
BENCHMARK(BM_PipeSendRecvSharedTensor)->Arg(40)->Arg(1 << 20);

void BM_PipeSendRecvPlainData(benchmark::State& state) {
  auto [a, b] = st::pipe();
  std::vector<std::int64_t> v(static_cast<std::size_t>(state.range(0)), 7);
  for (auto _ : state) {
    a.send(v);
    benchmark::DoNotOptimize(b.recv<std::vector<std::int64_t>>());
  }
}
BENCHMARK(BM_PipeSendRecvPlainData)->Arg(8)->Arg(4096);

// A Broadcast's message as broadcast_bench sends it, put and taken by its one reader in this
// process (no wake: the reader is not asleep): the writer's and the reader's work per message.
void BM_BroadcastPutGet(benchmark::State& state) {
  using Message = std::tuple<std::int64_t, std::int64_t, st::Tensor>;
  st::Broadcast<Message> b(1, 16);
  auto reader = b.reader(0);
  st::Tensor t =
      st::Tensor::empty_shared({static_cast<std::int64_t>(state.range(0))}, st::DType::kUInt8);
  for (auto _ : state) {
    b.put(Message{0, 1, t});
    benchmark::DoNotOptimize(reader.get());
  }
}
BENCHMARK(BM_BroadcastPutGet)->Arg(4096)->Arg(1 << 20);

}  // namespace
