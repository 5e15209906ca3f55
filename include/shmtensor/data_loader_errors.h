// The errors a DataLoader raises about its workers (data_loader.h).
#pragma once

#include <cstdint>
#include <string>

#include "shmtensor/error.h"
#include "shmtensor/export.h"

namespace shmtensor {

// Base of the errors a DataLoader raises about its workers.
class SHMTENSOR_API DataLoaderError : public Error {
 public:
  explicit DataLoaderError(const std::string& what) : Error(what) {}
};

// An exception escaped the dataset or collate_fn in a worker. what() reads
//   "DataLoader worker 1 (pid 4242) raised std::out_of_range in get(17): no sample 17"
class SHMTENSOR_API DataLoaderWorkerError : public DataLoaderError {
 public:
  DataLoaderWorkerError(const std::string& what, int worker_id, int pid, std::int64_t index,
                        std::string stage, std::string type_name, std::string message)
      : DataLoaderError(what), worker_id_(worker_id), pid_(pid), index_(index),
        stage_(std::move(stage)), type_name_(std::move(type_name)), message_(std::move(message)) {}
  int worker_id() const noexcept { return worker_id_; }
  int pid() const noexcept { return pid_; }
  // The sample index being loaded; -1 when the failure was not in get().
  std::int64_t index() const noexcept { return index_; }
  // "get", "collate_fn", "iteration", "worker_init_fn" or "sending the batch".
  const std::string& stage() const noexcept { return stage_; }
  const std::string& type_name() const noexcept { return type_name_; }  // demangled
  const std::string& message() const noexcept { return message_; }      // its what()

 private:
  int worker_id_, pid_;
  std::int64_t index_;
  std::string stage_, type_name_, message_;
};

// A worker ended: killed by a signal ("... was killed by signal SIGKILL"; for SIGBUS the
// text explains shared memory) or exited (exit_code() >= 0).
class SHMTENSOR_API DataLoaderWorkerDied : public DataLoaderError {
 public:
  DataLoaderWorkerDied(const std::string& what, int worker_id, int pid, int exit_code,
                       std::string signal_name)
      : DataLoaderError(what), worker_id_(worker_id), pid_(pid), exit_code_(exit_code),
        signal_name_(std::move(signal_name)) {}
  int worker_id() const noexcept { return worker_id_; }
  int pid() const noexcept { return pid_; }
  int exit_code() const noexcept { return exit_code_; }  // minus the signal when killed
  const std::string& signal_name() const noexcept { return signal_name_; }  // or empty

 private:
  int worker_id_, pid_, exit_code_;
  std::string signal_name_;
};

// No batch came within DataLoaderOptions::timeout.
class SHMTENSOR_API DataLoaderTimeout : public DataLoaderError {
 public:
  explicit DataLoaderTimeout(const std::string& what) : DataLoaderError(what) {}
};

}  // namespace shmtensor
