// A program that shmtensor did not start, for the named-queue tests: exec'd by
// named_queue_test.cc, it opens queues by name only.
//
//   named_queue_peer NAME STRATEGY
//     opens NAME_in and NAME_out; gets a float tensor from NAME_in, adds 100 to each of its
//     elements in place (the sender sees it: the same memory), then puts on NAME_out an
//     int64 tensor of its own, 0..7 times 3, and exits 0 (its tensor outlives it).
//   named_queue_peer NAME open-missing
//     exits 0 when opening NAME throws NameNotFound.
// Anything else exits 2, with the reason on stderr.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "shmtensor/queue.h"
#include "shmtensor/sharing_strategy.h"
#include "shmtensor/tensor.h"

using namespace shmtensor;

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const std::string name = argv[1];
  const std::string mode = argv[2];
  try {
    if (mode == "open-missing") {
      try {
        (void)Queue<Tensor>::open(name);
      } catch (const NameNotFound&) {
        return 0;
      }
      std::fprintf(stderr, "opening %s did not throw NameNotFound\n", name.c_str());
      return 2;
    }
    set_sharing_strategy(mode == "file_system" ? SharingStrategy::kFileSystem
                                               : SharingStrategy::kFileDescriptor);
    auto in = Queue<Tensor>::open(name + "_in");
    auto out = Queue<Tensor>::open(name + "_out");
    Tensor t = in.get();
    float* p = t.data_ptr<float>();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] += 100;
    Tensor mine = Tensor::empty({8}, DType::kInt64);
    for (int i = 0; i < 8; ++i) mine.data_ptr<std::int64_t>()[i] = 3 * i;
    out.put(mine);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "named_queue_peer: %s\n", e.what());
    return 2;
  }
}
