#include "data/loader_errors.h"

#include <csignal>
#include <cstdio>

namespace shmtensor::internal {

namespace {
std::string worker_name(int worker_id, int pid) {
  return "DataLoader worker " + std::to_string(worker_id) + " (pid " + std::to_string(pid) + ")";
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}
}  // namespace

DataLoaderWorkerError worker_error(int worker_id, int pid, const WorkerFailure& f) {
  const auto colon = f.text.find(": ");
  std::string type = f.text.substr(0, colon);
  std::string message = colon == std::string::npos ? std::string() : f.text.substr(colon + 2);
  std::string where;
  if (f.stage == "get") {
    where = "in get(" + std::to_string(f.index) + ")";
  } else {
    where = "in " + f.stage;
  }
  std::string what = worker_name(worker_id, pid) + " raised " + type + " " + where + ": " + message;
  return DataLoaderWorkerError(what, worker_id, pid, f.index, f.stage, std::move(type),
                               std::move(message));
}

DataLoaderWorkerDied worker_died(int worker_id, const WorkerExit& exit,
                                 const std::string& loading) {
  std::string what = worker_name(worker_id, exit.pid);
  if (exit.exit_code < 0) {
    what += " was killed by signal " + exit.signal_name;
  } else {
    what += " exited unexpectedly with exit code " + std::to_string(exit.exit_code);
  }
  if (!loading.empty()) what += " while loading " + loading;
  if (!exit.error.empty()) what += ": " + exit.error;
  if (exit.exit_code == -SIGBUS) {
    // Touching shared memory that the kernel cannot back is the usual cause (torch's
    // "out of shared memory" case): a full /dev/shm or memory cgroup.
    what +=
        ". A bus error in a DataLoader worker usually means it ran out of shared memory: "
        "/dev/shm is too small for the batches (Docker gives containers 64 MB unless run "
        "with --shm-size, e.g. --shm-size=8g), or the memory limit was reached. "
        "shmtensor reserves the space of every segment it creates, so check memory that "
        "the dataset itself maps; `shmtensor doctor` shows the limits";
  } else if (exit.exit_code == -SIGKILL) {
    what += " (killed from outside, or by the kernel's out-of-memory killer: see dmesg)";
  }
  return DataLoaderWorkerDied(what, worker_id, exit.pid, exit.exit_code, exit.signal_name);
}

DataLoaderTimeout loader_timeout(double seconds, const std::string& waiting_for) {
  return DataLoaderTimeout("DataLoader timed out after " + seconds_text(seconds) +
                           " seconds waiting for " + waiting_for);
}

}  // namespace shmtensor::internal
