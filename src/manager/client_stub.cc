// Placeholder until the manager daemon lands: registration is a no-op.
#include "manager/client.h"

namespace shmtensor::internal::manager {
void register_created(const std::string&) {}
void register_opened(const std::string&) {}
void release(const std::string&, bool) {}
}  // namespace shmtensor::internal::manager
