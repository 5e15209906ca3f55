#include "os/private_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "os/syscall.h"

namespace shmtensor::internal {

void ensure_private_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) == -1 && errno != EEXIST)
    throw_system_error(errno, "mkdir", path + ", mode 0700",
                       "set SHMTENSOR_MANAGER_DIR to a directory this user may create");
  struct stat st {};
  check_syscall("lstat", path, [&] { return ::lstat(path.c_str(), &st); });
  auto refuse = [&](const std::string& why) {
    throw Error("shmtensor-manager directory " + path + " " + why +
                "; refusing to use it (another user could impersonate the manager). Remove it, "
                "or set SHMTENSOR_MANAGER_DIR to a private directory");
  };
  if (!S_ISDIR(st.st_mode)) refuse("is not a directory");
  if (st.st_uid != ::geteuid())
    refuse("belongs to uid " + std::to_string(st.st_uid) + ", not " + std::to_string(::geteuid()));
  if ((st.st_mode & 077) != 0) {
    // Ours but too open (e.g. made with a permissive umask by an old version): tighten it.
    check_syscall("chmod", path + ", 0700", [&] { return ::chmod(path.c_str(), 0700); });
  }
}

bool is_own_directory(const std::string& path) noexcept {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::geteuid();
}

UniqueFd try_lock_file(const std::string& path) {
  UniqueFd fd(check_syscall("open", path + ", O_CREAT", [&] {
    return ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  }));
  if (retry_eintr([&] { return ::flock(fd.get(), LOCK_EX | LOCK_NB); }) == -1) {
    if (errno == EWOULDBLOCK) return UniqueFd();
    throw_system_error(errno, "flock", path);
  }
  return fd;
}

UniqueFd open_for_append(const std::string& path) noexcept {
  return UniqueFd(
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600));
}

bool write_fully(int fd, const std::string& data) noexcept {
  std::size_t off = 0;
  while (off < data.size()) {
    ssize_t n = retry_eintr([&] { return ::write(fd, data.data() + off, data.size() - off); });
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

std::string read_small_file(const std::string& path) noexcept {
  std::string out;
  try {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) return out;
    char buf[65536];
    for (;;) {
      ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf, sizeof buf); });
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
  } catch (...) {
    out.clear();
  }
  return out;
}

bool replace_file(const std::string& path, const std::string& content) noexcept {
  const std::string tmp = path + ".tmp";
  bool ok = false;
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) return false;
    ok = write_fully(fd.get(), content);
  }
  return ok && ::rename(tmp.c_str(), path.c_str()) == 0;
}

std::vector<std::string> list_directory(const std::string& dir) noexcept {
  std::vector<std::string> out;
  try {
    std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
    if (!d) return out;
    while (dirent* e = ::readdir(d.get())) {
      std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(std::move(n));
    }
  } catch (...) {
  }
  return out;
}

bool remove_file(const std::string& path) noexcept { return ::unlink(path.c_str()) == 0; }

bool file_exists(const std::string& path) noexcept {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  const char* real = ::realpath(path.c_str(), buf);
  return real == nullptr ? std::string() : std::string(real);
}

}  // namespace shmtensor::internal
