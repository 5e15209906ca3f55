// Shared libraries loaded at run time: the CUDA driver (libcuda.so.1), which a machine
// without an NVIDIA driver does not have.
#pragma once

#include <string>

namespace shmtensor::internal {

// dlopen(path, RTLD_NOW | RTLD_LOCAL). Returns the library's handle, never unloaded: it
// stays for the life of the process. nullptr when it cannot be loaded, with *why set to
// the loader's reason (dlerror). Never throws.
void* load_library(const std::string& path, std::string* why) noexcept;

// dlsym: the address of `symbol` in `library`, or nullptr when it has none. Never throws.
void* library_symbol(void* library, const char* symbol) noexcept;

}  // namespace shmtensor::internal
