// The library's own door into Storage (storage.h): a handle made from, and the
// implementation behind, its bytes (src/memory, src/wire). Internal.
#pragma once

#include <memory>
#include <utility>

#include "shmtensor/storage.h"

namespace shmtensor::internal {

struct StorageAccess {
  static Storage make(std::shared_ptr<StorageImpl> impl) noexcept {
    return Storage(std::move(impl));
  }
  static const std::shared_ptr<StorageImpl>& impl(const Storage& s) noexcept { return s.impl_; }
};

}  // namespace shmtensor::internal
