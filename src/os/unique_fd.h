// Move-only owner of a file descriptor.
#pragma once

#include <utility>

namespace shmtensor::internal {

class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  int release() noexcept { return std::exchange(fd_, -1); }
  // Closes the current fd (never retried on EINTR: Linux closes it regardless).
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

// dup with O_CLOEXEC.
UniqueFd dup_cloexec(int fd);

// What kind of file an fd is (fstat's file type); kUnknown when fstat fails. Never throws.
enum class FileKind { kUnknown, kRegular, kFifo, kSocket, kDirectory, kOther };
FileKind file_kind(int fd) noexcept;

}  // namespace shmtensor::internal
