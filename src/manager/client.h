// The library's side of the manager daemon (shmtensor-manager), used by the memory layer
// for file_system segments. Every name is registered before it is created, so no crash
// window exists in which a name is unknown to the manager.
//
// Thread-safe. After fork the child uses its own connection (the parent's is never shared).
#pragma once

#include <string>

namespace shmtensor::internal::manager {

// Before shm_open(O_CREAT|O_EXCL) of `name` (e.g. "/shmtensor_12_ab..._3").
// Starts the daemon if none runs. Throws Error saying why and where it looked if the
// daemon cannot be started.
void register_created(const std::string& name);
// After this process opened (mapped) an existing name it did not create.
void register_opened(const std::string& name);
// After this process unmapped `name` (and, if it was the last holder, unlinked it).
void release(const std::string& name, bool unlinked);

}  // namespace shmtensor::internal::manager
