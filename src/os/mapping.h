// Move-only owner of an mmap'ed range.
#pragma once

#include <cstddef>
#include <utility>

namespace shmtensor::internal {

class Mapping {
 public:
  Mapping() noexcept = default;
  Mapping(void* addr, std::size_t size) noexcept : addr_(addr), size_(size) {}
  Mapping(Mapping&& o) noexcept
      : addr_(std::exchange(o.addr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      addr_ = std::exchange(o.addr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  // MAP_SHARED read-write mapping of [0, size) of fd. Throws SystemError.
  static Mapping map_shared(int fd, std::size_t size, const char* what);
  // MAP_SHARED|MAP_ANONYMOUS: inherited by forked children, shared with them.
  static Mapping map_anonymous_shared(std::size_t size);

  std::byte* data() const noexcept { return static_cast<std::byte*>(addr_); }
  std::size_t size() const noexcept { return size_; }
  explicit operator bool() const noexcept { return addr_ != nullptr; }
  void reset() noexcept;

 private:
  void* addr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace shmtensor::internal
