// shmtensor-manager's logic, as a class so that it can run (and be tested) in any process;
// tools/shmtensor-manager/main.cc only parses arguments and calls run().
//
// One daemon serves one ManagerLocation (user, group, /dev/shm). It
//  - takes an exclusive flock on the location's lock file: a second daemon started while one
//    serves finds the lock taken and the socket answering, reports EXISTS and exits without
//    touching the socket (so it cannot steal or break the first one's clients); if the first
//    is exiting (lock taken, socket gone), the second waits for the lock;
//  - replaces a stale socket (from a daemon that was killed), listens, reports OK;
//  - if it found such a stale socket or a journal, carries on from the killed daemon's
//    journal, then sweeps the names the journal does not know (sweep_orphans) once and
//    adopts those it keeps;
//  - accepts only peers of its own effective uid (SO_PEERCRED); a connection that sends
//    anything malformed is closed, and only that one;
//  - feeds every message into a Tracker and watches the processes it names with pidfds
//    (polling /proc every 250 ms where the kernel has none, and for process groups);
//    writes its journal once per turn of its loop, and before it answers a sync;
//  - keeps the named channels (channels.h), watching each creator, and hands dups of their
//    fds to openers of its uid;
//  - when it has no connection, no channel and the tracker nothing left to watch for
//    grace_ms, or on SIGTERM, SIGINT or SIGHUP: removes its socket and returns.
#pragma once

#include <memory>
#include <string>

#include "manager/paths.h"

namespace shmtensor::internal::manager {

// run()'s result when another daemon already serves the location.
inline constexpr int kExitAlreadyRunning = 3;

struct DaemonOptions {
  ManagerLocation location;
  int grace_ms = 2000;
  // Where to report the start: "OK <pid>", "EXISTS" or "ERROR <why>", one line; closed
  // after. -1: nowhere.
  int notify_fd = -1;
  // Sweep orphans at start when the previous daemon was killed.
  bool sweep = true;
  // Append stderr to location.log_path (truncated beyond 1 MiB) once the directory exists.
  bool log_to_file = false;
};

class Daemon {
 public:
  explicit Daemon(DaemonOptions options);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Serves until idle or signalled. Returns 0, kExitAlreadyRunning, or 1 when it could not
  // start (the reason went to notify_fd and stderr). Throws nothing.
  int run() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shmtensor::internal::manager
