// A directory only its owner may enter, and lock files in it: where the manager daemon
// keeps its socket, and how two daemons of one group agree on who serves.
#pragma once

#include <string>
#include <vector>

#include "os/unique_fd.h"

namespace shmtensor::internal {

// Creates `path` (one level; the parent must exist) with mode 0700 if it is missing. Then
// checks that it is a real directory (not a symlink), owned by this effective uid, with no
// group/other permissions. Throws Error naming the path and what is wrong: a directory
// someone else made is never used (it could let them impersonate the daemon).
void ensure_private_dir(const std::string& path);

// True when `path` is a directory owned by this effective uid.
bool is_own_directory(const std::string& path) noexcept;

// Opens (creating, 0600) `path` and takes flock(LOCK_EX|LOCK_NB) on it. Returns the fd,
// which holds the lock until closed (or the process dies), or an invalid fd when another
// process holds it. Throws SystemError for anything else.
UniqueFd try_lock_file(const std::string& path);

// Small files in that directory (the daemon's journal). None of these throws.
// open(O_WRONLY|O_CREAT|O_APPEND|O_CLOEXEC, 0600); invalid fd on failure.
UniqueFd open_for_append(const std::string& path) noexcept;
// write() until all of `data` is written; false on error.
bool write_fully(int fd, const std::string& data) noexcept;
// The whole file ("" if it is missing or unreadable).
std::string read_small_file(const std::string& path) noexcept;
// Writes `content` to path.tmp and renames it over `path`.
bool replace_file(const std::string& path, const std::string& content) noexcept;
// Names of the entries of `dir` (not "." and ".."); empty if it cannot be read.
std::vector<std::string> list_directory(const std::string& dir) noexcept;

// unlink(); false if it did not exist (or could not be removed).
bool remove_file(const std::string& path) noexcept;
bool file_exists(const std::string& path) noexcept;
// `path` with symbolic links and ".." resolved (realpath); "" if it does not exist.
std::string real_path(const std::string& path);

}  // namespace shmtensor::internal
