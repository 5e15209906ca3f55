// fds and tickets of plain pickles in flight, kept by shmtensor-manager: the Python
// package's door to them (python/shmtensor/multiprocessing/keeper.py). A pickle cannot
// carry an fd: its sender gives the fd to the manager under a random 16-byte token, which
// travels in the pickle; one process takes it, whenever it loads the pickle, even after
// the sender exited. A ticket (no fd) lets exactly one load, in any process, adopt what a
// file_system pickle carries. docs/manager.md, "Kept fds and tickets".
//
// Each process keeps one connection to the manager for these (a forked child makes its
// own); a keep is one send without an answer, and the manager reads every request already
// sent by any process before it says that a token is unknown. A token whose sender is gone
// is dropped SHMTENSOR_KEEPER_GRACE_S seconds (default 300) after the manager saw it gone.
#pragma once

#include <string>

#include "shmtensor/export.h"

namespace shmtensor::internal {

enum class KeptFdKind { kFd, kTicket, kUnknown };

// Keeps a duplicate of `fd` (-1: a ticket) under `token` (16 bytes). Starts the manager if
// none runs. Throws std::invalid_argument for another token size, Error (SystemError for a
// failed system call) when the manager cannot be reached.
SHMTENSOR_API void keep_fd_for_pickle(const std::string& token, int fd);
// Takes what `token` holds, once: kFd with the fd in *fd (close-on-exec, the caller's),
// kTicket, or kUnknown (taken already, never kept, or dropped after its sender died).
// Throws as keep_fd_for_pickle.
SHMTENSOR_API KeptFdKind take_fd_of_pickle(const std::string& token, int* fd);
// The fd of this process's connection for these, -1 while there is none.
SHMTENSOR_API int fd_keeper_connection() noexcept;

}  // namespace shmtensor::internal
