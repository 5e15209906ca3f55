// Where the manager daemon of this user lives (its private directory, socket, lock and log)
// and where its program is found. All of it comes from the environment, with defaults that
// need no setting:
//
//   SHMTENSOR_MANAGER        path of the shmtensor-manager program (else: the build tree,
//                            the install prefix, next to the running program)
//   SHMTENSOR_MANAGER_DIR    directory of the socket (else $XDG_RUNTIME_DIR/shmtensor when
//                            XDG_RUNTIME_DIR is this user's, else /tmp/shmtensor-<uid>)
//   SHMTENSOR_MANAGER_GROUP  name of an independent daemon (default "default")
//   SHMTENSOR_MANAGER_GRACE_MS  how long an idle daemon waits for new clients (2000)
//
// One daemon serves one (user, group, /dev/shm): the socket's name includes the device of
// /dev/shm, so a process in a mount namespace with its own /dev/shm gets its own daemon,
// and "+2", so that an older installation's daemon of the same group (one without named
// channels and kept fds) serves its own clients beside this one.
#pragma once

#include <string>
#include <vector>

namespace shmtensor::internal::manager {

struct ManagerLocation {
  std::string dir;
  std::string group;
  std::string socket_path;   // <dir>/<group>+2-<dev>.sock
  std::string lock_path;     // <dir>/<group>+2-<dev>.lock
  std::string log_path;      // <dir>/<group>+2-<dev>.log
  std::string journal_path;  // <dir>/<group>+2-<dev>.journal (journal.h)
};

// From the environment (see above). Throws ConfigurationError for an invalid group name or
// a socket path longer than a socket address holds.
ManagerLocation manager_location();
ManagerLocation manager_location(const std::string& dir, const std::string& group);
// The directory alone, from the environment.
std::string default_manager_dir();

// Group names: 1 to 64 characters of [A-Za-z0-9_.-].
bool is_valid_group(const std::string& group) noexcept;

// Where to look for the program, in order. With SHMTENSOR_MANAGER set, only that.
std::vector<std::string> manager_program_candidates();

// SHMTENSOR_MANAGER_GRACE_MS, default 2000, clamped to [0, 600000].
int manager_grace_ms();

}  // namespace shmtensor::internal::manager
