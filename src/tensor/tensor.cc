// Tensor metadata, validation of foreign views (from_storage), element access.
#include "shmtensor/tensor.h"

#include <cmath>
#include <complex>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "shmtensor/internal/tensor_access.h"
#include "tensor/dispatch.h"

namespace shmtensor {

namespace internal {

Dims contiguous_strides(std::span<const std::int64_t> sizes) {
  Dims strides(sizes.size());
  std::int64_t stride = 1;
  for (std::size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    // A zero size would make every outer stride 0; torch keeps them as if the size were 1.
    // An empty tensor's sizes were not bounded by a byte count, so this can overflow.
    if (__builtin_mul_overflow(stride, sizes[d] > 0 ? sizes[d] : 1, &stride))
      throw std::invalid_argument("sizes " + sizes_to_string(sizes) + " overflow int64 strides");
  }
  return strides;
}

std::int64_t wrap_dim(std::int64_t dim, std::int64_t ndim) {
  if (ndim == 0) {
    throw std::out_of_range("dimension specified as " + std::to_string(dim) +
                            " but tensor has no dimensions");
  }
  const std::int64_t n = ndim;
  if (dim < -n || dim >= n) {
    throw std::out_of_range("Dimension out of range (expected to be in range of [" +
                            std::to_string(-n) + ", " + std::to_string(n - 1) + "], but got " +
                            std::to_string(dim) + ")");
  }
  return dim < 0 ? dim + n : dim;
}

std::int64_t checked_numel(std::span<const std::int64_t> sizes, std::size_t element_size) {
  std::int64_t numel = 1;
  for (std::int64_t s : sizes) {
    if (s < 0) {
      throw std::invalid_argument("negative dimension " + std::to_string(s) + " in sizes " +
                                  sizes_to_string(sizes));
    }
  }
  for (std::int64_t s : sizes) {
    if (__builtin_mul_overflow(numel, s, &numel)) {
      throw std::invalid_argument("sizes " + sizes_to_string(sizes) + " overflow int64");
    }
  }
  std::int64_t nbytes;
  if (__builtin_mul_overflow(numel, static_cast<std::int64_t>(element_size), &nbytes)) {
    throw std::invalid_argument("sizes " + sizes_to_string(sizes) +
                                " overflow int64 when counted in bytes");
  }
  return numel;
}

std::int64_t checked_mul(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw std::out_of_range("tensor stride arithmetic overflows int64");
  }
  return r;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    throw std::out_of_range("tensor offset arithmetic overflows int64");
  }
  return r;
}

std::string sizes_to_string(std::span<const std::int64_t> sizes) {
  std::string out = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

}  // namespace internal

namespace {

// Each dtype's element size and alignment, by enumerator.
struct ElementLayout {
  std::uint8_t size;
  std::uint8_t align;
};
template <class T>
constexpr ElementLayout layout_of() {
  return {sizeof(T), alignof(T)};
}
constexpr ElementLayout kElementLayouts[kNumDTypes] = {
    layout_of<bool>(),         layout_of<std::uint8_t>(),         layout_of<std::int8_t>(),
    layout_of<std::int16_t>(), layout_of<std::int32_t>(),         layout_of<std::int64_t>(),
    layout_of<Half>(),         layout_of<BFloat16>(),             layout_of<float>(),
    layout_of<double>(),       layout_of<std::complex<float>>(), layout_of<std::complex<double>>()};
static_assert(static_cast<int>(DType::kComplex128) == kNumDTypes - 1);

// The checks below in one pass, without building an error: true when the view is valid.
// Where it says false, the checks below find what is wrong and say it.
bool valid_view(const Storage& storage, std::int64_t storage_offset, const Dims& sizes,
                const Dims& strides, DType dtype) noexcept {
  const auto d = static_cast<std::size_t>(dtype);
  if (d >= static_cast<std::size_t>(kNumDTypes) || !storage.defined() ||
      sizes.size() != strides.size() || storage_offset < 0)
    return false;
  const ElementLayout layout = kElementLayouts[d];
  std::int64_t numel = 1;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    if (sizes[i] < 0 || strides[i] < 0 || __builtin_mul_overflow(numel, sizes[i], &numel))
      return false;
  std::int64_t nbytes;
  if (__builtin_mul_overflow(numel, std::int64_t{layout.size}, &nbytes)) return false;
  std::int64_t extent = storage_offset;
  if (numel > 0) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::int64_t span;
      if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) ||
          __builtin_add_overflow(extent, span, &extent))
        return false;
    }
    if (__builtin_add_overflow(extent, 1, &extent)) return false;
  }
  std::uint64_t needed;
  if (__builtin_mul_overflow(static_cast<std::uint64_t>(extent), std::uint64_t{layout.size},
                             &needed) ||
      needed > storage.nbytes())
    return false;
  return reinterpret_cast<std::uintptr_t>(storage.data()) % layout.align == 0;
}

}  // namespace

void internal::TensorAccess::assign_view(Tensor& out, Storage storage, std::int64_t storage_offset,
                                         const std::byte* sizes, const std::byte* strides,
                                         std::size_t ndim, DType dtype) {
  out.sizes_.assign_bytes(sizes, ndim);
  out.strides_.assign_bytes(strides, ndim);
  if (!valid_view(storage, storage_offset, out.sizes_, out.strides_, dtype)) {
    // from_storage throws, naming what is wrong, and leaves `out` undefined (the two agree;
    // were they not, its tensor stands).
    Dims sizes_taken = std::move(out.sizes_), strides_taken = std::move(out.strides_);
    out = Tensor();
    out = Tensor::from_storage(std::move(storage), storage_offset, std::move(sizes_taken),
                               std::move(strides_taken), dtype);
    return;
  }
  out.storage_ = std::move(storage);
  out.storage_offset_ = storage_offset;
  out.dtype_ = dtype;
}

// Every step is checked because the wire layer feeds this from another process's message:
// a tensor that passes must never address a byte outside the storage.
Tensor Tensor::from_storage(Storage storage, std::int64_t storage_offset,
                            Dims sizes, Dims strides, DType dtype) {
  if (valid_view(storage, storage_offset, sizes, strides, dtype))
    return Tensor(std::move(storage), storage_offset, std::move(sizes), std::move(strides), dtype);
  const std::size_t elsize = shmtensor::element_size(dtype);  // rejects a bad enumerator
  if (!storage.defined()) {
    throw std::invalid_argument("Tensor::from_storage: undefined storage");
  }
  if (sizes.size() != strides.size()) {
    throw std::invalid_argument("Tensor::from_storage: " + std::to_string(sizes.size()) +
                                " sizes but " + std::to_string(strides.size()) + " strides");
  }
  if (storage_offset < 0) {
    throw std::out_of_range("Tensor::from_storage: negative storage offset " +
                            std::to_string(storage_offset));
  }
  for (std::int64_t s : strides) {
    if (s < 0) {
      throw std::invalid_argument("Tensor::from_storage: negative stride in " +
                                  internal::sizes_to_string(strides));
    }
  }
  const std::int64_t numel = internal::checked_numel(sizes, elsize);
  // The highest element index reachable, or for an empty tensor the offset itself, which
  // must still lie within the storage so that data_ptr() is a valid pointer.
  std::int64_t extent = storage_offset;
  if (numel > 0) {
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      std::int64_t span;
      if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &span) ||
          __builtin_add_overflow(extent, span, &extent)) {
        throw std::out_of_range("Tensor::from_storage: sizes " + internal::sizes_to_string(sizes) +
                                " and strides " + internal::sizes_to_string(strides) +
                                " overflow int64");
      }
    }
    if (__builtin_add_overflow(extent, 1, &extent)) {
      throw std::out_of_range("Tensor::from_storage: extent overflows int64");
    }
  }
  std::uint64_t needed;
  if (__builtin_mul_overflow(static_cast<std::uint64_t>(extent), std::uint64_t{elsize}, &needed) ||
      needed > storage.nbytes()) {
    throw std::out_of_range(
        "Tensor::from_storage: offset " + std::to_string(storage_offset) + ", sizes " +
        internal::sizes_to_string(sizes) + " and strides " + internal::sizes_to_string(strides) +
        " of " + std::string(shmtensor::to_string(dtype)) + " reach beyond the storage of " +
        std::to_string(storage.nbytes()) + " bytes");
  }
  const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
  if (address % kElementLayouts[static_cast<std::size_t>(dtype)].align != 0) {
    throw std::invalid_argument("Tensor::from_storage: storage data is not aligned for " +
                                std::string(shmtensor::to_string(dtype)));
  }
  return Tensor(std::move(storage), storage_offset, std::move(sizes), std::move(strides), dtype);
}

std::int64_t Tensor::size(std::int64_t dim) const {
  return sizes_[static_cast<std::size_t>(internal::wrap_dim(dim, this->dim()))];
}

std::int64_t Tensor::stride(std::int64_t dim) const {
  return strides_[static_cast<std::size_t>(internal::wrap_dim(dim, this->dim()))];
}

std::int64_t Tensor::numel() const noexcept {
  // Cannot overflow: every constructor checked the product.
  std::int64_t n = 1;
  for (std::int64_t s : sizes_) n *= s;
  return n;
}

std::size_t Tensor::nbytes() const { return static_cast<std::size_t>(numel()) * element_size(); }

bool Tensor::is_contiguous() const noexcept {
  std::int64_t expected = 1;
  for (std::size_t d = sizes_.size(); d-- > 0;) {
    if (sizes_[d] == 0) return true;
  }
  for (std::size_t d = sizes_.size(); d-- > 0;) {
    if (sizes_[d] == 1) continue;
    if (strides_[d] != expected) return false;
    expected *= sizes_[d];
  }
  return true;
}

void Tensor::check_defined(const char* op) const {
  if (!defined()) {
    throw std::invalid_argument(std::string("Tensor::") + op + ": the tensor is undefined");
  }
}

void Tensor::check_dtype(DType requested, const char* op) const {
  check_defined(op);
  if (requested != dtype_) {
    throw std::invalid_argument(
        std::string("Tensor::") + op + "<" + std::string(shmtensor::to_string(requested)) +
        ">() called on a tensor of dtype " + std::string(shmtensor::to_string(dtype_)));
  }
}

void* Tensor::raw_data() { return const_cast<void*>(static_cast<const Tensor*>(this)->raw_data()); }

const void* Tensor::raw_data() const {
  check_defined("raw_data");
  // Read the storage's pointer afresh: share_memory_() may have moved the bytes.
  auto* base = static_cast<const std::byte*>(storage_.data());
  if (base == nullptr) return nullptr;  // 0-byte storage; from_storage forced offset 0
  return base + storage_offset_ * static_cast<std::int64_t>(element_size());
}

namespace {

template <class R, class F>
R read_single(const Tensor& t, F&& f) {
  if (t.numel() != 1) {
    throw std::invalid_argument("Tensor::item: a tensor with " + std::to_string(t.numel()) +
                                " elements cannot be converted to a scalar");
  }
  return internal::dispatch(t.dtype(), [&](auto tag) -> R {
    using T = typename decltype(tag)::type;
    return f(internal::load(static_cast<const T*>(t.raw_data()), 0));
  });
}

}  // namespace

bool Tensor::item_bool() const {
  check_defined("item");
  if (is_cuda()) return cpu().item_bool();
  return read_single<bool>(*this, [](const auto& v) { return internal::convert<bool>(v); });
}

std::int64_t Tensor::item_int64(std::int64_t min, std::uint64_t max) const {
  check_defined("item");
  if (is_cuda()) return cpu().item_int64(min, max);
  auto overflow = [](const std::string& value) {
    return std::out_of_range("Tensor::item: value " + value +
                             " cannot be converted to the requested type without overflow");
  };
  return read_single<std::int64_t>(*this, [&](const auto& v) -> std::int64_t {
    using T = std::remove_cvref_t<decltype(v)>;
    if constexpr (std::is_integral_v<T>) {
      const auto x = static_cast<std::int64_t>(v);
      if (x < min || (x > 0 && static_cast<std::uint64_t>(x) > max)) {
        throw overflow(std::to_string(x));
      }
      return x;
    } else {
      const double d = std::trunc(internal::convert<double>(v));
      // 2^63 is exact in double; max + 1.0 rounds to a power of two, so >= is exact.
      if (!std::isfinite(d) || d < static_cast<double>(min) ||
          d >= static_cast<double>(max) + 1.0 || d >= 9223372036854775808.0) {
        throw overflow(std::to_string(internal::convert<double>(v)));
      }
      return static_cast<std::int64_t>(d);
    }
  });
}

double Tensor::item_double() const {
  check_defined("item");
  if (is_cuda()) return cpu().item_double();
  return read_single<double>(*this, [](const auto& v) { return internal::convert<double>(v); });
}

std::complex<double> Tensor::item_complex() const {
  check_defined("item");
  if (is_cuda()) return cpu().item_complex();
  return read_single<std::complex<double>>(
      *this, [](const auto& v) { return internal::convert<std::complex<double>>(v); });
}

Tensor& Tensor::share_memory_() {
  check_defined("share_memory_");
  storage_.share_memory_();
  return *this;
}

}  // namespace shmtensor
