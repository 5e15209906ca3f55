// Naming a function so that a worker, forked or re-executed from the same program, finds it
// again: the module that holds it and its offset there (ASLR moves modules, not offsets).
// Internal: DataLoader sends a function-pointer collate_fn and worker_init_fn this way.
#pragma once

#include <cstdint>
#include <string>

#include "shmtensor/codec.h"
#include "shmtensor/export.h"

namespace shmtensor::internal {

struct FunctionRef {
  bool set = false;
  std::string module;
  std::uint64_t offset = 0;
  SHMTENSOR_FIELDS(set, module, offset)
};
// Throws Error when no loaded module holds `code` (a JIT'ed function).
SHMTENSOR_API FunctionRef function_ref(const void* code);
// Throws ProtocolError for an unset ref, Error when the module is not loaded here or the
// offset is not code of it.
SHMTENSOR_API const void* resolve_function(const FunctionRef& ref);

}  // namespace shmtensor::internal
