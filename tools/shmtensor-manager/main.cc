// shmtensor-manager: removes file_system shared memory that crashed processes leave
// behind. The library starts it (see src/manager/client.cc); it is not meant to be started
// by hand, though it can be, in the foreground, for debugging:
//
//   shmtensor-manager [--dir DIR] [--group NAME] [--grace-ms MS] [--notify-fd FD] [--no-sweep]
//                     [--detach]
//
// --detach (what the library passes): fork first, the process started exiting at once, so
// that the daemon is not its starter's child (os/daemonize.h, spawn_detached).
//
// Exit status: 0 after serving, 3 when another daemon already serves the group, 1 when it
// could not start, 2 for bad arguments.
// All the logic is in src/manager/daemon.cc.
#include <cstdlib>
#include <iostream>
#include <string>

#include "manager/daemon.h"
#include "manager/paths.h"
#include "os/daemonize.h"
#include "shmtensor/error.h"

namespace {

// Says why the daemon cannot start: on stderr and, for a daemon started by the library
// (whose stderr is /dev/null), on the notify pipe, which the client reports as an error.
int fail(int notify_fd, const std::string& why, int status) {
  if (notify_fd >= 0) shmtensor::internal::write_all_noexcept(notify_fd, "ERROR " + why + "\n");
  std::cerr << "shmtensor-manager: " << why << "\n";
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  namespace mgr = shmtensor::internal::manager;
  std::string dir = mgr::default_manager_dir();
  std::string group;
  int grace_ms = mgr::manager_grace_ms();
  int notify_fd = -1;
  bool sweep = true;
  bool detach = false;
  std::string bad;
  for (int i = 1; i < argc && bad.empty(); ++i) {
    std::string arg = argv[i];
    if (arg == "--no-sweep") {
      sweep = false;
      continue;
    }
    if (arg == "--detach") {
      detach = true;
      continue;
    }
    const char* v = i + 1 < argc ? argv[++i] : nullptr;
    if (v == nullptr)
      bad = "missing value for " + arg;
    else if (arg == "--dir")
      dir = v;
    else if (arg == "--group")
      group = v;
    else if (arg == "--grace-ms")
      grace_ms = std::atoi(v);
    else if (arg == "--notify-fd")
      notify_fd = std::atoi(v);
    else
      bad = "unknown argument " + arg;
  }
  if (!bad.empty())
    return fail(notify_fd,
                bad + "\nusage: shmtensor-manager [--dir DIR] [--group NAME] [--grace-ms MS] "
                      "[--notify-fd FD] [--no-sweep] [--detach]",
                2);
  if (detach) {
    try {
      shmtensor::internal::detach_from_starter();
    } catch (const shmtensor::Error& e) {
      return fail(notify_fd, e.what(), 1);
    }
  }
  if (group.empty()) {
    const char* g = std::getenv("SHMTENSOR_MANAGER_GROUP");
    group = (g != nullptr && *g != '\0') ? g : "default";
  }
  mgr::DaemonOptions options;
  try {
    options.location = mgr::manager_location(dir, group);
  } catch (const shmtensor::Error& e) {
    return fail(notify_fd, e.what(), 1);
  }
  options.grace_ms = grace_ms < 0 ? 0 : grace_ms;
  options.notify_fd = notify_fd;
  options.sweep = sweep;
  // Started by the library, stderr is /dev/null: keep a small log beside the socket.
  options.log_to_file = notify_fd >= 0;
  // 0: served and exited; 3: another daemon serves this group; 1: could not start.
  return mgr::Daemon(std::move(options)).run();
}
