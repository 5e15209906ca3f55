#include "shmtensor/internal/function_ref.h"

#include "os/code_address.h"

namespace shmtensor::internal {

FunctionRef function_ref(const void* code) {
  CodeAddress a = code_address_of(reinterpret_cast<std::uintptr_t>(code));
  return FunctionRef{true, std::move(a.module), static_cast<std::uint64_t>(a.offset)};
}

const void* resolve_function(const FunctionRef& ref) {
  if (!ref.set) throw ProtocolError("DataLoader worker: no function was named");
  return reinterpret_cast<const void*>(
      resolve_code_address(CodeAddress{ref.module, static_cast<std::uintptr_t>(ref.offset)}));
}

}  // namespace shmtensor::internal
