#include "shmtensor/sharing_strategy.h"

#include <atomic>
#include <stdexcept>
#include <string>

namespace shmtensor {

namespace {
// relaxed: the strategy is an independent setting; no other data is published with it.
std::atomic<SharingStrategy> g_strategy{SharingStrategy::kFileDescriptor};
}  // namespace

std::string to_string(SharingStrategy strategy) {
  switch (strategy) {
    case SharingStrategy::kFileDescriptor:
      return "file_descriptor";
    case SharingStrategy::kFileSystem:
      return "file_system";
  }
  return "unknown";
}

std::vector<SharingStrategy> get_all_sharing_strategies() {
  return {SharingStrategy::kFileDescriptor, SharingStrategy::kFileSystem};
}

SharingStrategy get_sharing_strategy() { return g_strategy.load(std::memory_order_relaxed); }

void set_sharing_strategy(SharingStrategy strategy) {
  if (strategy != SharingStrategy::kFileDescriptor && strategy != SharingStrategy::kFileSystem)
    throw std::invalid_argument(
        "invalid sharing strategy value " + std::to_string(static_cast<int>(strategy)) +
        ": valid values are SharingStrategy::kFileDescriptor (" +
        std::to_string(static_cast<int>(SharingStrategy::kFileDescriptor)) +
        ", \"file_descriptor\") and SharingStrategy::kFileSystem (" +
        std::to_string(static_cast<int>(SharingStrategy::kFileSystem)) + ", \"file_system\")");
  g_strategy.store(strategy, std::memory_order_relaxed);
}

void set_sharing_strategy(std::string_view name) {
  for (SharingStrategy s : get_all_sharing_strategies()) {
    if (to_string(s) == name) return set_sharing_strategy(s);
  }
  throw std::invalid_argument("invalid sharing strategy \"" + std::string(name) +
                              "\": valid values are \"file_descriptor\" and \"file_system\"");
}

}  // namespace shmtensor
