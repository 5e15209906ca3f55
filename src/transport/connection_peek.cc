// Looks at a Connection end's incoming ring that make no syscall: for a waiter that spins
// on several ends before it sleeps in poll() (a DataLoader's main process and its workers,
// src/data), so that a message published while it spins costs neither side a syscall.
#include "shmtensor/internal/connection_access.h"
#include "transport/connection_core.h"
#include "transport/ring_local.h"

namespace shmtensor::internal {

bool ConnectionAccess::has_message(const Connection& c) noexcept {
  if (!c.core_) return false;
  const ConnectionCore& k = *c.core_;
  // A socket-only end's datagrams are seen by a receive only.
  if (!k.ringed()) return true;
  return k.in.ring().has_ready();
}

std::optional<std::size_t> ConnectionAccess::spin_for_message(
    std::span<Connection* const> ends, std::chrono::steady_clock::time_point until) noexcept {
  for (std::uint32_t i = 0;; ++i) {
    for (std::size_t k = 0; k < ends.size(); ++k) {
      // A socket-only end is never found: its datagrams are seen by poll() and receives.
      const Connection* e = ends[k];
      if (e != nullptr && e->core_ && e->core_->ringed() && e->core_->in.ring().has_ready())
        return k;
    }
    if (i % 32 == 31 && std::chrono::steady_clock::now() >= until) return std::nullopt;
    ring_detail::pause_cpu();
  }
}

}  // namespace shmtensor::internal
