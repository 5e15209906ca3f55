// Exceptions thrown by shmtensor. Every failure is a shmtensor::Error; failures of a
// system call are SystemError and carry errno, the call and what we were doing.
#pragma once

#include <stdexcept>
#include <string>

namespace shmtensor {

// Base of every exception the library throws on purpose.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A system call failed. what() reads "<syscall>(<context>): <strerror> — <advice>".
class SystemError : public Error {
 public:
  SystemError(int err, std::string syscall, const std::string& context,
              const std::string& advice = {});
  int error_code() const noexcept { return errno_; }
  const std::string& syscall() const noexcept { return syscall_; }

 private:
  int errno_;
  std::string syscall_;
};

// Not enough room in /dev/shm (file_system strategy) or in memory for a segment.
// what() names the requested size, the free space and the fix.
class SharedMemoryFullError : public Error {
 public:
  SharedMemoryFullError(const std::string& what, std::size_t requested, std::size_t available)
      : Error(what), requested_(requested), available_(available) {}
  std::size_t requested() const noexcept { return requested_; }
  std::size_t available() const noexcept { return available_; }

 private:
  std::size_t requested_;
  std::size_t available_;
};

// Bytes or descriptors that came from another process (a segment header, a message, a
// cmsg) are malformed or inconsistent. The data is rejected; nothing was mapped or kept.
class ProtocolError : public Error {
 public:
  explicit ProtocolError(const std::string& what) : Error(what) {}
};

// The job's configuration, given in options or in environment variables, is invalid or
// incomplete. what() names the option or variable, its value and what to set.
class ConfigurationError : public Error {
 public:
  explicit ConfigurationError(const std::string& what) : Error(what) {}
};

}  // namespace shmtensor
