// Dims: a tensor's sizes or strides. A small vector of int64 that keeps up to kInline
// values inside itself and goes to the heap only beyond that, so that making, copying and
// receiving a tensor of up to 6 dimensions allocates nothing for its shape (a received
// tensor is decoded without an allocation: docs/benchmarks.md).
//
// It reads like a const std::vector<std::int64_t>: size(), operator[], iteration, data();
// it compares equal to a std::vector with the same values, converts to one (implicitly, or
// with vec() as torch's IntArrayRef does), and is a contiguous range, so std::span<const
// std::int64_t> takes it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <new>
#include <span>
#include <stdexcept>
#include <vector>

namespace shmtensor {

class Dims {
 public:
  using value_type = std::int64_t;
  using size_type = std::size_t;
  using difference_type = std::ptrdiff_t;
  using reference = std::int64_t&;
  using const_reference = const std::int64_t&;
  using pointer = std::int64_t*;
  using const_pointer = const std::int64_t*;
  using iterator = std::int64_t*;
  using const_iterator = const std::int64_t*;

  static constexpr std::size_t kInline = 6;
  // The most values a Dims holds (std::length_error beyond; a tensor has at most a few).
  static constexpr std::size_t kMaxSize = UINT32_MAX;

  Dims() noexcept = default;
  // n copies of value.
  explicit Dims(std::size_t n, std::int64_t value = 0) { resize(n, value); }
  Dims(std::initializer_list<std::int64_t> values) { assign_bytes(values.begin(), values.size()); }
  Dims(const std::vector<std::int64_t>& values) { assign_bytes(values.data(), values.size()); }
  explicit Dims(std::span<const std::int64_t> values) {
    assign_bytes(values.data(), values.size());
  }
  Dims(const Dims& other) {
    if (other.on_heap())
      assign_bytes(other.data_, other.size_);
    else
      copy_inline(other);
  }
  Dims(Dims&& other) noexcept { take(other); }
  Dims& operator=(const Dims& other) {
    if (this == &other) return *this;
    if (other.on_heap()) {
      assign_bytes(other.data_, other.size_);
    } else {
      release();
      copy_inline(other);
    }
    return *this;
  }
  Dims& operator=(Dims&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  ~Dims() { release(); }

  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::int64_t* data() noexcept { return data_; }
  const std::int64_t* data() const noexcept { return data_; }
  std::int64_t& operator[](std::size_t i) noexcept { return data_[i]; }
  const std::int64_t& operator[](std::size_t i) const noexcept { return data_[i]; }
  std::int64_t* begin() noexcept { return data_; }
  std::int64_t* end() noexcept { return data_ + size_; }
  const std::int64_t* begin() const noexcept { return data_; }
  const std::int64_t* end() const noexcept { return data_ + size_; }
  std::int64_t front() const noexcept { return data_[0]; }
  std::int64_t back() const noexcept { return data_[size_ - 1]; }

  void clear() noexcept { size_ = 0; }
  void push_back(std::int64_t v) {
    reserve(size_ + 1);
    data_[size_++] = v;
  }
  // Inserts v before pos; returns where it went.
  std::int64_t* insert(const std::int64_t* pos, std::int64_t v) {
    const auto at = static_cast<std::size_t>(pos - data_);
    reserve(size_ + 1);
    std::memmove(data_ + at + 1, data_ + at, (size_ - at) * sizeof(std::int64_t));
    data_[at] = v;
    ++size_;
    return data_ + at;
  }
  std::int64_t* erase(const std::int64_t* pos) noexcept {
    const auto at = static_cast<std::size_t>(pos - data_);
    std::memmove(data_ + at, data_ + at + 1, (size_ - at - 1) * sizeof(std::int64_t));
    --size_;
    return data_ + at;
  }
  void resize(std::size_t n, std::int64_t value = 0) {
    reserve(n);
    for (std::size_t i = size_; i < n; ++i) data_[i] = value;
    size_ = static_cast<std::uint32_t>(n);
  }
  void reserve(std::size_t n) {
    if (n <= capacity_) return;
    if (n > kMaxSize) throw std::length_error("Dims: more than 2^32 - 1 values");
    const std::size_t cap = std::min<std::size_t>(
        std::max<std::size_t>(n, 2 * std::size_t{capacity_}), kMaxSize);
    std::int64_t* heap = allocate(cap);
    if (size_ > 0) std::memcpy(heap, data_, size_ * sizeof(std::int64_t));
    if (on_heap()) delete[] data_;
    data_ = heap;
    capacity_ = static_cast<std::uint32_t>(cap);
  }

  // Replaces the values with n int64 copied from `bytes`, which need not be aligned (a
  // received message's) and may lie in this Dims. On an exception nothing changed.
  void assign_bytes(const void* bytes, std::size_t n) {
    if (n > capacity_) {
      assign_to_new_buffer(bytes, n);
      return;
    }
    if (n > 0) std::memmove(data_, bytes, n * sizeof(std::int64_t));
    size_ = static_cast<std::uint32_t>(n);
  }

  std::vector<std::int64_t> vec() const { return std::vector<std::int64_t>(begin(), end()); }
  operator std::vector<std::int64_t>() const { return vec(); }

  friend bool operator==(const Dims& a, const Dims& b) noexcept {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const Dims& a, const std::vector<std::int64_t>& b) noexcept {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  // assign_bytes beyond the capacity. Out of line: the rare case, and GCC, seeing it inlined
  // into a copy from a short vector, warns of a read it cannot tell never happens.
  [[gnu::noinline]] void assign_to_new_buffer(const void* bytes, std::size_t n) {
    std::int64_t* heap = allocate(n);  // may throw: before anything changed
    std::memcpy(heap, bytes, n * sizeof(std::int64_t));
    if (on_heap()) delete[] data_;
    data_ = heap;
    capacity_ = static_cast<std::uint32_t>(n);
    size_ = static_cast<std::uint32_t>(n);
  }
  static std::int64_t* allocate(std::size_t n) {
    if (n > kMaxSize) throw std::length_error("Dims: more than 2^32 - 1 values");
    return new std::int64_t[n];
  }
  bool on_heap() const noexcept { return data_ != inline_data(); }
  void release() noexcept {
    if (on_heap()) delete[] data_;
    data_ = inline_data();
    capacity_ = kInline;
    size_ = 0;
  }
  // Takes other's values; other is left empty.
  void take(Dims& other) noexcept {
    if (other.on_heap()) {
      data_ = other.data_;
      capacity_ = other.capacity_;
      other.data_ = other.inline_data();
      other.capacity_ = kInline;
      size_ = other.size_;
    } else {
      copy_inline(other);
    }
    other.size_ = 0;
  }
  // Copies the whole inline array, set or not (a fixed size: a few register moves, no
  // memcpy call; bytes, which may be copied whatever they hold); data_ is inline here.
  void copy_inline(const Dims& other) noexcept {
    std::memcpy(inline_, other.inline_, sizeof inline_);
    size_ = other.size_;
  }
  std::int64_t* inline_data() noexcept { return reinterpret_cast<std::int64_t*>(inline_); }
  const std::int64_t* inline_data() const noexcept {
    return reinterpret_cast<const std::int64_t*>(inline_);
  }

  std::int64_t* data_ = inline_data();
  std::uint32_t size_ = 0;
  std::uint32_t capacity_ = kInline;
  alignas(std::int64_t) std::byte inline_[kInline * sizeof(std::int64_t)];
};

}  // namespace shmtensor
