// Copies, in-place element ops and comparison.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "shmtensor/tensor.h"
#include "tensor/dispatch.h"

namespace shmtensor {

Tensor Tensor::contiguous() const {
  check_defined("contiguous");
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::clone() const {
  check_defined("clone");
  Tensor out = empty(sizes_, dtype_, device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dtype) const {
  check_defined("to");
  if (dtype == dtype_) return *this;
  Tensor out = empty(sizes_, dtype, device());
  out.copy_(*this);
  return out;
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_defined("copy_");
  if (!src.defined()) {
    throw std::invalid_argument(
        "Tensor::copy_: the source tensor is undefined (a default-constructed Tensor has no "
        "elements); give a defined tensor whose sizes broadcast to " +
        internal::sizes_to_string(sizes_));
  }
  // Reading from a storage we are writing could see already-overwritten elements (e.g.
  // x.copy_(x.transpose(0, 1))): copy the source out first. Distinct storages never overlap.
  Tensor source = src.storage_.is_same(storage_) && numel() > 0 ? src.clone() : src;
  try {
    source = source.expand(sizes_);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("copy_: source of sizes " + internal::sizes_to_string(src.sizes_) +
                                " cannot be broadcast to sizes " +
                                internal::sizes_to_string(sizes_));
  }
  if (numel() == 0) return *this;
  if (is_cuda() || source.is_cuda()) return copy_across_devices(source);
  if (dtype_ == source.dtype_ && is_contiguous() && source.is_contiguous()) {
    std::memmove(raw_data(), source.raw_data(), nbytes());
    return *this;
  }
  internal::dispatch(dtype_, [&](auto dst_tag) {
    using To = typename decltype(dst_tag)::type;
    internal::dispatch(source.dtype_, [&](auto src_tag) {
      using From = typename decltype(src_tag)::type;
      To* out = static_cast<To*>(raw_data());
      const From* in = static_cast<const From*>(source.raw_data());
      internal::for_each_offset2(sizes_, strides_, source.strides_,
                                 [&](std::int64_t o, std::int64_t i) {
                                   out[o] = internal::convert<To>(internal::load(in, i));
                                 });
    });
  });
  return *this;
}

namespace {

// Writes `value` (already converted) to every element of t.
template <class T>
void fill_with(Tensor& t, const T& value) {
  if (t.numel() == 0) return;
  T* out = static_cast<T*>(t.raw_data());
  if (t.is_contiguous()) {
    std::fill_n(out, t.numel(), value);
    return;
  }
  internal::for_each_offset(t.sizes(), t.strides(), [&](std::int64_t o) { out[o] = value; });
}

}  // namespace

Tensor& Tensor::fill_(double value) {
  check_defined("fill_");
  if (is_cuda()) return copy_(full({}, value, dtype_));  // broadcast, staged on the host
  internal::dispatch(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_with<T>(*this, internal::convert<T>(value));
  });
  return *this;
}

Tensor& Tensor::fill_(std::complex<double> value) {
  check_defined("fill_");
  if (is_cuda()) return copy_(full({}, value, dtype_));  // broadcast, staged on the host
  internal::dispatch(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_with<T>(*this, internal::convert<T>(value));
  });
  return *this;
}

Tensor& Tensor::add_(double value) {
  check_defined("add_");
  const bool is_integer = dtype_ == DType::kUInt8 || dtype_ == DType::kInt8 ||
                          dtype_ == DType::kInt16 || dtype_ == DType::kInt32 ||
                          dtype_ == DType::kInt64;
  if (is_integer && !(std::isfinite(value) && std::trunc(value) == value)) {
    throw std::invalid_argument("add_: cannot add the non-integral value " + std::to_string(value) +
                                " to a tensor of dtype " +
                                std::string(shmtensor::to_string(dtype_)));
  }
  if (numel() == 0) return *this;
  if (is_cuda()) {
    Tensor host = cpu();
    host.add_(value);
    return copy_(host);
  }
  internal::dispatch(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* data = static_cast<T*>(raw_data());
    auto apply = [&](auto&& op) {
      internal::for_each_offset(sizes_, strides_,
                                [&](std::int64_t o) { data[o] = op(internal::load(data, o)); });
    };
    if constexpr (std::is_same_v<T, bool>) {
      if (value != 0) apply([](bool) { return true; });
    } else if constexpr (std::is_integral_v<T>) {
      // Unsigned arithmetic wraps where signed overflow would be undefined; converting back
      // to T is modular in C++20, matching torch's wrap-around.
      const auto add = static_cast<std::uint64_t>(internal::saturating_cast<std::int64_t>(value));
      apply([add](T x) { return static_cast<T>(static_cast<std::uint64_t>(x) + add); });
    } else if constexpr (internal::kIsReducedFloat<T>) {
      const auto add = static_cast<float>(value);
      apply([add](T x) { return T(static_cast<float>(x) + add); });
    } else if constexpr (internal::kIsComplex<T>) {
      const auto add = static_cast<typename T::value_type>(value);
      apply([add](T x) { return x + add; });
    } else {
      const auto add = static_cast<T>(value);
      apply([add](T x) { return x + add; });
    }
  });
  return *this;
}

bool Tensor::equal(const Tensor& other) const {
  if (!defined() || !other.defined()) return defined() == other.defined();
  if (sizes_ != other.sizes_ || dtype_ != other.dtype_ || device() != other.device()) return false;
  if (is_cuda()) return cpu().equal(other.cpu());
  bool same = true;
  internal::dispatch(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Compare values, not bytes: +0 equals -0 and NaN equals nothing.
    using Compare = std::conditional_t<internal::kIsReducedFloat<T>, float, T>;
    const T* a = static_cast<const T*>(raw_data());
    const T* b = static_cast<const T*>(other.raw_data());
    internal::for_each_offset2(sizes_, strides_, other.strides_,
                               [&](std::int64_t i, std::int64_t j) {
                                 if (same && !(internal::convert<Compare>(internal::load(a, i)) ==
                                               internal::convert<Compare>(internal::load(b, j)))) {
                                   same = false;
                                 }
                               });
  });
  return same;
}

}  // namespace shmtensor
