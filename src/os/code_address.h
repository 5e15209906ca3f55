// Naming a function so that a re-executed copy of this program can find it: the module
// (shared object) that holds it and its offset from that module's load address. The same
// binary mapped at another address (ASLR) has the function at the same offset.
#pragma once

#include <cstdint>
#include <string>

namespace shmtensor::internal {

struct CodeAddress {
  std::string module;         // dl_iterate_phdr's dlpi_name; "" for the main executable
  std::uintptr_t offset = 0;  // address - load bias of the module
};

// Where the code at `address` lives in this process. Throws Error if no loaded module
// holds it (a JIT'ed or otherwise anonymous function).
CodeAddress code_address_of(std::uintptr_t address);

// The address of `where` in this process. Validates that the module is loaded and that the
// offset falls inside one of its executable segments; throws Error otherwise (a module the
// parent dlopen'ed that this process has not loaded, or a corrupt description).
std::uintptr_t resolve_code_address(const CodeAddress& where);

}  // namespace shmtensor::internal
