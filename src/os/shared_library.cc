#include "os/shared_library.h"

#include <dlfcn.h>

namespace shmtensor::internal {

void* load_library(const std::string& path, std::string* why) noexcept {
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = ::dlerror();
    try {
      *why = err != nullptr ? err : "dlopen failed";
    } catch (...) {  // no memory for the reason
    }
  }
  return lib;
}

void* library_symbol(void* library, const char* symbol) noexcept {
  return ::dlsym(library, symbol);
}

}  // namespace shmtensor::internal
