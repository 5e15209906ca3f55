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
#include <cstring>
#include <iostream>
#include <string>

#include "manager/daemon.h"
#include "manager/paths.h"
#include "os/daemonize.h"
#include "shmtensor/error.h"

namespace {

int usage(const char* why) {
  std::cerr << "shmtensor-manager: " << why
            << "\nusage: shmtensor-manager [--dir DIR] [--group NAME] [--grace-ms MS] "
               "[--notify-fd FD] [--no-sweep] [--detach]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  namespace mgr = shmtensor::internal::manager;
  std::string dir = mgr::default_manager_dir();
  std::string group;
  int grace_ms = mgr::manager_grace_ms();
  int notify_fd = -1;
  bool sweep = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--detach") != 0) continue;
    try {
      shmtensor::internal::detach_from_starter();
    } catch (const shmtensor::Error& e) {
      std::cerr << "shmtensor-manager: " << e.what() << "\n";
      return 1;
    }
    break;
  }
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (arg == "--no-sweep") {
      sweep = false;
      continue;
    }
    if (arg == "--detach") continue;
    const char* v = value();
    if (v == nullptr) return usage(("missing value for " + arg).c_str());
    if (arg == "--dir")
      dir = v;
    else if (arg == "--group")
      group = v;
    else if (arg == "--grace-ms")
      grace_ms = std::atoi(v);
    else if (arg == "--notify-fd")
      notify_fd = std::atoi(v);
    else
      return usage(("unknown argument " + arg).c_str());
  }
  if (group.empty()) {
    const char* g = std::getenv("SHMTENSOR_MANAGER_GROUP");
    group = (g != nullptr && *g != '\0') ? g : "default";
  }
  mgr::DaemonOptions options;
  try {
    options.location = mgr::manager_location(dir, group);
  } catch (const shmtensor::Error& e) {
    if (notify_fd >= 0)
      shmtensor::internal::write_all_noexcept(notify_fd, std::string("ERROR ") + e.what() + "\n");
    std::cerr << "shmtensor-manager: " << e.what() << "\n";
    return 1;
  }
  options.grace_ms = grace_ms < 0 ? 0 : grace_ms;
  options.notify_fd = notify_fd;
  options.sweep = sweep;
  // Started by the library, stderr is /dev/null: keep a small log beside the socket.
  options.log_to_file = notify_fd >= 0;
  // 0: served and exited; 3: another daemon serves this group; 1: could not start.
  return mgr::Daemon(std::move(options)).run();
}
